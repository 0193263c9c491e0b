"""What one exchange between engine groups costs (streaming over several engine groups, e.g. completion order): every
``exchange_every`` decode steps all ranks meet. A tick where no group ended anywhere was an all-gather of sizes, a
broadcast of each leader's empty share and an all-reduce of the "still running" flags (2 + leaders collectives); it is
now the one all-gather, which carries the flags, and only non-empty shares are broadcast after it.

A unit test: ``torch.distributed`` is replaced by a recorder of a 2-rank world (this rank 0, the other rank a leader
whose engine still runs), so the collectives one tick issues are counted exactly. The exchanges' results across real
ranks are tested in tests/test_rollout_engine_groups.py."""

from __future__ import annotations

import types

import pytest
import torch

from dapo_mcore.rollout.protocol import PartialGroup, Response
from dapo_mcore.rollout.scheduling import engine_groups, gather
from dapo_mcore.rollout.scheduling.engine_groups import EngineGroups, EngineGroupStream

pytestmark = pytest.mark.unit


class Recorder:
    """A 2-rank world seen from rank 0: the peer (a leader) has ``peer_share`` to send at every exchange and its engine
    runs as long as this rank's."""

    def __init__(self, peer_share: tuple[list[int], list[float]] = ([], [])):
        self.calls: list[str] = []
        self.peer_ints, self.peer_floats = (torch.tensor(peer_share[0], dtype=torch.int64),
                                            torch.tensor(peer_share[1], dtype=torch.float32))

    def get_world_size(self, group=None):
        return 2

    def get_rank(self, group=None):
        return 0

    def all_gather(self, out, tensor, group=None):
        self.calls.append("all_gather")
        out[0].copy_(tensor)
        # the peer's engine runs exactly as long as this rank's (its flag mirrors ours)
        row = [1, self.peer_ints.numel(), self.peer_floats.numel()] + ([int(tensor[3])] if tensor.numel() == 4 else [])
        out[1].copy_(torch.tensor(row, dtype=torch.int64))

    def broadcast(self, tensor, src, group=None):
        self.calls.append(f"broadcast{src}")
        if src == 1:
            tensor.copy_((self.peer_ints if tensor.dtype == torch.int64 else self.peer_floats)[:tensor.numel()])

    def all_reduce(self, tensor, group=None):
        self.calls.append("all_reduce")
        tensor *= 2  # the peer's flag mirrors ours


class Local:
    """This rank's engine stream: ``ticks`` decode steps, each ending the groups listed for it."""

    def __init__(self, ends: list[list[tuple[int, list[Response]]]]):
        self.ends = ends

    def ticks(self):
        yield from self.ends


@pytest.fixture
def world(monkeypatch):
    def install(recorder: Recorder) -> Recorder:
        plain = types.SimpleNamespace(to=lambda t: t, empty=lambda n, dt: torch.empty(n, dtype=dt), host=lambda t: t)
        for module in (gather, engine_groups):
            monkeypatch.setattr(module, "dist", recorder)
        monkeypatch.setattr(gather, "collective_device", lambda group=None: plain)
        monkeypatch.setattr(engine_groups, "strict_device", lambda group=None: plain)
        return recorder

    return install


def test_a_tick_where_nothing_ended_is_one_collective(world):
    rec = world(Recorder())
    stream = EngineGroupStream(Local([[], [], [], []] * 2), [0, 2], EngineGroups(count=2, index=0, leader=True), 4)
    ticks = stream.ticks()
    with pytest.raises(StopIteration):  # nothing ended in 8 decode steps (2 exchanges), then the local stream ran out
        next(ticks)
    per_tick = len(rec.calls) / stream.tally.count
    assert rec.calls[:1] == ["all_gather"] and per_tick <= 1.5, rec.calls  # the last tick's flag may need no more
    assert "all_reduce" not in rec.calls and not any(c.startswith("broadcast") for c in rec.calls)


def test_a_tick_broadcasts_only_the_shares_that_hold_groups(world):
    """The peer ended prompt 1's group (two responses); this rank nothing: one all-gather and the peer's two
    broadcasts (ints, floats), and every rank holds the peer's group."""
    ints, floats = gather.pack_responses([1], [[Response([5, 6], [-0.5, -0.25], "stop"), Response([7], [-1.0], "length")]])
    rec = world(Recorder((ints.tolist(), floats.tolist())))
    stream = EngineGroupStream(Local([[]] * 4), [0, 2], EngineGroups(count=2, index=0, leader=True), 4)
    ended = next(stream.ticks())
    assert rec.calls == ["all_gather", "broadcast1", "broadcast1"]
    assert [(pos, [r.token_ids for r in rs]) for pos, rs in ended] == [(1, [[5, 6], [7]])]


def test_partials_pack_into_one_int64_tensor_exactly():
    """The in-flight groups an abort exchanges (partial rollouts over several engine groups) travel as one int64 tensor
    on a gloo group (they were pickled through ``all_gather_object`` on the default group: NCCL, GPU memory, on a
    GPU); tokens and every log-prob bit come back."""
    from dapo_mcore.rollout.scheduling.engine_groups import pack_partials, unpack_partials

    lp = [-0.1, -1e-300, -123.456789012345678, float("-inf")]
    groups = [(3, PartialGroup(0, [Response([1, 2, 3], lp[:3], "length"), Response([9], [lp[3]], "stop")],
                               [False, True])),
              (7, PartialGroup(1, [Response([], [], "length")], [False]))]
    packed = pack_partials(groups)
    assert packed.dtype == torch.int64 and packed.dim() == 1
    back = unpack_partials(packed)
    assert [(g.index, g.done) for g in back] == [(3, [False, True]), (7, [False])]
    got = [(r.token_ids, r.logprobs, r.finish_reason) for g in back for r in g.responses]
    assert got == [([1, 2, 3], lp[:3], "length"), ([9], [lp[3]], "stop"), ([], [], "length")]
    assert unpack_partials(pack_partials([])) == []


def test_the_abort_exchange_uses_no_object_collective(monkeypatch):
    import torch.distributed as dist

    from dapo_mcore.rollout.scheduling import engine_groups as eg

    def refuse(*args, **kwargs):
        raise AssertionError("all_gather_object: a pickle through the default (NCCL on a GPU) group")

    monkeypatch.setattr(dist, "all_gather_object", refuse)
    sent = {}

    def fake_all_gather_packed(ints, floats, group=None):
        sent["group"] = group
        return [(ints, floats)]

    monkeypatch.setattr("dapo_mcore.collectives.packed.all_gather_packed", fake_all_gather_packed)
    monkeypatch.setattr(eg, "host_group", lambda: "gloo-group")
    stream = EngineGroupStream(None, [4], EngineGroups(count=2, index=0, leader=True), 4)
    mine = [PartialGroup(0, [Response([5], [-0.5], "length")], [False])]
    got = stream._exchange_partials(mine)
    assert sent["group"] == "gloo-group"
    assert [(g.index, [r.token_ids for r in g.responses]) for g in got] == [(4, [[5]])]
