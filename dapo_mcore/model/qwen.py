"""Qwen2 / Qwen2.5 / Qwen3 / Llama 3.x on Megatron-Core: Hugging Face config -> TransformerConfig -> GPTModel.

``transformer_config()`` is the one place where a Hugging Face ``config.json`` becomes Megatron's
``TransformerConfig``; ``build_gpt_model()`` builds this rank's ``GPTModel`` chunk(s) (one per virtual pipeline
stage) with the `local` or `transformer_engine` layer spec. Must be called after model parallel is initialized.
Reading the config (families, refusals) lives in ``dapo_mcore.model.hf_config``; its names are re-exported here.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from dapo_mcore.model.fp8 import fp8_transformer_kwargs
from dapo_mcore.model.hf_config import (  # noqa: F401  (re-exported: the model's public names)
    SUPPORTED_MODEL_TYPES,
    HFConfigError,
    QwenShape,
    rope_parameters,
    sliding_window_layers,
)
from dapo_mcore.model.moe import MoEShape, moe_transformer_kwargs
from dapo_mcore.model.vocab import VOCAB_PADDINGS, padded_vocab_size  # noqa: F401  (the padding rule's home name)

log = logging.getLogger(__name__)


def transformer_config(hf: dict[str, Any], *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       virtual_pipeline: int | None = None, sequence_parallel: bool = False,
                       params_dtype: torch.dtype = torch.float32, recompute: str = "none",
                       fp8: Any = None, use_cpu_initialization: bool | None = None, deterministic: bool = True,
                       expert_parallel: int = 1, routing_replay: bool = False):
    """Derive Megatron-Core's ``TransformerConfig`` from a Hugging Face Qwen2/Qwen3 config dict (Qwen3: q/k
    RMSNorm per head = ``qk_layernorm``, no QKV bias, ``kv_channels`` = its own ``head_dim``; Qwen3-MoE: the
    experts, router and dense/sparse layer pattern from model/moe.py)."""
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
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
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


def layer_spec(kind: str, attention: str = "auto", qk_layernorm: bool = False):
    """The Megatron layer spec: `local` (pure PyTorch) or `transformer_engine` (GPU).

    ``attention`` picks the local spec's ``core_attention`` submodule: ``auto``/``sdpa`` = PyTorch's fused
    ``scaled_dot_product_attention`` (dapo_mcore.model.attention), ``megatron_local`` = Megatron's own
    ``DotProductAttention``. The transformer_engine spec keeps Transformer Engine's attention (``auto`` only).
    ``qk_layernorm``: the per-head q/k norm of Qwen3 (Megatron's ``q_layernorm`` / ``k_layernorm``).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    from dapo_mcore.model.attention import resolve_attention

    if kind not in ("local", "transformer_engine"):
        raise ValueError(f"unknown layer spec {kind!r}; choose 'local' or 'transformer_engine'.")
    core = resolve_attention(attention, kind)
    if kind == "transformer_engine":
        from dapo_mcore.model.fp8 import require_transformer_engine

        require_transformer_engine("the transformer_engine layer spec")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
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


def set_llama3_inv_freq(rotary, shape: QwenShape) -> None:
    """Give Megatron's ``RotaryEmbedding`` the ``llama3`` frequencies of the config.

    megatron-core 0.16's ``rope_scaling=True`` takes only the factor and fixes ``low_freq_factor=1``,
    ``high_freq_factor=4`` and ``original_max_position_embeddings=8192`` (Llama 3.1's values); a config with other
    values would silently rotate differently. So the frequencies are recomputed here from the plain ones with all
    four of the config's values, by the same formula as transformers' ``_compute_llama3_parameters``. Must run
    before the first forward (the module caches its embeddings per length)."""
    factor, low, high, original = shape.rope_scaling
    dim = shape.head_dim
    plain = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rotary.inv_freq.device)
                                        / dim))
    rotary.inv_freq = rotary._apply_scaling(plain, factor=factor, low_freq_factor=low, high_freq_factor=high,
                                            original_max_position_embeddings=original)


def family_label(hf: dict[str, Any]) -> str:
    """The model family as logs name it ("Llama 3.x dense", "Qwen3-MoE"), from the one family table."""
    from dapo_mcore.model.hf_config import FAMILIES

    family = FAMILIES.get(hf.get("model_type"))
    return family.label if family is not None else str(hf.get("model_type"))


def build_gpt_model(hf: dict[str, Any], tconfig, *, spec: str = "local", make_vocab_size_divisible_by: int = 128,
                    attention: str = "auto", vocab_padding: str = "megatron") -> list:
    """Build this rank's GPTModel chunks (one per virtual pipeline stage). Parallel state must be initialized.

    The embedding and output layer hold ``padded_vocab_size(vocab, make_vocab_size_divisible_by, tp, vocab_padding)``
    rows. The default rule stays Megatron-LM's for callers that pass an exact row count as the divisor at TP 1; the
    trainer passes ``model.vocab_padding`` (whose default is ``tp``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    shape = QwenShape.from_hf(hf)
    vocab = padded_vocab_size(shape.vocab_size, make_vocab_size_divisible_by, tconfig.tensor_model_parallel_size,
                              vocab_padding)
    spec_obj = layer_spec(spec, attention, qk_layernorm=shape.qk_norm)
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
            rope_scaling=shape.rope_scaling is not None,
            rope_scaling_factor=shape.rope_scaling[0] if shape.rope_scaling else 8.0,
            vp_stage=None if vpp == 1 else vp_stage,
        )
        if shape.rope_scaling is not None:
            set_llama3_inv_freq(model.rotary_pos_emb, shape)
        chunks.append(model)
    log.info("built GPTModel (%s): %d layers, hidden %d, vocab %d (padded %d), %d chunk(s) on this rank",
             family_label(hf), shape.num_layers, shape.hidden_size, shape.vocab_size, vocab, len(chunks))
    return chunks
