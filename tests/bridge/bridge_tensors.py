"""Bit-exact comparison of two Hugging Face safetensors directories, shared by the Bridge fixtures, probe and tests.

Plain torch + safetensors, so it imports in the Bridge virtualenv and in the project's alike."""

from __future__ import annotations

from pathlib import Path

import torch


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def differences(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Every way `got` is not bit-identical to `expected` (missing/extra names, dtype, shape, values); [] if none."""
    out = [f"missing {k}" for k in sorted(set(expected) - set(got))]
    out += [f"extra {k}" for k in sorted(set(got) - set(expected))]
    for k in sorted(set(expected) & set(got)):
        a, b = expected[k], got[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{k}: {b.dtype} {tuple(b.shape)} != {a.dtype} {tuple(a.shape)}")
        elif not torch.equal(a, b):
            out.append(f"{k}: values differ (max abs {(a.float() - b.float()).abs().max().item():g})")
    return out


def hf_differences(expected_dir: Path, got_dir: Path) -> list[str]:
    return differences(load_safetensors_dir(expected_dir), load_safetensors_dir(got_dir))
