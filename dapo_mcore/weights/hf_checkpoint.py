"""Hugging Face checkpoint directories: validation against a mapping, and sharded streaming writing.

`check_hf_tensors` compares an HF directory's tensors with what the config implies (missing, unexpected,
shape, dtype) before any conversion writes a byte. `HFShardedWriter` plans ``model-XXXXX-of-YYYYY.safetensors``
shards from known shapes up front and streams tensors into them in order, then writes the index json.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dapo_mcore.weights.errors import InputFileError, InputMissingError, WeightsError
from dapo_mcore.weights.mapping import ModelMapping
from dapo_mcore.weights.safetensors_io import SafetensorsDirSource, StreamingSafetensorsWriter

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model")
TOKENIZER_DIR = "tokenizer"
"""Where `hf_to_mcore` keeps the HF dir's tokenizer files inside a Megatron checkpoint (for `mcore_to_hf`)."""


class HFCheckpointError(WeightsError):
    """An HF checkpoint whose tensors do not match its config (message names the tensors)."""


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise InputMissingError(f"{path} does not exist; an HF checkpoint dir needs config.json.")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputFileError(f"{path} is not valid JSON ({err}); copy or download it again.") from err
    if not isinstance(config, dict):
        raise InputFileError(f"{path} is not a JSON object; is it a Hugging Face config.json?")
    return config


def check_hf_tensors(mapping: ModelMapping, source: SafetensorsDirSource, *, dtype: torch.dtype | None,
                     allow_mixed_dtypes: bool = False) -> torch.dtype:
    """Check names and shapes against the config; return the common dtype (or raise naming the offenders).

    With `dtype` None the checkpoint's tensors must share one floating dtype unless `allow_mixed_dtypes`;
    with a `dtype` they are cast to it and only need to be floating point.
    """
    expected = mapping.hf_shapes()
    missing = [n for n in expected if n not in source.meta]
    unexpected = sorted(n for n in source.meta if n not in expected)
    if missing or unexpected:
        raise HFCheckpointError(f"{source.dir}: tensors do not match config.json: missing {missing[:5]} "
                                f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)}).")
    bad = [f"{n}: {source.shape(n)} (config implies {s})" for n, s in expected.items() if source.shape(n) != s]
    if bad:
        raise HFCheckpointError(f"{source.dir}: shape mismatch: {'; '.join(bad[:5])}")
    not_float = [n for n in expected if not source.dtype(n).is_floating_point]
    if not_float:
        raise HFCheckpointError(f"{source.dir}: non-floating tensors {not_float[:5]} ({source.dtype(not_float[0])}).")
    dtypes = {source.dtype(n) for n in expected}
    if dtype is None and len(dtypes) > 1 and not allow_mixed_dtypes:
        by = {d: next(n for n in expected if source.dtype(n) == d) for d in dtypes}
        raise HFCheckpointError(f"{source.dir}: mixed dtypes {sorted(map(str, dtypes))} (e.g. {by}); pass --dtype "
                                "to cast everything to one.")
    return dtype or next(iter(dtypes))


class HFShardedWriter:
    """Stream (name, tensor) pairs, in a known order, into size-capped HF safetensors shards + index json."""

    def __init__(self, directory: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_bytes: int,
                 *, direct: bool | None = False):
        self.dir = directory
        self.direct = direct  # O_DIRECT choice for the shard files (see StreamingSafetensorsWriter)
        shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
        size = 0
        self.total = 0
        for name, dtype, shape in plan:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, dtype, shape))
            size += nbytes
            self.total += nbytes
        n = len(shards)
        self.files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors" for i in range(n)]
        self.shards = shards
        self.weight_map = {name: f for f, shard in zip(self.files, shards, strict=True) for name, _, _ in shard}
        self._shard = -1
        self._left = 0
        self._writer: StreamingSafetensorsWriter | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._left == 0:
            if self._writer is not None:
                self._writer.close()
            self._shard += 1
            self._writer = StreamingSafetensorsWriter(self.dir / self.files[self._shard], self.shards[self._shard],
                                                      direct=self.direct)
            self._left = len(self.shards[self._shard])
        self._writer.write(name, tensor)
        self._left -= 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._shard != len(self.shards) - 1 or self._left:
            raise ValueError("HFShardedWriter closed before every planned tensor was written")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
            (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_hf_config(directory: Path, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
    config = dict(hf_config)
    name = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = name
    if "dtype" in config:
        config["dtype"] = name
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def copy_tokenizer_files(src: str | Path, dest: Path) -> list[str]:
    """Copy the tokenizer / generation-config / chat-template files that exist in `src` into `dest` (created
    when there is any); returns their names (empty when `src` has none)."""
    src = Path(src)
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if copied:
        dest.mkdir(parents=True, exist_ok=True)
    for f in copied:
        shutil.copy2(src / f, dest / f)
    return copied


def copy_tokenizer(tokenizer_dir: str | Path, directory: Path) -> list[str]:
    """Copy the tokenizer files of a user-named `tokenizer_dir`; raise when it has none."""
    src = Path(tokenizer_dir)
    if not src.is_dir():
        raise InputMissingError(f"tokenizer dir {src} does not exist; pass an existing --tokenizer dir.")
    copied = copy_tokenizer_files(src, directory)
    if not copied:
        raise InputMissingError(f"{src} holds none of the tokenizer files {', '.join(TOKENIZER_FILES)}.")
    return copied


def keep_model_files(dest: Path, tokenizer_dir: Path | None, model_dir: Path | None, tokenizer: Any) -> None:
    """Copy the original tokenizer files (``tokenizer_dir``) and generation config (``model_dir``) byte for byte into
    ``dest``, replacing what was there; a tokenizer that came from no directory is saved with ``save_pretrained``.

    A re-save would not do: transformers rewrites ``tokenizer_config.json`` (class, load-time keys, dropped
    ``added_tokens_decoder``) and drops ``vocab.json``/``merges.txt``/``generation_config.json``, so an export would not
    carry the model's own files.
    """
    staging = dest.with_name(f"{dest.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    copied = copy_tokenizer_files(tokenizer_dir, staging) if tokenizer_dir is not None else []
    if copied and model_dir is not None and (model_dir / "generation_config.json").is_file():
        shutil.copy2(model_dir / "generation_config.json", staging / "generation_config.json")
    if not copied:
        tokenizer.save_pretrained(str(staging))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(staging, dest)
