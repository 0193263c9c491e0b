"""An engine whose weights were discarded (vLLM sleep level 2 after an evaluation, or dummy start-up weights) is
resynced before the trainer wakes it; an engine that kept its weights is not (no needless sync per phase)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dapo_mcore.config import Config
from dapo_mcore.rollout.pipeline.colocated import ColocatedRollouts
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


class _ExportingActor(_Actor):
    """Exports the tiny model's full HF state dict, as a sync must."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def export_hf_weights(self):
        items = list(self.state.items())
        yield from (items[i:i + 8] for i in range(0, len(items), 8))


@pytest.mark.parametrize("level", [1, 2])
def test_every_wake_the_trainer_causes_is_preceded_by_releasing_the_allocator_cache(monkeypatch, level):
    """The trainer's phases wake the real VLLMEngine (a recording fake backend under it): a step's generation, an
    evaluation (the same ``_engine_awake``) and, at level 2, the resync its sleep forces. Each wake_up must come
    right after torch.cuda.empty_cache, so the trainer's freed activations are free for vLLM's own allocator."""
    import torch

    from dapo_mcore.rollout.engines.vllm_engine import VLLMEngine, VLLMEngineOptions
    from tests.test_rollout_vllm import TINY, FakeBackend, hf_state_dict

    backend = FakeBackend()
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: backend.calls.append(("empty_cache",)))
    engine = VLLMEngine(VLLMEngineOptions(model_path="/m", sleep_level=level, load_format="dummy"), TINY,
                        backend=backend, world_size=1)
    rollouts = ColocatedRollouts(Config(), engine=engine, scheduler=None, tokenizer=None, score=None,
                                 encode_prompt=None, timer=None)
    trainer = Trainer(Config(), SimpleNamespace(rollouts=rollouts, actor=_ExportingActor(hf_state_dict())))
    engine.sleep()
    trainer.sync_weights()  # start-up sync of the dummy weights
    for _ in range(3):  # generation, evaluation, the next step's generation
        with trainer._engine_awake():
            assert engine.state == "awake"
    wakes = [i for i, c in enumerate(backend.calls) if c[0] == "wake_up"]
    assert all(backend.calls[i - 1] == ("empty_cache",) for i in wakes), backend.calls
    syncs = sum(c == ("begin_weight_update",) for c in backend.calls)
    # the start-up sync wakes the weights, the first phase the KV cache, each later phase both; level 1 keeps the
    # weights (one sync), level 2 discards them at every sleep (a resync before each later phase)
    assert (len(wakes), syncs) == (1 + 1 + 2 * 2, 1 if level == 1 else 3)
