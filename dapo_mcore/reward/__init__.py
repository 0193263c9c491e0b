"""Rule-based rewards: the DAPO math verifier, a registry of reward functions, a bounded worker pool."""

from dapo_mcore.reward.math_verifier import (
    compute_score,
    extract_answer,
    normalize_answer,
    validate_ground_truth,
)
from dapo_mcore.reward.registry import decode_tail, get_reward, register_reward, reward_names
from dapo_mcore.reward.result import RewardResult

__all__ = [
    "RewardResult",
    "compute_score",
    "decode_tail",
    "extract_answer",
    "get_reward",
    "normalize_answer",
    "register_reward",
    "reward_names",
    "validate_ground_truth",
]
