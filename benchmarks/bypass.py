"""Bypass mode (algo.rollout_correction bypass) vs the decoupled mode: trainer seconds per step, same tiny run.

Both runs are ``examples/tiny_cpu.yaml`` (no evaluation) trained through the project's entry point, alternated
``--repeats`` times in this one process: decoupled ``preset=token_tis`` (the old-log-prob forward, then the
updates) and ``preset=bypass_ppo_clip`` (no old-log-prob forward: pi_old := the engine's log-probs). The trainer's
seconds per step are ``time/old_logprobs + time/train`` from each run's metrics, the first step left out (warm-up).

    OMP_NUM_THREADS=1 python benchmarks/bypass.py --steps 8 --repeats 2

``--all-presets``: instead, one short run per algo.rollout_correction preset (they complete; their metrics).

Last line: ``bypass_trainer_time_ratio: X`` (bypass / decoupled trainer seconds per step; < 1 is faster).
``--smoke`` (CI, seconds): each mode once, 2 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
MODES = {"decoupled": "algo.rollout_correction.preset=token_tis",
         "bypass": "algo.rollout_correction.preset=bypass_ppo_clip"}


def trainer_seconds(run_dir: Path) -> tuple[list[float], list[float]]:
    """Per step after the first: (old-log-prob seconds, train seconds)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time/train" in r][1:]
    return [float(r.get("time/old_logprobs", 0.0)) for r in rows], [float(r["time/train"]) for r in rows]


def train(run_dir: Path, steps: int, override: str) -> None:
    cmd = [sys.executable, "-m", "dapo_mcore.cli", "train", str(CONFIG), f"run.dir={run_dir}", "run.overwrite=true",
           f"train.steps={steps}", "eval.every=0", "eval.at_start=false", "checkpoint.every=0", override]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{override} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def run(mode: str, steps: int, out: Path) -> tuple[list[float], list[float]]:
    train(out / mode, steps, MODES[mode])
    return trainer_seconds(out / mode)


def all_presets(steps: int, out: Path) -> None:
    """One run per preset: steps done, updates, old-log-prob phase, and the step means of the correction metrics."""
    sys.path.insert(0, str(ROOT))
    from dapo_mcore.algo.rollout_correction import PRESETS

    print("| preset | steps | updates (skipped) | old_logprobs phase | rejected tokens | IS weight mean | KL k3 |")
    print("|---|---|---|---|---|---|---|")
    for name in PRESETS:
        train(out / name, steps, f"algo.rollout_correction.preset={name}")
        rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rows = [r for r in rows if "time/train" in r]

        def mean(key: str, rows: list[dict] = rows) -> float:
            return statistics.fmean(float(r.get(key, float("nan"))) for r in rows)

        phase = "skipped" if not any("time/old_logprobs" in r for r in rows) else "ran"
        print(f"| {name} | {len(rows)} | {sum(r['train/updates'] for r in rows):.0f} "
              f"({sum(r['train/skipped_updates'] for r in rows):.0f}) | {phase} | "
              f"{mean('rollout_corr/rejected_token_frac'):.3f} | {mean('rollout_corr/is_weight_mean'):.4f} | "
              f"{mean('rollout_corr/kl_k3'):.2e} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="run directories (default: a temporary folder)")
    parser.add_argument("--all-presets", action="store_true", help="one run per preset instead (see above)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds-long CI run: each mode once, 2 steps (the first is the warm-up left out)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.repeats, args.all_presets = 2, 1, False
    out = args.out or Path(tempfile.mkdtemp(prefix="dapo_bypass_bench_"))
    if args.all_presets:
        all_presets(args.steps, out)
        return
    seconds: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:  # alternated, so a change of machine load hits both
            lp, tr = run(mode, args.steps, out)
            seconds[mode] += list(zip(lp, tr, strict=True))
    print(f"load: {os.getloadavg()[0]:.2f} (1-min avg); {args.repeats} x {args.steps} steps per mode, first step of "
          "each run left out")
    print(f"{'mode':<10} {'old_logprobs s':>15} {'train s':>9} {'trainer s/step':>15}")
    per_step = {}
    for mode, pairs in seconds.items():
        lp, tr = statistics.fmean(p[0] for p in pairs), statistics.fmean(p[1] for p in pairs)
        per_step[mode] = lp + tr
        print(f"{mode:<10} {lp:>15.4f} {tr:>9.4f} {lp + tr:>15.4f}")
    print(f"bypass_trainer_time_ratio: {per_step['bypass'] / per_step['decoupled']:.3f}")


if __name__ == "__main__":
    main()
