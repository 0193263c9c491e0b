"""Bounded staleness at the real shape: trainer rank 0 and two engine ranks at engine tensor parallel 2, gloo, with
``DAPO_MCORE_STRICT_DEVICE=1`` (groups that are NCCL on a GPU refuse host tensors, and a collective on one holds the
simulated device from start to completion, NCCL's worst case: ``collectives/device.py``).

- Each engine rank stages only its own shard of each received version: the bytes it holds for a version are the
  bytes its engine loads (``rollout.pipeline.host_shard``), not the whole model's; loading the staged versions gives
  the engine exactly the shard of each version the trainer published.
- The version receiver's thread broadcasts on the weights group while the loop's thread runs the engine ranks' own
  collectives (the streaming ticks' ``all_reduce``, ``rollout.scheduling.engine_groups``). Both groups driven from
  two threads with no shared order deadlock once each collective holds the device (each rank waits for the device
  the other rank's thread holds, until the groups' timeout); the engine side's own group is gloo, so they do not.
"""

from __future__ import annotations

import pickle

import pytest

from tests.gloo_workers import run_gloo_workers
from tests.test_host_shard import TPLoader, shapes, shard_bytes, version

pytestmark = pytest.mark.distributed

WORLD, ENGINES, VERSIONS = 3, 2, 3
TIMEOUT_MIN = 0.1
"""The groups' timeout (6 s): a deadlock ends in it."""
TICKS = 200
"""How many collectives the loop runs before it takes each version (the receiver receives meanwhile): a fixed count,
the same on every rank, as the engine loop's collectives are."""


def _engine(rank, cfg, bridge, queue):
    from dapo_mcore.rollout.pipeline.async_engines import EngineLoop, _Stop
    from dapo_mcore.rollout.scheduling.engine_groups import _sum_over_ranks
    from dapo_mcore.telemetry.timers import PhaseTimer

    engine = TPLoader(rank)
    loop = EngineLoop(cfg, None, engine, bridge, [], PhaseTimer())
    loop._apply(loop._receive(), 0.0)  # the start's version, straight into the engine (what it reads is recorded)
    loop._start_receiver()
    ticks = 0
    for _ in range(1, VERSIONS):
        for _ in range(TICKS):  # the loop's own collectives while the receiver thread receives
            assert _sum_over_ranks([1]) == [ENGINES]
            ticks += 1
        loop._take()
    with pytest.raises(_Stop):
        loop._take()
    bridge.barrier()
    bridge.close()
    queue.put((rank + 1, {"version": loop.version, "staged_bytes": loop.staged_bytes, "ticks": ticks,
                          "params": pickle.dumps(engine.params)}))


def _worker(rank, world, port, queue):
    from pathlib import Path

    from dapo_mcore.actor.parallel import LaunchEnv
    from dapo_mcore.config import load_config
    from dapo_mcore.rollout.pipeline.async_source import AsyncRollouts
    from dapo_mcore.rollout.pipeline.bridge import init_split_world
    from dapo_mcore.telemetry.timers import PhaseTimer

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / "tiny_cpu.yaml", [
        "rollout.pipeline.mode=async", "algo.tis_cap=2", "rollout.pipeline.max_staleness=2",
        f"rollout.pipeline.engine_ranks={ENGINES}", "rollout.pipeline.bucket_mb=0.0003", "eval.every=0",
        "eval.at_start=false"])
    try:
        role, bridge = init_split_world(LaunchEnv(rank, world, 0, "127.0.0.1", port, "test"), "gloo", TIMEOUT_MIN,
                                        ENGINES)
        if not role.trainer:
            _engine(role.rank, cfg, bridge, queue)
            return
        timer = PhaseTimer()
        source = AsyncRollouts(cfg, bridge, timer)
        for v in range(VERSIONS):
            with timer.phase("sync_weights"):
                source.publish(version(v))
        source.close()
        queue.put((rank, {}))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails naming it
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        raise


def test_engine_ranks_stage_their_shard_and_receive_beside_their_own_collectives(monkeypatch):
    """Fails on staging the whole version (each rank held every tensor: 2.3x its shard here) and on the engine side's
    own group being NCCL on a GPU (the receiver's broadcasts and the loop's ticks deadlock: the groups time out)."""
    import torch

    monkeypatch.setenv("DAPO_MCORE_STRICT_DEVICE", "1")
    got = run_gloo_workers(_worker, WORLD, timeout_s=300)
    errors = {r: v["error"] for r, v in got.items() if "error" in v}
    assert not errors, errors
    last = {name: t for bucket in version(VERSIONS - 1) for name, t in bucket}
    whole = sum(t.numel() * t.element_size() for t in last.values())
    for rank in (1, 2):
        tp_rank = rank - 1
        assert got[rank]["version"] == VERSIONS - 1 and got[rank]["ticks"] > 0
        assert got[rank]["staged_bytes"] == shard_bytes(tp_rank) < whole / 2 + 300, (got[rank]["staged_bytes"], whole)
        want = TPLoader(tp_rank)
        want.update_weights(version(VERSIONS - 1))
        params = pickle.loads(got[rank]["params"])
        assert sorted(params) == sorted(want.params) and set(params) < set(shapes())
        for name, p in want.params.items():
            assert torch.equal(params[name], p), (rank, name)
