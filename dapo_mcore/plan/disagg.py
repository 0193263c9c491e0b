"""Disaggregated layouts: engines on their own GPUs, the trainer on the others (the asynchronous mode).

``dapo-mcore plan CONFIG --nodes N --disaggregated`` prices every split of the job's GPUs into engine GPUs and
trainer GPUs with the planner's own models (``planner.py``), and proposes the one that balances the two sides:

* **Trainer side**: the config's Megatron layout (TP x PP) on ``world - engine_gpus`` GPUs, data parallelism
  ``(world - engine_gpus) / (TP x PP)``, without a colocated engine (``colocate_vllm=False``: no vLLM KV cache,
  weights or sleep residue on these GPUs). Memory and its checks are :func:`fit.check`'s; its time is the
  planner's old-log-prob + update seconds at ``train_mfu`` on these GPUs.
* **Engine side**: ``engine_gpus / vllm_tensor_parallel`` vLLM engines that hold no optimizer state, gradients or
  trainer weights: vLLM may take ``engine_gpu_memory_utilization`` of the GPU (vLLM's own default, 0.9) plus the
  planner's ``overhead_gib`` (CUDA context, the NCCL buffers of the weight-transfer group). Its time is the
  planner's generation seconds (``decode_mfu``) scaled from all GPUs to the engine GPUs.
* **Weight transfer** (trainer -> engines, every step): the trainer gathers full bf16 tensors (``export_gbs`` per
  rank, as the colocated sync does) and broadcasts them to the engine GPUs over the network, each engine GPU
  receiving its 1/vllm-TP share at ``network_gbs`` (a pipelined broadcast: the time does not grow with the number of
  engines). It is counted as fully exposed: both sides stop for it.

One policy version behind, a step takes ``max(generation, trainer) + transfer``; the scan's fastest split is
*proposed* only when it beats the colocated run. The scan is a throughput model (the planner's FLOPs at assumed
MFUs, no generation tails); with a CONFIG, ``plan`` then prices the split it reports against the colocated run with
tails (``step_model.compare_with_tails``: the same rules and rollout model as ``benchmarks/rollout_sim.py``, so the
two never disagree), and that verdict is the one to go by. The split a run uses is
``rollout.pipeline.engine_ranks`` of an async config (``rollout.pipeline.mode=async``), which ``plan`` then prices
on its own; ``--engine-gpus`` prices another.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from dapo_mcore.plan.fit import LayoutDoesNotFit, check
from dapo_mcore.plan.planner import (
    GIB,
    PlanInput,
    estimate_flops,
    estimate_host,
    estimate_memory,
    estimate_step_seconds,
)
from dapo_mcore.plan.transfer import TransferRates, weight_sync_seconds


@dataclass
class EngineMemory:
    """Per-GPU bytes of a vLLM engine GPU that holds nothing of the trainer."""

    vllm: float
    weights: float
    kv_cache: float
    kv_tokens: int
    overhead: float

    @property
    def peak(self) -> float:
        return self.vllm + self.overhead


@dataclass
class Split:
    """One split of the job's GPUs: memory and seconds per step of each side."""

    engine_gpus: int
    trainer_gpus: int
    trainer: PlanInput | None
    """The trainer side's layout (None when the trainer GPUs do not make a valid Megatron layout)."""
    engine_memory: EngineMemory
    trainer_peak: float
    generation_s: float
    trainer_s: float
    transfer_s: float
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def step_s(self) -> float:
        return max(self.generation_s, self.trainer_s) + self.transfer_s


def engine_memory(p: PlanInput, utilization: float) -> EngineMemory:
    """The planner's vLLM memory model at ``utilization`` of the GPU, with no trainer state beside it."""
    est = estimate_memory(replace(p, colocate_vllm=True, vllm_gpu_memory_utilization=utilization))
    return EngineMemory(est.vllm_awake, est.vllm_weights, est.vllm_kv_cache, est.vllm_kv_tokens, p.overhead_gib * GIB)


def trainer_side(p: PlanInput, trainer_gpus: int) -> PlanInput:
    """The config's TP x PP on ``trainer_gpus`` GPUs, without a colocated engine (ValueError if not a layout)."""
    mp = p.tensor_parallel * p.pipeline_parallel
    if trainer_gpus < mp or trainer_gpus % mp:
        raise ValueError(f"{trainer_gpus} trainer GPUs are not a multiple of TP x PP = {mp}")
    t = replace(p, data_parallel=trainer_gpus // mp, colocate_vllm=False, offload_train_state_in_rollout=False)
    t.validate()
    return t


def price_split(p: PlanInput, engine_gpus: int, utilization: float = 0.9,
                rates: TransferRates | None = None) -> Split:
    """Memory and time of each side when ``engine_gpus`` of ``p``'s GPUs run the engines."""
    rates = rates or TransferRates()
    world = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    if not 0 < engine_gpus < world:
        raise ValueError(f"engine_gpus={engine_gpus} must lie between 1 and {world - 1} (the job has {world} GPUs)")
    if engine_gpus % p.vllm_tensor_parallel:
        raise ValueError(f"engine_gpus={engine_gpus} is not a multiple of vllm_tensor_parallel={p.vllm_tensor_parallel}")
    if not 0.0 < utilization < 1.0:
        raise ValueError(f"engine_gpu_memory_utilization={utilization} must lie in (0, 1), e.g. 0.9")
    problems: list[str] = []
    mem = engine_memory(p, utilization)
    seq = p.max_prompt_len + p.max_response_len
    if mem.peak > p.gpu_memory_gib * GIB:
        problems.append(f"engine GPU needs {mem.peak / GIB:.1f} GiB > {p.gpu_memory_gib} GiB; lower "
                        f"engine_gpu_memory_utilization")
    if mem.kv_tokens < seq:
        problems.append(f"engine KV cache holds {mem.kv_tokens} tokens < one sequence of {seq}; raise "
                        f"engine_gpu_memory_utilization or vllm_tensor_parallel")
    _, gen_all = estimate_step_seconds(p, estimate_flops(p))
    generation_s = gen_all * world / engine_gpus
    trainer_gpus = world - engine_gpus
    try:
        t = trainer_side(p, trainer_gpus)
    except ValueError as err:
        problems.append(f"trainer side: {err}")
        return Split(engine_gpus, trainer_gpus, None, mem, math.nan, generation_s, math.inf, math.nan, problems)
    try:
        check(t)
    except LayoutDoesNotFit as err:
        problems.append("trainer side " + str(err).replace(":\n  - ", ": ").replace("\n  - ", "; "))
    train_s, _ = estimate_step_seconds(t, estimate_flops(t))
    return Split(engine_gpus, trainer_gpus, t, mem, estimate_memory(t).train_peak, generation_s, train_s,
                 weight_sync_seconds(p, rates, disaggregated=True), problems)


def split_step(p: PlanInput) -> int:
    """Granularity of the scan: whole nodes of engines (a multiple of the vLLM TP)."""
    return math.lcm(p.vllm_tensor_parallel, p.gpus_per_host)


def scan_splits(p: PlanInput, utilization: float = 0.9, rates: TransferRates | None = None) -> list[Split]:
    """Every split with whole nodes of engines, fewest engine GPUs first."""
    world = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    step = split_step(p)
    return [price_split(p, e, utilization, rates) for e in range(step, world, step)]


def propose(splits: list[Split], colocated_s: float | None = None) -> Split | None:
    """The fitting split with the shortest step (``max(generation, trainer) + transfer``); None if none fits, or
    (given the colocated run's ``colocated_s``) if even that split is not faster than the colocated run."""
    fitting = [s for s in splits if s.fits]
    best = min(fitting, key=lambda s: (s.step_s, s.engine_gpus)) if fitting else None
    return None if best is None or (colocated_s is not None and best.step_s >= colocated_s) else best


def own_split(cfg: Any, p: Any, rates: Any, utilization: float = 0.9) -> Any:
    """The async split a config is priced at: its own ``rollout.pipeline.engine_ranks`` in async mode, else the
    planner's proposal (``propose``; None when no split fits)."""
    if cfg.rollout.pipeline.mode == "async":
        return price_split(p, cfg.rollout.pipeline.engine_ranks, utilization, rates)
    return propose(scan_splits(p, utilization, rates))


def colocated_step_seconds(p: PlanInput, rates: TransferRates | None = None) -> tuple[float, float, float]:
    """(generation, trainer, weight sync + sleep copies) seconds of today's colocated synchronous step."""
    train_s, gen_s = estimate_step_seconds(p, estimate_flops(p))
    sync = weight_sync_seconds(p, rates or TransferRates(), disaggregated=False) + estimate_host(p).sleep_copy_s
    return gen_s, train_s, sync


def format_splits(p: PlanInput, splits: list[Split], utilization: float, rates: TransferRates) -> str:
    """A table of the scanned splits, the colocated step beside them, and the proposal."""
    world = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    gen, train, sync = colocated_step_seconds(p, rates)
    rows = [f"disaggregated layouts of {world} GPUs (a throughput model: the planner's FLOPs at train {p.train_mfu:.0%} / "
            f"decode {p.decode_mfu:.0%} MFU, {p.generation_batches:g} generation batches of {p.gen_batch_prompts} "
            f"prompts x {p.responses_per_prompt} at mean {p.mean_response_len} tokens; no tails, see "
            f"benchmarks/rollout_sim.py); run one with rollout.pipeline.mode=async rollout.pipeline.engine_ranks=N",
            f"assumptions: engines at gpu_memory_utilization {utilization:g} with no trainer state; trainer "
            f"TP={p.tensor_parallel} PP={p.pipeline_parallel} without an engine; weights exported at "
            f"{rates.export_gbs:g} GB/s per rank and broadcast at {rates.network_gbs:g} GB/s per engine GPU, "
            f"fully exposed",
            f"colocated synchronous (today): generation {gen / 60:.1f} + trainer {train / 60:.1f} + weight sync "
            f"{sync:.1f} s = {(gen + train + sync) / 60:.1f} min per step",
            f"{'engine GPUs':>11} {'trainer':>7} {'DP':>3} {'engine GiB':>10} {'KV tokens':>10} {'trainer GiB':>11} "
            f"{'gen min':>8} {'train min':>9} {'xfer s':>7} {'step min':>8}  verdict"]
    for s in splits:
        head = (f"{s.engine_gpus:>11} {s.trainer_gpus:>7} {s.trainer.data_parallel if s.trainer else '-':>3} "
                f"{s.engine_memory.peak / GIB:>10.1f} {s.engine_memory.kv_tokens:>10}")
        if s.trainer is None:  # no trainer layout: nothing to time
            rows.append(f"{head} {'-':>11} {s.generation_s / 60:>8.1f} {'-':>9} {'-':>7} {'-':>8}  " + "; ".join(s.problems))
            continue
        rows.append(f"{head} {s.trainer_peak / GIB:>11.1f} {s.generation_s / 60:>8.1f} {s.trainer_s / 60:>9.1f} "
                    f"{s.transfer_s:>7.1f} {s.step_s / 60:>8.1f}  " + ("fits" if s.fits else "; ".join(s.problems)))
    best, fastest = propose(splits, gen + train + sync), propose(splits)
    if fastest is None:
        rows.append("no split fits: see the problems above")
    elif best is None:
        rows.append(f"no split is faster than the colocated run in this throughput model: the fastest, "
                    f"{fastest.engine_gpus} engine GPUs + {fastest.trainer_gpus} trainer GPUs, takes "
                    f"{fastest.step_s / 60:.1f} min a step vs colocated {(gen + train + sync) / 60:.1f} min (no tails: "
                    "see the verdict with generation tails below)")
    else:
        rows.append(f"proposed split: {best.engine_gpus} engine GPUs ({best.engine_gpus // p.vllm_tensor_parallel} "
                    f"engines) + {best.trainer_gpus} trainer GPUs (DP={best.trainer.data_parallel}): step "
                    f"{best.step_s / 60:.1f} min (generation {best.generation_s / 60:.1f}, trainer "
                    f"{best.trainer_s / 60:.1f}) vs colocated {(gen + train + sync) / 60:.1f} min")
    return "\n".join(rows)


# --- the command line (hooked into ``dapo-mcore plan`` by commands/plan.py) ------------------------------------

OPTIONS = ("disaggregated", "engine_gpus", "engine_gpu_memory_utilization", "weight_export_gbs", "weight_network_gbs",
           "tail_steps")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` options of a disaggregated layout."""
    group = parser.add_argument_group(
        "disaggregated layout (engines on their own GPUs: rollout.pipeline.mode=async; an async config is priced at "
        "its rollout.pipeline.engine_ranks without these)")
    group.add_argument("--disaggregated", action="store_true",
                       help="price every split of the GPUs into engine and trainer GPUs and propose the balanced one")
    group.add_argument("--engine-gpus", type=int, default=None,
                       help="price only this split: N engine GPUs, the rest train (implies --disaggregated)")
    group.add_argument("--engine-gpu-memory-utilization", type=float, default=0.9,
                       help="vLLM's memory fraction on an engine GPU (no trainer state beside it; default 0.9)")
    group.add_argument("--weight-export-gbs", type=float, default=TransferRates.export_gbs,
                       help=f"trainer-side weight export rate per rank, GB/s (default {TransferRates.export_gbs:g})")
    group.add_argument("--weight-network-gbs", type=float, default=TransferRates.network_gbs,
                       help=f"trainer -> engine broadcast rate per engine GPU, GB/s (default {TransferRates.network_gbs:g})")
    group.add_argument("--tail-steps", type=int, default=1,
                       help="with CONFIG: price the split against the colocated run with generation tails over this "
                            "many simulated steps per training stage (the rollout model of benchmarks/rollout_sim.py; "
                            "seconds to minutes); 0 skips it (default 1)")


def pop_arguments(args: dict[str, Any]) -> dict[str, Any] | None:
    """Remove this module's options from the parsed ``args``; the disaggregated request, or None."""
    opts = {k: args.pop(k) for k in OPTIONS}
    return opts if opts["disaggregated"] or opts["engine_gpus"] is not None else None


def run(p: PlanInput, opts: dict[str, Any], as_json: bool) -> int:
    """Print the splits (or the one asked for); exit 0 when a split fits, 1 when none does, 2 on a bad request."""
    if not p.colocate_vllm:
        raise ValueError("--disaggregated prices vLLM engines on their own GPUs: the config must use rollout.engine=vllm")
    rates = TransferRates(opts["weight_export_gbs"], opts["weight_network_gbs"])
    util = opts["engine_gpu_memory_utilization"]
    if opts["engine_gpus"] is not None:
        splits = [price_split(p, opts["engine_gpus"], util, rates)]
    else:
        splits = scan_splits(p, util, rates)
    colocated = sum(colocated_step_seconds(p, rates))
    verdict = None
    cfg, steps = opts.get("config"), opts.get("tail_steps", 0)
    if cfg is not None and steps and propose(splits) is not None:
        verdict = tails_verdict(cfg, p, splits[0] if len(splits) == 1 else propose(splits), rates, steps)
    if as_json:
        print(json.dumps({"splits": [_split_json(s) for s in splits],
                          "proposed_engine_gpus": getattr(propose(splits, colocated), "engine_gpus", None),
                          "with_tails": verdict and verdict[1]}, indent=2))
    else:
        print(format_splits(p, splits, util, rates))
        if verdict:
            print(verdict[0])
        if verdict and opts.get("requeue"):  # an async config: its own step time, tails included, sets the requeues
            from dapo_mcore.plan.step_model import requeue_line

            train_steps, time_limit_h, lead_min = opts["requeue"]
            print(requeue_line(train_steps, verdict[1]["async_s"], time_limit_h, lead_min))
    return 0 if propose(splits) else 1


def tails_verdict(cfg: Any, p: PlanInput, split: Split, rates: TransferRates, steps: int) -> tuple[str, dict[str, Any]]:
    """The config's rollout schedule priced with generation tails (``step_model.compare_with_tails``: the model
    ``benchmarks/rollout_sim.py`` prints), colocated vs async at ``split``: a line and its numbers."""
    from dapo_mcore.plan.step_model import SimSettings, colocated_input, compare_with_tails, variants_of

    sync_v, async_v = variants_of(cfg)
    sync_s, async_s = compare_with_tails(cfg, colocated_input(cfg, p), split, rates, SimSettings(steps=steps))
    faster = sync_s / async_s
    word = "faster" if faster > 1 else "not faster"
    line = (f"with generation tails (the rollout model of benchmarks/rollout_sim.py: {sync_v} vs {async_v}, mean of 3 "
            f"training stages, {steps} simulated step(s) each): colocated {sync_s / 60:.2f} min vs async at "
            f"{split.engine_gpus}+{split.trainer_gpus} GPUs {async_s / 60:.2f} min per step: async/sync speed-up "
            f"{faster:.2f}, async is {word}" + ("" if faster > 1 else "; keep rollout.pipeline.mode=sync"))
    return line, {"colocated_s": sync_s, "async_s": async_s, "speedup": faster, "engine_gpus": split.engine_gpus,
                  "variants": [sync_v, async_v], "steps": steps}


def _split_json(s: Split) -> dict[str, Any]:
    def num(x: float) -> float | None:  # JSON has no inf/nan: a split without a trainer layout has no times
        return x if math.isfinite(x) else None

    return {"engine_gpus": s.engine_gpus, "trainer_gpus": s.trainer_gpus, "fits": s.fits, "problems": s.problems,
            "engine_peak_gib": s.engine_memory.peak / GIB, "engine_kv_tokens": s.engine_memory.kv_tokens,
            "trainer_peak_gib": num(s.trainer_peak / GIB), "generation_s": s.generation_s,
            "trainer_s": num(s.trainer_s), "transfer_s": num(s.transfer_s), "step_s": num(s.step_s)}
