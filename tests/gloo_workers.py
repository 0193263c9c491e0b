"""Run a test's worker function on N spawned gloo ranks and collect what each rank puts on the queue."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_gloo_workers(worker: Callable[..., None], world: int, *, timeout_s: float = 600) -> dict[int, Any]:
    """Start ``worker(rank, world, port, queue)`` on `world` spawned processes; each puts ``(rank, result)`` once.

    The wait is generous (spawn + torch import are slow on a loaded 2-core machine); it only bounds a hang.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return results
