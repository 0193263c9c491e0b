"""FLOPs of a dense Qwen2 / Qwen3 decoder, and MFU from measured throughput.

The count is the usual "matmul FLOPs" convention (2 FLOPs per multiply-accumulate, as in
Megatron-LM, PaLM and nanoGPT MFU figures). Per token, per layer, with hidden size ``h``,
``n_h`` query heads and ``n_kv`` key/value heads of size ``d`` (Qwen2: ``h / n_h``; Qwen3: the config's
``head_dim``, e.g. 128 with ``n_h d = 8192 != h = 5120`` for Qwen3-32B), MLP width ``f``:

    Q and O projections      2 * h * (n_h * d)   each       = 4 h n_h d        (= 4 h^2 when n_h d = h)
    K and V projections      2 * h * (n_kv * d)  each       = 4 h n_kv d        (GQA)
    SwiGLU MLP               3 matmuls h x f               = 6 h f
    attention scores QK^T    2 * n_h * d * c
    attention values  PV     2 * n_h * d * c                = 4 n_h d c in total

where ``c`` is the number of keys the token attends to (its *context length*). Once per token:
the output logits, ``2 h V``. Not counted (each well under 1% at these shapes): the QKV biases,
RMSNorm (Qwen3's per-head q/k norms too), rotary embedding, SiLU and the elementwise gate, softmax,
residual adds, the embedding lookup (a gather, not a matmul).

Context length: a causal sequence of ``S`` tokens attends, at position ``i`` (1-based), to ``i``
keys, so the attention term of the whole sequence is ``4 h * S(S+1)/2`` -- what flash attention
with a causal mask actually computes. ``causal=False`` counts the full ``S x S`` square instead
(eager attention computes it and masks afterwards; torch's FLOP counter counts it that way).

Training FLOPs per token are ``3x`` the forward (backward = grads w.r.t. inputs + w.r.t. weights,
2x forward), ``4x`` with full activation recompute (one extra forward). Megatron's *selective*
recompute re-runs only the core attention, adding the attention-score term once more.

MFU = achieved model FLOP/s / peak FLOP/s, counting model FLOPs only (recompute excluded), so
recompute shows up as a lower MFU rather than inflated work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RECOMPUTE_MODES = ("none", "selective", "full")

# Dense peak FLOP/s per GPU from the vendor data sheets (SXM parts, without sparsity).
PEAK_FLOPS: dict[str, float] = {
    "h100-bf16": 989.4e12,
    "h100-fp8": 1978.9e12,
    "h200-bf16": 989.4e12,
    "h200-fp8": 1978.9e12,
    "a100-bf16": 312e12,
}


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a dense Qwen2 / Qwen3 decoder that the FLOPs and memory estimates need."""

    hidden: int
    """Model width ``h`` (HF ``hidden_size``)."""
    ffn: int
    """SwiGLU width ``f`` (HF ``intermediate_size``)."""
    layers: int
    """Decoder layers (HF ``num_hidden_layers``)."""
    heads: int
    """Query heads (HF ``num_attention_heads``)."""
    kv_heads: int
    """Key/value heads (HF ``num_key_value_heads``, GQA)."""
    vocab: int
    """Vocabulary size (HF ``vocab_size``)."""
    tied_embeddings: bool
    """Whether the output layer reuses the input embedding (HF ``tie_word_embeddings``)."""
    head_size: int | None = None
    """Size of one head ``d`` (HF ``head_dim``); None = ``hidden / heads`` (Qwen2)."""
    qkv_bias: bool = True
    """Biases on q/k/v (Qwen2; not Qwen3)."""
    qk_norm: bool = False
    """Per-head RMSNorm weights on queries and keys (Qwen3): 2 d parameters per layer."""
    experts: int = 0
    """MoE (Qwen3-MoE): experts per sparse layer (HF ``num_experts``); 0 = dense."""
    topk: int = 0
    """MoE: experts each token runs through (HF ``num_experts_per_tok``)."""
    moe_ffn: int = 0
    """MoE: SwiGLU width of one expert (HF ``moe_intermediate_size``)."""
    moe_layers: int = 0
    """MoE: how many layers are sparse (the rest keep the dense ``ffn``)."""

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection output: ``n_kv * d``."""
        return self.kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelShape:
        """Read the shape from a Hugging Face Qwen2 / Qwen3 ``config.json`` dict (HFConfigError, a ValueError, for
        one the project does not support)."""
        from dapo_mcore.model.hf_config import QwenShape
        from dapo_mcore.model.moe_shape import MoEShape

        s = QwenShape.from_hf(cfg)
        moe = MoEShape.from_hf(cfg)
        sparse = {} if moe is None else dict(experts=moe.num_experts, topk=moe.topk, moe_ffn=moe.moe_ffn_hidden_size,
                                             moe_layers=len(moe.moe_layers))
        return cls(
            hidden=s.hidden_size, ffn=s.ffn_hidden_size, layers=s.num_layers, heads=s.num_heads,
            kv_heads=s.num_kv_heads, vocab=s.vocab_size, tied_embeddings=s.tie_embeddings, head_size=s.head_dim,
            qkv_bias=s.qkv_bias, qk_norm=s.qk_norm, **sparse,
        )

    def mlp_params_per_layer(self, active: bool = False) -> float:
        """MLP parameters of one layer, averaged over dense and sparse layers (MoE: every expert plus the router,
        or with `active` only the ``topk`` experts a token runs through plus the router)."""
        dense = 3 * self.hidden * self.ffn
        if not self.experts:
            return dense
        per_expert = 3 * self.hidden * self.moe_ffn
        sparse = (self.topk if active else self.experts) * per_expert + self.experts * self.hidden
        return (dense * (self.layers - self.moe_layers) + sparse * self.moe_layers) / self.layers

    def expert_params(self) -> int:
        """All expert weights of the model (what expert parallelism splits); 0 for a dense model."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.moe_ffn

    def active_params(self) -> int:
        """Parameters a token runs through (MoE: ``topk`` of the experts; dense: all)."""
        return self.num_params() - round(self.layers * (self.mlp_params_per_layer() -
                                                        self.mlp_params_per_layer(active=True)))

    def layer_params(self) -> int:
        """Parameters of one decoder layer (projections, QKV bias or q/k norms, two RMSNorm weights)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_dim
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) if self.qkv_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        return attn + round(self.mlp_params_per_layer()) + 2 * h

    def num_params(self) -> int:
        """Total parameters, counting a tied embedding once."""
        emb = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else emb
        return self.layers * self.layer_params() + emb + head + self.hidden


def _dense_flops_per_token_layer(s: ModelShape) -> float:
    """Forward matmul FLOPs of one layer's projections and MLP, per token."""
    q = s.heads * s.head_dim  # MoE: the active experts and the router only (FLOPs from active parameters)
    return 2.0 * (s.hidden * q + 2 * s.hidden * s.kv_dim + q * s.hidden + s.mlp_params_per_layer(active=True))


def _attn_flops_per_key_layer(s: ModelShape) -> float:
    """Forward FLOPs of QK^T and PV for one (query token, key) pair in one layer."""
    return 4.0 * s.heads * s.head_dim


def forward_flops_per_token(shape: ModelShape, context_len: float) -> float:
    """Forward FLOPs for one token attending to ``context_len`` keys, logits included."""
    per_layer = _dense_flops_per_token_layer(shape) + _attn_flops_per_key_layer(shape) * context_len
    return shape.layers * per_layer + 2.0 * shape.hidden * shape.vocab


def attention_score_flops(shape: ModelShape, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs of QK^T and PV over one sequence of ``seq_len`` tokens, all layers."""
    pairs = seq_len * (seq_len + 1) / 2 if causal else float(seq_len) * seq_len
    return shape.layers * _attn_flops_per_key_layer(shape) * pairs


def sequence_forward_flops(shape: ModelShape, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs of one sequence of ``seq_len`` tokens (logits at every position)."""
    dense = seq_len * (shape.layers * _dense_flops_per_token_layer(shape) + 2.0 * shape.hidden * shape.vocab)
    return dense + attention_score_flops(shape, seq_len, causal)


def sequence_train_flops(shape: ModelShape, seq_len: int, recompute: str = "none",
                         causal: bool = True) -> float:
    """Hardware FLOPs of forward + backward over one sequence under a recompute mode.

    ``none``: 3x forward. ``selective``: 3x forward + the attention-score term once more.
    ``full``: 4x forward (the logits are not recomputed by Megatron's full recompute, but their
    share is small enough at these shapes that the 4x convention is kept).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r}; use one of {RECOMPUTE_MODES}")
    fwd = sequence_forward_flops(shape, seq_len, causal)
    if recompute == "none":
        return 3.0 * fwd
    if recompute == "selective":
        return 3.0 * fwd + attention_score_flops(shape, seq_len, causal)
    return 4.0 * fwd


def mfu(model_flops: float, seconds: float, num_gpus: int, peak_flops_per_gpu: float) -> float:
    """Model FLOPs utilisation: ``model_flops / seconds`` over the peak of ``num_gpus`` devices.

    ``model_flops`` should be the *model* FLOPs (3x forward for training, no recompute).
    """
    if seconds <= 0 or num_gpus <= 0 or peak_flops_per_gpu <= 0:
        raise ValueError("seconds, num_gpus and peak_flops_per_gpu must be positive")
    return model_flops / seconds / (num_gpus * peak_flops_per_gpu)


def mfu_from_tokens_per_second(shape: ModelShape, tokens_per_s: float, seq_len: int,
                               num_gpus: int, peak_flops_per_gpu: float, training: bool = True) -> float:
    """MFU from training (or forward-only) throughput in tokens/s over sequences of ``seq_len``."""
    per_token = sequence_forward_flops(shape, seq_len) / seq_len * (3.0 if training else 1.0)
    return mfu(per_token * tokens_per_s, 1.0, num_gpus, peak_flops_per_gpu)


def tokens_per_second_at_mfu(shape: ModelShape, mfu_value: float, seq_len: int, num_gpus: int,
                             peak_flops_per_gpu: float, training: bool = True) -> float:
    """Inverse of :func:`mfu_from_tokens_per_second`: the throughput an assumed MFU implies."""
    per_token = sequence_forward_flops(shape, seq_len) / seq_len * (3.0 if training else 1.0)
    return mfu_value * num_gpus * peak_flops_per_gpu / per_token
