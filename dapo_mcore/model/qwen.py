"""Qwen2 / Qwen2.5 on Megatron-Core: Hugging Face config -> TransformerConfig -> GPTModel.

``transformer_config()`` is the one place where a Hugging Face ``config.json`` becomes Megatron's
``TransformerConfig``; ``build_gpt_model()`` builds this rank's ``GPTModel`` chunk(s) (one per virtual pipeline
stage) with the `local` or `transformer_engine` layer spec. Must be called after model parallel is initialized.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dapo_mcore.model.fp8 import fp8_transformer_kwargs
from dapo_mcore.model.moe import MoEShape, moe_transformer_kwargs

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2",)


class HFConfigError(ValueError):
    """A Hugging Face config this project cannot build faithfully (message names the field and the fix)."""


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings of a config saved either way: transformers >= 5 nests them under ``rope_parameters``
    (``rope_theta`` included); older versions keep ``rope_theta`` at the top and scaling in ``rope_scaling``.
    Returns a dict with at least ``rope_type`` and ``rope_theta`` (10000.0, Qwen2Config's default, when absent)."""
    nested = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    if not isinstance(nested, dict) or not isinstance(legacy, dict):
        raise HFConfigError("rope_parameters / rope_scaling must be JSON objects; found "
                            f"{type(nested).__name__} / {type(legacy).__name__}.")
    if any(isinstance(v, dict) for v in nested.values()):
        raise HFConfigError(f"rope_parameters holds per-layer-type settings ({sorted(nested)}); Qwen2 has one RoPE "
                            "for all layers and Megatron builds one. Write a single rope_parameters object.")
    merged = {**legacy, **nested}
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFConfigError(f"rope partial_rotary_factor={merged['partial_rotary_factor']} is not supported "
                            "(Qwen2 rotates every dimension); remove it from config.json.")
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    theta = nested.get("rope_theta", hf.get("rope_theta", legacy.get("rope_theta", 10000.0)))
    merged["rope_theta"] = float(theta)
    return merged


def sliding_window_layers(hf: dict[str, Any]) -> list[int]:
    """Layers that Hugging Face runs with sliding-window attention (Qwen2: the layers from ``max_window_layers``
    on, when ``use_sliding_window``; transformers >= 5 also writes them out as ``layer_types``)."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return []  # transformers sets sliding_window to None when use_sliding_window is false
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    return list(range(int(hf.get("max_window_layers", 28)), layers))


def _refuse_unsupported(hf: dict[str, Any], rope: dict[str, Any]) -> None:
    """Features Megatron would silently compute differently: refuse them, naming the field."""
    if rope["rope_type"] != "default":
        field = "rope_parameters.rope_type" if hf.get("rope_parameters") else "rope_scaling"
        raise HFConfigError(f"{field}={rope['rope_type']!r} (RoPE scaling) is not supported: the Megatron model "
                            "would use plain RoPE and give different logits. Use a checkpoint without RoPE scaling "
                            "(e.g. remove it from config.json for contexts within max_position_embeddings).")
    sliding = sliding_window_layers(hf)
    if sliding:
        raise HFConfigError(f"use_sliding_window=true with sliding_window={hf['sliding_window']} on layers "
                            f"{sliding[:4]}{'...' if len(sliding) > 4 else ''} is not supported: the Megatron model "
                            "attends over the full context. Set use_sliding_window to false in config.json only if "
                            "every sequence stays within sliding_window tokens.")


@dataclass(frozen=True)
class QwenShape:
    """The architecture facts of a Qwen2 model that the conversion and the actor need."""

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

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> QwenShape:
        """Read a config.json dict saved by transformers 4 or 5; raise HFConfigError for what Megatron would
        compute differently (RoPE scaling, sliding windows)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; dapo-mcore supports {', '.join(SUPPORTED_MODEL_TYPES)} "
                             "(Qwen2 and Qwen2.5 checkpoints).")
        rope = rope_parameters(hf)
        _refuse_unsupported(hf, rope)
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        return cls(
            hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
            vocab_size=hf["vocab_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=rope["rope_theta"],
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        )


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's padding: the smallest multiple of ``divisible_by * tensor_parallel`` >= ``vocab_size``."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(hf: dict[str, Any], *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       virtual_pipeline: int | None = None, sequence_parallel: bool = False,
                       params_dtype: torch.dtype = torch.float32, recompute: str = "none",
                       fp8: Any = None, use_cpu_initialization: bool | None = None, deterministic: bool = True,
                       expert_parallel: int = 1, routing_replay: bool = False):
    """Derive Megatron-Core's ``TransformerConfig`` from a Hugging Face Qwen2 config dict."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = QwenShape.from_hf(hf)
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    recompute_kwargs: dict[str, Any] = {}
    if recompute == "selective":
        recompute_kwargs = dict(recompute_granularity="selective")
    elif recompute == "full":
        recompute_kwargs = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=use_cpu_initialization,
        deterministic_mode=deterministic and not torch.cuda.is_available(),
        **recompute_kwargs,
        **fp8_transformer_kwargs(fp8),
        **moe_transformer_kwargs(hf, expert_parallel=expert_parallel, routing_replay=routing_replay),
    )


def layer_spec(kind: str, attention: str = "auto"):
    """The Megatron layer spec: `local` (pure PyTorch) or `transformer_engine` (GPU).

    ``attention`` picks the local spec's ``core_attention`` submodule: ``auto``/``sdpa`` = PyTorch's fused
    ``scaled_dot_product_attention`` (dapo_mcore.model.attention), ``megatron_local`` = Megatron's own
    ``DotProductAttention``. The transformer_engine spec keeps Transformer Engine's attention (``auto`` only).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    from dapo_mcore.model.attention import resolve_attention

    if kind not in ("local", "transformer_engine"):
        raise ValueError(f"unknown layer spec {kind!r}; choose 'local' or 'transformer_engine'.")
    core = resolve_attention(attention, kind)
    if kind == "transformer_engine":
        from dapo_mcore.model.fp8 import require_transformer_engine

        require_transformer_engine("the transformer_engine layer spec")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    if core == "sdpa":
        from dapo_mcore.model.attention import SDPAttention, with_core_attention

        spec = with_core_attention(spec, SDPAttention)
    return spec


def moe_spec(tconfig, kind: str, attention: str, vp_stage: int | None):
    """The block spec of an MoE model's pipeline stage (model/moe.py), with the same attention as `layer_spec`."""
    from dapo_mcore.model.attention import SDPAttention, resolve_attention
    from dapo_mcore.model.moe import moe_block_spec

    core = SDPAttention if resolve_attention(attention, kind) == "sdpa" else None
    return moe_block_spec(tconfig, kind, core, vp_stage)


def build_gpt_model(hf: dict[str, Any], tconfig, *, spec: str = "local", make_vocab_size_divisible_by: int = 128,
                    attention: str = "auto") -> list:
    """Build this rank's GPTModel chunks (one per virtual pipeline stage). Parallel state must be initialized."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    shape = QwenShape.from_hf(hf)
    vocab = padded_vocab_size(shape.vocab_size, make_vocab_size_divisible_by, tconfig.tensor_model_parallel_size)
    spec_obj = layer_spec(spec, attention)
    vpp = tconfig.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vpp):
        if MoEShape.from_hf(hf) is not None:  # MoE and dense layers: one spec per layer of this stage
            spec_obj = moe_spec(tconfig, spec, attention, None if vpp == 1 else vp_stage)
        kwargs = {} if vpp == 1 else {"vp_stage": vp_stage}
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, **kwargs) if vpp > 1 else ps.is_pipeline_first_stage()
        post = ps.is_pipeline_last_stage(ignore_virtual=False, **kwargs) if vpp > 1 else ps.is_pipeline_last_stage()
        model = GPTModel(
            config=tconfig, transformer_layer_spec=spec_obj, vocab_size=vocab,
            max_sequence_length=shape.max_position_embeddings, pre_process=pre, post_process=post,
            parallel_output=True, share_embeddings_and_output_weights=shape.tie_embeddings,
            position_embedding_type="rope", rotary_percent=1.0, rotary_base=shape.rope_theta,
            vp_stage=None if vpp == 1 else vp_stage,
        )
        chunks.append(model)
    log.info("built GPTModel: %d layers, hidden %d, vocab %d (padded %d), %d chunk(s) on this rank",
             shape.num_layers, shape.hidden_size, shape.vocab_size, vocab, len(chunks))
    return chunks
