"""``dapo-mcore plan``: the capacity planner's command line and its bridge from a project config.

The estimates themselves live in ``plan/planner.py``; this module turns a YAML config (or ``--model`` flags) into a
``PlanInput``, prints the report, and exits 0 when the layout fits, 1 when it does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, fields
from typing import Any

from dapo_mcore.config.rules import expert_tensor_parallel
from dapo_mcore.plan import disagg as plan_disagg
from dapo_mcore.plan.fit import LayoutDoesNotFit, Names, check, staging_problem
from dapo_mcore.plan.planner import (
    CONFIG_KEYS,
    GIB,
    TRAINER_FIXED,
    PlanInput,
    estimate_flops,
    estimate_memory,
    estimate_step_seconds,
    format_report,
)
from dapo_mcore.plan.step_model import requeue_line


def plan_input_from_config(cfg: Any, world_size: int, **planner_settings: Any) -> PlanInput:
    """The PlanInput of a project ``Config`` launched on ``world_size`` GPUs (``planner_settings``: the rest).

    The model shape comes from ``model.hf_path``'s config.json, ``model.preset`` or the tiny base.
    """
    p = cfg.parallel
    precision = "fp8" if cfg.model.fp8.enabled else ("bf16" if cfg.model.params_dtype == "bfloat16" else "fp32")
    derived = dict(
        model=cfg.model.hf_config(cfg.tiny_base.preset), tensor_parallel=p.tensor_parallel, pipeline_parallel=p.pipeline_parallel,
        data_parallel=world_size // (p.tensor_parallel * p.pipeline_parallel), virtual_pipeline=p.virtual_pipeline or 1,
        expert_parallel=p.expert_parallel, expert_tensor_parallel=expert_tensor_parallel(cfg) or 0,
        micro_batch_tokens=cfg.train.micro_batch_tokens, recompute=cfg.model.recompute, precision=precision,
        distributed_optimizer=p.distributed_optimizer, colocate_vllm=cfg.rollout.engine == "vllm",
        vllm_tensor_parallel=cfg.rollout.vllm.tensor_parallel, vllm_engines=cfg.rollout.vllm.engines,
        vllm_gpu_memory_utilization=cfg.rollout.vllm.gpu_memory_utilization, vllm_sleep_level=cfg.rollout.vllm.sleep_level,
        max_prompt_len=cfg.data.max_prompt_len,
        max_response_len=cfg.rollout.max_new_tokens, rollout_prompts=cfg.train.prompts_per_step,
        responses_per_prompt=cfg.rollout.n, mini_batch_prompts=cfg.train.mini_batch_prompts,
        gen_batch_prompts=cfg.rollout.gen_batch_prompts, offload_train_state_in_rollout=p.offload_for_rollout,
        lora_rank=cfg.model.lora.rank, lora_targets=",".join(cfg.model.lora.target_modules),
        **TRAINER_FIXED,
    )
    pipe = cfg.rollout.pipeline
    if pipe.mode == "async":  # the engine ranks' staged versions (host memory per engine node)
        derived.update(async_lead=pipe.max_staleness - (1 if cfg.rollout.schedule.partial else 0),
                       async_engine_ranks=pipe.engine_ranks)
        if "host_memory_gib" not in planner_settings:
            derived["host_memory_gib"] = pipe.node_host_memory_gib
    return PlanInput(**derived, **planner_settings)


def moe_decode_lines(plan: PlanInput) -> list[str]:
    """An MoE model's decode model for the configured engines and, beside it, for the other engine layout
    (``rollout.vllm.engines``; ``plan.moe_decode``); nothing for a dense model."""
    from dapo_mcore.plan.planner import moe_generation

    lockstep = plan.vllm_engines == "data_parallel"
    mine, other = moe_generation(plan), moe_generation(plan, lockstep=not lockstep)
    if mine is None or other is None:
        return []
    engines, gpus = plan.tensor_parallel * plan.pipeline_parallel * plan.data_parallel, plan.vllm_tensor_parallel
    switch = "rollout.vllm.engines=" + ("instances" if lockstep else "data_parallel")
    return [mine.describe(engines // gpus, gpus, lockstep=lockstep),
            f"  with {switch}: {other.seconds / 60:.1f} min per generation batch ({other.step.seconds * 1e3:.1f} ms "
            f"per step, dispatch {other.step.dispatch_s * 1e3:.1f})"]


def validate_config_layout(cfg: Any, world_size: int) -> None:
    """The config's own layout, batch and rollout rules at ``world_size`` (ConfigError naming the fix).

    Deliberately not ``Config.validate``: planning happens on a laptop, where the datasets, GPU libraries and
    checkpoints of the cluster are absent; only the rules that decide the layout are checked here.
    """
    cfg.model.validate()
    cfg.validate_layout(world_size)


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


MARGIN = 0.1
"""Share of GPU memory a fitting layout should leave free; less gets a warning (the memory model is an estimate)."""


def headroom_warning(plan: PlanInput, est: Any, margin: float) -> str | None:
    """A warning line when the worse phase peak leaves less than ``margin`` of ``plan.gpu_memory_gib`` free."""
    peak = max(est.train_peak, est.rollout_peak) / GIB
    free = plan.gpu_memory_gib - peak
    if free >= margin * plan.gpu_memory_gib:
        return None
    phase = "training" if est.train_peak >= est.rollout_peak else "rollout"
    return (f"warning: fits with only {free:.1f} GiB free of {plan.gpu_memory_gib:g} GiB ({free / plan.gpu_memory_gib:.1%}"
            f" < the {margin:.0%} margin; {phase} peak {peak:.1f} GiB): the estimate leaves out allocator fragmentation "
            f"and NCCL/CUDA-graph buffers, so this may run out of memory; prefer a layout with more headroom (more "
            f"pipeline or tensor parallelism, parallel.offload_for_rollout, a smaller train.micro_batch_tokens)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapo-mcore plan", description=__doc__.splitlines()[0],
        epilog="Either CONFIG [OVERRIDES...] --nodes N (the layout of a project config, e.g. "
               "examples/qwen2.5-32b-fp8.yaml), or --model/--hf-config with layout flags.")
    parser.add_argument("config", nargs="?", help="a project YAML config (its layout, batch sizes and model)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of CONFIG, e.g. parallel.tensor_parallel=4")
    parser.add_argument("--model", help="a preset name from dapo_mcore.model.presets (without CONFIG)")
    parser.add_argument("--hf-config", help="path to a Hugging Face config.json (without CONFIG)")
    parser.add_argument("--nodes", type=int, default=None, help="nodes of the job (with CONFIG)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (= tasks) per node (with CONFIG; default 8)")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    parser.add_argument("--time-limit-hours", type=float, default=12.0,
                        help="the job's --time (with CONFIG: jobs and requeues the run needs; default 12)")
    parser.add_argument("--signal-minutes", type=float, default=60.0,
                        help="the --signal=B:USR1@ lead time in minutes (default 60, the 32B script's)")
    parser.add_argument("--margin", type=float, default=MARGIN,
                        help=f"warn when a layout fits with less free GPU memory than this share (default {MARGIN:g}: "
                             "the estimate leaves out allocator fragmentation, NCCL and CUDA-graph buffers)")
    for f in fields(PlanInput):
        if f.name == "model":
            continue
        kind = {bool: _parse_bool, int: int, float: float, str: str}[type(f.default)]
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=argparse.SUPPRESS,
                            help=f"(default: {f.default})")
    parser.add_argument("--rank-variants", action="store_true",
                        help="with CONFIG: also price every rollout schedule the step model knows for this recipe "
                             "(colocated and async, tails included) and print them fastest first (minutes)")
    parser.add_argument("--rank-steps", type=int, default=1,
                        help="--rank-variants: simulated steps per training stage and variant (default 1)")
    plan_disagg.add_arguments(parser)
    return parser


def ranking_lines(cfg: Any, plan: PlanInput, steps: int) -> tuple[list[str], tuple[str, float] | None]:
    """``--rank-variants``: every schedule of ``cfg``'s recipe priced by the step model, fastest first; and the
    "this config" row's (variant, seconds) of a colocated config (what :func:`model_step` gives), else None."""
    from dapo_mcore.errors import UserError
    from dapo_mcore.model.hf_config import is_moe
    from dapo_mcore.plan.step_model import (
        SimSettings,
        colocated_input,
        format_ranking,
        rank_variants,
        variants_of,
    )

    if is_moe(cfg.model.hf_config(cfg.tiny_base.preset)):
        raise UserError("--rank-variants cannot price this recipe's engines: the step model decodes at a dense "
                        "model's rates, not an MoE's (its layouts and decode model are plain `plan`'s); run "
                        "`dapo-mcore plan` without --rank-variants, which prices an MoE's generation")
    p = colocated_input(cfg, plan)
    rates = plan_disagg.TransferRates()
    split = plan_disagg.own_split(cfg, p, rates)
    sync_v, async_v = variants_of(cfg)
    own = (async_v, split.engine_gpus) if cfg.rollout.pipeline.mode == "async" else (sync_v, None)
    try:
        rows = rank_variants(cfg, p, rates, SimSettings(steps=steps), split)
    except ValueError as err:  # EngineModel.from_throughput: the decode rates contradict each other
        raise UserError(f"--rank-variants cannot price this recipe's engines: {err} (the step model's lone sequence "
                        "decodes at the dense 32B's rate, slower than this model's full engine per sequence: an MoE "
                        "with few active parameters); rank a dense recipe, or price it without --rank-variants") from err
    mine = next(((v, t) for v, s, t in rows if own == (v, None)), None)
    return ["rollout schedules of this recipe, fastest first (the step model of benchmarks/rollout_sim.py, "
            f"{steps} simulated step(s) per training stage; a model, not a measurement):",
            *format_ranking(rows, own)], mine


def model_step(cfg: Any, plan: PlanInput, steps: int) -> tuple[str, float] | None:
    """(variant, seconds) of a colocated config's own schedule by the step model (``step_model.own_step_seconds``,
    the function and settings of ``--rank-variants``' "this config" row); None without a config and vLLM engines,
    or where the step model cannot price the engines (an MoE whose lone sequence outruns its full engine)."""
    if cfg is None or not plan.colocate_vllm:
        return None
    from dapo_mcore.plan.step_model import SimSettings, colocated_input, own_step_seconds

    try:
        return own_step_seconds(cfg, colocated_input(cfg, plan), plan_disagg.TransferRates(), SimSettings(steps=steps))
    except ValueError:  # EngineModel.from_throughput: the decode rates contradict each other
        return None


def model_step_line(variant: str, seconds: float) -> str:
    return (f"step time by the step model: {seconds / 60:.2f} min ({variant}, this config's schedule, colocated; "
            f"mean of 3 training stages with generation tails; --rank-variants' 'this config' row): it sizes the "
            f"requeues (the MFU line above prices one generation batch of max-length responses)")


def _plan_from_args(parser: argparse.ArgumentParser,
                    args: dict[str, Any]) -> tuple[PlanInput, Names | None, int, int | None, int | None]:
    """(PlanInput, message names, max TP, train.steps of CONFIG, the engine ranks of an async CONFIG) from parsed
    arguments; parser.error on a mixed-up command line."""
    config, overrides, preset, path = args.pop("config"), args.pop("overrides"), args.pop("model"), args.pop("hf_config")
    nodes, gpus_per_node = args.pop("nodes"), args.pop("gpus_per_node")
    if config is None:
        if overrides or (preset is None) == (path is None):
            parser.error("give CONFIG [OVERRIDES...] --nodes N, or exactly one of --model / --hf-config")
        if path:
            with open(path) as fh:
                model = json.load(fh)
        else:
            from dapo_mcore.model.presets import preset_config

            model = preset_config(preset)
        return PlanInput(model=model, **args), None, 8, None, None, None
    if preset or path:
        parser.error("CONFIG names the model already; drop --model/--hf-config (override model.preset=... instead)")
    clashes = sorted(set(args) & (set(CONFIG_KEYS) | set(TRAINER_FIXED)))
    if clashes:
        parser.error("with CONFIG, set the layout through overrides, not flags: " + ", ".join(
            f"--{c.replace('_', '-')} -> {CONFIG_KEYS.get(c, 'fixed by the trainer')}" for c in clashes))
    if nodes is None or nodes < 1 or gpus_per_node < 1:
        parser.error("with CONFIG, give the job size: --nodes N [--gpus-per-node 8]")
    from dapo_mcore.commands.config import infer_preset
    from dapo_mcore.config import load_config

    cfg, note = infer_preset(load_config(config, overrides))
    if note:
        sys.stderr.write(f"warning: {note}\n")
    world = nodes * gpus_per_node
    validate_config_layout(cfg, world)
    pipe = cfg.rollout.pipeline
    engines = pipe.engine_ranks if pipe.mode == "async" else None
    return plan_input_from_config(cfg, world, **args), CONFIG_KEYS, gpus_per_node, cfg.train.steps, engines, cfg


def main(argv: list[str] | None = None) -> int:
    """``dapo-mcore plan``: print the estimate; exit 1 with the suggested changes if it does not fit."""
    parser = build_parser()
    args = vars(parser.parse_intermixed_args(argv))
    as_json = args.pop("json")
    margin = args.pop("margin")
    split_opts = {k: args[k] for k in plan_disagg.OPTIONS}
    disaggregated = plan_disagg.pop_arguments(args)
    time_limit_h, lead_min = args.pop("time_limit_hours"), args.pop("signal_minutes")
    if split_opts["tail_steps"] < 0:
        parser.error(f"--tail-steps {split_opts['tail_steps']}: give 0 (skip) or more simulated steps per stage")
    rank, rank_steps = args.pop("rank_variants"), args.pop("rank_steps")
    plan, names, max_tp, steps, engine_ranks, cfg = _plan_from_args(parser, args)
    ranked = None  # the "this config" row, the step time the plain report prints: priced once
    if rank:
        if cfg is None or not plan.colocate_vllm:
            parser.error("--rank-variants prices vLLM engines of a project config: give CONFIG with rollout.engine=vllm")
        if rank_steps < 1:
            parser.error(f"--rank-steps {rank_steps}: give 1 or more simulated steps per stage")
        lines, ranked = ranking_lines(cfg, plan, rank_steps)
        print("\n".join(lines))
    if disaggregated is None and engine_ranks is not None:
        # An async config prices its own split (rollout.pipeline.engine_ranks): the colocated estimate is not its.
        disaggregated = {**split_opts, "engine_gpus": engine_ranks,
                         "requeue": (steps, time_limit_h, lead_min) if steps else None}
    if engine_ranks is not None and (staging := staging_problem(plan)):
        print(f"does not fit: {staging}")
        return 1
    if disaggregated is not None:
        try:
            return plan_disagg.run(plan, {**disaggregated, "config": cfg}, as_json)
        except ValueError as err:
            parser.error(str(err))
    est, flops = estimate_memory(plan), estimate_flops(plan)
    if as_json:
        train_s, gen_s = estimate_step_seconds(plan, flops)
        print(json.dumps({"memory_gib": {k: v / GIB if isinstance(v, float) else v
                                         for k, v in asdict(est).items()},
                          "flops": asdict(flops), "step_seconds": {"train": train_s, "generation": gen_s}}, indent=2))
    else:
        print(format_report(plan, est, flops))
        from dapo_mcore.model.moe_shape import describe_experts

        engines = max(1, (engine_ranks or plan.tensor_parallel * plan.pipeline_parallel * plan.data_parallel)
                      // plan.vllm_tensor_parallel)
        dp = 1 if plan.vllm_engines == "instances" else engines
        experts = describe_experts(plan.model, plan.tensor_parallel, plan.expert_parallel,
                                   None if cfg is None else cfg.algo.router_replay,
                                   (plan.vllm_tensor_parallel, dp) if plan.colocate_vllm or engine_ranks else None,
                                   plan.expert_tp, engines)
        if experts:
            print(experts)
        for line in moe_decode_lines(plan):
            print(line)
    try:
        check(plan, names, max_tp)
    except LayoutDoesNotFit as err:
        print(err)
        return 1
    own = None if as_json else (ranked or model_step(cfg, plan, rank_steps))
    if own is not None:
        print(model_step_line(*own))
    if steps and not as_json:
        if own is not None:
            print(requeue_line(steps, own[1], time_limit_h, lead_min, basis=f"the step model, {own[0]}"))
        else:
            print(requeue_line(steps, sum(estimate_step_seconds(plan, flops)), time_limit_h, lead_min))
    warning = headroom_warning(plan, est, margin)
    if warning:
        print(warning)
    print("fits")
    return 0
