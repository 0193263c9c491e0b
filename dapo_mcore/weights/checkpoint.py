"""The canonical on-disk Megatron checkpoint of dapo-mcore (what `hf_to_mcore` writes and the actor loads).

Layout::

    <dir>/dapo_mcore_checkpoint.json              format version, HF config, tp/pp/vpp, layer spec, vocab, dtype
    <dir>/mp_rank_{tp:02d}_{pp:03d}/model.safetensors   that rank's GPTModel chunk(s) state dict

Keys are Megatron state-dict names (local layer indices), prefixed ``chunk{v}.`` when VPP > 1. Only tensors
are stored (Transformer Engine ``_extra_state`` entries are not). Writers build the checkpoint in a temp
directory next to the target and rename it into place at the end, so the target is never half written.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dapo_mcore.weights.atomic import atomic_directory, check_target_free, temp_dir_for  # noqa: F401 (re-exported)
from dapo_mcore.weights.errors import WeightsError
from dapo_mcore.weights.layout import ParallelLayout

log = logging.getLogger(__name__)

FORMAT_NAME = "dapo_mcore.megatron"
FORMAT_VERSION = 1
METADATA_FILE = "dapo_mcore_checkpoint.json"


class CheckpointError(WeightsError):
    """A checkpoint that does not match what it is loaded into, or is malformed (message names the mismatch)."""


@dataclass(frozen=True)
class CheckpointMeta:
    """The contents of ``dapo_mcore_checkpoint.json``."""

    hf_config: dict[str, Any]
    layout: ParallelLayout
    padded_vocab_size: int
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "hf_config": self.hf_config,
                **self.layout.as_dict(), "padded_vocab_size": self.padded_vocab_size, "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointMeta:
        if data.get("format") != FORMAT_NAME or data.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"not a {FORMAT_NAME} v{FORMAT_VERSION} checkpoint (found format "
                                  f"{data.get('format')!r} version {data.get('format_version')!r}).")
        layout = ParallelLayout(tp=data["tp"], pp=data["pp"], vpp=data["vpp"], layer_spec=data["layer_spec"],
                                make_vocab_size_divisible_by=data["make_vocab_size_divisible_by"])
        return cls(data["hf_config"], layout, data["padded_vocab_size"], data["dtype"])


def rank_dir_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def rank_file(directory: str | Path, tp_rank: int, pp_rank: int) -> Path:
    return Path(directory) / rank_dir_name(tp_rank, pp_rank) / "model.safetensors"


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The canonical model directory: `path` itself, or its ``model/`` subdirectory (a trainer checkpoint)."""
    path = Path(path)
    for candidate in (path, path / "model"):
        if (candidate / METADATA_FILE).exists():
            return candidate
    raise CheckpointError(f"{path} holds no {METADATA_FILE} (nor does {path / 'model'}); expected a checkpoint "
                          "written by hf_to_mcore or the trainer.")


def read_meta(directory: str | Path) -> CheckpointMeta:
    return CheckpointMeta.from_json(json.loads((resolve_checkpoint_dir(directory) / METADATA_FILE).read_text()))


def write_meta(directory: str | Path, meta: CheckpointMeta) -> None:
    (Path(directory) / METADATA_FILE).write_text(json.dumps(meta.to_json(), indent=2, sort_keys=True) + "\n")


def read_megatron_rank(directory: str | Path, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """The full state dict of one (tp, pp) rank file (memory-mapped tensors)."""
    directory = resolve_checkpoint_dir(directory)
    path = rank_file(directory, tp_rank, pp_rank)
    if not path.exists():
        meta = read_meta(directory)
        raise CheckpointError(f"{path} does not exist; the checkpoint has tp={meta.layout.tp} pp={meta.layout.pp}.")
    return load_file(os.fspath(path))


def read_rank_tensor(directory: str | Path, tp_rank: int, pp_rank: int, key: str) -> torch.Tensor:
    with safe_open(os.fspath(rank_file(directory, tp_rank, pp_rank)), framework="pt") as f:
        return f.get_tensor(key)
