"""Capacity planner: per-GPU memory and FLOPs of a DAPO layout, before any GPU is touched.

``dapo-mcore plan`` answers "does this layout fit, and if not, what should change?" for a dense
Qwen2 / Qwen3 policy trained by Megatron-Core with vLLM colocated on the same GPUs.

Memory model (bytes per GPU; ``P`` = parameters held by this rank's pipeline stage / TP):

* Persistent training state, by precision:
  ``bf16``/``fp8``: bf16 weights (2P) + gradient buffer (4P with ``grad_reduce_in_fp32``, else 2P)
  + fp32 main weights and Adam m, v (12P), the 12P divided by DP with the distributed optimizer.
  ``fp8`` adds the Transformer Engine FP8 weight copy and its transpose (2 bytes per linear weight).
  ``fp32`` (plain torch on CPU): weights 4P + grads 4P + Adam 8P (no main copy).
* Activations per token per layer, as stored for backward by the fused (Transformer Engine,
  flash attention) layer, in elements: ``4h + 2q + 2kv + 3f`` (block input, norm output, Q (``q`` = heads x
  head_dim, = h for Qwen2, 8192 for Qwen3-32B's h = 5120), K/V (GQA), attention output (q), residual, norm
  output, SwiGLU gate+up (2f), SwiGLU output (f)), plus ``q + kv`` with Qwen3's q/k norms (their inputs);
  divided by TP with sequence parallelism. ``selective`` recompute (Megatron's ``core_attn``) drops the
  attention output (q); ``full`` keeps only the block input (h)
  plus, transiently, one layer's full set while it is recomputed. Attention scores are never
  stored (flash attention), so there is no ``s^2`` term. No dropout masks (Qwen2 uses none).
* 1F1B keeps ``min(PP, micro-batches)`` micro-batches in flight on the first stage (each with
  its ``L/PP`` layers); interleaving (VPP > 1) multiplies that by ``1 + (PP-1)/(PP*VPP)``
  (Korthikanti et al. 2022). The last stage holds one micro-batch plus the logits and the training loss's
  temporaries (:func:`loss_logits_bytes`): the stored logits (``a`` bytes per element) plus, at the peak (the
  log-prob's backward), 8 fp32 bytes per element at TP > 1 (Megatron's vocab-parallel cross entropy keeps the
  softmax, which becomes the gradient, plus one masked/scaled copy) and 16 at TP = 1 (logsumexp's saved fp32 input
  and its backward's exp, product and gather gradient). The entropy metric runs without a graph, in chunks of
  ``actor.sizes.ENTROPY_CHUNK_BYTES`` (three fp32 chunks beside the held copy, in the forward): it adds nothing
  to the backward peak. ``tests/test_planner_memory.py`` runs the actor's loss function (``dapo_loss``) at TP=1 and
  on two gloo TP ranks and checks these counts against the live bytes it allocates.
* vLLM colocated with sleep mode: the two never peak together. During rollout vLLM is awake and
  holds ``gpu_memory_utilization * GPU`` (its weights at vLLM-TP, a workspace, and the KV cache in
  the rest) beside the trainer's persistent state (activations are gone; optionally the
  optimizer state and gradients are offloaded). During training vLLM sleeps (level 1: weights to
  host memory, KV cache freed), leaving ``vllm_sleep_residue_gib`` (context, CUDA-graph pool).
  The peak of a GPU is the larger of the two phases. What this assumes is released: before every vLLM wake
  (``VLLMEngine`` calls ``torch.cuda.empty_cache()`` there, for a step, an evaluation and a resync alike) the
  caching allocator hands back the training phase's activations, logits and loss temporaries, which vLLM's
  ``cuMemCreate`` mappings could not otherwise use; with ``offload_train_state_in_rollout`` Megatron's offload hooks
  also move the gradient buffers and optimizer state out. Weights and FP8 copies stay, and so does ``overhead_gib``
  (context, NCCL buffers, fragmentation the release cannot undo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from dapo_mcore.telemetry.flops import RECOMPUTE_MODES, ModelShape, sequence_forward_flops

GIB = 1024**3
PRECISIONS = ("bf16", "fp8", "fp32")


@dataclass
class PlanInput:
    """One layout to estimate. Defaults follow the DAPO 32B recipe where one applies."""

    model: dict[str, Any]
    """Hugging Face ``config.json`` of the policy (see ``dapo_mcore.model.presets``)."""
    tensor_parallel: int = 1
    """Megatron tensor-parallel size (sequence parallelism on when > 1)."""
    pipeline_parallel: int = 1
    """Megatron pipeline-parallel size."""
    data_parallel: int = 1
    """Data-parallel replicas of the trainer."""
    expert_parallel: int = 1
    """MoE: each layer's experts split over this many ranks inside the data-parallel group (weights and grads of
    experts / EP per GPU; with the distributed optimizer their Adam state is sharded over DP / EP replicas)."""
    expert_tensor_parallel: int = 0
    """MoE: each expert split over this many ranks (Megatron's expert-TP; 0 = tensor_parallel, Megatron's
    default). Expert weights and grads per GPU are experts / (EP x ETP); below TP the dispatcher no longer
    all-gathers the routed tokens over the TP group, so their activations divide by TP (``plan.activations``)."""
    virtual_pipeline: int = 1
    """Interleaved pipeline chunks per stage (1 = plain 1F1B)."""
    micro_batch_tokens: int = 22528
    """Packed tokens per micro-batch (THD token budget) per data-parallel rank."""
    recompute: str = "none"
    """Activation recompute: none, selective (core attention), full (whole layer)."""
    precision: str = "bf16"
    """bf16 (Megatron mixed precision), fp8 (TE FP8 GEMMs over bf16 weights), fp32 (plain, CPU)."""
    grad_reduce_in_fp32: bool = True
    """Gradient buffer in fp32 (4 B/param) rather than the parameter dtype."""
    distributed_optimizer: bool = True
    """Shard fp32 main weights and Adam states over data-parallel ranks (ZeRO-1)."""
    lora_rank: int = 0
    """LoRA (model.lora.rank; 0 = full fine-tuning): the base frozen (weights only), the adapters trained (plan/lora.py)."""
    lora_targets: str = "linear_qkv,linear_proj,linear_fc1,linear_fc2"
    """LoRA's targeted Megatron layers, comma-separated (model.lora.target_modules)."""
    offload_train_state_in_rollout: bool = False
    """Move gradients and optimizer state to host memory while vLLM generates (parallel.offload_for_rollout)."""
    colocate_vllm: bool = True
    """vLLM shares the trainer's GPUs (sleep mode between phases)."""
    vllm_tensor_parallel: int = 4
    """vLLM tensor-parallel size."""
    vllm_engines: str = "data_parallel"
    """data_parallel: the vLLM engines form one data-parallel group (lockstep; an MoE model's experts over all of
    them); instances: independent engines (an MoE model's experts within each). Prices MoE decoding."""
    vllm_gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use while awake (weights + workspace + KV cache)."""
    vllm_workspace_gib: float = 2.0
    """vLLM activation workspace for its profiling pass and sampling."""
    vllm_sleep_residue_gib: float = 1.0
    """What vLLM keeps on the GPU while asleep (context, CUDA-graph pool)."""
    vllm_sleep_level: int = 2
    """vLLM sleep level between phases: 1 copies its weights to pinned host memory and back every step; 2 drops
    them (the weight sync after every update overwrites them anyway), costing no copy."""
    vllm_load_format: str = "dummy"
    """How vLLM gets its first weights: dummy (random; the start-up sync overwrites every weight) or auto (every
    rank reads the whole checkpoint from the filesystem)."""
    host_to_device_gbs: float = 20.0
    """Pinned host <-> GPU copy rate per GPU in GB/s while all GPUs of a node copy at once (PCIe Gen5 x16 is
    ~50 GB/s alone; shared host links roughly halve it): prices sleep level 1."""
    filesystem_read_gbs: float = 10.0
    """Aggregate read rate of the shared filesystem in GB/s: prices vLLM's start-up read with load_format=auto."""
    gpus_per_host: int = 8
    """GPUs per node (host memory is per node)."""
    host_memory_gib: float = 1800.0
    """Host memory per node usable by the job (H100 HGX nodes: 2 TiB)."""
    async_lead: int = 0
    """Async mode: D, how many batches the engine ranks run ahead (0 = colocated). Each engine rank keeps up to D - 1
    received versions in host memory (``config.rules.staged_host_bytes``)."""
    async_engine_ranks: int = 0
    """Async mode: the engine ranks; up to ``gpus_per_host`` of them share one node's host memory."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (H100 SXM: 80)."""
    overhead_gib: float = 3.0
    """CUDA context, NCCL buffers and allocator fragmentation, per GPU."""
    max_prompt_len: int = 2048
    """Longest prompt in tokens."""
    max_response_len: int = 20480
    """Longest response in tokens."""
    mean_prompt_len: int = 256
    """Mean prompt length in tokens (for FLOPs per step)."""
    mean_response_len: int = 8192
    """Mean response length in tokens (for FLOPs per step)."""
    rollout_prompts: int = 512
    """Prompts per DAPO step (train batch)."""
    responses_per_prompt: int = 16
    """Responses sampled per prompt (group size G)."""
    mini_batch_prompts: int = 32
    """Prompts per gradient update (mini-batch)."""
    gen_batch_prompts: int = 1536
    """Prompts per generation batch (DAPO: 3 x the 512-prompt train batch, so rejected groups can be replaced)."""
    generation_batches: float = 1.0
    """Generation batches per step (dynamic sampling draws more when too few groups are usable)."""
    peak_tflops: float = 989.4
    """Dense bf16 peak of one GPU in TFLOP/s (H100 SXM), the MFU reference even for FP8 GEMMs."""
    train_mfu: float = 0.35
    """Assumed MFU of the old-log-prob and update passes, for the step-time estimate."""
    decode_mfu: float = 0.10
    """Assumed MFU of generation (decoding is memory-bound), for the step-time estimate."""

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size (``expert_tensor_parallel``, or TP when unset)."""
        return self.expert_tensor_parallel or self.tensor_parallel

    def validate(self) -> None:
        """Raise ValueError naming the fix for an impossible layout."""
        shape = ModelShape.from_hf(self.model)
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "virtual_pipeline",
                     "micro_batch_tokens", "vllm_tensor_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        tp = self.tensor_parallel
        if shape.kv_heads % tp or shape.heads % tp:
            ok = [d for d in range(1, shape.kv_heads + 1) if shape.kv_heads % d == 0 and shape.heads % d == 0]
            raise ValueError(f"tensor_parallel={tp} must divide num_key_value_heads={shape.kv_heads} and "
                             f"num_attention_heads={shape.heads} (Megatron splits query groups); use one of {ok}")
        chunks = self.pipeline_parallel * self.virtual_pipeline
        if shape.layers % chunks:
            ok = [d for d in range(1, shape.layers + 1) if shape.layers % d == 0]
            raise ValueError(f"pipeline_parallel*virtual_pipeline={chunks} must divide num_hidden_layers="
                             f"{shape.layers}; use a product in {ok}")
        etp = self.expert_tp
        if self.expert_parallel < 1 or etp < 1 or tp % etp or (tp * self.data_parallel) % (etp * self.expert_parallel) or (
                self.expert_parallel > 1 and (not shape.experts or shape.experts % self.expert_parallel)):
            raise ValueError(f"expert_parallel={self.expert_parallel} x expert_tensor_parallel={etp} must divide "
                             f"tensor_parallel x data_parallel={tp * self.data_parallel} (expert_tensor_parallel a "
                             f"divisor of tensor_parallel={tp}), and expert_parallel the model's experts "
                             f"({shape.experts or 'dense model: use 1'})")
        if shape.heads % self.vllm_tensor_parallel:
            raise ValueError(f"vllm_tensor_parallel={self.vllm_tensor_parallel} must divide "
                             f"num_attention_heads={shape.heads}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={self.recompute!r}; use one of {RECOMPUTE_MODES}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; use one of {PRECISIONS}")
        if not 0.0 < self.vllm_gpu_memory_utilization < 1.0:
            raise ValueError("vllm_gpu_memory_utilization must lie in (0, 1), e.g. 0.5")
        if self.precision == "fp32" and self.distributed_optimizer and self.data_parallel > 1:
            raise ValueError("precision=fp32 is the plain CPU path; set distributed_optimizer=False")
        responses = self.mini_batch_prompts * self.responses_per_prompt
        if responses % self.data_parallel:
            raise ValueError(f"a mini-batch of {self.mini_batch_prompts} prompts x {self.responses_per_prompt} = "
                             f"{responses} responses cannot be shared equally by data_parallel={self.data_parallel}; "
                             f"choose a layout whose data parallelism divides {responses}")
        if self.vllm_engines not in ("data_parallel", "instances"):
            raise ValueError(f"vllm_engines={self.vllm_engines!r}; use data_parallel or instances")
        if self.vllm_sleep_level not in (1, 2):
            raise ValueError(f"vllm_sleep_level={self.vllm_sleep_level}; use 1 or 2")
        if self.vllm_load_format not in ("dummy", "auto"):
            raise ValueError(f"vllm_load_format={self.vllm_load_format!r}; use dummy or auto")
        if min(self.peak_tflops, self.train_mfu, self.decode_mfu) <= 0:
            raise ValueError("peak_tflops, train_mfu and decode_mfu must be > 0 (e.g. 989.4, 0.35, 0.10)")


@dataclass
class MemoryEstimate:
    """Per-GPU bytes of the worst pipeline stage, by component and phase."""

    weights: float
    grads: float
    optimizer: float
    fp8_weight_cache: float
    activations: float
    logits: float
    overhead: float
    vllm_awake: float
    vllm_asleep: float
    vllm_weights: float
    vllm_kv_cache: float
    vllm_kv_tokens: int
    train_peak: float
    rollout_peak: float
    worst_stage: str

    @property
    def persistent(self) -> float:
        return self.weights + self.grads + self.optimizer + self.fp8_weight_cache

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.rollout_peak)


def stage_params(shape: ModelShape, pp: int, stage: int) -> tuple[int, int]:
    """(all parameters, transformer-layer linear weights) of one pipeline stage, before TP.

    The first stage holds the input embedding, the last the final norm and the output layer; a tied
    output layer costs nothing extra at PP=1 and is a second copy of the embedding at PP>1. Only
    the transformer layers' linear weights get FP8 copies (Megatron keeps the output layer in bf16).
    """
    layers = shape.layers // pp
    q = shape.heads * shape.head_dim
    linear_per_layer = 2 * shape.hidden * q + 2 * shape.hidden * shape.kv_dim + 3 * shape.hidden * shape.ffn
    total = layers * shape.layer_params()
    emb = shape.vocab * shape.hidden
    if stage == 0:
        total += emb
    if stage == pp - 1:
        total += shape.hidden
        if not shape.tied_embeddings or pp > 1:
            total += emb
    return total, layers * linear_per_layer


def activation_bytes_per_token_layer(shape: ModelShape, recompute: str, act_bytes: int,
                                     tensor_parallel: int = 1, expert_tensor_parallel: int | None = None) -> float:
    """Bytes one token leaves stored for backward in one layer on one rank (Transformer Engine kernels; sequence
    parallelism when TP > 1; MoE layers with the all-to-all dispatcher's all-gather over expert-TP, None = TP):
    ``plan.activations``, checked against measurement."""
    from dapo_mcore.plan.activations import layer_activations

    return layer_activations(shape, recompute, act_bytes, tensor_parallel,
                             expert_tensor_parallel=expert_tensor_parallel).total


def _persistent_bytes(p: PlanInput, params: int, linear: int) -> tuple[float, float, float, float]:
    """(weights, grads, optimizer, fp8 cache) bytes for ``params`` held on one GPU."""
    if p.precision == "fp32":
        return 4.0 * params, 4.0 * params, 8.0 * params, 0.0
    weights = 2.0 * params
    grads = (4.0 if p.grad_reduce_in_fp32 else 2.0) * params
    optimizer = 12.0 * params / (p.data_parallel if p.distributed_optimizer else 1)
    fp8 = 2.0 * linear if p.precision == "fp8" else 0.0
    return weights, grads, optimizer, fp8


def _expert_parallel_bytes(p: PlanInput, shape: ModelShape, params: float, w: float, g: float,
                           o: float) -> tuple[float, float, float]:
    """(weights, grads, optimizer) of an MoE stage whose experts are split over ``expert_parallel`` ranks: the
    expert share of each shrinks by EP; Adam's state of the experts is sharded over the DP / EP replicas of each
    expert (distributed optimizer), i.e. the same bytes per GPU as without EP there."""
    share = shape.expert_params() / shape.layers * (shape.layers // p.pipeline_parallel) / params
    # w, g, o were counted at params / TP; an expert is split over EP x ETP ranks instead
    keep = 1.0 - share + share * p.tensor_parallel / (p.expert_parallel * p.expert_tp)
    o_keep = 1.0 if p.distributed_optimizer else keep
    return w * keep, g * keep, o * o_keep


def num_microbatches(p: PlanInput) -> int:
    """Micro-batches per data-parallel rank in one mini-batch, at the mean sequence length."""
    seq = p.mean_prompt_len + p.mean_response_len
    tokens = p.mini_batch_prompts * p.responses_per_prompt * seq / p.data_parallel
    return max(1, math.ceil(tokens / p.micro_batch_tokens))


def _stage_activation_bytes(p: PlanInput, shape: ModelShape, stage: int) -> tuple[float, float]:
    """(activations, logits) bytes on ``stage`` at the micro-batch token budget."""
    act_bytes = 4 if p.precision == "fp32" else 2
    per_layer = activation_bytes_per_token_layer(shape, p.recompute, act_bytes, p.tensor_parallel, p.expert_tp)
    pp, n_mb = p.pipeline_parallel, num_microbatches(p)
    in_flight = float(min(pp - stage, n_mb))
    if p.virtual_pipeline > 1 and pp > 1:
        in_flight *= 1 + (pp - 1) / (pp * p.virtual_pipeline)
    acts = per_layer * (shape.layers // pp) * in_flight * p.micro_batch_tokens
    if p.recompute == "full":  # the layer being recomputed holds its full activations during its backward
        acts += activation_bytes_per_token_layer(shape, "none", act_bytes, p.tensor_parallel,
                                                 p.expert_tp) * p.micro_batch_tokens
    logits = 0.0
    if stage == pp - 1:
        logits = loss_logits_bytes(p.micro_batch_tokens, shape.vocab / p.tensor_parallel, p.tensor_parallel, act_bytes)
    return acts, logits


def loss_logits_bytes(tokens: int, local_vocab: float, tensor_parallel: int, act_bytes: int) -> float:
    """Peak bytes of a micro-batch's logits and the training loss's temporaries on the last stage (module docstring).

    The larger of the log-prob backward (``a + 8`` or, at TP = 1, ``a + 16`` bytes per logit) and the forward with
    the entropy metric (the logits, one held fp32 copy and three fp32 entropy chunks).
    """
    from dapo_mcore.actor import sizes

    elements = tokens * local_vocab
    backward = elements * (act_bytes + (16 if tensor_parallel == 1 else 8))
    forward = elements * (act_bytes + 4) + 3 * sizes.ENTROPY_CHUNK_BYTES
    return max(backward, forward)


def _vllm_bytes(p: PlanInput, shape: ModelShape) -> tuple[float, float, float, int]:
    """(awake budget, weights, KV-cache bytes, KV-cache tokens) of one vLLM GPU."""
    awake = p.vllm_gpu_memory_utilization * p.gpu_memory_gib * GIB
    weights = 2.0 * shape.num_params() / p.vllm_tensor_parallel
    kv = awake - weights - p.vllm_workspace_gib * GIB
    kv_heads = max(1, shape.kv_heads // p.vllm_tensor_parallel)  # vLLM replicates KV heads past TP=n_kv
    per_token = 2 * shape.layers * kv_heads * shape.head_dim * 2
    return awake, weights, kv, max(0, int(kv // per_token))


def estimate_memory(p: PlanInput) -> MemoryEstimate:
    """Per-GPU memory of the worst pipeline stage (see the module docstring for the model)."""
    p.validate()
    shape = ModelShape.from_hf(p.model)
    awake, vllm_w, kv, kv_tokens = _vllm_bytes(p, shape) if p.colocate_vllm else (0.0, 0.0, 0.0, 0)
    asleep = p.vllm_sleep_residue_gib * GIB if p.colocate_vllm else 0.0
    overhead = p.overhead_gib * GIB
    stages: list[MemoryEstimate] = []
    for stage in range(p.pipeline_parallel):
        params, linear = stage_params(shape, p.pipeline_parallel, stage)
        w, g, o, c = _persistent_bytes(p, params / p.tensor_parallel, linear / p.tensor_parallel)
        if shape.experts:
            w, g, o = _expert_parallel_bytes(p, shape, params, w, g, o)
        if p.lora_rank > 0:  # the frozen base keeps its weights only; the adapters train
            from dapo_mcore.plan.lora import adapter_params_per_gpu, lora_persistent_bytes

            adapters = adapter_params_per_gpu(shape, p.lora_rank, tuple(p.lora_targets.split(",")),
                                              tensor_parallel=p.tensor_parallel, pipeline_parallel=p.pipeline_parallel,
                                              expert_parallel=p.expert_parallel)
            aw, g, o = lora_persistent_bytes(adapters, p.precision)
            w += aw
        acts, logits = _stage_activation_bytes(p, shape, stage)
        train = w + g + o + c + acts + logits + overhead + asleep
        kept = w + c  # the offload hooks move grad buffers and optimizer state, not weights or FP8 copies
        if not p.offload_train_state_in_rollout:
            kept += g + o
        rollout = kept + overhead + awake if p.colocate_vllm else 0.0
        stages.append(MemoryEstimate(w, g, o, c, acts, logits, overhead, awake, asleep, vllm_w, kv, kv_tokens,
                                     train, rollout, f"stage {stage}/{p.pipeline_parallel}"))
    # Components of the stage with the highest training peak; the rollout peak of the worst stage.
    worst = max(stages, key=lambda s: s.train_peak)
    return replace(worst, rollout_peak=max(s.rollout_peak for s in stages))


@dataclass
class FlopsEstimate:
    """FLOPs of one DAPO step over the whole job (all GPUs)."""

    generation: float
    """Forward FLOPs of every generated sequence (prompt prefill + response decode)."""
    old_logprobs: float
    """Forward FLOPs of the old-policy log-probs over the kept batch."""
    train: float
    """Forward + backward FLOPs of the updates, recompute included (hardware FLOPs)."""
    train_model: float
    """Model FLOPs of the updates (3x forward), the MFU numerator."""
    train_tokens: int
    """Tokens (prompt + response) in the kept batch."""


def estimate_flops(p: PlanInput) -> FlopsEstimate:
    """FLOPs per step at the mean prompt/response lengths (a single representative length)."""
    from dapo_mcore.telemetry.flops import sequence_train_flops

    shape = ModelShape.from_hf(p.model)
    seq = p.mean_prompt_len + p.mean_response_len
    n_seq = p.rollout_prompts * p.responses_per_prompt
    n_generated = p.gen_batch_prompts * p.responses_per_prompt * p.generation_batches
    fwd = sequence_forward_flops(shape, seq)
    return FlopsEstimate(
        generation=fwd * n_generated, old_logprobs=fwd * n_seq,
        train=sequence_train_flops(shape, seq, p.recompute) * n_seq, train_model=3 * fwd * n_seq,
        train_tokens=n_seq * seq,
    )


def estimate_step_seconds(p: PlanInput, flops: FlopsEstimate) -> tuple[float, float]:
    """(log-prob + update seconds, generation seconds) of one step at the assumed MFUs on all GPUs; an MoE model's
    generation takes at least what its decode model (`moe_generation`) says."""
    peak = p.tensor_parallel * p.pipeline_parallel * p.data_parallel * p.peak_tflops * 1e12
    generation = flops.generation / (peak * p.decode_mfu)
    moe = moe_generation(p)
    if moe is not None:
        generation = max(generation, moe.seconds * p.generation_batches)
    return (flops.old_logprobs + flops.train) / (peak * p.train_mfu), generation


def moe_generation(p: PlanInput, lockstep: bool | None = None):
    """The MoE decode model's estimate (``plan.moe_decode``) of one generation batch on the colocated engines of
    ``vllm_tensor_parallel`` GPUs: one vLLM data-parallel group over all of them with ``lockstep`` (None: as
    ``vllm_engines`` says), else independent engines; None for a dense model or without vLLM."""
    if lockstep is None:
        lockstep = p.vllm_engines == "data_parallel"
    from dapo_mcore.plan.moe_decode import generation_seconds

    shape = ModelShape.from_hf(p.model)
    if not shape.experts or not p.colocate_vllm:
        return None
    gpus = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    return generation_seconds(shape, gpus=p.vllm_tensor_parallel, engines=gpus // p.vllm_tensor_parallel,
                              responses=p.gen_batch_prompts * p.responses_per_prompt,
                              mean_response=p.mean_response_len, max_response=p.max_response_len,
                              prompt=p.mean_prompt_len, kv_tokens=_vllm_bytes(p, shape)[3], peak_tflops=p.peak_tflops,
                              lockstep=lockstep, gpus_per_node=p.gpus_per_host)


@dataclass
class HostEstimate:
    """Per-step engine overheads and per-node host memory that the GPU estimates leave out."""

    sleep_copy_s: float
    """Seconds per step vLLM's sleep/wake spends copying its weights to host memory and back (level 1 only)."""
    engine_load_s: float
    """Seconds at start-up for every rank to read the checkpoint into vLLM (load_format=auto only)."""
    checkpoint_host_bytes: float
    """Host memory of one node while a checkpoint gathers the distributed optimizer's fp32 state to DP rank 0."""
    sleep_host_bytes: float
    """Pinned host memory of one node holding vLLM weights asleep (level 1 only)."""
    staging_host_bytes: float = 0.0
    """Async mode: host memory of one engine node holding received versions until their batch starts."""

    @property
    def host_peak(self) -> float:
        return self.checkpoint_host_bytes + self.sleep_host_bytes


def estimate_host(p: PlanInput) -> HostEstimate:
    """Engine sleep/start-up seconds and the host memory a node needs (see the PlanInput fields used)."""
    shape = ModelShape.from_hf(p.model)
    params = shape.num_params()
    vllm_weights = 2.0 * params / p.vllm_tensor_parallel if p.colocate_vllm else 0.0
    level1 = p.colocate_vllm and p.vllm_sleep_level == 1
    sleep_s = 2 * vllm_weights / (p.host_to_device_gbs * 1e9) if level1 else 0.0
    gpus = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    read = gpus * 2.0 * params if p.colocate_vllm and p.vllm_load_format == "auto" else 0.0
    # megatron-core's save_parameter_state gathers each model shard's fp32 main weights + Adam moments
    # (12 B/param) to its DP rank 0; those ranks sit on the first nodes, up to gpus_per_host shards per node.
    shards_per_node = min(p.gpus_per_host, p.tensor_parallel * p.pipeline_parallel)
    ckpt = 12.0 * params / (p.tensor_parallel * p.pipeline_parallel) * shards_per_node if p.distributed_optimizer else 0.0
    from dapo_mcore.config.rules import staged_host_bytes

    width = 4 if p.precision == "fp32" else 2  # the weight sync sends the bf16 weights (FP8 runs keep bf16 ones)
    staging = staged_host_bytes(params, width, p.async_lead, min(p.async_engine_ranks, p.gpus_per_host),
                                p.vllm_tensor_parallel if p.colocate_vllm else 1)  # each rank its engine's shard
    return HostEstimate(sleep_s, read / (p.filesystem_read_gbs * 1e9), ckpt,
                        vllm_weights * p.gpus_per_host if level1 else 0.0, staging)


def format_report(p: PlanInput, est: MemoryEstimate, flops: FlopsEstimate) -> str:
    """A plain-text table of the estimate."""
    gpus = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    rows = [
        f"layout: TP={p.tensor_parallel} PP={p.pipeline_parallel} VPP={p.virtual_pipeline} DP={p.data_parallel} "
        f"({gpus} GPUs), {p.precision}, recompute={p.recompute}, distributed_optimizer={p.distributed_optimizer}, "
        f"micro_batch_tokens={p.micro_batch_tokens}, micro-batches/update={num_microbatches(p)}",
        f"per-GPU memory (worst stage: {est.worst_stage}), GiB:",
    ]
    for name in ("weights", "grads", "optimizer", "fp8_weight_cache", "activations", "logits", "overhead"):
        rows.append(f"  {name:<18}{getattr(est, name) / GIB:8.2f}")
    if p.colocate_vllm:
        rows.append(f"  {'vllm (awake)':<18}{est.vllm_awake / GIB:8.2f}   TP={p.vllm_tensor_parallel}: weights "
                    f"{est.vllm_weights / GIB:.2f}, KV cache {est.vllm_kv_cache / GIB:.2f} = {est.vllm_kv_tokens} tokens "
                    f"({est.vllm_kv_tokens // (p.max_prompt_len + p.max_response_len)} max-length sequences)")
        rows.append(f"  {'vllm (asleep)':<18}{est.vllm_asleep / GIB:8.2f}")
    rows.append(f"  {'TRAIN PEAK':<18}{est.train_peak / GIB:8.2f}   of {p.gpu_memory_gib}")
    if p.colocate_vllm:
        rows.append(f"  {'ROLLOUT PEAK':<18}{est.rollout_peak / GIB:8.2f}   of {p.gpu_memory_gib}")
        kept = "weights + FP8 copies" if p.offload_train_state_in_rollout else "weights, grads, optimizer state"
        rows.append(f"assumes released before each vLLM wake (torch.cuda.empty_cache): activations + logits "
                    f"{(est.activations + est.logits) / GIB:.2f} GiB"
                    + (", grads + optimizer (offloaded)" if p.offload_train_state_in_rollout else "")
                    + f"; kept through rollout: {kept} + overhead")
    rows.append(f"FLOPs per step (PFLOP): generation {flops.generation / 1e15:.0f} ({p.gen_batch_prompts} prompts x "
                f"{p.responses_per_prompt} x {p.generation_batches:g} batches), old log-probs "
                f"{flops.old_logprobs / 1e15:.0f}, train {flops.train / 1e15:.0f} (model {flops.train_model / 1e15:.0f}), "
                f"{flops.train_tokens / 1e6:.1f} M tokens trained")
    train_s, gen_s = estimate_step_seconds(p, flops)
    host = estimate_host(p)
    moe = "" if moe_generation(p) is None else "; MoE generation: the decode model below where it is slower"
    rows.append(f"step time at assumed MFU (train {p.train_mfu:.0%}, decode {p.decode_mfu:.0%} of {p.peak_tflops:g} "
                f"TFLOP/s{moe}): log-probs + updates {train_s / 60:.1f} min, generation {gen_s / 60:.1f} min, "
                f"total {(train_s + gen_s + host.sleep_copy_s) / 60:.1f} min (with the engine's sleep copies)")
    rows.append(f"engine: sleep level {p.vllm_sleep_level} copies {host.sleep_copy_s:.1f} s/step of weights to host "
                f"and back; start-up read (load_format={p.vllm_load_format}) {host.engine_load_s / 60:.1f} min")
    rows.append(f"host memory per node: checkpoint gather {host.checkpoint_host_bytes / GIB:.0f} GiB + vLLM asleep "
                f"{host.sleep_host_bytes / GIB:.0f} GiB of {p.host_memory_gib:g}")
    if p.async_lead > 1:
        rows.append(f"host memory per engine node (async, {p.async_lead - 1} staged version(s) per engine rank): "
                    f"{host.staging_host_bytes / GIB:.0f} GiB of {p.host_memory_gib:g}")
    return "\n".join(rows)


# --- the command line ---------------------------------------------------------------------------------

CONFIG_KEYS: dict[str, str] = {
    "tensor_parallel": "parallel.tensor_parallel", "pipeline_parallel": "parallel.pipeline_parallel",
    "virtual_pipeline": "parallel.virtual_pipeline", "data_parallel": "DP",
    "expert_parallel": "parallel.expert_parallel", "expert_tensor_parallel": "parallel.expert_tensor_parallel",
    "distributed_optimizer": "parallel.distributed_optimizer", "recompute": "model.recompute",
    "precision": "model.fp8.enabled / model.params_dtype", "micro_batch_tokens": "train.micro_batch_tokens",
    "colocate_vllm": "rollout.engine", "vllm_tensor_parallel": "rollout.vllm.tensor_parallel",
    "vllm_engines": "rollout.vllm.engines",
    "vllm_gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization", "max_prompt_len": "data.max_prompt_len",
    "max_response_len": "rollout.max_new_tokens", "rollout_prompts": "train.prompts_per_step",
    "responses_per_prompt": "rollout.n", "mini_batch_prompts": "train.mini_batch_prompts",
    "gen_batch_prompts": "rollout.gen_batch_prompts", "offload_train_state_in_rollout": "parallel.offload_for_rollout",
    "vllm_sleep_level": "rollout.vllm.sleep_level",
}
"""PlanInput fields a project config determines, and the config key (or note) that sets each one."""

# Fixed by the trainer, not by the config: it reduces gradients in fp32.
TRAINER_FIXED: dict[str, Any] = {"grad_reduce_in_fp32": True}
