"""HF <-> Megatron weight mapping and TP/PP resharding, shared by conversion/ and the rollout weight sync.

Entry points: `get_mapping(hf_config)` (dispatch on model_type), the canonical checkpoint format
(`checkpoint`), live-model loading/saving (`live`), and the streaming export iterator (`export.iter_hf_weights`).
Importing this package does not import Megatron.
"""

from dapo_mcore.weights.layout import LayoutError, ParallelLayout
from dapo_mcore.weights.registry import (
           UnsupportedModelError,
           get_mapping,
           register_mapping,
           supported_model_types,
)

__all__ = ["LayoutError", "ParallelLayout", "UnsupportedModelError", "get_mapping", "register_mapping",
           "supported_model_types"]
