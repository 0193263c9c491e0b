"""Llama 3.x (dense: Llama 3.1 / 3.2 / 3.3): the Qwen2 name table without QKV biases.

Llama's Hugging Face names are Qwen2's (``model.layers.{i}.self_attn.q_proj`` ...): the same rows, minus the
biases, so Megatron's fused ``linear_qkv`` / ``linear_fc1`` and the padded, vocabulary-split embedding come out as
for Qwen. Llama 3.2's 1B / 3B tie the output layer to the embedding (``tie_word_embeddings``), which the
``OUTPUT`` row handles as for tied Qwen models: nothing stored in HF, a copy on the last pipeline stage when it is
not the first. The ``llama3`` RoPE scaling has no weights; the model builder reads it (model/qwen.py).
"""

from __future__ import annotations

from typing import Any

from dapo_mcore.weights.mapping import ModelMapping, TensorRule
from dapo_mcore.weights.qwen2 import (
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

LLAMA_RULES: tuple[TensorRule, ...] = (EMBEDDING, INPUT_NORM, QKV, ATTN_OUT, MLP_NORM, MLP_IN, MLP_OUT, FINAL_NORM,
                                       OUTPUT)
"""Hugging Face's LlamaForCausalLM state-dict order."""


def llama_mapping(hf_config: dict[str, Any]) -> ModelMapping:
    return qwen_mapping(hf_config, LLAMA_RULES)
