"""The GPU software stack this code was written against, checked at start-up with a one-line error.

megatron-core: 0.16.1 (CI's main suite), 0.17.x (every call the project makes read unchanged against core_v0.17.1)
and up to 0.19.x (CI's ``.ci/tiers/20-mcore-newest.sh`` runs the tiny e2e, actor and conversion tests on 0.19.2).
Transformer Engine ``>=2.9,<2.12`` (megatron-core 0.16.1's ``dev`` extra). vLLM ``>=0.20.1,<0.34``: the engine's
APIs were read against 0.33, and ``slurm/env.sh`` sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
beside sleep mode, which vLLM before 0.20.1 (its PR #40812) refuses with an assert in ``CuMemAllocator``. A
mismatched stack fails late and obscurely (an FP8 kernel, a missing vLLM keyword), so every entry point
(``dapo-mcore`` start-up, the GPU check's sections) calls :func:`check_gpu_stack` before any process group exists.
``slurm/constraints-gpu.txt`` pins one combination inside these ranges (``pip install -c``); a test keeps the
pins, the gpu extra, ``rollout.engines.vllm_engine.SUPPORTED_VLLM`` and ``slurm/env.sh`` in agreement.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable

from dapo_mcore.model.fp8 import MissingGPUExtra

# package -> ([min, max) release, the distribution names it may be installed under)
SUPPORTED: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]] = {
    "megatron-core": ((0, 16, 1), (0, 20), ("megatron-core", "megatron_core")),
    "transformer-engine": ((2, 9), (2, 12), ("transformer-engine", "transformer_engine", "transformer-engine-cu12")),
    "vllm": ((0, 20, 1), (0, 34), ("vllm",)),
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
                    installed: Callable[[tuple[str, ...]], str | None] = _installed,
                    import_module: Callable[[str], object] = importlib.import_module) -> None:
    """Raise MissingGPUExtra (one line) if a package the run needs is installed at an unsupported version, or if an
    installed Transformer Engine does not load against this torch (:func:`check_transformer_engine_abi`).

    megatron-core is always checked; Transformer Engine only when the run uses it, vLLM only with its engine.
    A package that is absent is left to the import that needs it (which names the install command).
    """
    _check(transformer_engine, vllm, installed)
    if transformer_engine and installed(SUPPORTED["transformer-engine"][2]) is not None:
        check_transformer_engine_abi(import_module)


_ABI_HINT = ("reinstall it against this torch: pip install --no-build-isolation 'transformer-engine[pytorch]==2.11.0' "
             "(needs nvcc and cuDNN on the node), or use an NGC PyTorch container, which ships a matching pair")


def check_transformer_engine_abi(import_module: Callable[[str], object] = importlib.import_module) -> None:
    """Import TE's torch extension now, so a build against another torch fails here in one line, not deep in Megatron.

    ``transformer_engine_torch`` is compiled against the torch of its build environment; pip's isolated build uses
    whatever torch it downloads, not the installed one (vLLM's), and the import then fails with an undefined C++
    symbol or a missing shared object.
    """
    import torch

    try:
        import_module("transformer_engine.pytorch")
    except (ImportError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MissingGPUExtra(f"Transformer Engine does not load with torch {torch.__version__} ({first[:200]}): "
                              f"its torch extension was built against another torch; {_ABI_HINT}") from None


def _check(transformer_engine: bool, vllm: bool, installed: Callable[[tuple[str, ...]], str | None]) -> None:
    wanted = ["megatron-core"] + (["transformer-engine"] if transformer_engine else []) + (["vllm"] if vllm else [])
    for package in wanted:
        lo, hi, names = SUPPORTED[package]
        version = installed(names)
        if version is not None and not lo <= release(version) < hi:
            raise MissingGPUExtra(
                f"{package} {version} is not supported: need >= {_fmt(lo)} and < {_fmt(hi)} (megatron-core "
                f"0.16.1-0.19 + TE 2.9-2.11 + vLLM 0.20.1-0.33); install the pinned set: pip install -c "
                f"slurm/constraints-gpu.txt 'dapo-mcore[gpu]'")
