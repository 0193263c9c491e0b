"""Reading a Hugging Face ``config.json`` into the architecture facts this project builds on (no torch import).

One table, :data:`FAMILIES`, says which ``model_type`` values are supported and how each differs: Qwen2/Qwen2.5
have a QKV bias and no q/k norm; Qwen3 (dense) has a per-head RMSNorm on queries and keys, no bias and a
``head_dim`` that need not equal ``hidden_size / num_attention_heads``; Llama 3.x has neither, and Llama 3.1+ scales
RoPE (``rope_type: llama3``). ``QwenShape.from_hf`` reads a config of
any family, refusing (with :class:`HFConfigError`, naming the field and what is supported) everything the
Megatron model would compute differently: other model types, RoPE scaling, sliding windows, attention biases the
family does not have, activations other than SiLU. Config validation, the planner, conversion and the actor all
read a model through it, so a checkpoint is refused once, up front, in the same words.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class HFConfigError(ValueError):
    """A Hugging Face config this project cannot build faithfully (message names the field and the fix)."""


def expert_count(hf: Mapping[str, Any]) -> int:
    """Experts per MoE layer of a Hugging Face config (a config.json dict), 0 for a dense model: ``num_experts`` (as
    Qwen3-MoE configs were saved) or ``num_local_experts`` (as transformers 5 saves them). The one place that reads
    either spelling: everything that asks "is this MoE?" (vLLM's expert parallelism, its weight-layout guard, the
    config rules, the rehearsal) asks here."""
    for key in ("num_experts", "num_local_experts"):
        value = hf.get(key)
        if value:
            return int(value)
    return 0


def is_moe(hf: Mapping[str, Any]) -> bool:
    """Whether the config's model routes tokens to experts (either spelling of the expert count; see `expert_count`)."""
    return expert_count(hf) > 0


@dataclass(frozen=True)
class Family:
    """How one Hugging Face ``model_type`` maps onto the Megatron GPT model."""

    label: str
    """Human name in messages, e.g. "Qwen2 / Qwen2.5"."""
    hf_class: str
    """The transformers causal-LM class (the transformers rollout engine builds it)."""
    qkv_bias: bool | None
    """Biases on q/k/v: True (Qwen2 always), or None = read ``attention_bias`` (Qwen3: supported only when false)."""
    qk_norm: bool
    """A per-head RMSNorm on queries and keys before RoPE (Megatron's ``qk_layernorm``)."""
    default_head_dim: int | None
    """``head_dim`` when config.json has none (transformers' default), None = hidden_size / num_attention_heads."""
    rope_types: tuple[str, ...] = ("default",)
    """RoPE variants the family is released with and Megatron builds alike (Llama 3.1+: ``llama3`` scaling)."""


FAMILIES: dict[str, Family] = {
    "qwen2": Family("Qwen2 / Qwen2.5", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, default_head_dim=None),
    "qwen3": Family("Qwen3 dense", "Qwen3ForCausalLM", qkv_bias=None, qk_norm=True, default_head_dim=128),
    # Qwen3 attention + MoE MLPs; the MoE half (experts, router, sparse layers) is read by model/moe.py
    "qwen3_moe": Family("Qwen3-MoE", "Qwen3MoeForCausalLM", qkv_bias=None, qk_norm=True, default_head_dim=128),
    "llama": Family("Llama 3.x dense", "LlamaForCausalLM", qkv_bias=None, qk_norm=False, default_head_dim=None,
                    rope_types=("default", "llama3")),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def supported_text() -> str:
    return ", ".join(f"{t} ({f.label})" for t, f in FAMILIES.items())


def family_of(hf: dict[str, Any]) -> Family:
    """The family of a config dict; HFConfigError naming the supported model types otherwise."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise HFConfigError(f"model_type={model_type!r} is not supported; dapo-mcore trains model_type "
                            f"{supported_text()}.")
    return FAMILIES[model_type]


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings of a config saved either way: transformers >= 5 nests them under ``rope_parameters``
    (``rope_theta`` included); older versions keep ``rope_theta`` at the top and scaling in ``rope_scaling``.
    Returns a dict with at least ``rope_type`` and ``rope_theta`` (10000.0, the Qwen configs' default, when absent)."""
    nested = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    if not isinstance(nested, dict) or not isinstance(legacy, dict):
        raise HFConfigError("rope_parameters / rope_scaling must be JSON objects; found "
                            f"{type(nested).__name__} / {type(legacy).__name__}.")
    if any(isinstance(v, dict) for v in nested.values()):
        raise HFConfigError(f"rope_parameters holds per-layer-type settings ({sorted(nested)}); Qwen has one RoPE "
                            "for all layers and Megatron builds one. Write a single rope_parameters object.")
    merged = {**legacy, **nested}
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFConfigError(f"rope partial_rotary_factor={merged['partial_rotary_factor']} is not supported "
                            "(supported: 1.0, every dimension rotated); remove it from config.json.")
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    theta = nested.get("rope_theta", hf.get("rope_theta", legacy.get("rope_theta", 10000.0)))
    merged["rope_theta"] = float(theta)
    return merged


def sliding_window_layers(hf: dict[str, Any]) -> list[int]:
    """Layers that Hugging Face runs with sliding-window attention (Qwen2/Qwen3: the layers from
    ``max_window_layers`` on, when ``use_sliding_window``; transformers >= 5 also writes them out as ``layer_types``)."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return []  # transformers sets sliding_window to None when use_sliding_window is false
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    return list(range(int(hf.get("max_window_layers", 28)), layers))


def _refuse_unsupported(hf: dict[str, Any], rope: dict[str, Any], family: Family) -> None:
    """Features Megatron would silently compute differently: refuse them, naming the field."""
    if rope["rope_type"] not in family.rope_types:
        field = "rope_parameters.rope_type" if hf.get("rope_parameters") else "rope_scaling"
        supported = ", ".join(repr(t) for t in family.rope_types)
        raise HFConfigError(f"{field}={rope['rope_type']!r} (RoPE scaling) is not supported for {family.label} "
                            f"(supported: {supported}): the Megatron model would use plain RoPE and give different "
                            "logits. Use a checkpoint without RoPE scaling (e.g. remove it from config.json for "
                            "contexts within max_position_embeddings).")
    sliding = sliding_window_layers(hf)
    if sliding:
        raise HFConfigError(f"use_sliding_window=true with sliding_window={hf['sliding_window']} on layers "
                            f"{sliding[:4]}{'...' if len(sliding) > 4 else ''} is not supported (supported: full "
                            "attention): the Megatron model attends over the full context. Set use_sliding_window to "
                            "false in config.json only if every sequence stays within sliding_window tokens.")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"hidden_act={act!r} is not supported (supported: 'silu', the SwiGLU of {family.label}).")
    if family.qkv_bias is None and hf.get("attention_bias", False):
        raise HFConfigError(f"attention_bias=true is not supported for model_type={hf['model_type']!r} (supported: "
                            f"false, as in every released {family.label} checkpoint: Megatron's biased output "
                            "projection would add biases to the MLP too).")
    if hf.get("mlp_bias", False):
        raise HFConfigError(f"mlp_bias=true is not supported for model_type={hf['model_type']!r} (supported: false, "
                            f"as in every released {family.label} checkpoint).")


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llama3_rope_scaling(rope: dict[str, Any]) -> tuple[float, float, float, int] | None:
    """``(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)`` of a ``llama3`` RoPE,
    None for plain RoPE. All four are required, as transformers' ``_compute_llama3_parameters`` requires them."""
    if rope["rope_type"] != "llama3":
        return None
    missing = [k for k in _LLAMA3_KEYS if rope.get(k) is None]
    if missing:
        raise HFConfigError(f"rope_type='llama3' without {', '.join(missing)} in rope_scaling / rope_parameters; "
                            "copy them from the checkpoint's own config.json (Llama 3.1: factor 8.0, low_freq_factor "
                            "1.0, high_freq_factor 4.0, original_max_position_embeddings 8192).")
    factor, low, high = (float(rope[k]) for k in _LLAMA3_KEYS[:3])
    if not (factor >= 1.0 and high > low > 0):
        raise HFConfigError(f"llama3 rope scaling needs factor >= 1 and high_freq_factor > low_freq_factor > 0; "
                            f"found factor={factor}, low_freq_factor={low}, high_freq_factor={high}.")
    return factor, low, high, int(rope["original_max_position_embeddings"])



MEGATRON_LLAMA3_FIXED = (1.0, 4.0, 8192)
"""low_freq_factor, high_freq_factor, original_max_position_embeddings that Megatron-LM's ``--use-rope-scaling`` and
Megatron-Bridge's ``rope_scaling`` fix (only the factor is a setting); Llama 3.1 / 3.2 / 3.3 use exactly these."""


def megatron_rope_scaling_factor(hf: dict[str, Any], fmt: str) -> float | None:
    """The llama3 factor to write into a Megatron-LM / Megatron-Bridge checkpoint's model settings (None: plain RoPE);
    HFConfigError when the config's other llama3 values are not the ones those readers fix, which they would build
    as a different RoPE."""
    scaling = llama3_rope_scaling(rope_parameters(hf))
    if scaling is None:
        return None
    if scaling[1:] != MEGATRON_LLAMA3_FIXED:
        raise HFConfigError(f"llama3 RoPE with low_freq_factor={scaling[1]}, high_freq_factor={scaling[2]}, "
                            f"original_max_position_embeddings={scaling[3]} cannot be written as {fmt}: its reader "
                            "fixes them at 1.0 / 4.0 / 8192 and would rotate differently; convert to the Hugging Face "
                            "or dapo-mcore format instead.")
    return scaling[0]

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class QwenShape:
    """The architecture facts of a supported model that the conversion and the actor need."""

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool = True
    """Biases on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    rope_scaling: tuple[float, float, float, int] | None = None
    """Llama 3.1+'s ``llama3`` RoPE: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> QwenShape:
        """Read a config.json dict saved by transformers 4 or 5; raise HFConfigError for what Megatron would
        compute differently (other model types, RoPE scaling, sliding windows, ...)."""
        family = family_of(hf)
        missing = [k for k in _REQUIRED if k not in hf]
        if missing:
            raise HFConfigError(f"config.json of model_type={hf['model_type']!r} has no {', '.join(missing)}; "
                                "save it with transformers' save_pretrained (or copy the checkpoint's own config.json).")
        rope = rope_parameters(hf)
        _refuse_unsupported(hf, rope, family)
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or family.default_head_dim or hf["hidden_size"] // heads
        return cls(
            hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=int(head_dim),
            vocab_size=hf["vocab_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=rope["rope_theta"],
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            qkv_bias=bool(family.qkv_bias), qk_norm=family.qk_norm, rope_scaling=llama3_rope_scaling(rope),
        )
