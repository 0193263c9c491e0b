"""The whole DAPO step, one model for ``dapo-mcore plan`` and ``benchmarks/rollout_sim.py``: phases composed into a step time.

Pure arithmetic on seconds, so each rule can be checked by hand:

* **Synchronous, colocated** (today's loop, and sync + streaming over all engines): every GPU generates, then
  computes the old log-probs, then trains, then the weights go into the engines: the step is the sum of the phases.
* **Asynchronous, disaggregated, one policy version behind**: while the trainer GPUs compute batch k's old
  log-probs and updates, the engine GPUs generate batch k+1 with the weights they hold; then the weights move
  trainer -> engines, and both sides take part in that copy (counted as fully exposed). Period k is
  ``max(generation of batch k+1, trainer on batch k) + transfer``; the side that finishes first waits.

The generation seconds come from the rollout model (``rollout_model.py``: continuous batching with each response's
length drawn per training stage, so a batch waits for its longest response), the old log-prob and update seconds
from the planner's FLOPs: :func:`price_variant` prices one variant on one stage, :func:`compare_with_tails` a
config's own schedule colocated vs async at a split. ``benchmarks/rollout_sim.py`` prints every variant with them;
``dapo-mcore plan`` prints the config's pair, so the two never disagree.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dapo_mcore.plan.rollout_model import (
    EngineModel,
    LengthModel,
    PromptPool,
    Recipe,
    Stage,
    StepResult,
    batch_and_filter_step,
    draw_batch_and_filter,
    streaming_step,
)


@dataclass(frozen=True)
class Phases:
    """Seconds of one step's phases (on whichever GPUs run them)."""

    generation: float
    old_logprobs: float
    train: float
    weight_sync: float

    @property
    def trainer(self) -> float:
        """The trainer's work on one batch."""
        return self.old_logprobs + self.train


@dataclass(frozen=True)
class StepTime:
    """One step's wall time and who waited for whom during it."""

    phases: Phases
    step: float
    trainer_wait: float
    """Seconds the trainer GPUs waited for rollouts (asynchronous only)."""
    engine_wait: float
    """Seconds the engine GPUs waited for new weights (asynchronous only)."""


def sync_step(phases: Phases) -> StepTime:
    """Colocated synchronous step: the phases one after the other on the same GPUs."""
    step = phases.generation + phases.old_logprobs + phases.train + phases.weight_sync
    return StepTime(phases, step, 0.0, 0.0)


def async_step(generation_next: float, trainer: Phases, transfer: float) -> StepTime:
    """One asynchronous period: batch k+1 generated (``generation_next`` s) while the trainer works on batch k
    (one-step-off, ``rollout.pipeline.max_staleness`` 1; a larger bound lets the engines run further ahead and
    absorb a slow batch, which this steady-state period does not model: its mean step time is the same)."""
    work = trainer.trainer
    phases = Phases(generation_next, trainer.old_logprobs, trainer.train, transfer)
    return StepTime(phases, max(generation_next, work) + transfer, max(0.0, generation_next - work),
                    max(0.0, work - generation_next))


def async_steps(generation: list[float], trainer: list[Phases], transfer: float) -> list[StepTime]:
    """Periods of a run of steps of one stage: batch k's training beside batch k+1's generation (cyclically, so
    every simulated batch is used once on each side)."""
    if len(generation) != len(trainer) or not generation:
        raise ValueError("need one generation time and one trainer time per simulated step")
    n = len(generation)
    return [async_step(generation[(k + 1) % n], trainer[k], transfer) for k in range(n)]


def mean_step(steps: list[StepTime]) -> StepTime:
    """The mean of each field over ``steps``."""
    n = len(steps)

    def avg(get) -> float:
        return sum(get(s) for s in steps) / n

    phases = Phases(avg(lambda s: s.phases.generation), avg(lambda s: s.phases.old_logprobs),
                    avg(lambda s: s.phases.train), avg(lambda s: s.phases.weight_sync))
    return StepTime(phases, avg(lambda s: s.step), avg(lambda s: s.trainer_wait), avg(lambda s: s.engine_wait))


# --- one step priced with generation tails: the rollout model (``rollout_model.py``) drives the phases above -------

STAGES_32B = (
    Stage("early", mean_len=1200.0, all_correct=0.10, all_wrong=0.30),
    Stage("mid", mean_len=3000.0, all_correct=0.35, all_wrong=0.20),
    Stage("late", mean_len=5000.0, all_correct=0.55, all_wrong=0.15),
)
"""Three stages of a DAPO run (assumptions, docs/results.md, "Step and generation simulator"): the paper's mean
response length grows from ~1k to ~5k tokens, the share of all-correct prompts grows, a hard core stays all-wrong."""

SYNC_VARIANTS = ("today", "today_chunked", "sync_stream", "sync_partial", "sync_stream_rr", "sync_partial_rr")
ASYNC_VARIANTS = ("async", "async_stream", "async_partial")
COMPLETION_VARIANTS = ("sync_stream_done", "sync_partial_done", "async_stream_done", "async_partial_done")
"""``rollout.schedule.order: completion``: the whole round streams over every engine, groups decided as they end."""


@dataclass(frozen=True)
class SimSettings:
    """The simulation's knobs (``benchmarks/rollout_sim.py``'s flags of the same names, and their defaults)."""

    max_seqs: int = 128
    kv_limit: bool = True
    engine_tokens_per_s: float = 0.0
    single_seq_tokens_per_s: float = 80.0
    prompt_len: int = 256
    sigma_group: float = 0.5
    sigma_resp: float = 0.6
    steps: int = 3
    warmup: int = 1
    max_staleness: int | None = None
    order: str = "prompt"
    chunk_prompts: int = 256
    stream_chunk: int = 0
    seed: int = 0


def variants_of(cfg: Any) -> tuple[str, str]:
    """(the colocated variant, the async variant) that run ``cfg``'s rollout schedule: batch-and-filter, streaming
    with abort, or partial rollouts."""
    s = cfg.rollout.schedule
    if s.streaming and s.order == "completion":
        kind = "partial" if s.partial else "stream"
        return f"sync_{kind}_done", f"async_{kind}_done"
    if s.partial:
        return "sync_partial_rr", "async_partial"
    if s.streaming:
        return "sync_stream_rr", "async_stream"
    return "today", "async"


def mean_running_context(pool: PromptPool, prompt_len: int) -> float:
    """Mean KV context of a running sequence: E[L^2] / (2 E[L]) for lengths L (uniform progress) plus the prompt."""
    lengths = pool.take(2048)[0].astype(float)
    return float((lengths**2).mean() / (2 * lengths.mean())) + prompt_len


def running_seqs(stage: Stage, recipe: Recipe, lengths: LengthModel, kv_tokens: int, st: Any, k: int) -> int:
    """Running sequences per engine in a stage: max_seqs, or fewer when the KV cache cannot hold them."""
    ctx = mean_running_context(PromptPool(stage, recipe.group_size, lengths, seed=st.seed + 1000 + k), st.prompt_len)
    return min(st.max_seqs, int(kv_tokens / ctx)) if st.kv_limit else st.max_seqs


BATCH_VARIANTS = ("today", "today_chunked", "async")
"""The batch-and-filter variants (the rest stream)."""


def one_step(variant: str, pool: PromptPool, recipe: Recipe, model: EngineModel, carry: list, st: Any,
             partial: bool) -> tuple[StepResult, list]:
    """One step of a variant's generation policy: (its result, the groups it carries into the next step)."""
    if variant in ("today", "async"):
        return batch_and_filter_step(pool, recipe, model), []
    if variant == "today_chunked":
        return batch_and_filter_step(pool, recipe, model, chunk=st.chunk_prompts), []
    if variant.endswith("_done"):
        return streaming_step(pool, recipe, model, carry, partial=partial, max_staleness=st.max_staleness or 1,
                              order="completion", chunk=0)
    chunk = (st.stream_chunk or recipe.gen_batch_prompts) if variant.endswith("_rr") else 0
    return streaming_step(pool, recipe, model, carry, partial=partial, max_staleness=st.max_staleness or 1,
                          order=st.order, chunk=chunk)


def generation(variant: str, pool: PromptPool, recipe: Recipe, model: EngineModel, st: Any,
               warm: dict | None = None) -> list[StepResult]:
    """``warmup + steps`` steps of a variant's generation policy on one prompt stream; the last ``steps``.

    A warm-up step's result is thrown away, so it is not simulated where it need not be: a batch-and-filter one
    only draws its prompts (:func:`draw_batch_and_filter`); the first one of a streaming variant is the same step as
    its partial twin's (``sync_stream`` and ``sync_partial`` differ only in what they carry out of it), so with
    ``warm`` (a dict the caller keeps across the variants it prices on one prompt stream with the same settings)
    it is simulated once, partial, and the twin without partial rollouts carries nothing. The steps that count are
    simulated as they are: the results are those of simulating every step."""
    out: list[StepResult] = []
    carry: list = []
    for i in range(st.warmup + st.steps):
        if i < st.warmup and variant in BATCH_VARIANTS:
            draw_batch_and_filter(pool, recipe, st.chunk_prompts if variant == "today_chunked" else 0)
            continue
        if i == 0 < st.warmup and warm is not None:
            key = (variant.replace("partial", "stream").replace("async_", "sync_"), model)
            if key not in warm:
                warm[key] = (one_step(variant, pool, recipe, model, [], st, partial=True)[1], copy.deepcopy(pool))
            carried, after = warm[key]
            pool, carry = copy.deepcopy(after), (carried if "partial" in variant else [])
            continue
        res, carry = one_step(variant, pool, recipe, model, carry, st, partial="partial" in variant)
        if i >= st.warmup:
            out.append(res)
    return out


def trainer_phases(trainer: Any, results: list[StepResult], prompt_len: int) -> list[tuple[float, float]]:
    """(old log-prob, update) seconds of each step's kept batch: the planner's FLOPs at its mean kept length."""
    from dapo_mcore.plan.planner import estimate_flops, estimate_step_seconds

    out = []
    for r in results:
        t = replace(trainer, mean_prompt_len=prompt_len, mean_response_len=max(1, round(float(np.mean(r.kept_lengths)))))
        flops = estimate_flops(t)
        logprobs, _ = estimate_step_seconds(t, replace(flops, train=0.0))
        out.append((logprobs, estimate_step_seconds(t, flops)[0] - logprobs))
    return out


def step_times(variant: str, results: list[StepResult], trainer: Any, sync_s: float, prompt_len: int) -> StepTime:
    """Mean step time of a variant over its simulated steps (the rules at the top of this module)."""
    phases = [Phases(r.wall_s, lp, tr, sync_s)
              for r, (lp, tr) in zip(results, trainer_phases(trainer, results, prompt_len), strict=True)]
    if not variant.startswith("async"):
        return mean_step([sync_step(ph) for ph in phases])
    return mean_step(async_steps([ph.generation for ph in phases], phases, sync_s))


@dataclass(frozen=True)
class Pricing:
    """What a stage's variant runs on: its engines' decode model and its trainer (``plan_disagg.Split`` or None)."""

    recipe: Recipe
    base: EngineModel
    lengths: LengthModel
    kv_colocated: int
    sync_s: float
    vllm_tp: int
    warm: dict = field(default_factory=dict, compare=False, repr=False)
    """First warm-up steps simulated so far, shared by the variants priced with this pricing (see :func:`generation`)."""


def price_variant(variant: str, split: Any, p: Any, pr: Pricing, stage: Stage, k: int, st: Any) -> tuple[StepTime,
                                                                                                          list[StepResult]]:
    """One variant on one stage (``split`` None: colocated on all of ``p``'s GPUs)."""
    kv = pr.kv_colocated if split is None else split.engine_memory.kv_tokens
    engines = pr.base.engines if split is None else split.engine_gpus // pr.vllm_tp
    model = EngineModel(engines, running_seqs(stage, pr.recipe, pr.lengths, kv, st, k), pr.base.t0, pr.base.t1)
    warm = pr.warm.setdefault((k, stage, st.seed, st.order, st.max_staleness, st.stream_chunk, st.chunk_prompts), {})
    results = generation(variant, PromptPool(stage, pr.recipe.group_size, pr.lengths, seed=st.seed + k), pr.recipe,
                         model, st, warm)
    trainer = p if split is None else split.trainer
    return step_times(variant, results, trainer, pr.sync_s if split is None else split.transfer_s, st.prompt_len), results


def pricing(cfg: Any, p: Any, rates: Any, st: Any) -> Pricing:
    """The decode model the planner implies for ``cfg`` on ``p``'s GPUs (a full engine's rate from the planner's
    generation estimate; a lone sequence at ``single_seq_tokens_per_s``)."""
    from dapo_mcore.plan.planner import estimate_flops, estimate_memory, estimate_step_seconds
    from dapo_mcore.plan.transfer import weight_sync_seconds

    world = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    _, gen_s = estimate_step_seconds(p, estimate_flops(p))
    tokens = p.gen_batch_prompts * p.responses_per_prompt * p.mean_response_len * p.generation_batches
    engines = world // p.vllm_tensor_parallel
    tokens_per_s = st.engine_tokens_per_s or tokens / gen_s / engines
    recipe = Recipe(cfg.train.prompts_per_step, cfg.rollout.n, cfg.rollout.gen_batch_prompts, cfg.algo.max_gen_batches)
    return Pricing(recipe, EngineModel.from_throughput(engines, st.max_seqs, tokens_per_s, st.single_seq_tokens_per_s),
                   LengthModel(sigma_group=st.sigma_group, sigma_resp=st.sigma_resp, cap=cfg.rollout.max_new_tokens),
                   estimate_memory(p).vllm_kv_tokens, weight_sync_seconds(p, rates, disaggregated=False),
                   p.vllm_tensor_parallel)


def compare_with_tails(cfg: Any, p: Any, split: Any, rates: Any, st: Any = SimSettings(),
                       stages: tuple[Stage, ...] = STAGES_32B) -> tuple[float, float]:
    """(colocated, async at ``split``) mean step seconds over ``stages`` for ``cfg``'s rollout schedule, tails
    included: the numbers ``benchmarks/rollout_sim.py`` prints for the same variants and split."""
    sync_v, async_v = variants_of(cfg)
    pr = pricing(cfg, p, rates, st)
    sync = [price_variant(sync_v, None, p, pr, stage, k, st)[0].step for k, stage in enumerate(stages)]
    asyn = [price_variant(async_v, split, p, pr, stage, k, st)[0].step for k, stage in enumerate(stages)]
    return float(np.mean(sync)), float(np.mean(asyn))


def colocated_input(cfg: Any, p: Any) -> Any:
    """The colocated run of ``cfg`` (the sync recipe): an async config's engines take ``gpu_memory_utilization`` of
    GPUs of their own; colocated beside the trainer they get the sync default (``VLLMConfig``'s)."""
    if cfg.rollout.pipeline.mode != "async":
        return p
    from dapo_mcore.config import VLLMConfig

    return replace(p, vllm_gpu_memory_utilization=VLLMConfig().gpu_memory_utilization)


def requeue_line(steps: int, step_seconds: float, time_limit_h: float, lead_min: float,
                 basis: str = "estimate, one generation batch") -> str:
    """How many jobs of ``time_limit_h`` (the last ``lead_min`` minutes spent checkpointing) ``steps`` need at the
    estimated step time, and the DAPO_MAX_REQUEUES that lets the run finish (slurm/env.sh defaults to 20)."""
    usable_s = max(time_limit_h * 3600 - lead_min * 60, step_seconds)
    per_job = max(1, int(usable_s // step_seconds))
    jobs = math.ceil(steps / per_job)
    need = jobs - 1
    note = "" if need <= 20 else f": more than DAPO_MAX_REQUEUES=20 (the run would stop near step {21 * per_job})"
    return (f"time: {steps} steps x ~{step_seconds / 60:.0f} min ({basis}) = "
            f"{steps * step_seconds / 3600:.0f} h = {jobs} jobs of {time_limit_h:g} h ({per_job} steps each), "
            f"{need} requeues{note}; submit with DAPO_MAX_REQUEUES={math.ceil(need * 1.5)} (1.5x for dynamic "
            f"sampling's extra batches and failures)")


def variant_seconds(variant: str, split: Any, p: Any, pr: Pricing, st: Any,
                    stages: tuple[Stage, ...] = STAGES_32B) -> float:
    """A variant's mean step seconds over ``stages`` (``split`` None: colocated): every step time ``plan`` prints,
    the plain report's and each ``--rank-variants`` row, is this function."""
    return float(np.mean([price_variant(variant, split, p, pr, stage, k, st)[0].step for k, stage in enumerate(stages)]))


def own_step_seconds(cfg: Any, p: Any, rates: Any, st: Any = SimSettings(steps=1), split: Any = None,
                     stages: tuple[Stage, ...] = STAGES_32B) -> tuple[str, float]:
    """(variant, mean step seconds) of ``cfg``'s own schedule: colocated on ``p``'s GPUs, or async at ``split`` for
    an async config; the number ``plan`` prints and sizes the requeues with, and ``--rank-variants``' "this config"
    row (the same function and settings)."""
    sync_v, async_v = variants_of(cfg)
    variant, at = (async_v, split) if cfg.rollout.pipeline.mode == "async" else (sync_v, None)
    return variant, variant_seconds(variant, at, p, pricing(cfg, p, rates, st), st, stages)


def rank_variants(cfg: Any, p: Any, rates: Any, st: Any = SimSettings(), split: Any = None,
                  stages: tuple[Stage, ...] = STAGES_32B) -> list[tuple[str, Any, float]]:
    """Every variant the model knows for ``cfg``'s recipe, fastest first: ``(variant, split or None, mean step
    seconds over ``stages``)``; colocated ones on ``p``'s GPUs, async ones at ``split`` (left out when it is None or
    does not fit)."""
    pr = pricing(cfg, p, rates, st)

    def mean(variant: str, at: Any) -> float:
        return variant_seconds(variant, at, p, pr, st, stages)

    rows = [(v, None, mean(v, None)) for v in (*SYNC_VARIANTS, *COMPLETION_VARIANTS) if not v.startswith("async")]
    if split is not None and split.fits:
        rows += [(v, split, mean(v, split)) for v in (*ASYNC_VARIANTS, *COMPLETION_VARIANTS) if v.startswith("async")]
    return sorted(rows, key=lambda r: r[2])


VARIANT_SWITCHES = {
    "today": "(paper-exact: rollout.schedule.preset=paper, every switch off, rollout.pipeline.mode=sync)",
    "today_chunked": "rollout.schedule.streaming=true, one engine group per chunk (no stream)",
    "sync_stream": "streaming over all engines, prompt order (model only)",
    "sync_partial": "partial rollouts over all engines, prompt order (model only)",
    "sync_stream_rr": "rollout.schedule.streaming=true",
    "sync_partial_rr": "rollout.schedule.streaming=true partial=true",
    "sync_stream_done": "rollout.schedule.streaming=true order=completion",
    "sync_partial_done": "rollout.schedule.preset=partial_completion (streaming=true partial=true order=completion)",
    "async": "rollout.pipeline.mode=async",
    "async_stream": "rollout.pipeline.mode=async + streaming",
    "async_partial": "rollout.pipeline.mode=async + streaming + partial (max_staleness=2)",
    "async_stream_done": "rollout.pipeline.mode=async + streaming order=completion",
    "async_partial_done": "rollout.pipeline.mode=async + streaming + partial order=completion (max_staleness=2)",
}
"""What a user sets to run each variant (the schedule keys under ``rollout.schedule``)."""


def format_ranking(rows: list[tuple[str, Any, float]], own: tuple[str, int | None]) -> list[str]:
    """The ranked table: step minutes and speed-up over the paper-exact sync loop (``today``); ``own`` = (variant,
    engine GPUs or None) marks the config's own schedule."""
    paper = next(t for v, s, t in rows if v == "today" and s is None)
    lines = [f"{'rank':<5}{'variant':<20}{'layout':<14}{'min/step':>9}{'vs paper':>9}  how"]
    for i, (v, s, t) in enumerate(rows, 1):
        layout = "colocated" if s is None else f"async {s.engine_gpus}+{s.trainer_gpus}"
        mark = "  <- this config" if (v, getattr(s, "engine_gpus", None)) == own else ""
        lines.append(f"{i:<5}{v:<20}{layout:<14}{t / 60:>9.2f}{paper / t:>9.2f}  {VARIANT_SWITCHES[v]}{mark}")
    return lines
