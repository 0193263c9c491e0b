"""Named Qwen2/Qwen2.5, Qwen3 and Llama 3.x shapes as Hugging Face ``config.json`` dictionaries.

Presets stand in for a real ``config.json`` when none is at hand (planning, benchmarks, tests).
Each value is exactly what Hugging Face's Qwen2 / Qwen3 config would hold, so a preset and a downloaded
config go through the same code path. The Qwen3 shapes are those of the published Qwen/Qwen3-8B and
Qwen/Qwen3-32B config.json files (head_dim 128 everywhere: 64 x 128 = 8192 != hidden 5120 for 32B).
"""

from __future__ import annotations

import copy
from typing import Any

_QWEN2_COMMON: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "sliding_window": None,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

_QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    # The tiny shape as Qwen3: q/k norm, no QKV bias, head_dim 32 != hidden 64 / 4 heads (queries are 128 wide),
    # GQA 4/2, tied embeddings; head_dim 32 is also the smallest vLLM's CPU attention accepts.
    "tiny-qwen3": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       max_position_embeddings=128, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                      tie_word_embeddings=False),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json; the same shape in slime's scripts/models/qwen3-30B-A3B.sh):
    # 48 layers, all sparse: 128 experts of width 768, 8 per token (renormalised), 30.5B total / 3.3B active.
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], router_aux_loss_coef=0.001, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          max_position_embeddings=40960, tie_word_embeddings=False),
}

_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

_LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    # Llama 3.x in miniature: no QKV bias, head_dim 32 (= 128 / 4, the smallest vLLM's CPU attention accepts), GQA
    # 4/2, tied embeddings (as Llama 3.2 1B/3B) and the llama3 RoPE scaling with an original context of 16 tokens,
    # so scaling changes every frequency band (plain, smoothed and divided) within a test's 24-token sequence.
    "tiny-llama": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=32, rms_norm_eps=1e-5, tie_word_embeddings=True,
                       max_position_embeddings=128, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                       rope_scaling=dict(_LLAMA3_ROPE, factor=4.0, original_max_position_embeddings=16)),
    # meta-llama/Llama-3.1-8B config.json
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE)),
    # meta-llama/Llama-3.2-1B config.json: tied embeddings, head_dim 64, RoPE factor 32
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5,
                        tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
}

_SHAPES: dict[str, dict[str, Any]] = {
    # The embedded CPU default: small enough for a 2-core laptop, every Qwen2 feature present
    # (GQA with fewer KV heads than heads, QKV bias, RMSNorm, SwiGLU, tied embeddings).
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 max_position_embeddings=128, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
    # The tiny shape with head_dim 32 (2 heads of 32 instead of 4 of 16), the smallest head size vLLM's CPU
    # attention kernels accept (head_dim 16 is refused at the first generate). Two KV heads, so actor TP=2 splits
    # them; the price is no GQA (heads == KV heads), and K/V are twice as wide (~8k parameters more than "tiny").
    "tiny-hd32": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      max_position_embeddings=128, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
    # The tiny shape over the tool task's vocabulary (the tiny one plus ReTool's markers and "print", 35 tokens, 48
    # rows), twice as wide: it must copy a tool's output digit by digit into its answer.
    "tiny-tools": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=48, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       max_position_embeddings=128, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, rms_norm_eps=1e-5, tie_word_embeddings=False),
}

PRESET_NAMES: tuple[str, ...] = (*_SHAPES, *_QWEN3_SHAPES, *_LLAMA_SHAPES)
_TABLES = ((_SHAPES, _QWEN2_COMMON), (_QWEN3_SHAPES, _QWEN3_COMMON), (_LLAMA_SHAPES, _LLAMA_COMMON))


def preset_config(name: str, **overrides: Any) -> dict[str, Any]:
    """Return the HF ``config.json`` dict of a named preset, with optional field overrides.

    ``overrides`` replaces fields, e.g. ``num_hidden_layers=2`` for a few-layer copy of a big shape.
    """
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESET_NAMES)}")
    shapes, common = next((shapes, common) for shapes, common in _TABLES if name in shapes)
    cfg = copy.deepcopy(common)
    cfg.update(copy.deepcopy(shapes[name]))
    cfg.update(overrides)
    return cfg


def _squash(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum() or ch == ".")


def preset_named_by(path: str | None) -> str | None:
    """The preset a model directory's name names (``/models/Qwen2.5-32B`` -> ``qwen2.5-32b``, ``Llama-3.1-8B-Instruct``
    -> ``llama3.1-8b``): the longest preset whose name, case and dashes aside, the directory's last component starts
    with; None if none does."""
    if not path:
        return None
    name = _squash(str(path).rstrip("/").rsplit("/", 1)[-1])
    matches = sorted((p for p in PRESET_NAMES if name.startswith(_squash(p))), key=len)
    return matches[-1] if matches else None
