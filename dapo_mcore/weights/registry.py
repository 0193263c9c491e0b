"""Model families with an HF <-> Megatron weight mapping, keyed by Hugging Face ``model_type``.

Each built-in family is one row of ``_builtin()``: its ``model_type`` and the factory ``hf_config -> ModelMapping`` of
its mapping module (the modules never import this one: the arrows point one way). ``register_mapping`` adds a
family from outside the package; ``get_mapping`` dispatches on the config's ``model_type`` and lists the supported
types when it is unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dapo_mcore.weights.errors import WeightsError
from dapo_mcore.weights.mapping import ModelMapping

MappingFactory = Callable[[dict[str, Any]], ModelMapping]
_REGISTRY: dict[str, MappingFactory] = {}


class UnsupportedModelError(WeightsError):
    """The HF config's model_type has no weight mapping."""


def register_mapping(model_type: str, factory: MappingFactory) -> None:
    """Register the mapping factory of one HF `model_type` (once; a built-in type counts as registered)."""
    _load_builtin()
    if model_type in _REGISTRY:
        raise ValueError(f"a weight mapping for model_type {model_type!r} is already registered.")
    _REGISTRY[model_type] = factory


def supported_model_types() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(_REGISTRY))


def get_mapping(hf_config: dict[str, Any]) -> ModelMapping:
    """The weight mapping for an HF config dict (dispatch on ``model_type``)."""
    _load_builtin()
    model_type = hf_config.get("model_type")
    if model_type not in _REGISTRY:
        raise UnsupportedModelError(f"unsupported model_type {model_type!r}: no HF <-> Megatron weight mapping; "
                                    f"supported: {', '.join(sorted(_REGISTRY))}.")
    return _REGISTRY[model_type](hf_config)


def _builtin() -> dict[str, MappingFactory]:
    """The families this package ships (imported on first use: the mapping modules import torch)."""
    from dapo_mcore.weights import llama, qwen2, qwen3, qwen3_moe

    return {"qwen2": qwen2.qwen2_mapping, "qwen3": qwen3.qwen3_mapping, "qwen3_moe": qwen3_moe.qwen3_moe_mapping,
            "llama": llama.llama_mapping}


def _load_builtin() -> None:
    for model_type, factory in _builtin().items():
        _REGISTRY.setdefault(model_type, factory)
