"""An MoE model's decode time on vLLM: per-step latency from the bytes a step reads and the tokens it dispatches.

Decoding a sparse model is not priced by its active FLOPs: at a batch of B running sequences every decode step reads
(per GPU of an engine of G GPUs) the dense weights (attention, router, embeddings) / G, the experts that any of the
B tokens picks (uniform routing: a share ``1 - (1 - k/E)^B`` of them, all of them past a few dozen tokens), and the
KV cache of every running sequence; and each MoE layer moves the batch's tokens between the engine's GPUs.

* Memory: ``bytes / (hbm_gbs * hbm_efficiency)``.
* Compute: ``2 * active parameters * B / G`` at ``decode_compute_mfu`` of the GPU's peak (a floor; rarely binding).
* Dispatch, engines within a node (vLLM TP x EP inside one instance): tokens are replicated over the instance's TP
  ranks, so each layer's attention and MoE output are one all-reduce each of ``B * h * 2`` bytes over NVLink (ring:
  ``2 (G-1)/G`` of it per GPU) plus ``collective_latency_us``.
* Dispatch, one vLLM data-parallel group over ``D`` engines (the lockstep layout): vLLM's default all-to-all
  all-gathers every token of every engine to every GPU of the expert-parallel group and reduce-scatters back, so a
  layer moves ``2 * B * D * h * 2`` bytes per GPU over the slowest link it crosses (InfiniBand across nodes).
* ``step_overhead_ms`` per step (scheduler, sampler, CUDA-graph launch).

A generation batch of R responses on I engines: each engine holds ``B = min(R / I, KV-cache tokens / context)``
sequences at a mean context of prompt + half the mean response, and runs ``(R / I) * mean / B`` steps at t(B); the
longest response needs ``max`` steps even alone, at t(1) at least, so the batch takes the larger of the two. These
are a model's assumptions (the defaults: H100 SXM), not measurements: ``plan`` prints them beside the number.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_mcore.telemetry.flops import ModelShape

BF16 = 2


@dataclass(frozen=True)
class DecodeAssumptions:
    """The hardware terms of the decode model (H100 SXM 80 GB, NVLink 4, 400 Gb/s InfiniBand per GPU)."""

    hbm_gbs: float = 3350.0
    """HBM bandwidth of one GPU, GB/s."""
    hbm_efficiency: float = 0.6
    """Share of it decode kernels (GEMV-shaped expert GEMMs, paged attention) achieve."""
    nvlink_gbs: float = 450.0
    """NVLink bandwidth per GPU and direction inside a node, GB/s."""
    network_gbs: float = 45.0
    """Inter-node bandwidth per GPU (one 400 Gb/s NIC), GB/s, achieved."""
    collective_latency_us: float = 15.0
    """Latency of one small collective inside a node (NCCL all-reduce / all-to-all of a decode batch)."""
    network_latency_us: float = 40.0
    """Latency of one collective that crosses nodes."""
    step_overhead_ms: float = 1.0
    """Per decode step: scheduling, sampling, launch."""
    decode_compute_mfu: float = 0.4
    """Share of peak FLOP/s the decode GEMMs reach when compute-bound."""


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of one engine at batch ``batch``: its parts in seconds."""

    batch: int
    memory_s: float
    compute_s: float
    dispatch_s: float
    overhead_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s) + self.dispatch_s + self.overhead_s


def decode_step(shape: ModelShape, gpus: int, batch: int, context: float, peak_tflops: float,
                lockstep_engines: int = 1, engines_per_node: float = 1.0,
                a: DecodeAssumptions = DecodeAssumptions()) -> DecodeStep:
    """One engine of ``gpus`` GPUs decoding ``batch`` sequences at mean ``context`` tokens; ``lockstep_engines`` > 1:
    one vLLM data-parallel group of that many engines (experts over all of them), ``engines_per_node`` of which
    share a node (1 or fewer: every exchange crosses nodes)."""
    experts = shape.expert_params()
    touched = 1.0 - (1.0 - shape.topk / shape.experts) ** (batch * lockstep_engines) if shape.experts else 0.0
    weights = (shape.num_params() - experts) * BF16 / gpus + experts * BF16 / (gpus * lockstep_engines) * touched
    kv_heads = max(1.0, shape.kv_heads / gpus)
    kv = batch * context * shape.layers * 2 * kv_heads * shape.head_dim * BF16
    memory = (weights + kv) / (a.hbm_gbs * 1e9 * a.hbm_efficiency)
    compute = 2.0 * shape.active_params() * batch / gpus / (peak_tflops * 1e12 * a.decode_compute_mfu)
    token = shape.hidden * BF16
    if lockstep_engines > 1:  # all-gather + reduce-scatter of every engine's tokens, per MoE layer
        crosses = lockstep_engines > engines_per_node
        bw, lat = (a.network_gbs, a.network_latency_us) if crosses else (a.nvlink_gbs, a.collective_latency_us)
        moe = 2 * batch * lockstep_engines * token / (bw * 1e9) + 2 * lat * 1e-6
        attn = (2 * (gpus - 1) / gpus * batch * token / (a.nvlink_gbs * 1e9) + a.collective_latency_us * 1e-6
                if gpus > 1 else 0.0)
        dispatch = shape.moe_layers * moe + shape.layers * attn
    elif gpus > 1:  # attention and MoE outputs: one all-reduce each per layer, inside the node
        per = 2 * (gpus - 1) / gpus * batch * token / (a.nvlink_gbs * 1e9) + a.collective_latency_us * 1e-6
        dispatch = (shape.layers + shape.moe_layers) * per
    else:
        dispatch = 0.0
    return DecodeStep(batch, memory, compute, dispatch, a.step_overhead_ms * 1e-3)


@dataclass(frozen=True)
class GenerationEstimate:
    """A generation batch's decode time and what it rests on."""

    seconds: float
    batch: int
    step: DecodeStep
    tail_step: DecodeStep
    steps: float

    def describe(self, engines: int, gpus: int, lockstep: bool) -> str:
        layout = (f"{engines} vLLM engines of {gpus} GPU(s) in one data-parallel group (experts over all of them)"
                  if lockstep else f"{engines} independent vLLM engines of {gpus} GPU(s), experts within each")
        s = self.step
        return (f"MoE decode model: {layout}; {self.batch} sequences per engine: {s.seconds * 1e3:.1f} ms per step "
                f"(memory {s.memory_s * 1e3:.1f}, dispatch {s.dispatch_s * 1e3:.1f}, overhead {s.overhead_s * 1e3:.1f})"
                f", {self.steps:.0f} steps; the longest response alone {self.tail_step.seconds * 1e3:.1f} ms per "
                f"step; generation {self.seconds / 60:.1f} min (assumes HBM 3.35 TB/s at 60%, NVLink 450 GB/s, "
                f"45 GB/s between nodes, uniform routing; a model, not a measurement)")


def generation_seconds(shape: ModelShape, *, gpus: int, engines: int, responses: float, mean_response: float,
                       max_response: int, prompt: float, kv_tokens: int, peak_tflops: float,
                       lockstep: bool, gpus_per_node: int = 8,
                       a: DecodeAssumptions = DecodeAssumptions()) -> GenerationEstimate:
    """A generation batch of ``responses`` on ``engines`` engines of ``gpus`` GPUs each (``kv_tokens``: one
    engine's KV cache in tokens); ``lockstep``: one vLLM data-parallel group (the colocated SPMD layout)."""
    per_engine = responses / engines
    context = prompt + mean_response / 2
    batch = max(1, int(min(per_engine, kv_tokens / max(1.0, prompt + mean_response))))
    together = engines if lockstep else 1
    per_node = max(1.0, gpus_per_node / gpus)
    step = decode_step(shape, gpus, batch, context, peak_tflops, together, per_node, a)
    tail = decode_step(shape, gpus, 1, prompt + max_response, peak_tflops, together, per_node, a)
    steps = per_engine * mean_response / batch
    return GenerationEstimate(max(steps * step.seconds, max_response * tail.seconds), batch, step, tail, steps)
