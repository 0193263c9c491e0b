"""A LoRA run's checkpoint -> Hugging Face: the merged model, or the adapter alone as a peft adapter directory.

``dapo-mcore convert mcore-to-hf --mcore CKPT --out DIR`` on a LoRA run's checkpoint writes the merged model: each
targeted projection is ``W + alpha / r * B @ A`` (fp32 arithmetic, stored in the checkpoint's dtype), everything else
the base as it is: a plain Hugging Face checkpoint. With ``--adapter-only`` it writes what ``peft`` loads::

    DIR/adapter_config.json        r, lora_alpha, target_modules (HF names: q_proj, ..., down_proj), ...
    DIR/adapter_model.safetensors  base_model.model.<module>.lora_A.weight / lora_B.weight, fp32

``peft.PeftModel.from_pretrained(base, DIR)`` then gives the merged model's outputs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from dapo_mcore.weights import checkpoint as ckpt
from dapo_mcore.weights.lora import peft_name

log = logging.getLogger(__name__)

LORA_DIR = "lora"


def lora_dir(mcore_dir: str | Path) -> Path | None:
    """The ``lora/`` directory of a trainer checkpoint (given as the checkpoint or its ``model/``), or None."""
    path = Path(mcore_dir)
    for candidate in (path / LORA_DIR, path.parent / LORA_DIR):
        if (candidate / "base.json").is_file():
            return candidate
    return None


def read_adapter(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(base.json, peft-named adapter tensors) of a checkpoint's ``lora/``."""
    from safetensors.torch import load_file

    meta = json.loads((directory / "base.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted((directory / "adapter").glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise ckpt.CheckpointError(f"{directory}/adapter holds no adapter files; the checkpoint is incomplete.")
    return meta, tensors


class Merger:
    """Adds ``scale * B @ A`` to the HF tensors that have an adapter (as `convert_mcore_to_hf` streams them)."""

    def __init__(self, directory: Path):
        self.meta, self.tensors = read_adapter(directory)
        self.scale = float(self.meta["alpha"]) / int(self.meta["rank"])
        self.merged = 0

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not name.endswith(".weight") or peft_name(name, "A") not in self.tensors:
            return tensor
        a, b = self.tensors[peft_name(name, "A")], self.tensors[peft_name(name, "B")]
        self.merged += 1
        return (tensor.float() + self.scale * (b.float() @ a.float())).to(tensor.dtype)

    def check_all_used(self) -> None:
        expected = len(self.tensors) // 2
        if self.merged != expected:
            raise ckpt.CheckpointError(f"merged {self.merged} of the checkpoint's {expected} adapters: the adapter "
                                       "names do not fit the model (a checkpoint of another model?).")


def export_adapter(mcore_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the peft adapter directory of a LoRA run's checkpoint; CheckpointError (one line) if it has none."""
    from safetensors.torch import save_file

    directory = lora_dir(mcore_dir)
    if directory is None:
        raise ckpt.CheckpointError(f"{mcore_dir} holds no LoRA adapters (no lora/base.json): --adapter-only needs a "
                                   "checkpoint of a run with model.lora.rank > 0; convert it without the flag.")
    _, tensors = read_adapter(directory)
    with ckpt.atomic_directory(out_dir) as tmp:
        (tmp / "adapter_config.json").write_text((directory / "adapter_config.json").read_text())
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(tmp / "adapter_model.safetensors"),
                  {"format": "pt"})
    log.info("wrote the peft adapter (%d tensors) to %s", len(tensors), out_dir)
    return Path(out_dir)
