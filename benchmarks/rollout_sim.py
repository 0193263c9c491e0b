"""Simulated 32B DAPO steps: today's loop vs streaming over all engines vs asynchronous disaggregated layouts.

Default: the WHOLE step (generation, old log-probs, updates, weight sync) of each variant on the recipe's
GPUs (default ``examples/qwen2.5-32b-fp8.yaml`` at 128 GPUs):
(a) ``today``: synchronous, colocated, batch-and-filter rounds of 1,536 prompts (what the recipe runs);
(a') ``today_chunked``: today's ``rollout.schedule.streaming`` with several engine groups (no stream: chunks of
``--chunk-prompts`` over all engines, each waiting for its longest response, stop after the chunk that fills);
(b) ``sync_stream``: streaming + abort over all engines at once, decisions in prompt order (``--order``);
(b') ``sync_partial``: the same with partial rollouts; (b*) / (b'*) ``sync_stream_rr`` / ``sync_partial_rr``: the same as
``rollout/scheduling/engine_groups.py`` builds it (prompts round robin per chunk of ``--stream-chunk``, drained
between chunks); (c) ``async``: engines on their own GPUs, the trainer on the others, one policy version behind,
batch-and-filter; (d) ``async_stream``: async + streaming/abort; (e) ``async_partial``: async + partial rollouts.
Generation is simulated (``dapo_mcore/plan/rollout_model.py``); old log-probs, updates and the memory of each side are the
planner's (``dapo_mcore/plan/planner.py``, ``dapo_mcore/plan/disagg.py``: FLOPs at 35% MFU, KV cache per engine); the
step rules are in ``dapo_mcore/plan/step_model.py``. Async variants run on every engine/trainer split the planner accepts
and report their best. Every assumption is printed first. Last line: ``sim_step_time_ratio: X`` = today's mean step
time / the best variant's (mean over the three stages).

``--generation-only``: the generation simulator (generation wall time of the scheduling policies, completion order):
``batch_filter`` (today), ``batch_adaptive`` (rounds sized from the last step's usable fraction),
``stream_abort`` and ``stream_partial`` (aborted groups continue next step, at most ``--max-staleness`` steps), and
``stream_adaptive[_partial]``: the stream's fresh prompts bounded from the last step's usable fraction. Last line
``sim_generation_time_ratio: X`` (batch-and-filter / streaming+abort wall time, mean over stages).

The stage assumptions (mean length and all-correct / all-wrong shares) are ``STAGES_32B`` below and in
docs/results.md ("Step and generation simulator"). Decode speed: a full engine decodes the planner's implied rate (its generation
estimate at 10% decode MFU, response tokens per second per engine) and a lone sequence ``--single-seq-tokens-per-s``.

``--calibrate-tiny RUN_DIR`` replays a real tiny run instead: each step's usable fraction, outcome shares and mean
response length from its metrics.jsonl / ledger.jsonl drive the batch-and-filter model, whose generated tokens per
kept group are compared with the ledger's, per stage (thirds of the run). Last line
``tiny_tokens_per_kept_group_sim_over_real: X``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/rollout_sim.py` from anywhere

from dapo_mcore.plan import disagg as plan_disagg  # noqa: E402
from dapo_mcore.plan.planner import PlanInput  # noqa: E402
from dapo_mcore.plan.rollout_model import (  # noqa: E402
    EngineModel,
    LengthModel,
    PromptPool,
    Recipe,
    Stage,
    StepResult,
    batch_and_filter_step,
    streaming_step,
)
from dapo_mcore.plan.step_model import (  # noqa: E402
    ASYNC_VARIANTS,
    STAGES_32B,
    SYNC_VARIANTS,
    StepTime,
    price_variant,
    running_seqs,
    step_times,
    trainer_phases,
)
from dapo_mcore.plan.step_model import mean_running_context as _mean_running_context  # noqa: E402

# STAGES_32B (dapo_mcore/plan/step_model.py): the stage assumptions, stated in docs/results.md.
POLICIES = ("batch_filter", "batch_adaptive", "stream_abort", "stream_partial", "stream_adaptive",
            "stream_adaptive_partial")
# Adaptive over-sampling: a round of (missing groups / last step's usable fraction) x 1.2 prompts, at most 4 x the
# step's prompts (the cap keeps a bad estimate from flooding the engines).
ADAPTIVE_MARGIN, ADAPTIVE_CAP = 1.2, 4
FATES = ("kept", "rejected", "surplus", "aborted")


def simulate(policy: str, pool: PromptPool, recipe: Recipe, model: EngineModel, steps: int, warmup: int,
             max_staleness: int) -> list[StepResult]:
    """``warmup + steps`` consecutive steps of one policy on one prompt stream; the last ``steps`` results."""
    out, carry = [], []
    usable_estimate = recipe.prompts_per_step / recipe.gen_batch_prompts  # what the fixed recipe assumes
    for _ in range(warmup + steps):
        adaptive = (usable_estimate, ADAPTIVE_MARGIN, ADAPTIVE_CAP * recipe.prompts_per_step)
        if policy.startswith("batch"):
            res = batch_and_filter_step(pool, recipe, model, adaptive if policy == "batch_adaptive" else None)
        else:
            res, carry = streaming_step(pool, recipe, model, carry, partial=policy.endswith("partial"),
                                        max_staleness=max_staleness,
                                        admit=adaptive if "adaptive" in policy else None)
        usable_estimate = res.usable_seen / max(res.groups_done, 1)
        out.append(res)
    return out[warmup:]


def summarize(results: list[StepResult]) -> dict[str, float]:
    """Per-step means: wall seconds, tokens by fate, generated tokens per kept group, mean kept response length."""
    mean = {f: float(np.mean([getattr(r, f) for r in results])) for f in (*FATES, "wall_s", "generated", "prompts_drawn")}
    mean["carried"] = float(np.mean([r.carried_out for r in results]))
    kept_groups = sum(r.groups_kept for r in results)
    mean["tokens_per_kept_group"] = sum(r.generated for r in results) / max(kept_groups, 1)
    mean["stale_share"] = sum(r.kept_stale for r in results) / max(sum(r.kept for r in results), 1.0)
    mean["kept_resp_len"] = float(np.mean([x for r in results for x in r.kept_lengths]))
    mean["short_steps"] = sum(r.groups_kept < results[0].groups_kept or r.groups_kept == 0 for r in results)
    return mean


def recipe_from_config(path: str) -> tuple[Recipe, int, int]:
    """(recipe, max response length, vLLM tensor parallel) of a project config."""
    from dapo_mcore.config import load_config

    cfg = load_config(path)
    recipe = Recipe(cfg.train.prompts_per_step, cfg.rollout.n, cfg.rollout.gen_batch_prompts, cfg.algo.max_gen_batches)
    return recipe, cfg.rollout.max_new_tokens, cfg.rollout.vllm.tensor_parallel


def planner_decode(path: str, gpus: int, preset: str) -> tuple[float, int]:
    """(response tokens/s per engine, KV-cache tokens per engine) implied by the planner for this config."""
    from dapo_mcore.commands.plan import plan_input_from_config
    from dapo_mcore.config import load_config
    from dapo_mcore.plan.planner import estimate_flops, estimate_memory, estimate_step_seconds

    cfg = load_config(path, ["model.hf_path=null", f"model.preset={preset}"])
    p = plan_input_from_config(cfg, gpus)
    _, gen_s = estimate_step_seconds(p, estimate_flops(p))
    tokens = p.gen_batch_prompts * p.responses_per_prompt * p.mean_response_len * p.generation_batches
    return tokens / gen_s / (gpus // p.vllm_tensor_parallel), estimate_memory(p).vllm_kv_tokens


def run_32b(args: argparse.Namespace) -> list[str]:
    recipe, cap, vllm_tp = recipe_from_config(args.config)
    tokens_per_s, kv_tokens = planner_decode(args.config, args.gpus, args.preset)
    if args.engine_tokens_per_s:
        tokens_per_s = args.engine_tokens_per_s
    model = EngineModel.from_throughput(args.gpus // vllm_tp, args.max_seqs, tokens_per_s, args.single_seq_tokens_per_s)
    lengths = LengthModel(sigma_group=args.sigma_group, sigma_resp=args.sigma_resp, cap=cap)
    lines = [f"recipe: {recipe}; engines {model.engines} x max {model.max_seqs} sequences; decode "
             f"{tokens_per_s:.0f} tokens/s per full engine (planner), {args.single_seq_tokens_per_s:g} for a lone "
             f"sequence (t0={model.t0 * 1e3:.1f} ms + {model.t1 * 1e3:.4f} ms per running sequence)"]
    ratios: dict[str, list[float]] = {p: [] for p in POLICIES[1:]}
    for k, stage in enumerate(STAGES_32B):
        probe = PromptPool(stage, recipe.group_size, lengths, seed=args.seed + 1000 + k)
        ctx = _mean_running_context(probe, args.prompt_len)
        sample = probe.take(4096)[0]
        lines.append(f"\n== stage {stage.name}: mean length {stage.mean_len:g} (capped {sample.mean():.0f}, "
                     f"{(sample >= cap).mean():.1%} at the cap), "
                     f"usable {stage.usable:.2f} (all-correct {stage.all_correct:.2f}, all-wrong {stage.all_wrong:.2f}); "
                     f"KV {kv_tokens} tokens/engine fit ~{kv_tokens / ctx:.0f} sequences at mean context {ctx:.0f}")
        # vLLM runs no more sequences than its KV cache holds (it preempts beyond): the stage's running limit.
        seqs = min(model.max_seqs, int(kv_tokens / ctx)) if args.kv_limit else model.max_seqs
        stage_model = EngineModel(model.engines, seqs, model.t0, model.t1)
        lines.append(f"running sequences per engine: {seqs} ({seqs / (model.t0 + model.t1 * seqs):.0f} tokens/s per "
                     f"full engine, {1 / (model.t0 + model.t1 * seqs):.0f} per sequence)")
        lines.append(f"{'policy':<24}{'wall min':>9}{'prompts':>8}{'kept Mtok':>10}{'rejected':>9}{'surplus':>8}"
                     f"{'aborted':>8}{'carried':>8}{'gen Mtok':>9}{'tok/kept grp':>13}{'kept len':>9}{'stale':>7}")
        walls = {}
        for policy in POLICIES:
            pool = PromptPool(stage, recipe.group_size, lengths, seed=args.seed + k)
            s = summarize(simulate(policy, pool, recipe, stage_model, args.steps, args.warmup,
                                     args.max_staleness or 2))
            walls[policy] = s["wall_s"]
            lines.append(f"{policy:<24}{s['wall_s'] / 60:>9.2f}{s['prompts_drawn']:>8.0f}"
                         + "".join(f"{s[f] / 1e6:>{w}.1f}" for f, w in zip(FATES, (10, 9, 8, 8), strict=True))
                         + f"{s['carried'] / 1e6:>8.1f}{s['generated'] / 1e6:>9.1f}{s['tokens_per_kept_group']:>13.0f}"
                         f"{s['kept_resp_len']:>9.0f}{s['stale_share']:>7.1%}" + (f"  ({s['short_steps']} steps short)" if s["short_steps"] else ""))
        for policy in POLICIES[1:]:
            ratios[policy].append(walls["batch_filter"] / walls[policy])
        lines.append("wall time ratio batch_filter / " + ", ".join(f"{p} {r[-1]:.2f}" for p, r in ratios.items()))
    lines.append("")
    lines += [f"sim_generation_time_ratio_{p}: {np.mean(ratios[p]):.2f}" for p in POLICIES[1:]]
    lines.append(f"sim_generation_time_ratio: {np.mean(ratios['stream_abort']):.2f}")
    return lines


VARIANT_TEXT = {
    "today": "(a) today: colocated batch-and-filter",
    "today_chunked": "(a') today + schedule.streaming (chunks)",
    "sync_stream": "(b) sync + streaming/abort, all engines",
    "sync_partial": "(b') sync + partial rollouts, all engines",
    "sync_stream_rr": "(b*) (b) as built: round robin per chunk",
    "sync_partial_rr": "(b'*) (b') as built: round robin per chunk",
    "async": "(c) async disaggregated, batch-and-filter",
    "async_stream": "(d) async + streaming/abort",
    "async_partial": "(e) async + partial rollouts",
    "sync_stream_done": "(f) sync + streaming, completion order",
    "sync_partial_done": "(f') sync + partial, completion order",
    "async_stream_done": "(g) async + streaming, completion order",
    "async_partial_done": "(g') async + partial, completion order",
}
"""Row labels: every variant of ``step_model`` (the completion-order ones are a config's own with ``--variants
config``)."""


_trainer_phases = trainer_phases  # tests/test_rollout_sim.py checks it against hand-computed FLOPs
_step_times = step_times


def run_step(args: argparse.Namespace) -> list[str]:
    """The whole step (generation, old log-probs, updates, weight sync) of every variant, per stage, priced by the
    model ``dapo-mcore plan`` uses (``dapo_mcore/plan/step_model.py``)."""
    from dapo_mcore.commands.plan import plan_input_from_config
    from dapo_mcore.config import load_config
    from dapo_mcore.plan.step_model import colocated_input, pricing, variants_of

    cfg = load_config(args.config, ["model.hf_path=null", f"model.preset={args.preset}"])
    p = colocated_input(cfg, plan_input_from_config(cfg, args.gpus))
    rates = plan_disagg.TransferRates(args.weight_export_gbs, args.weight_network_gbs)
    splits = [s for s in plan_disagg.scan_splits(p, args.engine_memory_utilization, rates) if s.fits]
    if args.engine_gpus:
        splits = [s for s in splits if s.engine_gpus in args.engine_gpus]
    if not splits:
        raise SystemExit("rollout_sim: no disaggregated split fits (see dapo-mcore plan ... --disaggregated)")
    pr = pricing(cfg, p, rates, args)
    kv_engine = splits[0].engine_memory.kv_tokens
    lines = _assumption_lines(args, pr.recipe, pr.base, 1.0 / (pr.base.t0 / pr.base.max_seqs + pr.base.t1),
                              pr.kv_colocated, kv_engine, pr.sync_s, splits, p)
    sync_v, async_v = variants_of(cfg)
    sync_vs, async_vs = (("today", sync_v), (async_v,)) if args.variants == "config" else (SYNC_VARIANTS, ASYNC_VARIANTS)
    layouts = [(v, None) for v in dict.fromkeys(sync_vs)]  # today first: every row's speed-up is over it
    layouts += [(v, s) for s in splits for v in async_vs]
    times: dict[tuple[str, int], list[StepTime]] = {}
    for k, stage in enumerate(STAGES_32B):
        lines.append(f"\n== stage {stage.name}: mean length {stage.mean_len:g}, usable {stage.usable:.2f} "
                     f"(all-correct {stage.all_correct:.2f}, all-wrong {stage.all_wrong:.2f})")
        seqs = {kv: running_seqs(stage, pr.recipe, pr.lengths, kv, args, k) for kv in (pr.kv_colocated, kv_engine)}
        lines.append(f"running sequences per engine (KV limit): colocated {seqs[pr.kv_colocated]}, "
                     f"disaggregated {seqs[kv_engine]}")
        lines.append(_STEP_HEADER)
        for variant, split in layouts:
            st, results = price_variant(variant, split, p, pr, stage, k, args)
            times.setdefault((variant, 0 if split is None else split.engine_gpus), []).append(st)
            stale = sum(r.kept_stale for r in results) / max(sum(r.kept for r in results), 1.0)
            kept_len = float(np.mean([x for r in results for x in r.kept_lengths]))
            lines.append(_step_row(variant, split, p, st, times[("today", 0)][k].step, stale, kept_len))
    mean = {key: float(np.mean([t.step for t in ts])) for key, ts in times.items()}
    own = [(s.engine_gpus, mean[(async_v, s.engine_gpus)]) for s in splits]
    lines.append("")
    lines += [f"this config's schedule: {sync_v} (colocated) {mean[(sync_v, 0)] / 60:.2f} min vs {async_v} at "
              f"{e}+{p.tensor_parallel * p.pipeline_parallel * p.data_parallel - e} GPUs {m / 60:.2f} min per step: "
              f"async/sync speed-up {mean[(sync_v, 0)] / m:.2f}" for e, m in own]
    if args.variants == "config":
        return [*lines, f"sim_async_over_sync_speedup: {mean[(sync_v, 0)] / own[0][1]:.2f}"]
    return lines + _summary_lines(times, splits, p)


_STEP_HEADER = (f"{'variant':<44}{'E+T GPUs':>9}{'gen':>7}{'logp':>6}{'train':>6}{'sync s':>7}{'T wait':>7}"
                f"{'E wait':>7}{'step':>7}{'today/':>7}{'kept len':>9}{'stale':>7}   (minutes unless marked)")


def _split_text(split: plan_disagg.Split | None, p: PlanInput) -> str:
    world = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    return f"{world} shared" if split is None else f"{split.engine_gpus}+{split.trainer_gpus}"


def _step_row(variant: str, split: plan_disagg.Split | None, p: PlanInput, st: StepTime, today: float,
              stale: float, kept_len: float) -> str:
    ph = st.phases
    return (f"{VARIANT_TEXT[variant]:<44}{_split_text(split, p):>9}{ph.generation / 60:>7.2f}{ph.old_logprobs / 60:>6.2f}"
            f"{ph.train / 60:>6.2f}{ph.weight_sync:>7.1f}{st.trainer_wait / 60:>7.2f}{st.engine_wait / 60:>7.2f}"
            f"{st.step / 60:>7.2f}{today / st.step:>7.2f}{kept_len:>9.0f}{stale:>7.1%}")


def _assumption_lines(args: argparse.Namespace, recipe: Recipe, base: EngineModel, tokens_per_s: float,
                      kv_colocated: int, kv_engine: int, sync_s: float, splits: list, p: PlanInput) -> list[str]:
    return [
        f"recipe: {recipe}; {base.engines} engines x max {base.max_seqs} sequences when colocated",
        f"decode: {tokens_per_s:.0f} response tokens/s per full engine (the planner's generation estimate at "
        f"{p.decode_mfu:.0%} decode MFU), {args.single_seq_tokens_per_s:g} for a lone sequence; training: the planner's "
        f"FLOPs at {p.train_mfu:.0%} MFU of {p.peak_tflops:g} TFLOP/s per GPU, at each step's mean kept length",
        f"KV cache per engine: colocated {kv_colocated} tokens (gpu_memory_utilization "
        f"{p.vllm_gpu_memory_utilization:g}), disaggregated {kv_engine} tokens ({args.engine_memory_utilization:g}, no "
        f"trainer state)",
        f"weight sync: colocated {sync_s:.1f} s (export at {args.weight_export_gbs:g} GB/s per rank); disaggregated "
        f"{splits[0].transfer_s:.1f} s (+ broadcast at {args.weight_network_gbs:g} GB/s per engine GPU), fully exposed",
        f"decisions: streaming in {args.order} order; partial rollouts carry a group at most "
        f"{args.max_staleness or 1} step(s); today_chunked = chunks of {args.chunk_prompts} prompts; async: one policy "
        f"version behind, splits scanned: " + ", ".join(f"{s.engine_gpus}+{s.trainer_gpus}" for s in splits),
        "not modelled: prefill, preemption, scoring, engine sleep/wake, stragglers; a model, not a measurement",
    ]


def _summary_lines(times: dict[tuple[str, int], list[StepTime]], splits: list, p: PlanInput) -> list[str]:
    """Mean step time per variant over the stages (async: its best split), the winner and the headline."""
    mean = {key: float(np.mean([t.step for t in ts])) for key, ts in times.items()}
    best_split = {v: min((e for (w, e) in mean if w == v), key=lambda e: mean[(v, e)]) for v in ASYNC_VARIANTS}
    rows = [(v, 0) for v in SYNC_VARIANTS] + [(v, best_split[v]) for v in ASYNC_VARIANTS]
    today = mean[("today", 0)]
    by_split = {s.engine_gpus: s for s in splits}
    lines = ["", "== step time per variant (minutes; async at its best split), mean over the stages",
             f"{'variant':<44}{'E+T GPUs':>9}{'early':>8}{'mid':>8}{'late':>8}{'mean':>8}{'today/':>8}"]
    for v, e in rows:
        lines.append(f"{VARIANT_TEXT[v]:<44}{_split_text(by_split.get(e), p):>9}"
                     + "".join(f"{t.step / 60:>8.2f}" for t in times[(v, e)])
                     + f"{mean[(v, e)] / 60:>8.2f}{today / mean[(v, e)]:>8.2f}")
    for v in ASYNC_VARIANTS:
        lines.append(f"{v} by split: " + ", ".join(f"{e}+{by_split[e].trainer_gpus} {mean[(v, e)] / 60:.2f}"
                                                  for (w, e) in sorted(mean) if w == v))
    winner = min(rows, key=lambda r: mean[r])
    ts = times[winner]
    gen = np.mean([t.phases.generation for t in ts]) / 60
    work = np.mean([t.phases.old_logprobs + t.phases.train for t in ts]) / 60
    lines.append(f"best: {VARIANT_TEXT[winner[0]]} on {_split_text(by_split.get(winner[1]), p)} GPUs: "
                 f"{mean[winner] / 60:.2f} min per step vs today's {today / 60:.2f} (generation {gen:.2f} min, "
                 f"old log-probs + updates {work:.2f} min per step)")
    lines.append(f"sim_step_time_ratio: {today / mean[winner]:.2f}")
    return lines


def _read_jsonl(path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def tiny_steps(run_dir: Path) -> list[tuple[int, Stage, float, int]]:
    """Per real step: (step, Stage from its metrics, real generated tokens, real kept groups)."""
    metrics, ledger = _read_jsonl(run_dir / "metrics.jsonl"), _read_jsonl(run_dir / "ledger.jsonl")
    out = []
    for step in sorted(set(metrics) & set(ledger)):
        m, c = metrics[step], ledger[step]
        groups = m["sampling/groups_generated"]
        mean_len = c["cost/step/tokens_generated"] / c["cost/step/rollouts_generated"]
        ac, aw = m["sampling/groups_all_correct"] / groups, m["sampling/groups_all_wrong"] / groups
        stage = Stage(f"step{step}", mean_len, ac, min(aw, 1.0 - ac - 1e-3))
        out.append((step, stage, float(c["cost/step/tokens_generated"]), int(c["cost/step/prompts_kept"])))
    return out


def _tiny_predict(stage: Stage, recipe: Recipe, cap: int, seed: int, steps: int) -> tuple[float, float]:
    """Mean (generated tokens per kept group, generation batches) of batch-and-filter over ``steps`` steps."""
    model = EngineModel(engines=1, max_seqs=recipe.gen_batch_prompts * recipe.group_size, t0=1.0, t1=0.0)
    lengths = LengthModel(sigma_group=0.0, sigma_resp=0.1, cap=cap, shift_all_correct=0.0, shift_all_wrong=0.0)
    res = simulate("batch_filter", PromptPool(stage, recipe.group_size, lengths, seed, chunk=256), recipe, model,
                   steps, 0, 0)
    return sum(r.generated for r in res) / sum(r.groups_kept for r in res), float(np.mean([r.gen_batches for r in res]))


def run_tiny(args: argparse.Namespace) -> list[str]:
    recipe, cap, _ = recipe_from_config(args.tiny_config)
    steps = tiny_steps(Path(args.calibrate_tiny))
    if not steps:
        raise SystemExit(f"rollout_sim: no steps in {args.calibrate_tiny}/metrics.jsonl and ledger.jsonl")
    lines = [f"tiny recipe: {recipe}, max {cap} new tokens; {len(steps)} real steps from {args.calibrate_tiny}",
             f"{'stage':<12}{'steps':>8}{'usable':>8}{'real tok/kept':>14}{'sim per-step':>13}{'sim stage-mean':>15}"]
    thirds = np.array_split(np.arange(len(steps)), 3)
    real_all = sim_all = 0.0
    for name, idx in zip(("early", "mid", "late"), thirds, strict=True):
        part = [steps[i] for i in idx]
        real_tok, kept = sum(p[2] for p in part), sum(p[3] for p in part)
        # Each real step replayed with its own usable fraction and length (args.tiny_reps draws each) ...
        per_step = sum(_tiny_predict(st, recipe, cap, args.seed + s, args.tiny_reps)[0] * k for s, st, _, k in part)
        # ... and the stage as the 32B model sees it: one mean outcome split and length for the whole stage.
        mean = Stage(name, float(np.mean([p[1].mean_len for p in part])), float(np.mean([p[1].all_correct for p in part])),
                     float(np.mean([p[1].all_wrong for p in part])))
        stage_pred = _tiny_predict(mean, recipe, cap, args.seed, len(part) * args.tiny_reps)[0]
        real_all, sim_all = real_all + real_tok, sim_all + per_step
        lines.append(f"{name:<12}{f'{part[0][0]}-{part[-1][0]}':>8}{mean.usable:>8.2f}{real_tok / kept:>14.1f}"
                     f"{per_step / kept:>13.1f}{stage_pred:>15.1f}")
    lines.append(f"whole run: real {real_all:.0f} generated tokens, per-step replay {sim_all:.0f}")
    lines.append(f"tiny_tokens_per_kept_group_sim_over_real: {sim_all / real_all:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "examples/qwen2.5-32b-fp8.yaml"), help="the recipe to simulate")
    ap.add_argument("--preset", default="qwen2.5-32b", help="model preset for the planner's decode rate")
    ap.add_argument("--gpus", type=int, default=128, help="GPUs of the job (engines = gpus / vLLM TP)")
    ap.add_argument("--max-seqs", type=int, default=128, help="running sequences per engine (vLLM max_num_seqs / KV)")
    ap.add_argument("--no-kv-limit", dest="kv_limit", action="store_false",
                    help="run max-seqs sequences whatever the KV cache holds (default: fewer when it is full)")
    ap.add_argument("--engine-tokens-per-s", type=float, default=0.0, help="full-engine decode rate; 0 = the planner's")
    ap.add_argument("--single-seq-tokens-per-s", type=float, default=80.0, help="decode rate of a lone sequence")
    ap.add_argument("--prompt-len", type=int, default=256, help="mean prompt tokens (KV context only)")
    ap.add_argument("--sigma-group", type=float, default=0.5, help="lognormal sigma of the per-group length factor")
    ap.add_argument("--sigma-resp", type=float, default=0.6, help="lognormal sigma of a response within its group")
    ap.add_argument("--steps", type=int, default=3, help="steps measured per stage and policy")
    ap.add_argument("--warmup", type=int, default=1, help="steps run first (partial rollouts need a carry)")
    ap.add_argument("--max-staleness", type=int, default=None,
                    help="steps an aborted group may be carried (default: 1, the trainer's bound; 2 with "
                         "--generation-only)")
    ap.add_argument("--generation-only", action="store_true",
                    help="the generation simulator: generation time of the scheduling policies only (completion order)")
    ap.add_argument("--order", choices=("prompt", "completion"), default="prompt",
                    help="streaming decides groups in prompt order (the trainer's scheduler) or as they finish")
    ap.add_argument("--chunk-prompts", type=int, default=256,
                    help="today_chunked: prompts per chunk (rollout.schedule.stream_chunk_prompts; 256 = 8 groups "
                         "of 16 per engine at 32 engines, one full engine's 128 sequences)")
    ap.add_argument("--stream-chunk", type=int, default=0,
                    help="(b*): prompts per streamed chunk of rollout/scheduling/engine_groups.py (round robin over "
                         "the engines, drained before the next; default 0 = a whole generation round, its best case)")
    ap.add_argument("--engine-gpus", type=int, nargs="*", default=None,
                    help="async: simulate only these engine-GPU counts (default: every split that fits)")
    ap.add_argument("--engine-memory-utilization", type=float, default=0.9,
                    help="async: vLLM memory fraction on an engine GPU (no trainer state beside it)")
    ap.add_argument("--weight-export-gbs", type=float, default=plan_disagg.TransferRates.export_gbs,
                    help="trainer-side weight export rate per rank, GB/s")
    ap.add_argument("--weight-network-gbs", type=float, default=plan_disagg.TransferRates.network_gbs,
                    help="async: trainer -> engine broadcast rate per engine GPU, GB/s")
    ap.add_argument("--variants", choices=("all", "config"), default="all",
                    help="all variants, or only the config's own schedule colocated and async (what `dapo-mcore plan` "
                         "prices for it; last line sim_async_over_sync_speedup at the first split)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibrate-tiny", metavar="RUN_DIR", help="replay a real tiny run's metrics instead")
    ap.add_argument("--tiny-config", default="examples/tiny_cpu.yaml", help="the tiny run's config")
    ap.add_argument("--tiny-reps", type=int, default=10, help="simulated draws per real tiny step")
    ap.add_argument("--smoke", action="store_true",
                    help="one measured step per stage, no warm-up (the same simulator; run in CI with --generation-only)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = 1, 0
    if args.calibrate_tiny:
        lines = run_tiny(args)
    else:
        lines = run_32b(args) if args.generation_only else run_step(args)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
