"""An engine whose weights were discarded (vLLM sleep level 2 after an evaluation, or dummy start-up weights) is
resynced before the trainer wakes it; an engine that kept its weights is not (no needless sync per phase)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dapo_mcore.config import Config
from dapo_mcore.rollout.colocated import ColocatedRollouts
from dapo_mcore.rollout.protocol import EngineError
from dapo_mcore.trainer import Trainer

pytestmark = pytest.mark.unit


class _Level2Engine:
    """The state machine of VLLMEngine at sleep level 2 on a GPU: sleep discards the weights, wake refuses them."""

    def __init__(self) -> None:
        self.weights_valid, self.awake, self.events = True, False, []

    def update_weights(self, buckets) -> None:
        list(buckets)
        self.weights_valid = True
        self.events.append("sync")

    def wake(self) -> None:
        if not self.weights_valid:
            raise EngineError("sleep level 2 discarded the weights; call update_weights() before wake().")
        self.awake = True
        self.events.append("wake")

    def sleep(self) -> None:
        self.awake, self.weights_valid = False, False
        self.events.append("sleep")


class _Actor:
    def offload(self) -> None: ...

    def reload(self) -> None: ...

    def export_hf_weights(self):
        yield from ()


def test_a_discarded_engine_is_resynced_before_it_wakes_and_a_valid_one_is_not():
    engine = _Level2Engine()
    rollouts = ColocatedRollouts(Config(), engine=engine, scheduler=None, tokenizer=None, score=None,
                                 encode_prompt=None, timer=None)
    trainer = Trainer(Config(), SimpleNamespace(rollouts=rollouts, actor=_Actor()))
    with trainer._engine_awake():  # weights valid (the step's sync just landed): no extra sync
        assert engine.awake
    with trainer._engine_awake():  # e.g. the next step's generation after an evaluation's level-2 sleep
        assert engine.awake
    assert engine.events == ["wake", "sleep", "sync", "wake", "sleep"]
