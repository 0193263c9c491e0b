"""Core attention for Megatron-Core's local layer spec on ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materialises the GQA-repeated keys and values, the [b, h, s, s] score
matrix (in a global buffer), a masked copy of it, an unfused softmax and a score-sized gradient: about half of an
actor step on CPU. :class:`SDPAttention` computes the same function with PyTorch's fused kernel and is a drop-in
``core_attention`` submodule of the layer spec (same constructor and forward signature), so it works wherever the
local spec does: CPU, and GPUs without Transformer Engine.

* Layout: query [sq, b, np, hn], key/value [sk, b, ng, hn] in, context [sq, b, np * hn] out (heads per tensor
  parallel partition come from the tensors themselves). With ``packed_seq_params.qkv_format == "thd"`` the batch
  dimension is gone ([t, np, hn]) and each sequence of ``cu_seqlens`` is attended to on its own.
* Masks follow the local spec: an explicit ``attention_mask`` (bool, True = masked) wins; without one a causal
  layer is causal. A mask that is exactly the causal mask runs as ``is_causal`` (no mask tensor in the kernel).
  One difference: a query row with every key masked gets zeros here, a uniform average in the local spec; the
  actor's layouts never build such a row (every token sees itself).
* GQA: ``enable_gqa`` instead of repeating keys and values, except on CUDA with an explicit mask, where the
  efficient kernels lack GQA and SDPA would fall back to its math path (the same rule as transformers').
* ``apply_query_key_layer_scaling`` divides the scores by the layer number and multiplies them back inside the
  softmax in the local spec: the net scale is the plain one, which is what SDPA applies.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

ATTENTION_BACKENDS = ("auto", "sdpa", "megatron_local")


class _OneSlotCache:
    """Remembers one derived value per tensor object (the same mask / cu_seqlens is seen by every layer)."""

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._version = -1
        self._value: Any = None

    def get(self, tensor: torch.Tensor, compute) -> Any:
        if self._ref is not None and self._ref() is tensor and self._version == tensor._version:
            return self._value
        value = compute(tensor)
        self._ref, self._version, self._value = weakref.ref(tensor), tensor._version, value
        return value


_causal_verdicts = _OneSlotCache()
# cu_seqlens as Python ints, once per micro-batch rather than once per layer (a device sync on GPU).
_cu_q, _cu_kv, _cu_q_padded = _OneSlotCache(), _OneSlotCache(), _OneSlotCache()


def _is_causal_mask(mask: torch.Tensor) -> bool:
    """Whether a Megatron mask (True = masked, [.., s, s]) is exactly the causal mask in every batch row."""
    sq, sk = mask.shape[-2], mask.shape[-1]
    if sq != sk or mask.dtype != torch.bool:
        return False
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(1)
    return bool(torch.equal(mask, causal.expand_as(mask)))


def _segments(cu_seqlens: torch.Tensor) -> list[int]:
    return [int(x) for x in cu_seqlens.tolist()]


class SDPAttention(MegatronModule):
    """``core_attention`` on ``scaled_dot_product_attention``; constructor and forward as Megatron's
    ``DotProductAttention`` (the ``CoreAttentionBuilder`` / ``CoreAttention`` protocols of megatron-core)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None):
        from megatron.core.transformer.utils import is_layer_window_attention

        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs Transformer Engine's attention; use "
                             "model.layer_spec=transformer_engine or context_parallel_size=1.")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by the SDPA core attention; "
                             "use model.attention=megatron_local.")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError("sliding-window attention is not supported by the SDPA core attention; "
                             "use model.attention=megatron_local.")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the SDPA core attention (nor the local one).")
        causal = self._causal_type(attn_mask_type)
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed sequences in {packed_seq_params.qkv_format!r} format are not supported; "
                                 "the SDPA core attention takes qkv_format='thd'.")
            if attention_mask is not None:
                raise ValueError("pass either packed_seq_params (THD) or an attention_mask, not both.")
            return self._thd(query, key, value, packed_seq_params, causal)
        sq, b, heads, dim = query.shape
        mask, is_causal = None, False
        if attention_mask is not None:
            if _causal_verdicts.get(attention_mask, _is_causal_mask):
                is_causal = True
            else:
                mask = ~attention_mask  # Megatron: True = masked; SDPA: True = attend
        elif causal and sq > 1:
            is_causal = True
        if is_causal and sq != key.shape[0]:
            raise ValueError(f"causal attention with {sq} queries and {key.shape[0]} keys is not supported "
                             "(no KV cache in the SDPA core attention).")
        # [s, b, h, d] -> [b, h, s, d] as views; the kernel keeps the query's memory order, so the output
        # permuted back to [s, b, h, d] is contiguous and the final reshape is free.
        ctx = self._sdpa(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                         mask, is_causal)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)

    def _causal_type(self, attn_mask_type) -> bool:
        from megatron.core.transformer.enums import AttnMaskType

        # Like the local spec, an explicit mask overrides the type; the type decides only without one.
        kind = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        return kind in (AttnMaskType.causal, AttnMaskType.padding_causal)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              is_causal: bool) -> torch.Tensor:
        """q [b, np, s, d], k/v [b, ng, s, d] -> [b, np, s, d]."""
        group = q.shape[1] // k.shape[1]
        gqa = group > 1
        if gqa and mask is not None and q.is_cuda:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            gqa = False
        dropout = self.dropout_p if self.training else 0.0
        call = dict(attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=self.softmax_scale, enable_gqa=gqa)
        if dropout > 0.0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            # As the local spec: dropout under the model-parallel RNG state. (On CPU, SDPA's dropout draws from
            # the default generator whatever the tracker holds.)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, **call)
        return F.scaled_dot_product_attention(q, k, v, **call)

    def _thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any,
             causal: bool) -> torch.Tensor:
        """Packed [t, np, hn] / [t, ng, hn]: each sequence attends within itself. Returns [t, np * hn]."""
        cu_q = _cu_q.get(params.cu_seqlens_q, _segments)
        if _cu_kv.get(params.cu_seqlens_kv, _segments) != cu_q:
            raise ValueError("THD self-attention needs cu_seqlens_kv == cu_seqlens_q.")
        padded = cu_q if params.cu_seqlens_q_padded is None else _cu_q_padded.get(params.cu_seqlens_q_padded, _segments)
        t, heads, dim = query.shape
        pieces: list[torch.Tensor] = []
        for i in range(len(cu_q) - 1):
            start, n, slot = padded[i], cu_q[i + 1] - cu_q[i], padded[i + 1] - padded[i]
            if n > 0:
                q, k, v = (x[start:start + n].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                pieces.append(self._sdpa(q, k, v, None, causal and n > 1)[0].transpose(0, 1))
            if slot > n:  # padding between sequences (cu_seqlens_*_padded) gets zeros, as in TE
                pieces.append(query.new_zeros((slot - n, heads, dim)))
        if padded[-1] < t:
            pieces.append(query.new_zeros((t - padded[-1], heads, dim)))
        return torch.cat(pieces).reshape(t, heads * dim)


def resolve_attention(attention: str, layer_spec: str) -> str:
    """The core attention a layer spec gets: ``auto`` is SDPA under the local spec and TE's own under TE's."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTION_BACKENDS)}.")
    if layer_spec == "transformer_engine":
        if attention != "auto":
            raise ValueError(f"model.attention={attention} applies to the local layer spec; the transformer_engine "
                             "spec uses Transformer Engine's attention (set model.attention=auto).")
        return "transformer_engine"
    return "sdpa" if attention == "auto" else attention


def with_core_attention(spec, core_attention: type):
    """A copy of a GPT layer spec (TransformerLayer -> self_attention -> core_attention) with another
    ``core_attention`` submodule; the spec passed in is left as it is."""
    layer = spec.submodules
    attn = getattr(layer, "self_attention", None)
    if attn is None or not hasattr(getattr(attn, "submodules", None), "core_attention"):
        raise RuntimeError("this megatron-core's GPT layer spec has no self_attention.submodules.core_attention; "
                           "use model.attention=megatron_local.")
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=core_attention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, self_attention=attn))
