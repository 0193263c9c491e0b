"""DAPO's Table 1 at tiny scale: naive GRPO, then one technique added per row, on the ``sumchain`` task.

Rows (cumulative, as in the paper's table): naive GRPO -> + overlong filtering -> + clip-higher -> + soft overlong
punishment -> + token-level loss -> + dynamic sampling (= DAPO). Each row is ``examples/tiny_cpu_chain.yaml`` with
config overrides, trained through the project's own entry point (``python -m dapo_mcore.cli train``, one run
directory per row and seed); the numbers come from each run's ``metrics.jsonl`` and cost ledger. Note: the last
row keeps overlong filtering on (the table is cumulative); the example config itself does not filter.

Per row (mean ± half the min-max spread over seeds): held-out avg@k at the last step, policy entropy at the end
(mean of the last 3 steps), mean response length and truncated fraction over training, clip fractions (all, low,
high), usable-group fraction, generated tokens and wall seconds of the run. Runs go ``--jobs`` at a time, one
thread each. The base model is built once before the runs (a cache hit afterwards).

    OMP_NUM_THREADS=1 python benchmarks/ablation.py --seeds 3 --steps 30 --out runs/ablation --figures docs/figures

Last line: ``dapo_minus_grpo_avg_at_k: X`` (DAPO row minus naive GRPO row, seed means). ``--smoke`` (CI, seconds):
the first and the last row, one seed, one step each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dapo_mcore.telemetry import keys  # noqa: E402

CONFIG = ROOT / "examples" / "tiny_cpu_chain.yaml"

ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("grpo", ("algo.clip_high=0.2", "algo.loss_agg=seq-mean-token-mean", "algo.dynamic_sampling=false",
              "algo.overlong_shaping=false", "algo.overlong_filter=false", "rollout.gen_batch_prompts=16")),
    ("+overlong_filter", ("algo.overlong_filter=true",)),
    ("+clip_higher", ("algo.clip_high=0.28",)),
    ("+soft_overlong", ("algo.overlong_shaping=true",)),
    ("+token_loss", ("algo.loss_agg=token-mean",)),
    ("+dynamic_sampling", ("algo.dynamic_sampling=true", "rollout.gen_batch_prompts=24")),
)
"""(row name, overrides it adds to the previous row); the first row is naive GRPO on the chain config."""

COLUMNS: tuple[tuple[str, str], ...] = (
    ("avg_at_k", "avg@k"), ("entropy_end", "entropy"), ("resp_len", "resp len"), ("truncated", "trunc"),
    ("clipfrac", "clip"), ("clipfrac_low", "clip lo"), ("clipfrac_high", "clip hi"), ("usable", "usable"),
    ("gen_tokens", "gen tokens"), ("wall_s", "wall s"),
)


def row_overrides(index: int) -> list[str]:
    """The overrides of row ``index``: every row's additions up to it (later ones win on a repeated key)."""
    merged: dict[str, str] = {}
    for _, adds in ROWS[: index + 1]:
        for item in adds:
            key, _, value = item.partition("=")
            merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]


def _mean(records: list[dict[str, Any]], key: str, last: int | None = None) -> float:
    values = [float(r[key]) for r in records if r.get(key) is not None and r[keys.STEP] > 0]
    if last is not None:
        values = values[-last:]
    return statistics.fmean(values) if values else float("nan")


def summarize_run(records: list[dict[str, Any]], wall_s: float) -> dict[str, float]:
    """One run's row values from its merged per-step records (``load_run``)."""
    evals = [r for r in records if keys.EVAL_AVG_AT_K in r]
    totals = [r for r in records if keys.cost_key("tokens_generated", cumulative=True) in r]
    return {
        "avg_at_k": float(evals[-1][keys.EVAL_AVG_AT_K]) if evals else float("nan"),
        "avg_at_k_base": float(evals[0][keys.EVAL_AVG_AT_K]) if evals else float("nan"),
        "entropy_end": _mean(records, keys.TRAIN_ENTROPY, last=3),
        "resp_len": _mean(records, keys.ROLLOUT_RESP_LEN_MEAN),
        "truncated": _mean(records, keys.ROLLOUT_TRUNCATED_FRAC),
        "clipfrac": _mean(records, keys.TRAIN_CLIPFRAC),
        "clipfrac_low": _mean(records, keys.TRAIN_CLIPFRAC_LOW),
        "clipfrac_high": _mean(records, keys.TRAIN_CLIPFRAC_HIGH),
        "usable": _mean(records, keys.ROLLOUT_USABLE_GROUP_FRAC),
        "gen_tokens": float(totals[-1][keys.cost_key("tokens_generated", cumulative=True)]) if totals else float("nan"),
        "wall_s": wall_s,
    }


def aggregate(runs: list[dict[str, float]]) -> dict[str, tuple[float, float]]:
    """Per column: (mean over seeds, half the min-max spread)."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = (statistics.fmean(values), (max(values) - min(values)) / 2)
    return out


def _fmt(value: float, spread: float, key: str) -> str:
    if key in ("gen_tokens", "wall_s", "resp_len"):
        return f"{value:.0f}±{spread:.0f}" if key != "resp_len" else f"{value:.1f}±{spread:.1f}"
    return f"{value:.3f}±{spread:.3f}"


def format_table(table: dict[str, dict[str, tuple[float, float]]], k: int) -> str:
    """Markdown table, one row per ablation row."""
    head = ["row"] + [label.replace("@k", f"@{k}") for _, label in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, agg in table.items():
        lines.append("| " + " | ".join([name] + [_fmt(*agg[key], key) for key, _ in COLUMNS]) + " |")
    return "\n".join(lines)


def run_one(row: int, seed: int, args: argparse.Namespace, env: dict[str, str]) -> tuple[int, int, Path, float]:
    """Train one (row, seed) through the CLI; returns its run directory and wall seconds."""
    run_dir = args.out / ROWS[row][0].lstrip("+") / f"seed{seed}"
    cmd = [sys.executable, "-m", "dapo_mcore.cli", "train", str(args.config), f"run.dir={run_dir}",
           f"train.steps={args.steps}", f"train.seed={seed}", f"eval.every={args.eval_every}", "checkpoint.every=0",
           *row_overrides(row), *args.extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"row {ROWS[row][0]} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"  done {ROWS[row][0]:<18} seed {seed}  {wall:6.1f}s", flush=True)
    return row, seed, run_dir, wall


def build_base(args: argparse.Namespace) -> None:
    """Pre-train (or find cached) the config's tiny base once, so parallel runs do not all pre-train it."""
    from dapo_mcore.config import load_config
    from dapo_mcore.data.base_model import ensure_base_model
    from dapo_mcore.run.runtime import _cache_root

    cfg = load_config(args.config, [])
    ensure_base_model(_cache_root() / "tiny_base", cfg.tiny_base)


def write_mean_run(run_dirs: list[Path], out_dir: Path) -> Path:
    """A run directory whose ``metrics.jsonl`` holds, per step, the seed mean of every numeric key (for the report)."""
    from dapo_mcore.telemetry.diagnose import load_run

    runs = [load_run(d) for d in run_dirs]
    by_step: dict[int, dict[str, list[float]]] = {}
    for records in runs:
        for rec in records:
            slot = by_step.setdefault(rec[keys.STEP], {})
            for key, value in rec.items():
                if key != keys.STEP and isinstance(value, (int, float)) and not isinstance(value, bool):
                    slot.setdefault(key, []).append(float(value))
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "metrics.jsonl").open("w") as f:
        for step in sorted(by_step):
            row = {key: statistics.fmean(v) for key, v in by_step[step].items() if len(v) == len(runs)}
            f.write(json.dumps({keys.STEP: step, **row}) + "\n")
    return out_dir


def cost_accuracy_figure(table: dict[str, dict[str, tuple[float, float]]], k: int, path: Path) -> Path:
    """Held-out avg@k against generated tokens, one point per row with seed spread as error bars."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.subplots()
    for i, (name, agg) in enumerate(table.items()):
        (x, dx), (y, dy) = agg["gen_tokens"], agg["avg_at_k"]
        ax.errorbar([x], [y], xerr=[dx], yerr=[dy], fmt="o", color=f"C{i}", capsize=3, label=name)
    base = statistics.fmean(agg["avg_at_k_base"][0] for agg in table.values())
    ax.axhline(base, color="gray", linestyle="--", linewidth=1, label="base model")
    ax.set(title="Cost vs accuracy (seed mean, bars: half min-max spread)", xlabel="generated tokens per run",
           ylabel=f"held-out avg@{k} at the end")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path


def write_figures(done: dict[int, list[Path]], table: dict[str, dict[str, tuple[float, float]]], k: int,
                  args: argparse.Namespace) -> list[Path]:
    """The report's compare grid over the rows' seed means (against step) and the cost-vs-accuracy plot."""
    from dapo_mcore.telemetry.report import compare_figure

    means = [write_mean_run(done[i], args.out / "seed_mean" / ROWS[i][0].lstrip("+")) for i in sorted(done)]
    grid = compare_figure(means, args.figures / "ablation_compare.png", x="step")
    _to_palette(grid)
    return [grid, cost_accuracy_figure(table, k, args.figures / "ablation_cost_accuracy.png")]


def _to_palette(path: Path, colors: int = 32) -> None:
    """Re-save a PNG with a small palette (line plots lose nothing visible; the file shrinks ~4x, for docs/)."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per row (train.seed = 1..N; default 3)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--eval-every", type=int, default=15, help="held-out evaluation period in steps (default 15)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation", help="parent of the run directories")
    parser.add_argument("--config", type=Path, default=CONFIG, help="base config (default examples/tiny_cpu_chain.yaml)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each (default 2)")
    parser.add_argument("--rows", type=str, default="", help="comma-separated row indices (default: all)")
    parser.add_argument("--figures", type=Path, default=None, help="write the figures into this directory")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override applied to every row after its own (repeatable), e.g. optim.lr=2e-4")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds-long CI run: naive GRPO and DAPO (rows 0 and 5), one seed, 1 step each, side by "
                             "side, into a new temporary --out")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.seeds, args.steps, args.eval_every = f"0,{len(ROWS) - 1}", 1, 1, 1
        args.out, args.extra = Path(tempfile.mkdtemp(prefix="dapo_ablation_smoke_")), [*args.extra, "eval.at_start=false"]
    if args.seeds < 1 or args.steps < 1 or args.jobs < 1:
        parser.error("--seeds, --steps and --jobs must be >= 1")
    bad = [item for item in args.extra if "=" not in item]
    if bad:
        parser.error(f"--set {bad[0]}: use KEY=VALUE, e.g. --set optim.lr=2e-4")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty; give a new directory (run directories are never reused)")
    rows = [int(i) for i in args.rows.split(",")] if args.rows else list(range(len(ROWS)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    build_base(args)
    print(f"base model ready after {time.perf_counter() - start:.1f}s; {len(rows)} rows x {args.seeds} seeds, "
          f"{args.steps} steps, {args.jobs} at a time", flush=True)
    jobs = [(r, s) for s in range(1, args.seeds + 1) for r in rows]
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda job: run_one(*job, args, env), jobs))
    except RuntimeError as err:  # a run failed (e.g. a bad --set value): its stderr tail, no traceback
        print(f"ablation: {err}", file=sys.stderr)
        return 2
    from dapo_mcore.telemetry.diagnose import load_run

    done: dict[int, list[Path]] = {}
    per_row: dict[int, list[dict[str, float]]] = {}
    k = 0
    for row, _, run_dir, wall in sorted(results):
        records = load_run(run_dir)
        k = int(next((r[keys.EVAL_K] for r in records if keys.EVAL_K in r), 0))
        done.setdefault(row, []).append(run_dir)
        per_row.setdefault(row, []).append(summarize_run(records, wall))
    table = {ROWS[r][0]: aggregate(per_row[r]) for r in sorted(per_row)}
    (args.out / "summary.json").write_text(json.dumps({"table": table, "runs": per_row}, indent=1) + "\n")
    print(format_table(table, k))
    if args.figures is not None:
        for path in write_figures(done, table, k, args):
            print(f"figure: {path}")
    print(f"ablation wall seconds: {time.perf_counter() - start:.0f}")
    if 0 in per_row and len(ROWS) - 1 in per_row:
        gap = table[ROWS[-1][0]]["avg_at_k"][0] - table[ROWS[0][0]]["avg_at_k"][0]
        print(f"dapo_minus_grpo_avg_at_k: {gap:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
