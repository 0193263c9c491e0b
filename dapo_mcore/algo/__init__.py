"""DAPO algorithm pieces as pure torch functions: loss, advantages, dynamic sampling, overlong shaping.

The names below are loaded on first use (PEP 562), so that reading a config (``dapo_mcore.algo.config``) does not
import torch: ``dapo-mcore config`` and the refusals before a run start in a fraction of the time.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "broadcast_to_tokens": "advantages", "group_advantages": "advantages",
    "PRESETS": "config", "AlgoConfig": "config",
    "DynamicSamplingExhausted": "dynamic_sampling", "Group": "dynamic_sampling", "SamplingStats": "dynamic_sampling",
    "collect_groups": "dynamic_sampling", "usable_groups": "dynamic_sampling",
    "get_loss_agg": "loss", "loss_agg_names": "loss", "loss_denominators": "loss", "masked_entropy_contrib": "loss",
    "policy_loss": "loss", "register_loss_agg": "loss", "token_entropy": "loss",
    "overlong_filter_mask": "overlong", "overlong_penalty": "overlong",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
