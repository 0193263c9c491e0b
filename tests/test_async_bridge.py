"""The async bridge's weights group as NCCL sees it: every tensor on the device, one host sync a bucket.

Three gloo ranks (trainer rank 0 + two engine ranks) built by ``init_split_world`` with
``DAPO_MCORE_STRICT_DEVICE=1``: the weights group refuses any tensor that was not moved onto its (simulated) device,
as ``ProcessGroupNCCL`` refuses host tensors. A version published through ``AsyncRollouts.publish`` reaches both
engine ranks' ``EngineLoop`` exactly.
"""

from __future__ import annotations

import pickle

import pytest

from tests.gloo_workers import run_gloo_workers

pytestmark = pytest.mark.distributed

WORLD, ENGINES = 3, 2
TIMEOUT_MIN, GENERATE_S = 0.1, 9.0
"""The groups' timeout (6 s) and how long the engine ranks "generate" before they take the version: longer."""


def _weights():
    import torch

    g = torch.Generator().manual_seed(3)
    return [[("model.a", torch.randn(64, 8, generator=g)), ("model.b", torch.randn(8, generator=g).bfloat16())],
            [("model.c", torch.randn(32, 32, generator=g))]]


class _Engine:
    """Records the weights an engine rank loads (the EngineLoop's only use of the engine here)."""

    def __init__(self):
        self.loaded = {}

    def update_weights(self, buckets):
        for bucket in buckets:
            for name, t in bucket:
                self.loaded[name] = t.clone()

    def wake(self):
        pass


def _worker(rank, world, port, queue):
    from pathlib import Path

    from dapo_mcore.actor.parallel import LaunchEnv
    from dapo_mcore.config import load_config
    from dapo_mcore.rollout.pipeline.async_engines import EngineLoop, _Stop
    from dapo_mcore.rollout.pipeline.async_source import AsyncRollouts
    from dapo_mcore.rollout.pipeline.bridge import init_split_world
    from dapo_mcore.telemetry.timers import PhaseTimer

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / "tiny_cpu.yaml", ["rollout.pipeline.mode=async", "algo.tis_cap=2",
                                                             "rollout.pipeline.bucket_mb=0.002", "eval.every=0",
                                                             "eval.at_start=false"])
    try:
        role, bridge = init_split_world(LaunchEnv(rank, world, 0, "127.0.0.1", port, "test"), "gloo", TIMEOUT_MIN,
                                        ENGINES)
        if role.trainer:
            source = AsyncRollouts(cfg, bridge, PhaseTimer())
            source.publish(_weights())
            source.close()
            queue.put((rank, {"syncs": bridge.device.syncs}))
            return
        import time

        time.sleep(GENERATE_S)  # a generation longer than the timeout: the trainer must not be in a collective
        engine = _Engine()
        loop = EngineLoop(cfg, None, engine, bridge, [], PhaseTimer())
        header = loop._receive()[0]  # (header, buckets, seconds)
        try:
            loop._receive()
        except _Stop:
            pass
        bridge.barrier()
        # as bytes: a tensor put on the queue is shared by a file descriptor that dies with this process, which may
        # exit before the test reads it
        queue.put((rank, {"version": header["version"], "loaded": pickle.dumps(engine.loaded)}))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails naming it
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        raise


def test_a_version_crosses_a_device_strict_weights_group_to_two_engine_ranks(monkeypatch):
    """Fails on a header sent as host tensors (the header's size and bytes were host tensors: "Tensors must be CUDA and
    dense"). The sender waits on the host once per bucket. The engine ranks join 9 s after the trainer publishes, past
    the groups' 6 s timeout: the trainer waits at the meeting (Bridge.meet, on the store), not in the broadcast
    (a header broadcast would time out there)."""
    import torch

    monkeypatch.setenv("DAPO_MCORE_STRICT_DEVICE", "1")
    got = run_gloo_workers(_worker, WORLD, timeout_s=300)
    errors = {r: v["error"] for r, v in got.items() if "error" in v}
    assert not errors, errors
    from dapo_mcore.rollout.pipeline.async_source import rebucket

    assert got[0]["syncs"] == len(list(rebucket(_weights(), int(0.002 * (1 << 20))))) == 2  # [a, b], [c]
    want = {name: t for bucket in _weights() for name, t in bucket}
    for rank in (1, 2):
        assert got[rank]["version"] == 0
        loaded = pickle.loads(got[rank]["loaded"])
        assert sorted(loaded) == sorted(want)
        for name, t in want.items():
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), (rank, name)


def test_the_strict_group_refuses_a_host_tensor_and_passes_a_moved_one():
    import torch

    from dapo_mcore.collectives.device import DeviceStrictGroup, SimulatedDevice

    class Group:
        def broadcast(self, tensors, opts):
            return ("sent", len(tensors))

    device = SimulatedDevice()
    group = DeviceStrictGroup(Group(), device)
    with pytest.raises(ValueError, match="Tensors must be CUDA and dense"):
        group.broadcast([torch.zeros(2)], None)
    assert group.broadcast([device.to(torch.zeros(2)), device.empty(3, torch.uint8)], None) == ("sent", 2)
