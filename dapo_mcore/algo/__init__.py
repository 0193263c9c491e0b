"""DAPO algorithm pieces as pure torch functions: loss, advantages, dynamic sampling, overlong shaping."""

from dapo_mcore.algo.advantages import broadcast_to_tokens, group_advantages
from dapo_mcore.algo.config import PRESETS, AlgoConfig
from dapo_mcore.algo.dynamic_sampling import (
    DynamicSamplingExhausted,
    Group,
    SamplingStats,
    collect_groups,
    usable_groups,
)
from dapo_mcore.algo.loss import (
    get_loss_agg,
    loss_agg_names,
    loss_denominators,
    masked_entropy_contrib,
    policy_loss,
    register_loss_agg,
    token_entropy,
)
from dapo_mcore.algo.overlong import overlong_filter_mask, overlong_penalty

__all__ = [
    "PRESETS",
    "AlgoConfig",
    "DynamicSamplingExhausted",
    "Group",
    "SamplingStats",
    "broadcast_to_tokens",
    "collect_groups",
    "get_loss_agg",
    "group_advantages",
    "loss_agg_names",
    "loss_denominators",
    "masked_entropy_contrib",
    "overlong_filter_mask",
    "overlong_penalty",
    "policy_loss",
    "register_loss_agg",
    "token_entropy",
    "usable_groups",
]
