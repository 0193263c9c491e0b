"""The engine ranks' version receiver (``rollout.pipeline.async_channels.VersionReceiver``), bounded staleness:

- it holds at most D - 1 versions on the host, the one being received and the one being loaded included (it held
  D + 1: a receive started as soon as the loop took a version, while that version was still loading);
- on a GPU it sets the engine's device in its thread and receives on a side stream of its own, and the loop waits on
  the version's event before loading it (a new thread's current device is 0 and its current stream the default one,
  the stream vLLM generates on: each broadcast wait parked generation);
- the engine's loop keeps stepping while a receive is in progress (a slow stand-in transport).

What only a GPU can show (the default stream really left free, the overlap measured): ``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from dapo_mcore.rollout.pipeline.async_channels import VersionReceiver

pytestmark = pytest.mark.unit


class Stop(Exception):
    pass


class Copy:
    """A received version's host copy (what the receiver keeps alive until the loop lets go of it)."""


def test_at_most_d_minus_one_copies_live_the_one_loading_included():
    live, peak, lock = set(), [0], threading.Lock()

    def receive():
        if len(received) == 6:
            raise Stop
        copy = Copy()
        with lock:
            key = id(copy)
            live.add(key)
            weakref.finalize(copy, live.discard, key)
            peak[0] = max(peak[0], len(live))
        time.sleep(0.02)  # the transfer
        received.append(copy)
        return {"version": len(received) - 1}, [copy], 0.0

    for staged in (1, 2):  # D = 2 and D = 3
        received: list = []
        live.clear()
        peak[0] = 0
        rx = VersionReceiver(receive, staged, Stop)
        for version in range(6):
            (header, buckets, _), _ = rx.take()
            assert header["version"] == version
            received[version] = None  # the stand-in's own reference
            time.sleep(0.05)  # the engine loads it: the receiver must not start another copy if at the bound
            del buckets, header
            rx.release()
        with pytest.raises(Stop):
            rx.take()
        assert peak[0] == staged, (staged, peak[0])


class FakeCuda:
    """Records what the receiver thread does with CUDA: its device, the stream its receives run on, the event."""

    def __init__(self):
        self.calls: list = []
        self.local = threading.local()

    def set_device(self, device):
        self.calls.append(("set_device", device, threading.current_thread().name))

    def Stream(self, device=None):  # noqa: N802 - torch's name
        return ("side-stream", device)

    def stream(self, s):
        fake = self

        class Ctx:
            def __enter__(self):
                fake.local.current = s

            def __exit__(self, *exc):
                fake.local.current = None

        return Ctx()

    def Event(self):  # noqa: N802 - torch's name
        fake = self

        class Event:
            def record(self, s):
                fake.calls.append(("record", s))

            def synchronize(self):
                fake.calls.append(("synchronize", threading.current_thread().name))

        return Event()


def test_the_receiver_sets_the_engines_device_and_receives_on_a_side_stream(monkeypatch):
    fake = FakeCuda()
    for name in ("set_device", "Stream", "stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    seen = []

    def receive():
        if seen:
            raise Stop
        seen.append((threading.current_thread().name, getattr(fake.local, "current", None)))
        return {"version": 0}, [], 0.0

    rx = VersionReceiver(receive, 1, Stop, device=3)
    rx.take()
    assert fake.calls[0] == ("set_device", 3, "dapo-engine-versions")  # in the receiver's own thread
    assert seen == [("dapo-engine-versions", ("side-stream", 3))]  # the receive ran on the side stream
    assert fake.calls[1:] == [("record", ("side-stream", 3)), ("synchronize", threading.current_thread().name)]


def test_the_engine_loop_keeps_stepping_while_a_receive_is_in_progress():
    """A slow transport (0.4 s per version, in small waits like a broadcast's) against a loop of 2 ms decode steps:
    the loop's steps during the receive are counted."""
    window = {}

    def receive():
        if "end" in window:
            raise Stop
        window["start"] = time.monotonic()
        while time.monotonic() - window["start"] < 0.4:
            time.sleep(0.005)
        window["end"] = time.monotonic()
        return {"version": 0}, [], 0.4

    rx = VersionReceiver(receive, 1, Stop)
    steps: list[float] = []
    while "end" not in window:
        time.sleep(0.002)  # one decode step of the engine
        steps.append(time.monotonic())
    during = [t for t in steps if window["start"] <= t <= window["end"]]
    assert len(during) >= 20, len(during)  # ~0.4 s / (2 ms + scheduling): far more than 20 on an idle core
    rx.take()


def test_a_collective_on_a_group_that_is_nccl_on_a_gpu_holds_the_simulated_device_until_it_completes(monkeypatch):
    """NCCL's worst case, as the strict CPU check simulates it (``collectives.device.device_held``): a second thread's
    collective waits for the device until the first one's completes. Without it two threads of one rank never wait for
    each other on CPU, so an order of two communicators that deadlocks on a GPU passes every CPU test."""
    from dapo_mcore.collectives import device

    monkeypatch.setattr(device, "_SIMULATED", device.SimulatedDevice())
    release, order = threading.Event(), []

    class Work:
        def __init__(self, tag):
            self.tag = tag

        def wait(self):
            if self.tag == "a":
                release.wait(10)
            order.append(("done", self.tag))

    class Group:
        def broadcast(self, tensors, tag):
            order.append(("start", tag))
            return Work(tag)

    group = device.DeviceStrictGroup(Group(), device._SIMULATED)
    t = device._SIMULATED.empty(1, torch.uint8)
    first = threading.Thread(target=group.broadcast, args=([t], "a"))
    first.start()
    while not order:
        time.sleep(0.001)
    second = threading.Thread(target=group.broadcast, args=([t], "b"))
    second.start()
    time.sleep(0.2)
    assert order == [("start", "a")]  # b waits for the device a holds
    release.set()
    first.join(10)
    second.join(10)
    assert order == [("start", "a"), ("done", "a"), ("start", "b"), ("done", "b")]
