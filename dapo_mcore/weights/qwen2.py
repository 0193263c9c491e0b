"""Qwen2 / Qwen2.5: the declarative HF <-> Megatron name table, for both Megatron layer specs (its rows are
shared with the other Qwen families, e.g. ``qwen3.py``).

Each row: Megatron name with the `local` spec, with the `transformer_engine` spec (norms fused into the
following linear as ``layer_norm_weight``), the HF name(s), their shape kinds, the TP split kind and scope.
``{i}`` is the layer index: global in HF names, local to the pipeline chunk in Megatron names.
"""

from __future__ import annotations

from typing import Any

from dapo_mcore.model.qwen import QwenShape, padded_vocab_size
from dapo_mcore.weights.mapping import ModelMapping, Scope, TensorRule
from dapo_mcore.weights.transforms import Split

_L = "decoder.layers.{i}."
_H = "model.layers.{i}."

EMBEDDING = TensorRule("embedding.word_embeddings.weight", "embedding.word_embeddings.weight",
                       ("model.embed_tokens.weight",), ("embed",), Split.VOCAB, Scope.FIRST)
INPUT_NORM = TensorRule(_L + "input_layernorm.weight", _L + "self_attention.linear_qkv.layer_norm_weight",
                        (_H + "input_layernorm.weight",), ("norm",), Split.REPLICATED, Scope.LAYER)
QKV = TensorRule(_L + "self_attention.linear_qkv.weight", _L + "self_attention.linear_qkv.weight",
                 (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
                 ("q", "kv", "kv"), Split.QKV, Scope.LAYER)
QKV_BIAS = TensorRule(_L + "self_attention.linear_qkv.bias", _L + "self_attention.linear_qkv.bias",
                      (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
                      ("q_bias", "kv_bias", "kv_bias"), Split.QKV, Scope.LAYER)
ATTN_OUT = TensorRule(_L + "self_attention.linear_proj.weight", _L + "self_attention.linear_proj.weight",
                      (_H + "self_attn.o_proj.weight",), ("o",), Split.ROW, Scope.LAYER)
MLP_NORM = TensorRule(_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight",
                      (_H + "post_attention_layernorm.weight",), ("norm",), Split.REPLICATED, Scope.LAYER)
MLP_IN = TensorRule(_L + "mlp.linear_fc1.weight", _L + "mlp.linear_fc1.weight",
                    (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), ("gate_up", "gate_up"),
                    Split.GATE_UP, Scope.LAYER)
MLP_OUT = TensorRule(_L + "mlp.linear_fc2.weight", _L + "mlp.linear_fc2.weight",
                     (_H + "mlp.down_proj.weight",), ("down",), Split.ROW, Scope.LAYER)
FINAL_NORM = TensorRule("decoder.final_layernorm.weight", "decoder.final_layernorm.weight",
                        ("model.norm.weight",), ("norm",), Split.REPLICATED, Scope.LAST)
OUTPUT = TensorRule("output_layer.weight", "output_layer.weight",
                    ("lm_head.weight",), ("embed",), Split.VOCAB, Scope.LAST, tied_output=True)

QWEN2_RULES: tuple[TensorRule, ...] = (EMBEDDING, INPUT_NORM, QKV, QKV_BIAS, ATTN_OUT, MLP_NORM, MLP_IN, MLP_OUT,
                                       FINAL_NORM, OUTPUT)


def qwen_mapping(hf_config: dict[str, Any], rules: tuple[TensorRule, ...]) -> ModelMapping:
    """The mapping of a dense Qwen model of any family: ``rules`` placed with the config's shape."""
    shape = QwenShape.from_hf(hf_config)
    return ModelMapping(
        hf_config, rules, num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size, vocab_size=shape.vocab_size, tie_embeddings=shape.tie_embeddings,
        padded_vocab_fn=padded_vocab_size,
    )


def qwen2_mapping(hf_config: dict[str, Any]) -> ModelMapping:
    return qwen_mapping(hf_config, QWEN2_RULES)
