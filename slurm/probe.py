"""A tiny real gloo job that follows the trainer's launch and requeue contract.

Used to exercise slurm/launch.sh end to end without the trainer:

    python slurm/probe.py OUT_DIR [--steps N] [--step-seconds S]

Every rank joins an ``env://`` process group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as
launch.sh exports them), and each step all-reduces ``rank + 1`` (the sum must be
``W (W + 1) / 2``). Rank 0 appends one JSON line per step to OUT_DIR/metrics.jsonl. On SIGUSR1 or
SIGTERM the ranks agree (all-reduce of the flag) to stop after the current step, rank 0 writes
OUT_DIR/checkpoint.json, and every rank exits 75; a restarted job resumes after the checkpointed
step. When all steps are done rank 0 writes OUT_DIR/done.json and the ranks exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REQUEUE_EXIT_CODE = 75
_stop_requested = False


def _request_stop(signum: int, frame: object) -> None:
    global _stop_requested
    _stop_requested = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGUSR1, _request_stop)
    signal.signal(signal.SIGTERM, _request_stop)

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list[str] = [""] * world  # which host each rank runs on (the two-node test checks them)
    dist.all_gather_object(hosts, socket.gethostname())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = args.out_dir / "checkpoint.json"
    start = json.loads(ckpt.read_text())["step"] + 1 if ckpt.exists() else 0
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    for step in range(start, args.steps):
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        time.sleep(args.step_seconds)
        if rank == 0:
            with open(args.out_dir / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps({"step": step, "sum": value.item(), "world": world, "restart": restart,
                                     "hosts": hosts}) + "\n")
        stop = torch.tensor([1.0 if _stop_requested else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() and step + 1 < args.steps:
            # The peers' srun SIGTERM (--kill-on-bad-exit) may land during interpreter shutdown, which restores
            # the default handlers (death by SIGTERM) but keeps SIG_IGN (as dapo_mcore.cli does).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            if rank == 0:
                ckpt.write_text(json.dumps({"step": step}))
            dist.barrier()
            dist.destroy_process_group()
            print(f"rank {rank}: stop requested, checkpointed step {step}, exiting {REQUEUE_EXIT_CODE}", flush=True)
            return REQUEUE_EXIT_CODE
    if rank == 0:
        (args.out_dir / "done.json").write_text(json.dumps({"world": world, "steps": args.steps, "restart": restart,
                                                                   "hosts": hosts}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
