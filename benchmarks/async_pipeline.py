"""Today's synchronous loop vs the async mode, same processes, same steps, side by side.

For each task (``max4``: examples/tiny_cpu.yaml; ``chain``: examples/tiny_cpu_chain.yaml, whose response lengths
vary; ``tail``: the chain task with ``rollout.max_new_tokens=96`` (the tiny base's 128 positions less the longest
prompt), so the responses that ramble without answering run to 96 tokens while the answered ones end at 9-31: a
long-tailed length distribution, and batches whose generation time varies with how many rambles they draw), real CLI
runs on ``--nproc`` gloo processes:
- ``sync``: every process trains (data parallel) and generates (its own engine group), one phase after the other;
- ``async``: ``--nproc - 1`` trainer processes and one engine process; the engine generates step n+1's batch with
  the policy after step n-1 while the trainer trains step n (algo.tis_cap=2 corrects the lag);
- ``async-k2`` / ``async-k4``: the same processes as ``async`` with bounded staleness
  (``rollout.pipeline.max_staleness`` 2 / 4): the engine runs up to 2 / 4 batches ahead, so a slow batch is absorbed
  by the ones generated before it;
- ``async2``: the same ``--nproc - 1`` trainer processes beside two engine ranks (two engine groups; one process
  more);
- ``async2-inline``: the same, with the trainer waiting for each evaluation after its step
  (``DAPO_MCORE_EVAL_INLINE=1``, evaluation on the trainer's path): against ``async2`` it gives the eval-overlap gain,
  the trainer's seconds spent on evaluations (``time/eval`` + ``async/trainer_wait_eval_s``) before and after.
Per run: wall seconds of the steps (the sum of ``time/step``: set-up excluded), held-out avg@4 at the end, the lag
of the trained tokens, and for async the share of generation hidden behind training. Run from the repository root:
``.venv/bin/python benchmarks/async_pipeline.py [--steps 40] [--nproc 2]``; ``--smoke`` (CI, seconds): the chain
task, sync and async, 2 steps each, held-out avg@4 once at the end.
The line before the last: ``bounded_over_one_step_off: X`` = async wall / async-k2 wall (async-k4 without k2) on the
last task that ran both (> 1: bounded staleness is faster). Last line: ``async_over_sync_wall: X`` = sync wall /
async wall on the chain task (> 1: async is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"max4": ROOT / "examples" / "tiny_cpu.yaml", "chain": ROOT / "examples" / "tiny_cpu_chain.yaml",
           "tail": ROOT / "examples" / "tiny_cpu_chain.yaml"}
TASK_OVERRIDES = {"tail": ("rollout.max_new_tokens=96",)}
MODES = {"sync": (), "async": ("rollout.pipeline.mode=async", "rollout.pipeline.engine_ranks=1"),
         "async-k2": ("rollout.pipeline.mode=async", "rollout.pipeline.engine_ranks=1",
                      "rollout.pipeline.max_staleness=2"),
         "async-k4": ("rollout.pipeline.mode=async", "rollout.pipeline.engine_ranks=1",
                      "rollout.pipeline.max_staleness=4"),
         "async2": ("rollout.pipeline.mode=async", "rollout.pipeline.engine_ranks=2"),
         "async2-inline": ("rollout.pipeline.mode=async", "rollout.pipeline.engine_ranks=2")}


def torchrun(nproc: int) -> list[str]:
    """``python -m torch.distributed.run`` for ``nproc`` local processes on a free port (torchrun's default, 29500,
    collides with any other job on this host that also takes the default, e.g. a test suite running beside)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(port)]


def run(task: str, mode: str, steps: int, nproc: int, out: Path, eval_every: int,
        overrides: list[str]) -> dict[str, float]:
    run_dir = out / f"{task}-{mode}"
    extra = [*TASK_OVERRIDES.get(task, ()), *MODES[mode]]
    procs = nproc + 1 if mode.startswith("async2") else nproc  # the second engine rank is one process more
    cmd = [*torchrun(procs), "-m", "dapo_mcore.cli", "train", str(CONFIGS[task]), f"run.dir={run_dir}",
           f"train.steps={steps}", "checkpoint.every=0", f"eval.every={eval_every}", "algo.tis_cap=2.0", *extra,
           *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if mode.endswith("-inline"):
        env["DAPO_MCORE_EVAL_INLINE"] = "1"
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
               "eval_s": sum(r.get("time/eval", 0.0) for r in stepped),
               "trainer_eval_s": sum(r.get("time/eval", 0.0) + r.get("async/trainer_wait_eval_s", 0.0) for r in stepped),
               "engine_eval_s": sum(r.get("async/engine_eval_s", 0.0) for r in stepped)}
    return out_row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--tasks", default="max4,chain,tail")
    ap.add_argument("--modes", default="sync,async,async-k2,async2,async2-inline")
    ap.add_argument("overrides", nargs="*", help="key=value for every run, e.g. train.epochs=4 (a trainer-bound step)")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds-long CI run: the chain task, sync and async, 2 steps each, evaluated once at the end")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tasks, args.modes, args.steps, args.eval_every = "chain", "sync,async", 2, 0
        args.overrides = [*args.overrides, "eval.at_start=false"]
    results: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        for task in args.tasks.split(","):
            for mode in args.modes.split(","):
                results[task, mode] = run(task, mode, args.steps, args.nproc, Path(tmp), args.eval_every,
                                          args.overrides)
                r = results[task, mode]
                print(f"{task:6s} {mode:8s} wall {r['wall_s']:7.1f} s (eval {r['eval_s']:5.1f} s)  held-out "
                      f"avg@4 {r['base_avg_at_4']:.3f} -> {r['avg_at_4']:.3f}  lag {r['lag_mean']:.2f}  "
                      f"trainer waited {r['trainer_wait_s']:6.1f} s  overlap {r['overlap']:.2f}  trainer on evals "
                      f"{r['trainer_eval_s']:5.1f} s", flush=True)
    for task in args.tasks.split(","):
        s = results[task, "sync"]
        for mode in (m for m in args.modes.split(",") if m.startswith("async")):
            a = results[task, mode]
            print(f"{task}: sync/{mode} wall {s['wall_s'] / a['wall_s']:.2f}x; held-out avg@4 {mode} - sync "
                  f"{a['avg_at_4'] - s['avg_at_4']:+.3f} after {args.steps} steps")
        if (task, "async2-inline") in results and (task, "async2") in results:
            before, after = results[task, "async2-inline"], results[task, "async2"]
            print(f"{task}: eval overlap (2 engine ranks): the trainer's seconds on evaluations {before['trainer_eval_s']:.1f} "
                  f"-> {after['trainer_eval_s']:.1f} (engines evaluated {after['engine_eval_s']:.1f} s); wall "
                  f"{before['wall_s']:.1f} -> {after['wall_s']:.1f} s ({before['wall_s'] / after['wall_s']:.2f}x)")
    bounded = [(t, m) for t in args.tasks.split(",") for m in ("async-k2", "async-k4")
               if (t, m) in results and (t, "async") in results]
    for task, mode in bounded:
        print(f"{task}: one-step-off/{mode} wall {results[task, 'async']['wall_s'] / results[task, mode]['wall_s']:.2f}x"
              f"; trainer waited {results[task, 'async']['trainer_wait_s']:.1f} -> "
              f"{results[task, mode]['trainer_wait_s']:.1f} s; lag {results[task, mode]['lag_mean']:.2f}")
    if bounded:  # the last task's K = 2 (or K = 4 where K = 2 did not run)
        task = bounded[-1][0]
        mode = "async-k2" if (task, "async-k2") in results else "async-k4"
        print(f"bounded_over_one_step_off: {results[task, 'async']['wall_s'] / results[task, mode]['wall_s']:.3f}")
    last = "chain" if ("chain", "sync") in results else args.tasks.split(",")[-1]
    print(f"async_over_sync_wall: {results[last, 'sync']['wall_s'] / results[last, 'async']['wall_s']:.3f}")


if __name__ == "__main__":
    main()
