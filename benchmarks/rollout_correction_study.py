"""Which rollout correction (algo.rollout_correction) in async mode: held-out avg@4 at a fixed step count.

Each run is ``examples/tiny_cpu_chain.yaml`` in async mode (1 trainer + 1 engine process, gloo), with streaming and
partial rollouts (``max_staleness=2``: prefixes sampled two policy versions back), trained through the project's
entry point for ``--steps`` steps and evaluated once at the end (avg@4 on the held-out set). Per preset and seed:
held-out avg@4, and the means over the run of the ``rollout_corr/*`` metrics (off-policy KL k3, ESS, rejected token
fraction), the lag of the trained tokens and the trainer's seconds per step (old_logprobs + train). Runs go one at a
time (2 processes each: the machine has 2 cores).

    OMP_NUM_THREADS=1 python benchmarks/rollout_correction_study.py --steps 40 --seeds 1 2

Last line: ``best_preset_avg_at_4: X (NAME)`` (seed mean). ``--smoke`` (CI, seconds): token_tis, one seed, 2 steps.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python benchmarks/rollout_correction_study.py` from anywhere

from benchmarks.async_pipeline import torchrun  # noqa: E402  (a free port, not torchrun's default)

CONFIG = ROOT / "examples" / "tiny_cpu_chain.yaml"
PRESETS = ("token_tis", "seq_mis", "icepop", "geo_rs", "bypass_ppo_clip")
ASYNC = ("rollout.pipeline.mode=async", "rollout.pipeline.engine_ranks=1", "rollout.pipeline.max_staleness=2",
         "rollout.schedule.streaming=true", "rollout.schedule.stream_chunk_prompts=8", "rollout.schedule.partial=true",
         "eval.at_start=false", "checkpoint.every=0")


def run(preset: str, seed: int, steps: int, out: Path) -> dict[str, float]:
    run_dir = out / f"{preset}-s{seed}"
    cmd = [*torchrun(2), "-m", "dapo_mcore.cli", "train", str(CONFIG), f"run.dir={run_dir}", "run.overwrite=true",
           f"train.steps={steps}", f"eval.every={steps}", f"train.seed={seed}",
           f"algo.rollout_correction.preset={preset}", *ASYNC]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        said = [ln for ln in lines if ln.startswith("dapo-mcore")] or lines[-3:] or ["(no output)"]  # a rank's line
        print(f"{preset} seed {seed} failed (exit {proc.returncode}): {said[0]}", flush=True)
        return {"failed": float(proc.returncode), "wall_s": time.perf_counter() - t0}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trained = [r for r in rows if "time/train" in r]

    def mean(key: str) -> float:
        values = [float(r[key]) for r in trained if key in r]
        return statistics.fmean(values) if values else float("nan")

    evals = [r["eval/avg_at_k"] for r in rows if "eval/avg_at_k" in r]
    return {"avg_at_4": float(evals[-1]) if evals else float("nan"), "kl_k3": mean("rollout_corr/kl_k3"),
            "ess": mean("rollout_corr/ess"), "rejected": mean("rollout_corr/rejected_token_frac"),
            "lag": mean("async/lag_mean"),
            "trainer_s": mean("time/train") + (mean("time/old_logprobs") if "bypass" not in preset else 0.0),
            "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="seconds-long CI run: token_tis, one seed, 2 steps (the second trains a lagged batch)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.seeds, args.presets = 2, [1], ["token_tis"]
    out = args.out or Path(tempfile.mkdtemp(prefix="dapo_corr_study_"))
    results: dict[str, list[dict[str, float]]] = {}
    for seed in args.seeds:
        for preset in args.presets:
            res = run(preset, seed, args.steps, out)
            results.setdefault(preset, []).append(res)
            print(f"{preset} seed {seed}: {json.dumps({k: round(v, 4) for k, v in res.items()})} "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"| preset | held-out avg@4 (seeds {' / '.join(map(str, args.seeds))}) | mean | off-policy KL k3 | ESS | "
          "rejected tokens | lag | trainer s/step |")
    print("|---|---|---|---|---|---|---|---|")
    best = ("", -1.0)
    for preset, runs in results.items():
        ok = [r for r in runs if "failed" not in r]
        if not ok:
            print(f"| {preset} | failed | | | | | | |")
            continue
        avg = statistics.fmean(r["avg_at_4"] for r in ok)
        best = max(best, (preset, avg), key=lambda x: x[1])

        def m(key: str, ok: list[dict[str, float]] = ok) -> float:
            return statistics.fmean(r[key] for r in ok)

        seeds = " / ".join(f"{r['avg_at_4']:.3f}" for r in ok)
        print(f"| {preset} | {seeds} | {avg:.3f} | {m('kl_k3'):.2e} | "
              f"{m('ess'):.3f} | {m('rejected'):.3f} | {m('lag'):.2f} | {m('trainer_s'):.3f} |")
    failed = sorted({p for p, runs in results.items() for r in runs if "failed" in r})
    if best[0]:
        print(f"best_preset_avg_at_4: {best[1]:.3f} ({best[0]})")
    if failed:  # a study with a failed run is a failed study, whatever the others gave
        print(f"rollout_correction_study: runs failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
