"""Generated responses exchanged between ranks as flat tensors: exact round trip, and a real 2-rank gather."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dapo_mcore.rollout.protocol import Response
from dapo_mcore.rollout.scheduling.gather import all_gather_responses, pack_responses, unpack_responses
from tests.gloo_workers import run_gloo_workers


def _random_share(seed: int, indices: list[int]) -> list[list[Response]]:
    rng = random.Random(seed)
    share = []
    for _ in indices:
        group = []
        for _ in range(rng.randint(0, 3)):
            n = rng.randint(0, 6)
            lp = [float(torch.tensor(rng.uniform(-9, 0), dtype=torch.float32)) for _ in range(n)] if rng.random() < 0.8 else []
            group.append(Response(token_ids=[rng.randint(0, 150000) for _ in range(n)], logprobs=lp,
                                  finish_reason=rng.choice(["stop", "length"])))
        share.append(group)
    return share


@pytest.mark.unit
def test_pack_unpack_is_exact_including_empty_groups_and_missing_logprobs():
    indices = [7, 0, 3, 12]
    share = _random_share(1, indices)
    ints, floats = pack_responses(indices, share)
    # Trailing padding (as the all-gather adds) must be ignored.
    got = unpack_responses(torch.cat([ints, torch.zeros(5, dtype=torch.int64)]), torch.cat([floats, torch.zeros(3)]))
    assert got == dict(zip(indices, share, strict=True))


@pytest.mark.unit
def test_empty_share_round_trips():
    ints, floats = pack_responses([], [])
    assert unpack_responses(ints, floats) == {}


def _worker(rank: int, world: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    indices = list(range(rank, 9, world))  # strided shares of 9 prompts, uneven sizes
    merged = all_gather_responses(indices, _random_share(100 + rank, indices))
    queue.put((rank, merged))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_two_gloo_ranks_each_receive_every_share():
    results = run_gloo_workers(_worker, 2)
    expected = {}
    for rank in range(2):
        idx = list(range(rank, 9, 2))
        expected.update(zip(idx, _random_share(100 + rank, idx), strict=True))
    assert results[0] == expected and results[1] == expected
