"""The reward worker pool: order, hostile inputs, per-answer timeout, crash replacement, shutdown."""

from __future__ import annotations

import os
import time

import pytest

from dapo_mcore.reward import compute_score
from dapo_mcore.reward.pool import RewardPool

pytestmark = pytest.mark.unit


def hang_or_crash(response: str | bytes, ground_truth: str):
    """Test reward function (module level so spawned workers can import it)."""
    if response == "HANG":
        time.sleep(3600)
    if response == "CRASH":
        os._exit(7)
    if response == "RAISE":
        raise ValueError("boom")
    return compute_score(response, ground_truth)


HOSTILE = [
    "x" * 10**6 + "\nAnswer: 540",              # 1 MB, correct at the end
    "Answer: 540\n" + "y" * 10**6,              # 1 MB, answer far outside the window
    b"\x80" * 10**6 + b"Answer: 540",           # 1 MB of invalid UTF-8 bytes, correct
    b"Answer: 540\xff\xfe\xfd",                 # invalid UTF-8 inside the answer
    "{" * 500_000 + "Answer: 540",              # deeply nested braces
    "\\boxed{" * 100_000,                       # unclosed boxes
    "\x00\x01\x02\x1b[2J\x7f" * 1000 + "Answer: 540",  # control characters
    "Answer: 5\x00\x00",
    "\ud800\udfff" * 100 + "Answer: 540",       # lone surrogates
    "Answer:" * 200_000,
]


def test_pool_matches_in_process_and_keeps_order():
    responses = [f"work...\nAnswer: {i % 7}" for i in range(300)] + HOSTILE
    gts = [str(i % 5) for i in range(300)] + ["540"] * len(HOSTILE)
    with RewardPool("math_dapo", num_workers=2, timeout_s=20, chunk_size=16) as pool:
        got = pool.score(responses, gts)
    assert got == [compute_score(r, g) for r, g in zip(responses, gts, strict=True)]
    assert [r.acc for r in got[300:]] == [True, False, True, False, True, False, True, False, True, False]


def test_strict_mode_through_pool():
    with RewardPool("math_dapo_strict_box", num_workers=1) as pool:
        got = pool.score(["\\boxed{540}", "\\boxed{" * 10**5, b"\\boxed{54\xff0}"], ["540"] * 3)
    assert [r.acc for r in got] == [True, False, False]


def test_hung_answer_times_out_and_worker_is_replaced():
    responses = ["Answer: 1", "HANG", "Answer: 2", "Answer: 3", "HANG", "Answer: 4"]
    # 3 s: long enough that a loaded machine (load ~10 on 2 cores) never stalls a real answer that long, short
    # enough to keep the test quick; the hang itself is an hour.
    with RewardPool(hang_or_crash, num_workers=2, timeout_s=3.0, chunk_size=3) as pool:
        start = time.monotonic()
        got = pool.score(responses, ["1", "1", "2", "3", "1", "4"])
        elapsed = time.monotonic() - start
        assert pool.restarts == 2
        # the pool still works after replacing workers
        assert pool.score(["Answer: 9"], ["9"])[0].acc
    assert elapsed < 600, elapsed  # far below the hour a hung answer would take: the pool did not wait for it
    assert [r.acc for r in got] == [True, False, True, True, False, True]
    assert "timed out after 3s" in got[1].reason and "timed out" in got[4].reason
    assert got[0].reason is None


def test_crashing_and_raising_answers_are_scored_wrong():
    responses = ["Answer: 1", "CRASH", "Answer: 2", "RAISE", "Answer: 3"]
    with RewardPool(hang_or_crash, num_workers=1, timeout_s=20, chunk_size=5) as pool:
        got = pool.score(responses, ["1", "1", "2", "1", "3"])
        assert pool.restarts == 1
    assert [r.acc for r in got] == [True, False, True, False, True]
    assert "crashed (exit code 7)" in got[1].reason
    assert "ValueError: boom" in got[3].reason


def test_close_is_clean_and_idempotent():
    pool = RewardPool(num_workers=2)
    procs = [s.proc for s in pool._slots]
    pool.close()
    pool.close()
    assert all(not p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["Answer: 1"], ["1"])


def test_argument_checks():
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(num_workers=0)
    with pytest.raises(ValueError, match="registered: "):
        RewardPool("nope")
    with RewardPool(num_workers=1) as pool, pytest.raises(ValueError, match="2 responses but 1"):
        pool.score(["a", "b"], ["1"])


class _GonePeer:
    """A worker's end of the pipe whose parent is gone after ``answers`` chunks: recv raises EOFError (or send
    BrokenPipeError, with ``on_send``), as the pipe of a killed rank does."""

    def __init__(self, answers: int, on_send: bool = False) -> None:
        self.chunks, self.on_send, self.sent = answers, on_send, []

    def recv(self):
        if self.chunks == 0:
            raise EOFError
        self.chunks -= 1
        return [("Answer: 540", "540")]

    def send(self, obj):
        if self.on_send and obj != "ready":
            raise BrokenPipeError(32, "Broken pipe")
        self.sent.append(obj)


class _Counter:
    value = 0


@pytest.mark.parametrize("on_send", [False, True], ids=["recv", "send"])
def test_a_worker_whose_parent_died_stops_without_a_traceback(monkeypatch, on_send):
    """The rank that owns the pool is killed (rehearse's kill -9): its workers find the pipe closed and stop
    quietly (before: EOFError/BrokenPipeError out of the worker, a traceback in the run's log)."""
    import signal

    from dapo_mcore.reward import pool

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the worker ignores SIGINT: not in the test process
    monkeypatch.setattr(pool.mp, "parent_process", lambda: None)  # the parent: gone
    conn = _GonePeer(answers=1, on_send=on_send)
    assert pool._worker_main(conn, _Counter(), compute_score, {}) is None
    assert conn.sent[0] == "ready" and len(conn.sent) == (1 if on_send else 2)


def test_a_worker_whose_parent_lives_and_dropped_the_pipe_still_raises(monkeypatch):
    """Only a dead parent is quiet: a live parent that closed the pipe without the stop message is a bug, raised."""
    import signal

    from dapo_mcore.reward import pool

    class _Alive:
        def join(self, timeout=None):
            pass

        def is_alive(self):
            return True

    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setattr(pool.mp, "parent_process", lambda: _Alive())
    with pytest.raises(EOFError):
        pool._worker_main(_GonePeer(answers=0), _Counter(), compute_score, {})
