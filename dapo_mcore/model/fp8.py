"""FP8 training settings for Transformer Engine, validated against what is installed.

Transformer Engine is imported lazily: on a machine without CUDA (or without the ``gpu`` extra) every FP8 or
TE request is refused with a message that says what to install or change, before anything is allocated.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

# Minimum compute capability per recipe (Hopper = 9.0, Ada = 8.9, Blackwell = 10.0).
_RECIPE_MIN_CC = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
# Transformer Engine versions that introduced each recipe.
_RECIPE_MIN_TE = {"delayed": (1, 0), "tensorwise": (2, 2), "blockwise": (2, 3), "mxfp8": (2, 1)}


class MissingGPUExtra(RuntimeError):
    """A GPU-only feature was requested where its packages or hardware are absent."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def require_transformer_engine(what: str) -> Any:
    """Import transformer_engine.pytorch or raise MissingGPUExtra explaining how to get it."""
    if not torch.cuda.is_available():
        raise MissingGPUExtra(f"{what} needs a CUDA GPU with Transformer Engine; this machine has no CUDA. "
                              "Use model.layer_spec=local and model.fp8.enabled=false on CPU.")
    if importlib.util.find_spec("transformer_engine") is None:
        raise MissingGPUExtra(f"{what} needs Transformer Engine: pip install 'dapo-mcore[gpu]' "
                              "(or use an NGC PyTorch container, which ships it).")
    return importlib.import_module("transformer_engine.pytorch")


def check_fp8(fp8: Any) -> None:
    """Refuse an FP8 setting this machine cannot run, naming the fix. ``fp8`` is a config.FP8Config."""
    if fp8 is None or not fp8.enabled:
        return
    require_transformer_engine(f"model.fp8.enabled=true (FP8 training, recipe {fp8.recipe})")
    import transformer_engine

    te_version = _version_tuple(getattr(transformer_engine, "__version__", "0"))
    need_te = _RECIPE_MIN_TE[fp8.recipe]
    if te_version < need_te:
        raise MissingGPUExtra(f"model.fp8.recipe={fp8.recipe} needs Transformer Engine >= "
                              f"{'.'.join(map(str, need_te))}; found {transformer_engine.__version__}.")
    cc = torch.cuda.get_device_capability()
    need_cc = _RECIPE_MIN_CC[fp8.recipe]
    if cc < need_cc:
        raise MissingGPUExtra(f"model.fp8.recipe={fp8.recipe} needs compute capability >= {need_cc[0]}.{need_cc[1]}; "
                              f"this GPU is {cc[0]}.{cc[1]}. Use recipe=delayed or tensorwise on Ada/Hopper, "
                              "or disable FP8.")


def fp8_transformer_kwargs(fp8: Any) -> dict[str, Any]:
    """The TransformerConfig keyword arguments for an FP8Config (empty when FP8 is off)."""
    if fp8 is None or not fp8.enabled:
        return {}
    check_fp8(fp8)
    kwargs: dict[str, Any] = dict(fp8=fp8.format, fp8_recipe=fp8.recipe, fp8_param=fp8.fp8_params)
    if fp8.recipe == "delayed":
        kwargs.update(fp8_amax_history_len=fp8.amax_history_len, fp8_amax_compute_algo="max")
    return kwargs
