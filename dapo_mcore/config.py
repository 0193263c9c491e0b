"""The typed config tree of a dapo-mcore run: one dataclass per component, loaded from YAML with dotted overrides.

``load_config(path, overrides)`` reads and type-checks; ``Config.validate(world_size)`` checks every
cross-field rule before any process group or device is touched, with errors that name the fix.
``write_resolved(config, run_dir)`` stores what actually ran.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from dapo_mcore.algo.config import AlgoConfig
from dapo_mcore.algo.schedule_config import ScheduleConfig
from dapo_mcore.configtree import ConfigError, apply_overrides, from_dict, read_yaml, to_dict
from dapo_mcore.data.config import DataConfig
from dapo_mcore.data.tiny_base_settings import TinyBaseSettings
from dapo_mcore.model.hf_config import HFConfigError, QwenShape
from dapo_mcore.model.presets import PRESET_NAMES, preset_config

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
    """A Megatron checkpoint made by `dapo-mcore convert hf-to-mcore` (skips conversion at start)."""
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
    """Pad the vocabulary to a multiple of this times tensor_parallel (Megatron's convention); padded logits are masked."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: selective = attention core only; full = every layer (most memory saved, ~33% more compute)."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 settings (GPU only)."""
    tokenizer_path: str | None = None
    """Tokenizer directory if it is not `hf_path`."""

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
        if self.attention != "auto" and self.layer_spec == "transformer_engine":
            raise ConfigError(f"model.attention={self.attention} applies to the local layer spec; with "
                              "model.layer_spec=transformer_engine set model.attention=auto (TE's attention).")
        if self.fp8.enabled and self.layer_spec != "transformer_engine":
            raise ConfigError("model.fp8.enabled=true needs model.layer_spec=transformer_engine "
                              "(the local spec has no FP8 kernels).")


@dataclass
class ParallelConfig:
    """Process layout. world size = tensor_parallel x pipeline_parallel x data parallel."""

    tensor_parallel: int = 1
    """Tensor-parallel size: must divide the attention heads and the KV heads."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size: must divide the number of layers (times virtual_pipeline)."""
    virtual_pipeline: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); needs pipeline_parallel > 1."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tensor_parallel > 1)."""
    expert_parallel: int = 1
    """MoE models (qwen3_moe): split each layer's experts over this many ranks, taken inside the data-parallel group
    (must divide num_experts and world / (tensor_parallel x pipeline_parallel)); tokens reach their experts by
    all-to-all. 1 = every rank holds every expert."""
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
    """Seed of model init, sampling and data order."""


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
    """async: the most policy versions any trained token may lag the policy that trains on it. Generation runs one
    version ahead (the batch of step n+1 is sampled by the weights after step n-1), so 1 is the minimum; partial
    rollouts continue prefixes sampled one more version back and need 2."""
    bucket_mb: float = 256.0
    """async: the weight transfer's bucket size (MiB): each bucket is one broadcast, tensors are never split."""


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
    """Run directory: config, metrics, TensorBoard, rollouts, checkpoints, ledger, figures."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest checkpoint in `dir`; never: refuse a directory that already holds a run."""
    overwrite: bool = False
    """Delete an existing run directory first (dangerous; off by default)."""
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
        for section in (self.algo, self.data, self.tiny_base):
            try:
                section.validate(check_files) if section is self.data else section.validate()
            except ConfigError:
                raise
            except ValueError as exc:  # component configs raise ValueError; report it as a config error
                raise ConfigError(str(exc)) from exc
        self.reward.validate()
        self.telemetry.validate()
        self.validate_layout(world_size)

    def validate_layout(self, world_size: int) -> None:
        """The layout, batch and rollout rules alone (no dataset files or reward registry needed): what a
        cluster config can be checked against on a laptop, e.g. by ``dapo-mcore plan``. In async mode the layout
        rules apply to the ranks that train (``trainer_world``)."""
        pipe = self.rollout.pipeline
        if pipe.mode == "async":
            _validate_split(self, world_size)
        trainers = trainer_world(self, world_size)
        _validate_layout(self, trainers, world_size)
        _validate_batches(self, trainers)
        _validate_rollout(self)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _at_least(*checks: tuple[str, float, float]) -> None:
    """Refuse the first ``(key, value, minimum)`` whose value is below its minimum, naming that key alone."""
    for key, value, minimum in checks:
        if not value >= minimum:
            raise ConfigError(f"{key}={value!r} must be >= {minimum}.")


def _validate_split(cfg: Config, world_size: int) -> None:
    """Async mode: the engines get ``engine_ranks`` ranks of their own, the trainer at least one model replica."""
    engines, p = cfg.rollout.pipeline.engine_ranks, cfg.parallel
    model_parallel = max(p.tensor_parallel, 1) * max(p.pipeline_parallel, 1)
    if engines < 1:
        raise ConfigError(f"rollout.pipeline.engine_ranks={engines} must be >= 1: the async mode runs the engines on "
                          f"ranks of their own; give them some of the {world_size} ranks (e.g. "
                          f"rollout.pipeline.engine_ranks={max(1, world_size // 2)}), or set rollout.pipeline.mode=sync.")
    if engines >= world_size:
        raise ConfigError(f"rollout.pipeline.engine_ranks={engines} leaves no trainer rank of the {world_size} launched: "
                          f"launch {engines + model_parallel} processes ({engines} engine ranks + {model_parallel} "
                          f"trainer ranks, a multiple of tensor_parallel x pipeline_parallel), lower "
                          "rollout.pipeline.engine_ranks, or set rollout.pipeline.mode=sync.")


def _launch_hint(cfg: Config, trainers: int, world_size: int, model_parallel: int) -> str:
    """What to launch when ``trainers`` ranks do not fit the model-parallel layout (sync: the world; async: the
    world minus the engine ranks)."""
    up = -(-trainers // model_parallel) * model_parallel
    if trainers == world_size:
        return f"launch a multiple of {model_parallel} processes"
    engines = world_size - trainers
    counts = sorted({c + engines for c in (up - model_parallel, up) if c > 0})
    return (f"launch {' or '.join(str(c) for c in counts)} processes ({engines} engine ranks + a multiple of "
            f"{model_parallel} trainer ranks), change rollout.pipeline.engine_ranks")


def _validate_layout(cfg: Config, world_size: int, launched: int | None = None) -> None:
    """The model-parallel rules over the ``world_size`` ranks that train (``launched``: the job's ranks, more in
    async mode, where the engines have their own)."""
    shape = cfg.model.architecture(cfg.tiny_base.preset)
    heads, kv, layers = shape.num_heads, shape.num_kv_heads, shape.num_layers
    p = cfg.parallel
    for name, value in (("tensor_parallel", p.tensor_parallel), ("pipeline_parallel", p.pipeline_parallel)):
        if value < 1:
            raise ConfigError(f"parallel.{name}={value} must be >= 1.")
    if heads % p.tensor_parallel or kv % p.tensor_parallel:
        which = f"num_attention_heads={heads}" if heads % p.tensor_parallel else f"num_key_value_heads={kv}"
        both = ", ".join(str(d) for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0)
        raise ConfigError(f"parallel.tensor_parallel={p.tensor_parallel} does not divide {which}; use one that divides "
                          f"both {heads} heads and {kv} KV heads: {both}.")
    stages = p.pipeline_parallel * (p.virtual_pipeline or 1)
    if layers % stages:
        raise ConfigError(f"parallel.pipeline_parallel={p.pipeline_parallel} x virtual_pipeline={p.virtual_pipeline or 1} "
                          f"does not divide num_hidden_layers={layers}; use a pipeline_parallel among {_divisors(layers)}.")
    if p.virtual_pipeline is not None and p.pipeline_parallel < 2:
        raise ConfigError("parallel.virtual_pipeline needs parallel.pipeline_parallel >= 2; unset it or raise pipeline_parallel.")
    if p.sequence_parallel and p.tensor_parallel < 2:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor_parallel >= 2.")
    if p.sequence_parallel and cfg.model.layer_spec == "local":
        raise ConfigError("parallel.sequence_parallel=true needs model.layer_spec=transformer_engine: the local spec's "
                          "torch RMSNorm has no sequence parallelism (Megatron asserts on every rank); set "
                          "parallel.sequence_parallel=false or model.layer_spec=transformer_engine.")
    _validate_experts(cfg, cfg.model.hf_config(cfg.tiny_base.preset), world_size)
    if p.distributed_optimizer and p.backend == "gloo":
        raise ConfigError("parallel.distributed_optimizer=true needs NCCL (gloo has no reduce-scatter); with "
                          "parallel.backend=gloo set parallel.distributed_optimizer=false.")
    model_parallel = p.tensor_parallel * p.pipeline_parallel
    if world_size % model_parallel:
        launched = world_size if launched is None else launched
        who = (f"world size {world_size}" if launched == world_size else
               f"{world_size} trainer ranks ({launched} launched - rollout.pipeline.engine_ranks={launched - world_size})")
        raise ConfigError(f"{who} is not a multiple of tensor_parallel x pipeline_parallel = {model_parallel}; "
                          f"{_launch_hint(cfg, world_size, launched, model_parallel)} or change the layout.")
    if p.timeout_minutes <= 0:
        raise ConfigError("parallel.timeout_minutes must be > 0 (minutes; 10 by default, 30 in the 7B/32B configs).")


def _validate_experts(cfg: Config, hf: dict, world_size: int) -> None:
    """Expert parallelism and the MoE layout (model/moe.py, actor/parallel.py name the fix)."""
    if ("moe" not in str(hf.get("model_type", "")) and cfg.parallel.expert_parallel == 1
            and cfg.algo.router_replay != "rollout"):
        return  # a dense model without EP or replay: nothing to check, and the checks' modules import torch (3-5 s)
    from dapo_mcore.actor.parallel import expert_layout_error
    from dapo_mcore.model.moe import MoEConfigError, MoEShape, check_expert_parallel

    p = cfg.parallel
    try:
        shape = MoEShape.from_hf(hf)
        check_expert_parallel(shape, p.expert_parallel)
    except MoEConfigError as exc:
        raise ConfigError(str(exc)) from None
    problem = expert_layout_error(world_size, p.tensor_parallel, p.pipeline_parallel, p.expert_parallel)
    if problem:
        raise ConfigError(problem)
    if cfg.algo.router_replay == "rollout":
        if shape is None:
            raise ConfigError("algo.router_replay=rollout needs an MoE model (model_type qwen3_moe); set "
                              "algo.router_replay=none for a dense model.")
        if cfg.rollout.schedule.partial:
            raise ConfigError("algo.router_replay=rollout with rollout.schedule.partial: a resumed partial response "
                              "carries no routes for its earlier tokens in this version; set rollout.schedule.partial="
                              "false or algo.router_replay=none.")
        if cfg.model.recompute != "none":
            raise ConfigError(f"algo.router_replay=rollout with model.recompute={cfg.model.recompute}: recomputed "
                              "forwards would replay another micro-batch's routes; set model.recompute=none.")
    if shape is not None and p.tensor_parallel > 1 and not p.sequence_parallel:
        raise ConfigError(f"parallel.tensor_parallel={p.tensor_parallel} with an MoE model needs "
                          "parallel.sequence_parallel=true (Megatron requires it for MoE with TP), which needs "
                          "model.layer_spec=transformer_engine; on CPU split the model with parallel.expert_parallel "
                          "and parallel.pipeline_parallel instead.")


def _validate_batches(cfg: Config, world_size: int) -> None:
    t = cfg.train
    dp = world_size // (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)
    _at_least(("train.prompts_per_step", t.prompts_per_step, 1), ("train.mini_batch_prompts", t.mini_batch_prompts, 1),
              ("train.epochs", t.epochs, 1), ("train.steps", t.steps, 0))
    if t.prompts_per_step % t.mini_batch_prompts:
        raise ConfigError(f"train.mini_batch_prompts={t.mini_batch_prompts} does not divide train.prompts_per_step="
                          f"{t.prompts_per_step}; use one of {_divisors(t.prompts_per_step)}.")
    rollouts_per_mini = t.mini_batch_prompts * cfg.rollout.n
    if rollouts_per_mini % dp:
        raise ConfigError(f"a mini-batch holds {rollouts_per_mini} responses, which {dp} data-parallel ranks cannot share "
                          f"equally; make train.mini_batch_prompts x rollout.n a multiple of {dp}.")
    o, c = cfg.optim, cfg.checkpoint
    _at_least(("train.micro_batch_tokens", t.micro_batch_tokens, 1), ("optim.warmup_steps", o.warmup_steps, 0),
              ("optim.grad_clip", o.grad_clip, 0), ("checkpoint.every", c.every, 0), ("checkpoint.keep_last", c.keep_last, 1))
    if not o.lr > 0:  # also refuses NaN
        raise ConfigError(f"optim.lr={o.lr!r} must be > 0 (e.g. optim.lr=1e-6, the DAPO paper's value).")
    if not o.eps > 0:
        raise ConfigError(f"optim.eps={o.eps!r} must be > 0: Adam divides by sqrt(v) + eps, and v is 0 for a "
                          "gradient that is 0 (e.g. optim.eps=1e-8).")
    for i, beta in enumerate(o.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"optim.betas[{i}]={beta!r} must lie in [0, 1) (Adam: [0.9, 0.999]).")
    if len(o.betas) != 2:
        raise ConfigError(f"optim.betas={list(o.betas)} must hold two values (Adam: [0.9, 0.999]).")
    _at_least(("optim.weight_decay", o.weight_decay, 0), ("optim.skip_nonfinite_updates", o.skip_nonfinite_updates, 0))


def _validate_rollout(cfg: Config) -> None:
    r = cfg.rollout
    if r.n < 1:
        raise ConfigError(f"rollout.n={r.n}: need at least 1 response per prompt (DAPO uses 16).")
    if r.n < 2 and cfg.algo.dynamic_sampling:
        raise ConfigError("rollout.n=1 makes every group all-right or all-wrong, so dynamic sampling keeps nothing; "
                          "use rollout.n >= 2 or algo.dynamic_sampling=false.")
    _at_least(("rollout.gen_batch_prompts", r.gen_batch_prompts, 1), ("rollout.max_new_tokens", r.max_new_tokens, 1))
    if not cfg.algo.dynamic_sampling and r.gen_batch_prompts != cfg.train.prompts_per_step:
        what = "train on fewer groups" if r.gen_batch_prompts < cfg.train.prompts_per_step else "drop the surplus groups"
        raise ConfigError(
            f"algo.dynamic_sampling=false trains on exactly one generation batch, but rollout.gen_batch_prompts="
            f"{r.gen_batch_prompts} differs from train.prompts_per_step={cfg.train.prompts_per_step} (it would {what}); "
            f"set rollout.gen_batch_prompts={cfg.train.prompts_per_step}, or algo.dynamic_sampling=true.")
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p={r.top_p!r} must lie in (0, 1] (1.0 disables nucleus sampling).")
    if not r.temperature > 0:
        raise ConfigError(f"rollout.temperature={r.temperature!r} must be > 0 (1.0 samples the model's distribution).")
    vocab = int(cfg.model.hf_config(cfg.tiny_base.preset)["vocab_size"])
    outside = [t for t in r.stop_token_ids if not 0 <= t < vocab]
    if outside:
        raise ConfigError(f"rollout.stop_token_ids={list(r.stop_token_ids)}: {outside} lie outside the vocabulary "
                          f"[0, {vocab}); use token ids of the model's tokenizer.")
    try:
        r.schedule.validate(r.n, cfg.algo.dynamic_sampling)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if r.schedule.partial and not cfg.algo.correction.active:
        raise ConfigError("rollout.schedule.partial trains on tokens an older policy sampled; they need an off-policy "
                          "correction: set algo.tis_cap (e.g. 2.0) or algo.rollout_correction.preset (e.g. token_tis)")
    _validate_bypass(cfg)
    _validate_pipeline(cfg)
    if r.engine == "vllm" and not 0.0 < r.vllm.gpu_memory_utilization < 1.0:
        raise ConfigError("rollout.vllm.gpu_memory_utilization must lie in (0, 1).")
    if cfg.algo.overlong_shaping and cfg.algo.overlong_max_len > r.max_new_tokens:
        raise ConfigError(f"algo.overlong_max_len={cfg.algo.overlong_max_len} exceeds rollout.max_new_tokens="
                          f"{r.max_new_tokens}: responses can never be that long; set them equal (L_max).")
    _at_least(("eval.k", cfg.eval.k, 1), ("eval.every", cfg.eval.every, 0))
    if not cfg.eval.temperature > 0:
        raise ConfigError(f"eval.temperature={cfg.eval.temperature!r} must be > 0 (DAPO: 1.0).")
    if not 0.0 < cfg.eval.top_p <= 1.0:
        raise ConfigError(f"eval.top_p={cfg.eval.top_p!r} must lie in (0, 1] (DAPO: 0.7).")
    ps = cfg.run.profile_steps
    if ps and (len(ps) != 2 or ps[0] < 1 or ps[1] < ps[0]):
        raise ConfigError(f"run.profile_steps={ps} must be [first, last] with 1 <= first <= last (e.g. [3, 4]), or [].")


def trainer_world(cfg: Config, world_size: int) -> int:
    """Ranks that train: all of them, or those the async mode does not give to the engines."""
    return world_size - cfg.rollout.pipeline.engine_ranks if cfg.rollout.pipeline.mode == "async" else world_size


def ignored_async_keys(cfg: Config) -> list[str]:
    """``key=value`` of the async-only settings (``rollout.pipeline.*`` besides ``mode``) that differ from their
    defaults in a sync config: set, and ignored."""
    pipe = cfg.rollout.pipeline
    if pipe.mode == "async":
        return []
    default = PipelineConfig()
    return [f"rollout.pipeline.{f.name}={getattr(pipe, f.name)}" for f in fields(PipelineConfig)
            if f.name != "mode" and getattr(pipe, f.name) != getattr(default, f.name)]


def _validate_bypass(cfg: Config) -> None:
    """Bypass mode takes the engine's log-probs as pi_old: they must be the distribution the tokens were sampled from.
    Both engines report log_softmax(logits / T) over the full vocabulary (SamplingParams.logprobs="processed"), which
    is the sampling distribution only without top-k/top-p truncation."""
    r = cfg.rollout
    if not cfg.algo.correction.bypass:
        return
    if r.top_p != 1.0 or r.top_k != -1:
        raise ConfigError(f"algo.rollout_correction bypass needs the engine's log-probs to be the sampling "
                          f"distribution, but rollout.top_p={r.top_p}, rollout.top_k={r.top_k} truncate it (the engines "
                          f"report log_softmax(logits/T) over the full vocabulary); set rollout.top_p=1.0 and "
                          f"rollout.top_k=-1, or use a decoupled preset (e.g. token_tis)")
    hf = cfg.model.hf_config(cfg.tiny_base.preset)
    aux = float(hf.get("router_aux_loss_coef") or 0.0)
    if (hf.get("num_experts") or hf.get("num_local_experts")) and aux > 0:
        # bypass divides the gradients by denominators known only after the forward: the router's aux-loss
        # gradient, added inside the forward, would be divided too
        raise ConfigError(f"algo.rollout_correction bypass with an MoE model whose router_aux_loss_coef={aux} > 0 "
                          f"is not supported (the aux loss would be rescaled with the policy loss); use a decoupled "
                          f"preset (e.g. token_tis) or set router_aux_loss_coef to 0 in the model's config.json")


def _validate_pipeline(cfg: Config) -> None:
    pipe, r = cfg.rollout.pipeline, cfg.rollout
    if pipe.mode != "async":
        return
    if not cfg.algo.correction.active:
        raise ConfigError("rollout.pipeline.mode=async trains on responses the previous policy sampled; it needs an "
                          "off-policy correction: set algo.tis_cap (e.g. 2.0) or algo.rollout_correction.preset "
                          "(token_tis, seq_mis, icepop, geo_rs, bypass_ppo_clip, ...; see docs/rollout.md)")
    _at_least(("rollout.pipeline.engine_ranks", pipe.engine_ranks, 1),
              ("rollout.pipeline.max_staleness", pipe.max_staleness, 1), ("rollout.pipeline.bucket_mb", pipe.bucket_mb, 1e-3))
    if r.schedule.partial and pipe.max_staleness < 2:
        raise ConfigError("rollout.schedule.partial in async mode continues prefixes sampled two policy versions "
                          "before the step that trains on them: set rollout.pipeline.max_staleness=2 (or turn "
                          "rollout.schedule.partial off)")
    if r.engine == "vllm" and pipe.engine_ranks % r.vllm.tensor_parallel:
        raise ConfigError(f"rollout.pipeline.engine_ranks={pipe.engine_ranks} is not a multiple of "
                          f"rollout.vllm.tensor_parallel={r.vllm.tensor_parallel}: each vLLM engine is one TP group.")


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
