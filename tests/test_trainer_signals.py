"""The trainer's stop-signal handling, without a run: which signal asks for what, and the exit code it leads to."""

from __future__ import annotations

import signal

import pytest

from dapo_mcore.trainer import EXIT_INTERRUPTED, EXIT_REQUEUE, _Signals

pytestmark = pytest.mark.unit


def test_first_ctrl_c_asks_for_a_checkpoint_and_130_the_second_abandons_at_once():
    before = signal.getsignal(signal.SIGINT)
    signals = _Signals()
    try:
        signals._handle(signal.SIGINT, None)
        assert signals.requested == "SIGINT" and signals.exit_code == EXIT_INTERRUPTED == 130
        with pytest.raises(KeyboardInterrupt):
            signals._handle(signal.SIGINT, None)
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_preemption_signals_ask_for_a_requeue_and_a_later_ctrl_c_keeps_that_exit():
    signals = _Signals()
    try:
        signals._handle(signal.SIGUSR1, None)
        assert signals.requested == "SIGUSR1" and signals.exit_code == EXIT_REQUEUE == 75
        signals._handle(signal.SIGINT, None)  # a first Ctrl-C: the stop is already asked for
        signals._handle(signal.SIGTERM, None)
        assert signals.exit_code == EXIT_REQUEUE
        with pytest.raises(KeyboardInterrupt):  # the second Ctrl-C still abandons the step
            signals._handle(signal.SIGINT, None)
    finally:
        signals.restore()


def test_the_engine_ranks_ignore_every_signal_the_trainer_answers():
    # SIGHUP killed the async engine ranks (exit 129, no checkpoint) while the trainer checkpointed for it
    from dapo_mcore.rollout.pipeline.async_engines import IGNORED_SIGNALS

    signals = _Signals()
    try:
        assert set(IGNORED_SIGNALS) == set(signals._previous) and signal.SIGHUP in IGNORED_SIGNALS
    finally:
        signals.restore()


def test_a_stop_during_the_last_step_announces_exit_0_not_75(caplog):
    import logging

    signals = _Signals()
    try:
        signals.last_step = True
        with caplog.at_level(logging.WARNING):
            signals._handle(signal.SIGTERM, None)
        assert "exit 0" in caplog.text and "exit 75" not in caplog.text
    finally:
        signals.restore()
