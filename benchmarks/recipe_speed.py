"""The shipped 32B recipe's step time against the paper-exact synchronous batch-and-filter configuration.

Both are priced by ONE step model, the planner's (``dapo_mcore/plan/step_model.py``: generation from the rollout model of
``dapo_mcore/plan/rollout_model.py`` with per-stage length tails, old log-probs and updates from the planner's FLOPs, weight
sync from ``dapo_mcore/plan/disagg.py``), the model ``dapo-mcore plan`` and ``benchmarks/rollout_sim.py`` print:

* **shipped**: the recipe as it is on disk (``--config``, default ``examples/qwen2.5-32b-fp8.yaml``): its
  ``rollout.schedule`` decides the variant (batch-and-filter, streaming, partial rollouts) and its
  ``rollout.pipeline`` the layout (colocated, or async at ``rollout.pipeline.engine_ranks`` engine GPUs);
* **paper-exact sync**: the same recipe with every ``rollout.schedule`` switch off and ``rollout.pipeline.mode=sync``
  (DAPO's published loop: colocated, rounds of ``rollout.gen_batch_prompts`` prompts, filtered, repeated until full).

It also prints every variant the step model knows for this recipe, ranked (the async ones at the recipe's own split,
else at the planner's proposed split): what the recipe could ship, not what it ships. Mean over the three training
stages of ``STAGES_32B``. Last line: ``shipped_over_paper_sync: X`` (paper-exact step time / shipped step time).
``--smoke``: one simulated step per stage and no ranking (seconds; run in CI).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/recipe_speed.py` from anywhere

from dapo_mcore.plan import disagg as plan_disagg  # noqa: E402
from dapo_mcore.plan.step_model import (  # noqa: E402
    STAGES_32B,
    SimSettings,
    colocated_input,
    format_ranking,
    price_variant,
    pricing,
    rank_variants,
    variants_of,
)

PAPER_SYNC = ["rollout.pipeline.mode=sync", "rollout.schedule.preset=paper", "rollout.schedule.streaming=false",
              "rollout.schedule.order=prompt", "rollout.schedule.partial=false", "rollout.schedule.adaptive=false",
              "rollout.schedule.stage_responses=0", "rollout.schedule.history=false"]
"""Overrides that turn any recipe into DAPO's published synchronous batch-and-filter loop (the preset, and every
switch spelled out, so a recipe that sets a switch beside its preset is covered too)."""


def load(path: str, preset: str, extra: list[str]):
    from dapo_mcore.config import load_config

    return load_config(path, ["model.hf_path=null", f"model.preset={preset}", *extra])


def mean_step(variant: str, split, p, pr, st: SimSettings) -> float:
    """Mean step seconds of one variant over the three stages (``split`` None: colocated)."""
    return float(np.mean([price_variant(variant, split, p, pr, stage, k, st)[0].step
                          for k, stage in enumerate(STAGES_32B)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parent.parent
    ap.add_argument("--config", default=str(root / "examples/qwen2.5-32b-fp8.yaml"), help="the shipped recipe")
    ap.add_argument("--preset", default="qwen2.5-32b", help="model preset for the planner")
    ap.add_argument("--gpus", type=int, default=128, help="GPUs of the job")
    ap.add_argument("overrides", nargs="*", help="dotted overrides of the shipped recipe (key=value)")
    ap.add_argument("--steps", type=int, default=3, help="simulated steps per stage and variant")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-ranking", action="store_true", help="price only the shipped and paper-exact configurations")
    ap.add_argument("--engine-memory-utilization", type=float, default=0.9, help="async: vLLM memory on engine GPUs")
    ap.add_argument("--smoke", action="store_true",
                    help="one simulated step per stage, no ranking (the same step model; seconds, run in CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.no_ranking = 1, True

    from dapo_mcore.commands.plan import plan_input_from_config

    st = SimSettings(steps=args.steps, seed=args.seed)
    rates = plan_disagg.TransferRates()
    shipped = load(args.config, args.preset, args.overrides)
    paper = load(args.config, args.preset, [*args.overrides, *PAPER_SYNC])
    p = colocated_input(shipped, plan_input_from_config(shipped, args.gpus))
    pr = pricing(shipped, p, rates, st)
    sync_v, async_v = variants_of(shipped)
    split = plan_disagg.own_split(shipped, p, rates, args.engine_memory_utilization)
    shipped_v, shipped_split = (async_v, split) if shipped.rollout.pipeline.mode == "async" else (sync_v, None)
    assert variants_of(paper)[0] == "today"
    paper_s = mean_step("today", None, p, pr, st)
    shipped_s = paper_s if (shipped_v, shipped_split) == ("today", None) else mean_step(shipped_v, shipped_split, p, pr, st)
    where = "colocated" if shipped_split is None else f"async at {shipped_split.engine_gpus}+{shipped_split.trainer_gpus} GPUs"
    lines = [f"recipe: {args.config} on {args.gpus} GPUs (preset {args.preset}); step model: dapo_mcore/plan/step_model.py, "
             f"{args.steps} simulated step(s) per stage, stages " + ", ".join(s.name for s in STAGES_32B),
             f"paper-exact sync batch-and-filter (colocated): {paper_s / 60:.2f} min per step",
             f"shipped: {shipped_v} {where}: {shipped_s / 60:.2f} min per step"]
    if not args.no_ranking:
        lines.append("")
        lines += format_ranking(rank_variants(shipped, p, rates, st, split),
                                (shipped_v, getattr(shipped_split, "engine_gpus", None)))
        lines.append("(a model, not a measurement: no prefill, preemption, scoring or stragglers; async variants are "
                     "one policy version behind, partial ones carry groups one step; *_done: "
                     "rollout.schedule.order=completion)")
    lines.append(f"shipped_over_paper_sync: {paper_s / shipped_s:.2f}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
