"""``dapo-mcore config CONFIG [key=value ...]``, and the checks every command runs before anything heavy.

``precheck`` loads and validates a config (``run/checkpoints.py`` turns ``eval --checkpoint`` into a checkpoint
directory): both run before Megatron (and the trainer) is imported, so a typo in a key or a path costs
a fraction of a second, not the seconds of imports and model building it used to. ``main`` prints the resolved
config and the layout it implies, and starts nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import yaml

from dapo_mcore.config import Config, load_config
from dapo_mcore.config.rules import ignored_async_keys, trainer_world
from dapo_mcore.config.tree import ConfigError, to_dict

log = logging.getLogger(__name__)


def world_size_from_env(environ: dict[str, str] | None = None) -> int:
    """The launch's world size from torchrun or Slurm variables (the same ones ``actor.parallel.read_launch_env``
    reads, without importing torch), 1 for a lone process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_NTASKS"])
    return 1


def infer_preset(cfg: Config) -> tuple[Config, str | None]:
    """For the commands that plan a run rather than start it (config, plan, rehearse): a model.hf_path that is not
    on this machine and whose name names a preset (``/models/Qwen2.5-32B``, ``Llama-3.1-8B``) is planned as that
    preset. Returns the config and a line saying so (None when nothing was inferred)."""
    from dataclasses import replace

    from dapo_mcore.model.presets import preset_named_by

    m = cfg.model
    if not m.hf_path or (Path(m.hf_path) / "config.json").is_file():
        return cfg, None
    preset = preset_named_by(m.hf_path)
    if preset is None:
        return cfg, None
    note = (f"model.hf_path={m.hf_path} is not on this machine: planned as model.preset={preset}, the shape its "
            "name names")
    return replace(cfg, model=replace(m, hf_path=None, preset=preset)), note


def precheck(config_path: str, overrides: list[str], world_size: int | None = None, warn: bool = True,
             check_files: bool = True, plan_only: bool = False) -> Config:
    """Load and validate (raises ConfigError with the key and the fix); imports no torch model code. ``warn``: log
    (once, on rank 0) the async-only settings a sync config sets and ignores. ``plan_only`` (``config``): a model
    directory not on this machine is planned as the preset its name names (`infer_preset`, with a warning)."""
    cfg = load_config(config_path, overrides)
    if plan_only:
        cfg, note = infer_preset(cfg)
        if note:
            sys.stderr.write(f"warning: {note}\n")
    cfg.validate(world_size or world_size_from_env(), check_files=check_files)
    ignored = ignored_async_keys(cfg)
    main_rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    for advice in cfg.algo.advisories() if warn and main_rank else []:
        log.warning("%s", advice)
    if warn and ignored and main_rank:
        log.warning("%s only apply to rollout.pipeline.mode=async; this config is sync, so they are ignored (set "
                    "rollout.pipeline.mode=async, or remove them)", ", ".join(ignored))
    return cfg


def describe_layout(cfg: Config, world_size: int) -> list[str]:
    """What the config implies for one step and for the process layout."""
    t, r = cfg.train, cfg.rollout
    updates = t.prompts_per_step // t.mini_batch_prompts * t.epochs
    hf = cfg.model.hf_config(cfg.tiny_base.preset) if not cfg.model.hf_path or Path(cfg.model.hf_path, "config.json").is_file() else None
    model = ("from model.hf_path (config.json not found here)" if hf is None else
             f"{hf.get('num_hidden_layers')} layers, hidden {hf.get('hidden_size')}, "
             f"{hf.get('num_attention_heads')} heads / {hf.get('num_key_value_heads')} KV heads, "
             f"vocab {hf.get('vocab_size')}")
    run_dir = Path(cfg.run.dir)
    state = ("new" if not (run_dir / "config.yaml").is_file() else
             "exists: the run resumes from its latest checkpoint" if cfg.run.resume == "auto" else
             "exists and run.resume=never: train would refuse it")
    experts = None if hf is None else _expert_line(cfg, hf, world_size)
    return [
        *_process_lines(cfg, world_size),
        f"model: {model}",
        *([experts] if experts else []),
        *([lora] if (lora := _lora_line(cfg, hf)) else []),
        f"per step: {t.prompts_per_step} prompts x {r.n} samples = {t.prompts_per_step * r.n} rollouts trained; "
        f"generation batches of {r.gen_batch_prompts} prompts"
        + (f", refilled up to {cfg.algo.max_gen_batches} times (dynamic sampling)" if cfg.algo.dynamic_sampling else ""),
        f"updates: {updates} optimizer step(s) per rollout step ({t.prompts_per_step} / {t.mini_batch_prompts} "
        f"prompts per mini-batch x {t.epochs} epoch(s)); {t.steps} steps = {t.steps * updates} updates",
        _schedule_line(cfg),
        f"learning rate: {cfg.optim.lr:g}, warm-up {cfg.optim.warmup_steps} step(s)",
        f"eval: every {cfg.eval.every} steps, avg@{cfg.eval.k}; checkpoint every {cfg.checkpoint.every} steps",
        f"reward: {cfg.reward.name}" + (f" in {cfg.reward.workers} isolated worker(s), {cfg.reward.timeout_s:g}s per "
                                        "answer" if cfg.reward.workers else " in the trainer process"),
        f"run dir: {run_dir} ({state})",
    ]


def _lora_line(cfg: Config, hf: dict | None) -> str | None:
    from dapo_mcore.plan.lora import describe_lora

    lora, p = cfg.model.lora, cfg.parallel
    precision = "fp32" if cfg.model.params_dtype == "float32" else "bf16"
    return None if hf is None else describe_lora(hf, lora.rank, lora.alpha, lora.target_modules,
                                                 tensor_parallel=p.tensor_parallel,
                                                 pipeline_parallel=p.pipeline_parallel,
                                                 expert_parallel=p.expert_parallel, precision=precision)


def _schedule_line(cfg: Config) -> str:
    """Which rollout schedule runs, and the key that gives DAPO's published loop when it is another."""
    s = cfg.rollout.schedule
    on = [name for name, value in (("streaming", s.streaming), ("partial rollouts", s.partial),
                                   ("adaptive rounds", s.adaptive), ("prompt history", s.history),
                                   (f"staged groups of {s.stage_responses}", s.stage_responses)) if value]
    if not on:
        return "rollout schedule: batch and filter, DAPO's published loop (every rollout.schedule switch off)"
    named = f" (rollout.schedule.preset={s.preset})" if s.preset else ""
    return (f"rollout schedule: {' + '.join(on)}, {s.order} order{named}; DAPO's published loop: "
            "rollout.schedule.preset=paper")


def _expert_line(cfg: Config, hf: dict, world_size: int) -> str | None:
    from dapo_mcore.config.rules import vllm_data_parallel, vllm_engine_count
    from dapo_mcore.model.moe_shape import describe_experts

    vllm = ((cfg.rollout.vllm.tensor_parallel, vllm_data_parallel(cfg, world_size))
            if cfg.rollout.engine == "vllm" else None)
    return describe_experts(hf, cfg.parallel.tensor_parallel, cfg.parallel.expert_parallel, cfg.algo.router_replay,
                            vllm, cfg.parallel.expert_tensor_parallel, vllm_engine_count(cfg, world_size))


def _process_lines(cfg: Config, world_size: int) -> list[str]:
    """Who runs what: every rank trains and generates (sync), or the trainer/engine split (async)."""
    p, r = cfg.parallel, cfg.rollout
    engine_tp = r.vllm.tensor_parallel if r.engine == "vllm" else 1
    trainers = trainer_world(cfg, world_size)
    dp = trainers // (p.tensor_parallel * p.pipeline_parallel)
    layout = (f"data parallel {dp} x tensor parallel {p.tensor_parallel} x pipeline parallel {p.pipeline_parallel}"
              + (f" (virtual {p.virtual_pipeline})" if p.virtual_pipeline else ""))
    if r.pipeline.mode != "async":
        return [f"processes: {world_size} = {layout}",
                f"rollout engine: {r.engine}, {world_size // engine_tp} engine group(s) of {engine_tp} process(es), "
                "colocated with the trainer (rollout.pipeline.mode=sync)"]
    engines = r.pipeline.engine_ranks
    lead = r.pipeline.max_staleness - (1 if r.schedule.partial else 0)
    ahead = "step n+1" if lead == 1 else f"steps n+1 .. n+{lead}"
    return [f"processes: {world_size} = {trainers} trainer ranks (0-{trainers - 1}) + {engines} engine ranks "
            f"({trainers}-{world_size - 1}), rollout.pipeline.mode=async",
            f"trainer: {trainers} = {layout}",
            f"engines: {engines} = {engines // engine_tp} {r.engine} engine(s) (data parallel) x tensor parallel "
            f"{engine_tp}; they generate {ahead} while the trainer trains step n (max_staleness "
            f"{r.pipeline.max_staleness}, weights in {r.pipeline.bucket_mb:g} MiB buckets)"]


def main(argv: list[str] | None = None) -> int:
    """``dapo-mcore config CONFIG [key=value ...] [--world-size N]``: print, validate, run nothing."""
    parser = argparse.ArgumentParser(prog="dapo-mcore config",
                                     description="Print the resolved config and the layout it implies; runs nothing.")
    parser.add_argument("config", help="YAML config, e.g. examples/tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes to validate the layout for (default: from torchrun/Slurm variables, else 1)")
    args = parser.parse_intermixed_args(argv)  # overrides may follow --world-size
    world = args.world_size or world_size_from_env()
    # a cluster config, checked on a laptop
    cfg = precheck(args.config, args.overrides, world, check_files=False, plan_only=True)
    check_run_dir(cfg)
    sys.stdout.write(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    sys.stdout.write("# derived\n" + "".join(f"# {line}\n" for line in describe_layout(cfg, world)))
    for refusal in (missing_inputs(cfg), hardware_refusal(cfg)):
        if refusal:
            sys.stderr.write(f"warning: on this machine train would refuse: {refusal}\n")
    return 0


def check_run_dir(cfg: Config) -> None:
    """The run-directory refusals of ``train`` (another run's directory, resume=never, not writable), writing
    nothing."""
    from dapo_mcore.run.directory import check_writable, refuse_non_run_overwrite, refuse_other_run

    run_dir = Path(cfg.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir={str(run_dir)!r} exists and is not a directory; choose another run.dir.")
    check_writable(run_dir, "run.dir")
    refuse_non_run_overwrite(cfg)
    refuse_other_run(cfg)


def missing_inputs(cfg: Config) -> str | None:
    """The dataset-file refusal ``train`` would give here (a file absent from this machine), or None: ``config``
    checks cluster configs on laptops, so it warns instead."""
    try:
        cfg.data.validate()
    except ValueError as err:
        return str(err)
    return None


def hardware_refusal(cfg: Config) -> str | None:
    """What ``runtime.check_hardware`` would refuse on this machine (GPU-only settings without the GPU stack), or
    None. A warning, not an error: cluster configs are checked on laptops."""
    from dapo_mcore.model.fp8 import MissingGPUExtra
    from dapo_mcore.run.runtime import check_hardware

    try:
        check_hardware(cfg)
    except (MissingGPUExtra, ConfigError, ImportError) as err:
        return str(err)
    return None


if __name__ == "__main__":
    raise SystemExit(main())
