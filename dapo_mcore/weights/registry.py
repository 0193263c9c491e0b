"""Model families with an HF <-> Megatron weight mapping, keyed by Hugging Face ``model_type``.

A family registers a factory ``hf_config -> ModelMapping``; ``get_mapping`` dispatches on the config's
``model_type`` and lists the supported types when it is unknown.
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
    """Register the mapping factory of one HF `model_type` (once)."""
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


def _load_builtin() -> None:
    from dapo_mcore.weights import llama, qwen2, qwen3, qwen3_moe  # noqa: F401  (register themselves on import)
