"""Today's synchronous loop vs the async mode (#26), same processes, same steps, side by side.

For each task (``max4``: examples/tiny_cpu.yaml; ``chain``: examples/tiny_cpu_chain.yaml, whose response lengths
vary), two real CLI runs on ``--nproc`` gloo processes:
- ``sync``: every process trains (data parallel) and generates (its own engine group), one phase after the other;
- ``async``: ``--nproc - 1`` trainer processes and one engine process; the engine generates step n+1's batch with
  the policy after step n-1 while the trainer trains step n (algo.tis_cap=2 corrects the lag).
Per run: wall seconds of the steps (the sum of ``time/step``: set-up excluded), held-out avg@4 at the end, the lag
of the trained tokens, and for async the share of generation hidden behind training. Run from the repository root:
``.venv/bin/python benchmarks/async_pipeline.py [--steps 40] [--nproc 2]``.
Last line: ``async_over_sync_wall: X`` = sync wall / async wall on the chain task (> 1: async is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"max4": ROOT / "examples" / "tiny_cpu.yaml", "chain": ROOT / "examples" / "tiny_cpu_chain.yaml"}
ASYNC = ("rollout.pipeline.mode=async", "rollout.pipeline.engine_ranks=1")


def run(task: str, mode: str, steps: int, nproc: int, out: Path, eval_every: int) -> dict[str, float]:
    run_dir = out / f"{task}-{mode}"
    extra = [*ASYNC] if mode == "async" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "dapo_mcore.cli",
           "train", str(CONFIGS[task]), f"run.dir={run_dir}", f"train.steps={steps}", "checkpoint.every=0",
           f"eval.every={eval_every}", "algo.tis_cap=2.0", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{task}/{mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    stepped = [r for r in rows if r["step"] > 0]
    evals = [r for r in rows if "eval/avg_at_k" in r]
    out_row = {"wall_s": sum(r["time/step"] for r in stepped), "avg_at_4": evals[-1]["eval/avg_at_k"],
               "base_avg_at_4": evals[0]["eval/avg_at_k"],
               "lag_mean": sum(r.get("async/lag_mean", 0.0) for r in stepped) / len(stepped),
               "overlap": sum(r.get("async/overlap_frac", 0.0) for r in stepped) / len(stepped),
               "trainer_wait_s": sum(r.get("async/trainer_wait_s", r.get("time/generate", 0.0)) for r in stepped),
               "eval_s": sum(r.get("time/eval", 0.0) for r in stepped)}
    return out_row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--tasks", default="max4,chain")
    args = ap.parse_args()
    results: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        for task in args.tasks.split(","):
            for mode in ("sync", "async"):
                results[task, mode] = run(task, mode, args.steps, args.nproc, Path(tmp), args.eval_every)
                r = results[task, mode]
                print(f"{task:6s} {mode:5s} wall {r['wall_s']:7.1f} s (eval {r['eval_s']:5.1f} s)  held-out "
                      f"avg@4 {r['base_avg_at_4']:.3f} -> {r['avg_at_4']:.3f}  lag {r['lag_mean']:.2f}  "
                      f"trainer waited {r['trainer_wait_s']:6.1f} s  overlap {r['overlap']:.2f}", flush=True)
    for task in args.tasks.split(","):
        s, a = results[task, "sync"], results[task, "async"]
        print(f"{task}: sync/async wall {s['wall_s'] / a['wall_s']:.2f}x; held-out avg@4 async - sync "
              f"{a['avg_at_4'] - s['avg_at_4']:+.3f} after {args.steps} steps")
    last = "chain" if ("chain", "sync") in results else args.tasks.split(",")[-1]
    print(f"async_over_sync_wall: {results[last, 'sync']['wall_s'] / results[last, 'async']['wall_s']:.3f}")


if __name__ == "__main__":
    main()
