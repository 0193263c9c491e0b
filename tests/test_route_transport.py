"""MoE routing replay between ranks: routed experts survive every path a rollout takes to the rank that trains on it,
and only the routes of the samples a data-parallel rank trains on travel to it (actor.route_exchange).

Before this, the shared batch (rollout.scheduling.gather's shares, the async wire) carried tokens and log-probs only:
every multi-process run with ``algo.router_replay=rollout`` stopped at step 1 with "a rollout carries no routed
experts".
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dapo_mcore.actor.route_exchange import RoutesMissing, exchange_routes, plan_transfers
from dapo_mcore.algo.dynamic_sampling import SamplingStats
from dapo_mcore.data.records import PromptRecord
from dapo_mcore.rollout.pipeline import wire
from dapo_mcore.rollout.pipeline.source import StepBatch
from dapo_mcore.rollout.protocol import Response
from dapo_mcore.rollout.scheduling.gather import broadcast_shares
from dapo_mcore.rollout.scheduling.groups import GroupData
from tests.gloo_workers import run_gloo_workers

LAYERS, TOP_K = 3, 2


def _routes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 8, (n, LAYERS, TOP_K), generator=g, dtype=torch.int64).to(torch.int16)


def _response(seed: int, prompt_len: int = 2) -> Response:
    n = 3 + seed % 4
    return Response(list(range(seed, seed + n)), [-0.5] * n, "stop", routed_experts=_routes(prompt_len + n, seed))


def _batch() -> dict:
    groups = [GroupData(record=PromptRecord(f"p{i}", "1", "synthetic", i), prompt_ids=[1, i],
                        responses=[_response(10 * i + j) for j in range(2)], scores=[1.0, -1.0], acc=[True, False],
                        rewards=[1.0, -1.0], gen_batch=0, preds=["1", None], kept=i % 2 == 0) for i in range(4)]
    batch = StepBatch(kept=[g for g in groups if g.kept], generated=groups, stats=SamplingStats())
    return {"kind": "batch", "step": 1, "batch": batch, "version": 0}


@pytest.mark.unit
def test_the_async_wire_carries_routes_to_trainer_rank_0_and_not_beyond():
    message = _batch()
    packed = wire.pack(message)
    assert packed.routes.numel() == sum(2 * r.routed_experts.numel() for g in message["batch"].generated
                                        for r in g.responses)
    got = wire.unpack(packed)
    for a, b in zip(message["batch"].generated, got["batch"].generated, strict=True):
        for ra, rb in zip(a.responses, b.responses, strict=True):
            assert torch.equal(ra.routed_experts, rb.routed_experts) and rb.routed_experts.dtype == torch.int16
    light = wire.pack(wire.light(message), routes=False)  # trainer rank 0 -> the others: each fetches its own
    assert light.routes.numel() == 0
    assert all(r.routed_experts is None for g in wire.unpack(light)["batch"].kept for r in g.responses)


def _share_worker(rank: int, world: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    indices = [rank, rank + 2]
    local = [[_response(100 * rank + k)] for k in range(2)]
    shares = broadcast_shares(indices, local, sender=True)
    held = {i: [r.routed_experts for r in rs] for share in shares for i, rs in share.items()}
    mine = all(torch.equal(held[i][0], local[k][0].routed_experts) for k, i in enumerate(indices))
    others = all(held[i][0] is None for i in held if i not in indices)
    queue.put((rank, (mine, others)))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_a_generating_rank_keeps_its_own_routes_and_sends_none():
    """The engine group's leader keeps the routes of what it generated (the old code dropped them on every rank)."""
    assert run_gloo_workers(_share_worker, 2) == {0: (True, True), 1: (True, True)}


class _Sample:
    def __init__(self, routes: torch.Tensor | None):
        self.extra = {"routed_experts": routes}


def _exchange_worker(rank: int, world: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    truth = [_routes(5 + i, i) for i in range(6)]
    # Rank 0 holds samples 0-2, rank 1 holds 3-5 (their engine shares); rank 0 trains on 0, 3, 4; rank 1 on 1, 2, 5.
    samples = [_Sample(truth[i] if (i < 3) == (rank == 0) else None) for i in range(6)]
    needed = [0, 3, 4] if rank == 0 else [1, 2, 5]
    from dapo_mcore.collectives.device import collective_device

    got = exchange_routes(samples, needed, collective_device())  # marked under the NCCL-on-CPU check
    exact = all(torch.equal(samples[i].extra["routed_experts"], truth[i]) for i in needed)
    untouched = [i for i in range(6) if samples[i].extra["routed_experts"] is None]
    queue.put((rank, (exact, got, untouched)))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_each_rank_receives_exactly_the_routes_of_the_samples_it_trains_on():
    out = run_gloo_workers(_exchange_worker, 2)
    nbytes = [2 * LAYERS * TOP_K * (5 + i) for i in range(6)]
    assert out[0] == (True, nbytes[3] + nbytes[4], [5])
    assert out[1] == (True, nbytes[1] + nbytes[2], [0])


@pytest.mark.unit
def test_the_lowest_holder_sends_and_a_route_held_nowhere_is_named():
    # [world=3, 5 rows, n=3]: sample 0 held by ranks 1 and 2, needed by 0; sample 1 held by 0, needed by 0 and 2.
    t = torch.zeros(3, 5, 3, dtype=torch.int64)
    t[1, 0, 0] = t[2, 0, 0] = 1
    t[0, 1, 0] = 1
    t[0, 0, 1] = 1
    t[0, 1, 1] = t[2, 1, 1] = 1
    assert plan_transfers(t) == {(1, 0): [0], (0, 2): [1]}
    t[1, 1, 2] = 1  # sample 2 needed by rank 1, held by nobody
    with pytest.raises(RoutesMissing, match="sample 2 first.*algo.router_replay=none"):
        plan_transfers(t)


@pytest.mark.unit
def test_routes_of_a_micro_batch_padded_with_rows_cover_every_row():
    """Under virtual pipeline stages a rows micro-batch is padded with rows of padding: the replayed routes must cover
    them too (one per token the router sees), unrecorded there, the real rows' routes where they were."""
    from dapo_mcore.actor.route_exchange import align_routes

    routes = [torch.tensor([[[1, 2]], [[3, 0]]]), torch.tensor([[[2, 3]]])]  # [tokens, layers=1, k=2]
    out, known = align_routes(routes, width=3, packed=False, top_k=2, rows=4)
    assert out.shape == (4, 3, 1, 2) and known.shape == (4, 3)
    assert out[0, :2].tolist() == [[[1, 2]], [[3, 0]]] and out[1, 0].tolist() == [[2, 3]]
    assert known.tolist() == [[True, True, False], [True, False, False], [False] * 3, [False] * 3]
    assert bool((out[2:] == torch.arange(2)).all())  # filler experts 0..k-1 on the padding rows
    assert align_routes(routes, width=3, packed=False, top_k=2)[0].shape[0] == 2  # unpadded: one row per response
