"""The async trainer's wait for a batch is not bounded by the trainer group's collective timeout: trainer rank 0
receives the first batch after an evaluation at start and a whole generation, which can outlast
``parallel.timeout_minutes``; the other trainer ranks wait for it on the store (``Bridge.hold_trainers``, as the
weights group's ``meet`` does), and enter the broadcast only when rank 0 has the batch. Before, they waited inside
the broadcast and a generation longer than the timeout killed the run (NCCL's watchdog on a GPU, gloo's here)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from tests.gloo_workers import run_gloo_workers

TIMEOUT = datetime.timedelta(seconds=3)


def _worker(rank: int, world: int, port: int, queue) -> None:
    from dapo_mcore.collectives.device import TransferDevice
    from dapo_mcore.rollout.pipeline.async_source import _broadcast
    from dapo_mcore.rollout.pipeline.bridge import Bridge, Role

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=world,
                            timeout=TIMEOUT)
    bridge = Bridge(Role(True, rank, world, 1), None, None, None, TransferDevice("cpu"), dist.PrefixStore("b/", store),
                    poll=datetime.timedelta(seconds=1))
    value = None
    if rank == 0:
        time.sleep(3 * TIMEOUT.total_seconds())  # the engines' first generation, longer than the timeout
        value = {"value": [1, 2, 3]}
    try:
        bridge.hold_trainers(rank == 0)
        got = _broadcast(value, rank == 0)
        queue.put((rank, got))
    except RuntimeError as exc:
        queue.put((rank, f"failed: {exc}"[:200]))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_the_other_trainer_ranks_outwait_the_collective_timeout_on_the_store():
    assert run_gloo_workers(_worker, 2) == {0: {"value": [1, 2, 3]}, 1: {"value": [1, 2, 3]}}
