"""Qwen3 (dense): the Qwen2 name table without QKV biases, plus the per-head q/k RMSNorm weights.

Megatron's ``q_layernorm`` / ``k_layernorm`` (``qk_layernorm=True``) hold one ``head_dim`` weight each, shared by
every head, exactly like Hugging Face's ``q_norm`` / ``k_norm``; both layer specs use the same names, and the
weights are replicated over tensor-parallel ranks.
"""

from __future__ import annotations

from typing import Any

from dapo_mcore.weights.mapping import ModelMapping, Scope, TensorRule
from dapo_mcore.weights.qwen2 import (
    _H,
    _L,
    ATTN_OUT,
    EMBEDDING,
    FINAL_NORM,
    INPUT_NORM,
    MLP_IN,
    MLP_NORM,
    MLP_OUT,
    OUTPUT,
    QKV,
    qwen_mapping,
)
from dapo_mcore.weights.transforms import Split

Q_NORM = TensorRule(_L + "self_attention.q_layernorm.weight", _L + "self_attention.q_layernorm.weight",
                    (_H + "self_attn.q_norm.weight",), ("head_norm",), Split.REPLICATED, Scope.LAYER)
K_NORM = TensorRule(_L + "self_attention.k_layernorm.weight", _L + "self_attention.k_layernorm.weight",
                    (_H + "self_attn.k_norm.weight",), ("head_norm",), Split.REPLICATED, Scope.LAYER)

QWEN3_RULES: tuple[TensorRule, ...] = (EMBEDDING, INPUT_NORM, QKV, Q_NORM, K_NORM, ATTN_OUT, MLP_NORM, MLP_IN,
                                       MLP_OUT, FINAL_NORM, OUTPUT)
"""Attention rows in Hugging Face's order (q/k/v projections, then q_norm, k_norm, o_proj)."""


def qwen3_mapping(hf_config: dict[str, Any]) -> ModelMapping:
    return qwen_mapping(hf_config, QWEN3_RULES)
