"""Simulated generation wall time of one 32B DAPO step: batch-and-filter vs streaming+abort (+ partial rollouts).

Policies: ``batch_filter`` (today), ``batch_adaptive`` (rounds sized from the last step's usable fraction),
``stream_abort`` and ``stream_partial`` (aborted groups continue next step, at most ``--max-staleness`` steps), and
``stream_adaptive[_partial]``: the stream's fresh prompts bounded from the last step's usable fraction.

The step comes from a project config (default ``examples/qwen2.5-32b-fp8.yaml``: 512 prompts x 16 responses kept,
generation batches of 1,536 prompts, at most 10, responses up to 20,480 tokens, vLLM TP=4 on 128 GPUs = 32 engines).
The model of lengths, outcomes and decode is in ``benchmarks/rollout_sim_core.py``; the stage assumptions (mean
length and all-correct / all-wrong shares) are ``STAGES_32B`` below and in docs/results.md ("#16 simulator").
Decode speed: a full engine decodes the planner's implied rate (its generation estimate at 10% decode MFU, response
tokens per second per engine) and a lone sequence ``--single-seq-tokens-per-s``.

``--calibrate-tiny RUN_DIR`` replays a real tiny run instead: each step's usable fraction, outcome shares and mean
response length from its metrics.jsonl / ledger.jsonl drive the batch-and-filter model, whose generated tokens per
kept group are compared with the ledger's, per stage (thirds of the run). Last line:
``sim_generation_time_ratio: X`` (batch-and-filter / streaming+abort wall time, mean over stages), or
``tiny_tokens_per_kept_group_sim_over_real: X`` with ``--calibrate-tiny``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/rollout_sim.py` from anywhere

from benchmarks.rollout_sim_core import (  # noqa: E402
    EngineModel,
    LengthModel,
    PromptPool,
    Recipe,
    Stage,
    StepResult,
    batch_and_filter_step,
    streaming_step,
)

# Mean lengths: the DAPO paper's mean response length grows from ~1k to ~5k tokens over training. Outcome shares:
# its accuracy curve rises and the share of all-correct prompts grows (why dynamic sampling must draw more), while
# a hard core of DAPO-Math-17k stays all-wrong. These are assumptions, stated in docs/results.md.
STAGES_32B = (
    Stage("early", mean_len=1200.0, all_correct=0.10, all_wrong=0.30),
    Stage("mid", mean_len=3000.0, all_correct=0.35, all_wrong=0.20),
    Stage("late", mean_len=5000.0, all_correct=0.55, all_wrong=0.15),
)
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
    from dapo_mcore.config import load_config
    from dapo_mcore.plan_cli import plan_input_from_config
    from dapo_mcore.planner import estimate_flops, estimate_memory, estimate_step_seconds

    cfg = load_config(path, ["model.hf_path=null", f"model.preset={preset}"])
    p = plan_input_from_config(cfg, gpus)
    _, gen_s = estimate_step_seconds(p, estimate_flops(p))
    tokens = p.gen_batch_prompts * p.responses_per_prompt * p.mean_response_len * p.generation_batches
    return tokens / gen_s / (gpus // p.vllm_tensor_parallel), estimate_memory(p).vllm_kv_tokens


def _mean_running_context(pool: PromptPool, prompt_len: int) -> float:
    """Mean KV context of a running sequence: E[L^2] / (2 E[L]) for lengths L (uniform progress) plus the prompt."""
    lengths = pool.take(2048)[0].astype(float)
    return float((lengths**2).mean() / (2 * lengths.mean())) + prompt_len


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
            s = summarize(simulate(policy, pool, recipe, stage_model, args.steps, args.warmup, args.max_staleness))
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
    ap.add_argument("--max-staleness", type=int, default=2, help="steps an aborted group may be carried")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibrate-tiny", metavar="RUN_DIR", help="replay a real tiny run's metrics instead")
    ap.add_argument("--tiny-config", default="examples/tiny_cpu.yaml", help="the tiny run's config")
    ap.add_argument("--tiny-reps", type=int, default=10, help="simulated draws per real tiny step")
    args = ap.parse_args(argv)
    lines = run_tiny(args) if args.calibrate_tiny else run_32b(args)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
