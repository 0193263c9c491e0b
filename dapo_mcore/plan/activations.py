"""Bytes one token leaves stored for backward in one decoder layer, on one rank: the planner's activation model.

Each term is a tensor Megatron-Core's layer saves for its backward (checked against
``torch.autograd.graph.saved_tensors_hooks`` at tiny shapes in ``tests/test_activation_model.py``):

* Norms (input and pre-MLP): the input and the normalized output (the next linear's input), an fp32 ``rstd`` per
  token. Transformer Engine's fused RMSNorm stops there; the local spec's composed torch RMSNorm also keeps ``x *
  rstd`` (``fused=False``, the CPU structure).
* Attention: the fused QKV output, the q/k-norm inputs and fp32 ``rstd`` per head (Qwen3), the rotated q and k, the
  attention output and its fp32 log-sum-exp per head (flash / SDPA kernels: no score matrix). Selective recompute
  re-runs core attention, so only the log-sum-exp goes: its inputs and output are kept by their neighbours.
  The local spec's unfused rotary embedding keeps its cos/sin per token (4 head_dim).
* Dense SwiGLU MLP: the fc1 output (2f) and the fc2 input (f); unfused (the local spec on CPU) two more f-wide
  halves and the gated product (5f in all).
* MoE (Qwen3-MoE, the all-to-all dispatcher): routing on this rank's tokens (top-k indices and probabilities, the
  aux-loss scores, the routing map: ``28 k + 9 E`` bytes), and per routed token the dispatched hidden state (h),
  the expert SwiGLU (3 or 6 expert widths) and its fp32 probability. With tensor parallelism the dispatcher
  all-gathers the dispatched tokens over the expert-TP group (``MoEAlltoAllTokenDispatcher.dispatch_postprocess``,
  megatron-core 0.16.1 ``transformer/moe/token_dispatcher.py``; expert-TP defaults to TP in ``parallel_state.py``),
  so the ``k h`` term is NOT divided by TP, while the experts' own widths are (measured at TP 2 with sequence
  parallelism: to the byte). Expert parallelism moves tokens but
  not their number: balanced, a rank keeps ``k`` routed tokens per token of its micro-batch whatever EP is.

Sequence parallelism (on whenever TP > 1 in the planner) splits the norms' and the routing's tokens over TP
(measured at TP 2, dense and MoE, on gloo: Megatron-Core's local layers run it there but for one assert, in its torch
norm, which the measurement lets through: ``tests/dist_scripts/saved_bytes.py`` says why that is sound).
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_mcore.telemetry.flops import ModelShape

FP32 = 4


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token of one layer on one rank, by part (``total`` is what the planner charges)."""

    attention: float
    dense_mlp: float
    moe_mlp: float
    moe_fraction: float

    @property
    def total(self) -> float:
        return self.attention + (1 - self.moe_fraction) * self.dense_mlp + self.moe_fraction * self.moe_mlp


def layer_activations(shape: ModelShape, recompute: str, act_bytes: int, tensor_parallel: int = 1,
                      sequence_parallel: bool | None = None, expert_tensor_parallel: int | None = None,
                      fused: bool = True) -> LayerActivations:
    """The per-token, per-layer saved bytes of ``shape`` on one rank (see the module docstring)."""
    tp = tensor_parallel
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    etp = tp if expert_tensor_parallel is None else expert_tensor_parallel
    a, h, d = act_bytes, shape.hidden, shape.head_dim
    q, kv, heads, kv_heads = shape.heads * d, shape.kv_dim, shape.heads, shape.kv_heads
    if recompute == "full":  # only the layer's input stays; the recomputed layer is charged by the planner
        return LayerActivations(h * a / (tp if sp else 1), 0.0, 0.0, 0.0)
    seq = tp if sp else 1  # what sequence parallelism splits
    norm = ((2 if fused else 3) * h * a + FP32) / seq
    attn = (q + 2 * kv) * a / tp  # fused QKV output (v is read from it)
    if shape.qk_norm:
        attn += (q * a + (heads + kv_heads) * FP32 + (0 if fused else (q + kv) * a)) / tp
    if not fused:
        attn += 4 * d * a  # the local rotary embedding's cos/sin (not split: attention sees the whole sequence)
    attn += ((q + kv) * a + q * a) / tp  # rotated q and k, the attention output
    if recompute != "selective":
        attn += heads * FP32 / tp  # log-sum-exp
    dense = (3 if fused else 5) * shape.ffn * a / tp + norm
    moe = 0.0
    if shape.experts:
        k, m = shape.topk, shape.moe_ffn
        routing = (28 * k + 9 * shape.experts) / seq
        experts = (k * h * a + k * (3 if fused else 6) * m * a / etp + k * FP32) * etp / tp
        moe = norm + routing + experts
    share = shape.moe_layers / shape.layers if shape.experts else 0.0
    return LayerActivations(norm + attn, dense, moe, share)
