"""Two gloo ranks; rank 1 stops taking part after start-up. Rank 0's collective must fail, not hang.

Run as two processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set; rank 0 writes a JSON verdict to argv[1].
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _both_ready(folder: Path, rank: int, timeout: float = 600) -> None:
    """A file barrier before the 6 s rendezvous: on a loaded machine one rank may take longer than 6 s more than
    the other to import torch and Megatron, and the timeout under test is the collective's, not start-up's."""
    (folder / f"ready_{rank}").touch()
    deadline = time.monotonic() + timeout
    while not all((folder / f"ready_{r}").exists() for r in (0, 1)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {1 - rank} never became ready")
        time.sleep(0.05)


def main() -> None:
    import torch
    import torch.distributed as dist

    from dapo_mcore.actor.parallel import init_distributed, read_launch_env
    from dapo_mcore.model import cpu_compat

    launch = read_launch_env()
    cpu_compat.apply()  # the slow imports happen here, before the rendezvous below (init_distributed repeats it: a no-op)
    _both_ready(Path(sys.argv[1]).parent, launch.rank)
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
