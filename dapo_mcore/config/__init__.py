"""The typed config tree of a dapo-mcore run: one dataclass per component, loaded from YAML with dotted overrides.

``load_config(path, overrides)`` reads and type-checks; ``Config.validate(world_size)`` checks every
cross-field rule before any process group or device is touched, with errors that name the fix.
``write_resolved(config, run_dir)`` stores what actually ran.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dapo_mcore.algo.config import AlgoConfig
from dapo_mcore.algo.schedule_config import ScheduleConfig
from dapo_mcore.config.tools import ToolsConfig
from dapo_mcore.config.tree import ConfigError, apply_overrides, from_dict, read_yaml, to_dict
from dapo_mcore.data.config import DataConfig
from dapo_mcore.data.tiny_base_settings import TinyBaseSettings
from dapo_mcore.model.hf_config import HFConfigError, QwenShape
from dapo_mcore.model.lora.config import LoRAConfig, LoRAConfigError
from dapo_mcore.model.presets import PRESET_NAMES, preset_config
from dapo_mcore.model.vocab import VOCAB_PADDINGS

__all__ = ["Config", "ConfigError", "load_config", "write_resolved"]


@dataclass
class FP8Config:
    """FP8 training through Transformer Engine (Hopper GPUs only)."""

    enabled: bool = False
    """Train the linear layers in FP8. Needs the `transformer_engine` layer spec, Transformer Engine and an sm_89+ GPU."""
    format: Literal["hybrid", "e4m3"] = "hybrid"
    """FP8 format: hybrid = E4M3 forward, E5M2 gradients (the usual choice); e4m3 = E4M3 everywhere."""
    recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "tensorwise"
    """Scaling recipe. delayed = amax history; tensorwise = current scaling per tensor; blockwise needs TE >= 2.3
    on Hopper; mxfp8 needs Blackwell."""
    amax_history_len: int = 1024
    """Amax history length (delayed recipe only)."""
    fp8_params: bool = False
    """Keep the weights themselves in FP8 (saves memory; the optimizer keeps fp32 master weights). Exports, weight
    sync and checkpoints dequantize them to bf16."""


@dataclass
class ModelConfig:
    """Which model to train and how Megatron-Core builds it."""

    hf_path: str | None = None
    """Hugging Face model directory (config.json + safetensors). Converted to Megatron on start unless `mcore_path` is set."""
    mcore_path: str | None = None
    """A Megatron checkpoint to start from instead of `hf_path`'s weights: one made by `dapo-mcore convert hf-to-mcore`
    or a trainer checkpoint (any layout: resharded), or a megatron-core dist checkpoint (a Megatron-LM or
    Megatron-Bridge save dir, any layout; its vocabulary rows must match `vocab_padding`'s)."""
    preset: str | None = None
    """A named shape with random weights (for planning and benchmarks): one of the presets in dapo_mcore.model.presets."""
    tiny_base: bool = False
    """Build (or take from the cache) the embedded tiny base model and tokenizer of the CPU default."""
    layer_spec: Literal["local", "transformer_engine"] = "local"
    """Megatron layer implementation: `local` (pure PyTorch: CPU and any GPU) or `transformer_engine` (GPU; needed for FP8)."""
    attention: Literal["auto", "sdpa", "megatron_local"] = "auto"
    """Core attention of the local spec: auto = sdpa (PyTorch's fused scaled_dot_product_attention), megatron_local =
    Megatron's unfused DotProductAttention. The transformer_engine spec always uses TE's attention (leave auto)."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype. float32 on CPU; bfloat16 on GPU (the optimizer keeps fp32 main weights)."""
    make_vocab_size_divisible_by: int = 128
    """The divisor of `vocab_padding` (Megatron-LM's --make-vocab-size-divisible-by); padded logits are masked."""
    vocab_padding: Literal["tp", "megatron"] = "tp"
    """How many rows the embedding and output layer get (dapo_mcore.model.vocab): `tp` keeps the vocabulary as it is
    when tensor_parallel divides it, else pads to the next multiple of (the largest power of two <=
    make_vocab_size_divisible_by that divides it) x tensor_parallel: what Megatron-Bridge's models load (Qwen2.5's
    151,936 rows stay 151,936 at TP 1-8). `megatron` pads to a multiple of make_vocab_size_divisible_by x
    tensor_parallel: Megatron-LM's rule and dapo-mcore's only one in older versions (152,064 rows at TP 2). On resume
    the checkpoint's rule wins; a model.mcore_path of the other rule is re-padded on load (real rows unchanged)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: selective = attention core only; full = every layer (most memory saved, ~33% more compute)."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 settings (GPU only)."""
    tokenizer_path: str | None = None
    """Tokenizer directory if it is not `hf_path`."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA: low-rank adapters on the linear layers, the base frozen (rank 0 = off: full fine-tuning; docs/lora.md)."""

    def hf_config(self, tiny_preset: str = "tiny") -> dict[str, Any]:
        """The Hugging Face config.json dict of the model (from `hf_path`, the preset, or the tiny base's preset
        ``tiny_preset``, which is ``tiny_base.preset`` of the run)."""
        if self.hf_path:
            path = Path(self.hf_path) / "config.json"
            if not path.is_file():
                raise ConfigError(f"model.hf_path={self.hf_path!r} has no config.json; point it at a Hugging Face "
                                  f"model directory (to plan without the checkpoint at hand, override "
                                  f"model.hf_path=null model.preset=NAME with one of {', '.join(PRESET_NAMES)}).")
            return json.loads(path.read_text())
        if self.preset:
            return preset_config(self.preset)
        if self.tiny_base:
            return preset_config(tiny_preset)
        raise ConfigError("no model given: set model.hf_path, model.preset or model.tiny_base=true.")

    def architecture(self, tiny_preset: str = "tiny") -> QwenShape:
        """The model's architecture (``QwenShape``); ConfigError naming the source, the field and what is supported
        for a model type or feature that dapo-mcore cannot build faithfully (checked before anything starts)."""
        hf = self.hf_config(tiny_preset)
        try:
            return QwenShape.from_hf(hf)
        except HFConfigError as exc:
            source = f"model.hf_path={self.hf_path} (config.json)" if self.hf_path else f"model.preset={self.preset}"
            raise ConfigError(f"{source}: {exc}") from exc

    def validate(self) -> None:
        sources = [s for s in (self.hf_path, self.preset, self.tiny_base or None) if s]
        if len(sources) != 1:
            raise ConfigError("set exactly one of model.hf_path, model.preset, model.tiny_base "
                              f"(got {len(sources)}).")
        if self.preset is not None and self.preset not in PRESET_NAMES:
            raise ConfigError(f"model.preset={self.preset!r} is unknown; choose one of {', '.join(PRESET_NAMES)}.")
        if self.make_vocab_size_divisible_by < 1:
            raise ConfigError("model.make_vocab_size_divisible_by must be >= 1.")
        if self.vocab_padding not in VOCAB_PADDINGS:
            raise ConfigError(f"model.vocab_padding={self.vocab_padding!r} is unknown; use tp (Megatron-Bridge's "
                              "layout) or megatron (Megatron-LM's rule).")
        if self.attention != "auto" and self.layer_spec == "transformer_engine":
            raise ConfigError(f"model.attention={self.attention} applies to the local layer spec; with "
                              "model.layer_spec=transformer_engine set model.attention=auto (TE's attention).")
        if self.fp8.enabled and self.layer_spec != "transformer_engine":
            raise ConfigError("model.fp8.enabled=true needs model.layer_spec=transformer_engine "
                              "(the local spec has no FP8 kernels).")
        try:
            self.lora.validate()
        except LoRAConfigError as exc:
            raise ConfigError(str(exc)) from exc


@dataclass
class ParallelConfig:
    """Process layout. world size = tensor_parallel x pipeline_parallel x data parallel."""

    tensor_parallel: int = 1
    """Tensor-parallel size: must divide the attention heads and the KV heads."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size: must divide the number of layers (times virtual_pipeline)."""
    virtual_pipeline: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); needs pipeline_parallel > 1. The interleaved schedule runs
    a multiple of pipeline_parallel micro-batches (the token-budget packing splits further to reach one, so each data-
    parallel rank needs at least pipeline_parallel responses per mini-batch) and pads every micro-batch of a call to
    the largest one's shape."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tensor_parallel > 1)."""
    expert_parallel: int = 1
    """MoE models (qwen3_moe): split each layer's experts over this many ranks, taken inside the data-parallel group
    (must divide num_experts and world / (tensor_parallel x pipeline_parallel)); tokens reach their experts by
    all-to-all. 1 = every rank holds every expert."""
    expert_tensor_parallel: int = 1
    """MoE models: split each expert's weights over this many ranks (Megatron's expert tensor parallelism; must
    divide tensor_parallel and moe_intermediate_size). 1 (Megatron's MoE recipes' choice) keeps every expert whole:
    no all-gather of the routed tokens over the tensor-parallel group, one GEMM per expert per layer (grouped GEMM
    with Transformer Engine); tensor_parallel splits only attention and the dense layers. The expert-parallel group
    then spans the tensor-parallel ranks: expert_parallel x expert_tensor_parallel must divide
    world / pipeline_parallel. Ignored for a dense model."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (needs NCCL: GPU only)."""
    offload_for_rollout: bool = False
    """Colocated runs: move the actor's grad buffers and optimizer state to CPU while the engine generates, and back
    before training (Megatron's RL offload hooks). Frees GPU memory for the KV cache at the cost of two copies a step."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: auto = nccl with CUDA, gloo without."""
    timeout_minutes: float = 10
    """Collective timeout: a collective that waits this long for a rank that hangs fails instead (then the job exits
    75 and is requeued: docs/cluster.md "A rank hangs"); also how far apart the ranks may reach the rendezvous.
    Longer than the longest wait of a healthy rank (a checkpoint save, rank-0 work); fractions for tests."""


@dataclass
class OptimConfig:
    """AdamW with a constant learning rate after a linear warm-up (the DAPO recipe)."""

    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    warmup_steps: int = 10
    """Linear warm-up length in optimizer updates... counted in rollout steps (DAPO: 20, verl script: 10)."""
    skip_nonfinite_updates: int = 0
    """An update whose loss or gradients are NaN/inf is never applied. 0: the run stops at the first one (exit 2, one
    line naming the fix; nothing of that step is logged or checkpointed); N: skip up to N in a row (weights and Adam's
    state untouched, a warning each), stop at the next."""


@dataclass
class TrainConfig:
    """Batch sizes and loop lengths of the DAPO step."""

    steps: int = 100
    """Rollout steps to run."""
    prompts_per_step: int = 512
    """Groups (prompts) in one training batch after dynamic sampling."""
    mini_batch_prompts: int = 32
    """Groups per optimizer update: prompts_per_step / mini_batch_prompts updates per rollout step."""
    epochs: int = 1
    """Passes over each rollout batch."""
    micro_batch_tokens: int = 16384
    """Token budget of one micro-batch per rank (prompt + response tokens)."""
    seed: int = 1234
    """Seed of model init, sampling and data order: 0 .. 2**31 - 1 (torch, Megatron's per-rank offsets and the
    engines' seeds all take it)."""


@dataclass
class VLLMConfig:
    """vLLM engine settings (GPU, colocated with the trainer)."""

    tensor_parallel: int = 1
    """vLLM tensor-parallel size (may differ from the trainer's)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take for weights + KV cache while awake."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower decoding, faster start)."""
    max_num_batched_tokens: int = 8192
    """Scheduler token budget per iteration."""
    sleep_level: Literal[1, 2] = 2
    """Sleep mode level while the actor trains: 1 offloads weights to pinned host memory and back every step; 2
    discards them, which is right here since the weight sync overwrites every weight before each generation."""
    engines: Literal["data_parallel", "instances"] = "data_parallel"
    """How the vLLM engines (one per tensor_parallel ranks) relate. data_parallel: one vLLM data-parallel group over
    all of them (``data_parallel_size`` = engine ranks / tensor_parallel): they step in lockstep, and an MoE model's
    experts are split over all their GPUs, across nodes. instances: each engine is an independent vLLM instance
    (vLLM's external data parallelism, ``data_parallel_size=1``): an MoE model's experts are split over the
    instance's own GPUs only (expert parallel = tensor_parallel, inside a node when tensor_parallel <= 8), no
    collective between engines, and routing replay works (Model Runner V2 at data-parallel 1). The project's engine
    groups spread each call over the engines either way."""


@dataclass
class PipelineConfig:
    """Where the engines run and whether generation overlaps training (see docs/rollout.md, "Async mode")."""

    mode: Literal["sync", "async"] = "sync"
    """sync: the engines share the trainer's ranks and generate between training phases (colocated). async: the last
    ``engine_ranks`` ranks of the job run only the engines and generate step n+1's batch while the other ranks train
    step n; weights go trainer -> engines over their own process group after every step."""
    engine_ranks: int = 1
    """async: ranks (processes, one GPU each) given to the engines; the trainer gets the others. With vLLM, a multiple
    of rollout.vllm.tensor_parallel (each engine is one TP group)."""
    max_staleness: int = 1
    """async: K, the most policy versions any trained token may lag the policy that trains on it (asserted every
    step, per token). The engines run K batches ahead of the trainer (batch k is sampled by the weights after step
    max(0, k-K)) and take each new version at a batch boundary; 1 is one-step-off. Partial rollouts continue prefixes
    sampled for the batch before, one version older, so with ``rollout.schedule.partial`` the engines run K-1 ahead
    and K must be >= 2; a partial group that would still lag more than K is dropped (``async/dropped_stale_groups``).
    sync: must be 1."""
    bucket_mb: float = 256.0
    """async: the weight transfer's bucket size (MiB): each bucket is one broadcast, tensors are never split."""
    node_host_memory_gib: float = 1800.0
    """async with max_staleness > 1: host memory of one engine node that received versions may take (H100 HGX nodes:
    2 TiB). Each engine rank keeps up to D - 1 versions in host memory (D = the engines' lead), each its engine's
    shard (1/k of the weights at vLLM tensor parallel k), so a node of ``engine_ranks_per_node`` ranks needs that many
    times the shard; a config that does not fit is refused."""
    engine_ranks_per_node: int = 8
    """async: engine ranks on one node (its GPUs): the host memory above is shared by this many."""


@dataclass
class RolloutConfig:
    """How responses are sampled."""

    engine: Literal["hf", "vllm"] = "hf"
    """Rollout engine: hf (transformers, CPU or small models) or vllm (GPU)."""
    n: int = 16
    """Responses per prompt (G)."""
    gen_batch_prompts: int = 1536
    """Prompts per generation batch (dynamic sampling draws batches of this size until the training batch is full)."""
    max_new_tokens: int = 20480
    """Maximum response length (L_max)."""
    temperature: float = 1.0
    """Sampling temperature (also used for the actor's log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response besides the model's EOS ids. Both engines stop on the same set: these, every
    ``eos_token_id`` of the model's generation_config.json (an int or a list) and the tokenizer's EOS token; the
    rollout store records the id that ended each response."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM settings."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Colocated and synchronous (default), or disaggregated and asynchronous."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Rollout scheduling (streaming, partial rollouts, adaptive rounds, staged groups, prompt history); all off = DAPO's
    batch-and-filter loop exactly."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """Multi-turn tool use (ReTool's Python interpreter); off by default."""


@dataclass
class EvalConfig:
    """Held-out evaluation (avg@k, pass@k, maj@k)."""

    every: int = 10
    """Evaluate every this many steps (0 = only at the end)."""
    at_start: bool = True
    """Evaluate the base model before the first step (logged as step 0) so every curve starts from the base."""
    k: int = 32
    """Samples per problem."""
    temperature: float = 1.0
    """Eval sampling temperature (DAPO: 1.0)."""
    top_p: float = 0.7
    """Eval nucleus threshold (DAPO: 0.7)."""
    max_new_tokens: int | None = None
    """Eval response limit (default: rollout.max_new_tokens)."""
    max_prompts: int | None = None
    """Evaluate on the first this many prompts of ``data.eval`` (of those within ``data.max_prompt_len``; a task's
    held-out split is already in its seeded random order); null: every prompt. A cheaper evaluation of a large
    held-out set, at the cost of a noisier score; ``rehearse`` evaluates 8."""


@dataclass
class CheckpointConfig:
    """Checkpoints of the full training state."""

    every: int = 10
    """Save every this many steps (and at the end, and on SIGUSR1/SIGTERM)."""
    keep_last: int = 2
    """Keep this many recent checkpoints (older ones are deleted after a newer one is complete)."""


@dataclass
class RewardConfig:
    """How responses are scored."""

    name: str = "math_dapo"
    """Registered reward function (dapo_mcore.reward): math_dapo (Answer: line), math_dapo_strict (refuses hedged
    answers), math_dapo_strict_box (last \\boxed{}); or your own as package.module:function (must be importable)."""
    workers: int = 0
    """Scoring processes: 0 scores in the trainer process (registered rewards only: the fast rule verifier); >0 uses
    an isolated pool, which a custom package.module:function reward needs (a hang or a crash there is bounded)."""
    timeout_s: float = 10.0
    """Per-answer time limit: an answer over it is scored wrong, as a failure (in process: after 1-2x this long)."""
    max_failure_frac: float = 0.5
    """Stop the run, quoting the reward's first error, when at least this share of the last `failure_window` answers
    failed (the reward raised, timed out, crashed, or returned no verdict); 1.0 = only when all of them failed."""
    failure_window: int = 64
    """Answers the failure share is taken over (judged once half of them have been scored)."""

    def validate(self) -> None:
        from dapo_mcore.reward.registry import get_reward

        try:
            get_reward(self.name)
        except ValueError as exc:
            raise ConfigError(f"reward.name={self.name!r}: {exc}.") from exc
        if self.workers < 0 or self.timeout_s <= 0:
            raise ConfigError("reward.workers must be >= 0 and reward.timeout_s > 0.")
        if ":" in self.name and self.workers == 0:
            raise ConfigError(f"reward.name={self.name} is your own code, which may hang or exit the process: score "
                              "it in the worker pool, where reward.timeout_s bounds each answer (reward.workers=2).")
        if not 0.0 < self.max_failure_frac <= 1.0:
            raise ConfigError(f"reward.max_failure_frac={self.max_failure_frac!r} must lie in (0, 1] (default 0.5).")
        if self.failure_window < 1:
            raise ConfigError(f"reward.failure_window={self.failure_window} must be >= 1 (default 64).")


@dataclass
class RunConfig:
    """Where the run lives and what to do with an existing run directory."""

    dir: str = "runs/default"
    """Run directory: config, metrics, TensorBoard, rollouts, checkpoints, ledger, figures. Never empty (an unset
    variable in a launch script must not make it the current directory)."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest checkpoint in `dir`; never: refuse a directory that already holds a run."""
    overwrite: bool = False
    """Delete the run in `dir` first: only what a run writes there (config, metrics, checkpoints, ...); a directory
    that holds files but no run is refused."""
    lock: bool = True
    """Hold RUN_DIR/.run.lock for the whole run so that a second run on the directory is refused (a double submit, a
    requeue racing a restart). false only for a file system that cannot lock files: then start one run at a time."""
    resume_weights_only: bool = False
    """Resume the model weights but start the optimizer fresh (for optimizer state that cannot be resharded to a
    new layout: the distributed optimizer's). Adam's state of the default optimizer reshards exactly at any layout."""
    log_every: int = 1
    """Print a progress line every this many steps."""
    rollout_store: bool = True
    """Write every rollout to the zarr store in the run directory."""
    peak_tflops_per_device: float | None = None
    """Peak dense TFLOP/s of one device for MFU; default: the data-sheet value of a recognised GPU (H100/H200/A100),
    none on CPU (then only tokens/s is logged)."""
    profile_steps: list[int] = field(default_factory=list)
    """[first, last] steps to record with torch.profiler (traces in RUN_DIR/profile/); empty = off."""

    def validate(self) -> None:
        if not str(self.dir).strip():
            raise ConfigError("run.dir is empty (an unset variable in run.dir=$X?); an empty run.dir would be the "
                              "current directory: set run.dir=runs/NAME.")


@dataclass
class WandbConfig:
    """Weights & Biases, optional: every metric of metrics.jsonl with its step, from rank 0, into one W&B run that a
    requeued job continues (its id is kept in RUN_DIR/wandb_run_id). ``WANDB_MODE=offline`` (clusters without
    internet) writes the run under RUN_DIR/wandb/ for a later ``wandb sync``."""

    project: str | None = None
    """W&B project; unset (the default) = no W&B. Needs the wandb package (pip install wandb)."""
    entity: str | None = None
    """W&B entity (user or team); default: the account's default entity."""
    name: str | None = None
    """Display name of the run; default: the run directory's name."""
    group: str | None = None
    """Group of runs (e.g. an ablation) in the W&B UI."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run."""

    def validate(self) -> None:
        if self.project is None:
            return
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"telemetry.wandb.project={self.project} needs the wandb package, which is not "
                              "installed: pip install wandb (or unset telemetry.wandb.project).")


@dataclass
class TelemetryConfig:
    """Where metrics go besides RUN_DIR/metrics.jsonl and TensorBoard (always written)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases (off unless telemetry.wandb.project is set)."""
    progress_every_s: float = 60.0
    """In logs (Slurm, pipes): at most one line per this many seconds on the progress inside a step (phase,
    dynamic-sampling batch k of max, usable groups of the target, tokens generated), the first this long after the
    step started; a terminal shows it live beside the bar instead."""

    def validate(self) -> None:
        if not self.progress_every_s > 0:
            raise ConfigError(f"telemetry.progress_every_s={self.progress_every_s!r} must be > 0 (seconds; default 60).")
        self.wandb.validate()


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tiny_base: TinyBaseSettings = field(default_factory=TinyBaseSettings)
    """How the embedded tiny base model is pre-trained (used when model.tiny_base=true)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def validate(self, world_size: int = 1, check_files: bool = True) -> None:
        """Check every rule that can be checked before anything is allocated (hardware-independent: GPU-only
        settings are refused by ``runtime.check_hardware``, so cluster configs validate on a laptop;
        ``check_files=False`` also leaves out whether the dataset files exist on this machine)."""
        self.model.validate()
        if self.model.lora.enabled and self.parallel.distributed_optimizer:
            raise ConfigError("model.lora.rank > 0 with parallel.distributed_optimizer=true: the adapters' optimizer "
                              "state is small and LoRA checkpoints keep it per adapter; set "
                              "parallel.distributed_optimizer=false.")
        for section in (self.algo, self.data, self.tiny_base):
            try:
                section.validate(check_files) if section is self.data else section.validate()
            except ConfigError:
                raise
            except ValueError as exc:  # component configs raise ValueError; report it as a config error
                raise ConfigError(str(exc)) from exc
        self.reward.validate()
        self.telemetry.validate()
        self.run.validate()
        self.validate_layout(world_size)

    def validate_layout(self, world_size: int) -> None:
        """The layout, batch and rollout rules alone (no dataset files or reward registry needed): what a
        cluster config can be checked against on a laptop, e.g. by ``dapo-mcore plan``. In async mode the layout
        rules apply to the ranks that train (``trainer_world``)."""
        from dapo_mcore.config import rules

        if self.rollout.pipeline.mode == "async":
            rules.validate_split(self, world_size)
        trainers = rules.trainer_world(self, world_size)
        rules.validate_layout(self, trainers, world_size)
        rules.validate_batches(self, trainers)
        rules.validate_rollout(self)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or the defaults when ``path`` is None), apply dotted overrides, type-check."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    return from_dict(Config, data)


def write_resolved(config: Config, run_dir: str | Path) -> Path:
    """Write the resolved config into the run directory as ``config.yaml``."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    tmp.replace(out)
    return out
