"""The GPU software stack this code was written against, checked at start-up with a one-line error.

megatron-core 0.16.1 declares Transformer Engine ``>=2.9,<2.12`` (its ``dev`` extra), and the vLLM engine uses
APIs present in vLLM ``[0.11, 0.34)`` (``rollout.vllm_engine.SUPPORTED_VLLM``). A mismatched stack fails late
and obscurely (an FP8 kernel, a missing vLLM keyword), so a run refuses it before any process group exists.
``slurm/constraints-gpu.txt`` pins one combination inside these ranges (``pip install -c``); a test keeps the
two in agreement.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from dapo_mcore.model.fp8 import MissingGPUExtra

# package -> ([min, max) release, the distribution names it may be installed under)
SUPPORTED: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]] = {
    "megatron-core": ((0, 16, 1), (0, 17), ("megatron-core", "megatron_core")),
    "transformer-engine": ((2, 9), (2, 12), ("transformer-engine", "transformer_engine", "transformer-engine-cu12")),
    "vllm": ((0, 11), (0, 34), ("vllm",)),
}


def release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string; local tags and pre-release suffixes are dropped."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return tuple(parts)


def _installed(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def check_gpu_stack(*, transformer_engine: bool, vllm: bool,
                    installed: Callable[[tuple[str, ...]], str | None] = _installed) -> None:
    """Raise MissingGPUExtra (one line) if a package the run needs is installed at an unsupported version.

    megatron-core is always checked; Transformer Engine only when the run uses it, vLLM only with its engine.
    A package that is absent is left to the import that needs it (which names the install command).
    """
    wanted = ["megatron-core"] + (["transformer-engine"] if transformer_engine else []) + (["vllm"] if vllm else [])
    for package in wanted:
        lo, hi, names = SUPPORTED[package]
        version = installed(names)
        if version is not None and not lo <= release(version) < hi:
            raise MissingGPUExtra(
                f"{package} {version} is not supported: need >= {_fmt(lo)} and < {_fmt(hi)} (megatron-core 0.16.1 + "
                f"TE 2.9-2.11 + vLLM 0.11-0.33); install the pinned set: pip install -c slurm/constraints-gpu.txt "
                f"'dapo-mcore[gpu]'")
