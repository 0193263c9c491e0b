"""Rollout cost: DAPO's batch-and-filter loop vs each rollout.schedule switch and their combination, same seeds.

Each variant is one real tiny training run (``dapo-mcore train``, the embedded default unless ``--config``), one
after the other on this machine, with the same seed and data; only ``rollout.schedule.*`` differs. For each:
generated tokens split kept / rejected / surplus / aborted (the cost ledger; partial rollouts: plus the tokens of the
groups left unfinished when the run ended, and the kept tokens an older policy sampled), rollouts, prompts skipped
by the prompt history, stage-skipped groups, wall seconds of the steps, and held-out avg@k at the end and at equal
generated tokens (the last evaluation whose cumulative generated tokens are within the best combination's total).

    OMP_NUM_THREADS=1 python benchmarks/rollout_cost.py [--steps N] [--config examples/tiny_cpu_chain.yaml]

``--smoke`` (CI, seconds): today's loop and stream+partial, one step each.

Last line: ``generated_tokens_per_kept_group_ratio: X`` = generated tokens per kept group of today's loop over
that of the best variant whose final held-out avg@k is no more than 0.01 below today's (the issue's bar: >= 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
S = "rollout.schedule."
VARIANTS: dict[str, list[str]] = {
    "today": [],
    "streaming": [f"{S}streaming=true"],
    "adaptive": [f"{S}adaptive=true"],
    "staged4": [f"{S}stage_responses=4", f"{S}stage_audit_fraction=0.05"],
    "history": [f"{S}history=true"],
    "stream+history": [f"{S}streaming=true", f"{S}history=true"],
    "stream+history+staged4": [f"{S}streaming=true", f"{S}history=true", f"{S}stage_responses=4"],
    "all": [f"{S}streaming=true", f"{S}adaptive=true", f"{S}history=true", f"{S}stage_responses=4"],
    "stream+partial": [f"{S}streaming=true", f"{S}partial=true", "algo.tis_cap=2.0"],
    "stream+adaptive+history+partial": [f"{S}streaming=true", f"{S}adaptive=true", f"{S}history=true",
                                        f"{S}partial=true", "algo.tis_cap=2.0"],
}
ACC_SLACK = 0.01
BASE_OVERRIDES = ["algo.max_gen_batches=0"]
"""Every variant, today's included, runs without a round limit: staged groups need more rounds late in training and
must not fail on the limit set for today's loop, which never reaches it on the tiny task (9 rounds at most)."""


def run_variant(name: str, overrides: list[str], args: argparse.Namespace) -> dict:
    run_dir = Path(args.out).resolve() / name
    if args.reuse:
        metrics = run_dir / "metrics.jsonl"
        if not metrics.is_file():
            print(f"variant {name}: no finished run in {run_dir}", flush=True)
            return {}
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        return summarize(name, rows, float("nan"))
    steps = [] if args.steps is None else [f"train.steps={args.steps}"]
    cmd = [sys.executable, "-m", "dapo_mcore.cli", "train", str(Path(args.config).resolve()), f"run.dir={run_dir}", "run.overwrite=true",
           *steps, *BASE_OVERRIDES, *args.override, *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"variant {name} failed (exit {proc.returncode}): {last}", flush=True)
        return {}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return summarize(name, rows, wall)


def summarize(name: str, rows: list[dict], wall: float) -> dict:
    last = max((r for r in rows if "cost/total/tokens_generated" in r), key=lambda r: r["step"])
    tot = {k.removeprefix("cost/total/"): v for k, v in last.items() if k.startswith("cost/total/")}
    tokens_at: dict[int, float] = {0: 0.0}
    for r in rows:
        if "cost/total/tokens_generated" in r:
            tokens_at[r["step"]] = r["cost/total/tokens_generated"]
    evals = sorted((r["step"], r["eval/avg_at_k"]) for r in rows if "eval/avg_at_k" in r)
    sums = {k: sum(r.get(f"sampling/{k}", 0) for r in rows) for k in (
        "groups_stage_skipped", "groups_stage_audited", "groups_stage_audit_usable", "gen_batches",
        "tokens_stale_kept", "groups_resumed")}
    # Partial rollouts count a group's tokens when it ends; those still buffered when the run stopped were spent too.
    unfinished = last.get("sampling/tokens_partial_buffered", 0)
    return {"name": name, "tokens": tot["tokens_generated"] + unfinished, "kept_tokens": tot["tokens_generated_kept"],
            "rejected_tokens": tot["tokens_generated_rejected"] + unfinished, "surplus_tokens": tot.get("tokens_generated_surplus", 0),
            "aborted_tokens": tot.get("tokens_generated_aborted", 0), "rollouts": tot["rollouts_generated"],
            "kept_groups": tot["prompts_kept"], "skipped_prompts": tot.get("prompts_skipped", 0),
            "step_seconds": tot.get("seconds_step", 0.0), "wall": wall, "final_acc": evals[-1][1],
            "evals": [(s, tokens_at.get(s, 0.0), a) for s, a in evals], **sums}


def acc_at_tokens(result: dict, budget: float) -> tuple[int, float]:
    """The last evaluation taken with at most ``budget`` generated tokens: (step, avg@k)."""
    within = [(s, a) for s, t, a in result["evals"] if t <= budget]
    return within[-1]


def table(results: list[dict], budget: float) -> str:
    head = ("| variant | generated tokens | kept | rejected | surplus | aborted | rollouts | tokens / kept group | "
            "prompts skipped | stage-skipped (audited: usable) | resumed groups (stale kept tokens) | rounds | "
            "step s | wall s | avg@k end | "
            f"avg@k at <= {budget:,.0f} tokens (step) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        step, acc = acc_at_tokens(r, budget)
        stage = (f"{r['groups_stage_skipped']:.0f} ({r['groups_stage_audited']:.0f}: "
                 f"{r['groups_stage_audit_usable']:.0f})")
        lines.append(f"| {r['name']} | {r['tokens']:,.0f} | {r['kept_tokens']:,.0f} | {r['rejected_tokens']:,.0f} | "
                     f"{r['surplus_tokens']:,.0f} | {r['aborted_tokens']:,.0f} | {r['rollouts']:,.0f} | "
                     f"{r['tokens'] / r['kept_groups']:.1f} | {r['skipped_prompts']:,.0f} | {stage} | "
                     f"{r['groups_resumed']:.0f} ({r['tokens_stale_kept']:,.0f}) | "
                     f"{r['gen_batches']:.0f} | {r['step_seconds']:.1f} | {r['wall']:.0f} | {r['final_acc']:.3f} | "
                     f"{acc:.3f} ({step}) |")
    return "\n".join(lines)


SMOKE = ["checkpoint.every=0"]
"""``--smoke``: one step of today's loop and of the partial-rollout schedule (evaluated at the start, which the
equal-tokens column needs, and at the end)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny_cpu.yaml"),
                        help="the DAPO config to run (default examples/tiny_cpu.yaml; paths are relative to here)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per variant (default: the config's; fewer: a smoke run)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "rollout_cost"), help="run directories go under this")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--override", nargs="*", default=[], help="extra dotted overrides for every variant")
    parser.add_argument("--reuse", action="store_true",
                        help="do not train: tabulate the runs already under --out (wall seconds unknown)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds-long CI run: today and stream+partial, one step each, into a temporary --out")
    args = parser.parse_args(argv)
    if args.smoke:
        args.variants, args.steps, args.override = ["today", "stream+partial"], 1, [*args.override, *SMOKE]
        args.out = tempfile.mkdtemp(prefix="dapo_rollout_cost_smoke_")
    names = ["today"] + [v for v in args.variants if v != "today"]
    results, failed = [], []
    for name in names:
        r = run_variant(name, VARIANTS[name], args)
        if not r:
            failed.append(name)
            continue
        results.append(r)
        print(f"{name}: {r['tokens']:,.0f} tokens, {r['tokens'] / r['kept_groups']:.1f} per kept group, "
              f"final avg@k {r['final_acc']:.3f}, {r['wall']:.0f} s", flush=True)
    if not results or results[0]["name"] != "today":
        print("today's loop did not run; nothing to compare against", file=sys.stderr)
        return 1
    today = results[0]
    per_kept = {r["name"]: r["tokens"] / r["kept_groups"] for r in results}
    eligible = [r for r in results[1:] if r["final_acc"] >= today["final_acc"] - ACC_SLACK]
    best = min(eligible, key=lambda r: per_kept[r["name"]]) if eligible else today
    print(f"\nconfig {args.config}, {args.steps or 'its'} steps; best at no loss of final accuracy: {best['name']}")
    print(table(results, best["tokens"]))
    print(f"generated_tokens_per_kept_group_ratio: {per_kept['today'] / per_kept[best['name']]:.3f}")
    if failed:  # a study with a failed run is a failed study, whatever the others gave
        print(f"rollout_cost: variants failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
