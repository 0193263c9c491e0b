"""Two gloo ranks; rank 1 stops taking part after start-up. Rank 0's collective must fail, not hang.

Run as two processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set; rank 0 writes a JSON verdict to argv[1].
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    import torch
    import torch.distributed as dist

    from dapo_mcore.actor.parallel import init_distributed, read_launch_env

    launch = read_launch_env()
    init_distributed(launch, "gloo", timeout_minutes=0.1)  # 6 s
    if launch.rank == 1:
        time.sleep(120)  # alive but stuck: the worst case for a hang
        return
    start = time.time()
    try:
        dist.all_reduce(torch.ones(1))
        verdict = {"raised": False}
    except RuntimeError as exc:  # gloo reports the timeout as a RuntimeError (DistError subclasses it)
        verdict = {"raised": True, "error": str(exc)[:300]}
    verdict["seconds"] = time.time() - start
    with open(sys.argv[1], "w") as f:
        json.dump(verdict, f)


if __name__ == "__main__":
    main()
