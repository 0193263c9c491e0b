"""The roll call that names a hung rank: real TCPStore clients on this host, one rank without a responder."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from dapo_mcore.actor import rollcall

pytestmark = pytest.mark.unit

TIMEOUT = datetime.timedelta(seconds=10)


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    yield server


def test_the_rank_without_a_live_responder_is_named(store):
    live = [rollcall._RollCall("127.0.0.1", store.port, rank, 3, TIMEOUT) for rank in (0, 1)]
    store.set(f"{rollcall.PREFIX}/host/2", "n2")  # rank 2 started, recorded its host, then hung: no answer
    try:
        silent = live[0].call(wait_s=2.0)
        assert silent == rollcall.Silent(((2, "n2"),))
        assert silent.describe() == "rank 2 on n2 stopped answering (hung: stopped, frozen or stuck)"
    finally:
        for r in live:
            r.end()
    assert not any(r._thread.is_alive() for r in live), "end() releases every responder"


def test_every_rank_answering_and_a_store_that_does_not_answer(store):
    live = [rollcall._RollCall("127.0.0.1", store.port, rank, 2, TIMEOUT) for rank in (0, 1)]
    try:
        assert live[1].call(wait_s=2.0) == rollcall.Silent(())
        assert "alive but stuck" in rollcall.Silent(()).describe()
        with socket.socket() as frozen:  # accepts connections (the kernel's backlog), never answers
            frozen.bind(("127.0.0.1", 0))
            frozen.listen(8)
            live[0].port = frozen.getsockname()[1]
            silent = live[0].call(wait_s=1.0)
        assert silent.store_down and "rank 0's" in silent.describe()
    finally:
        live[0].port = store.port
        for r in live:
            r.end()


def test_one_process_has_no_roll_call(monkeypatch):
    monkeypatch.setattr(rollcall, "_ACTIVE", None)
    rollcall.start("127.0.0.1", 1, 0, 1, TIMEOUT)  # world 1: no store to connect to, nothing started
    assert rollcall.call() is None
