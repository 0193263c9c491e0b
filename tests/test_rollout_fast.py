"""The fast rollout simulator (``EngineSim.advance`` written flat, warm-up steps shared or only drawn) gives the
numbers of its plain form (tests/rollout_model_reference.py): event by event on random engines, and every variant's
step time of ``plan --rank-variants`` on two recipes and three settings, compared exactly (one machine, same floats)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dapo_mcore.plan import rollout_model, step_model
from dapo_mcore.plan.rollout_model import EngineModel, EngineSim
from tests.rollout_model_reference import ReferenceEngineSim, reference_generation

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _groups(rng: np.random.Generator, k: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Random groups: small lengths (ties on purpose), some partly generated already (partial rollouts)."""
    out = []
    for _ in range(k):
        lengths = rng.integers(1, 9, size=int(rng.integers(1, 5)))
        progress = None
        if rng.random() < 0.3:
            progress = np.minimum(rng.integers(0, 9, size=len(lengths)), lengths).astype(float)
            progress[0] = min(progress[0], lengths[0] - 1)  # one response left to run
        out.append((lengths, progress))
    return out


def _drive(sim_cls: type, model: EngineModel, seed: int, until_group: bool) -> list:
    """A scripted run: batches queued on chosen engines, a feeder that hands out more groups, every event's clock,
    completed groups and every group's progress recorded."""
    rng = np.random.default_rng(seed)
    sim = sim_cls(model)
    fed = _groups(rng, int(rng.integers(0, 6)))

    def feeder(engine: int) -> bool:
        if not fed:
            return False
        lengths, progress = fed.pop(0)
        sim.add_group(engine, lengths, progress)
        return True

    sim.feeder = feeder if rng.random() < 0.7 else None
    trace = []
    for _ in range(int(rng.integers(1, 4))):
        for lengths, progress in _groups(rng, int(rng.integers(1, 6))):
            sim.add_group(int(rng.integers(0, model.engines)), lengths, progress)
        for _ in range(int(rng.integers(1, 12))):
            done = sim.advance(until_group=until_group)
            trace.append((done, sim.now, [sim.progress(g).tolist() for g in range(len(sim.group_left))]))
            if done is None:
                break
        if rng.random() < 0.3:
            sim.wake()
    while (done := sim.advance(until_group=until_group)) is not None:
        trace.append((done, sim.now))
    trace.append((sim.now, sim.seq_done))
    return trace


@pytest.mark.parametrize("until_group", [False, True])
def test_the_engine_simulator_runs_event_by_event_as_its_plain_form(until_group):
    rng = np.random.default_rng(7)
    for seed in range(60):
        t1 = 0.0 if seed % 4 == 0 else float(rng.uniform(0.01, 0.5))  # t1 = 0: every engine at one pace, many ties
        model = EngineModel(int(rng.integers(1, 4)), int(rng.integers(1, 6)), float(rng.uniform(0.5, 2.0)), t1)
        assert _drive(EngineSim, model, seed, until_group) == _drive(ReferenceEngineSim, model, seed, until_group)


SMALL_32B = ["model.hf_path=null", "model.preset=qwen2.5-32b", "train.prompts_per_step=8",
             "rollout.gen_batch_prompts=16", "train.mini_batch_prompts=8", "algo.max_gen_batches=4"]
"""The fast 32B recipe at 8 prompts a step: fewer groups than its 32 colocated engines (split over them) and more
than its 24 async ones, a fraction of a second a pricing of all 13 variants."""


def _ranked(overrides: list[str], st: step_model.SimSettings) -> list[tuple[str, int | None, float]]:
    from dapo_mcore.commands.plan import plan_input_from_config
    from dapo_mcore.config import load_config
    from dapo_mcore.plan.disagg import TransferRates, own_split

    cfg = load_config(str(ROOT / "examples" / "qwen2.5-32b-fp8.yaml"), overrides)
    p = step_model.colocated_input(cfg, plan_input_from_config(cfg, 128))
    rows = step_model.rank_variants(cfg, p, TransferRates(), st, own_split(cfg, p, TransferRates()))
    return [(v, getattr(s, "engine_gpus", None), t) for v, s, t in rows]


@pytest.mark.parametrize(("st", "recipe"), [
    (step_model.SimSettings(steps=1), []),  # what plan prices
    (step_model.SimSettings(steps=2, warmup=1, max_staleness=2, order="completion"),
     ["rollout.n=8", "rollout.max_new_tokens=4096"]),
    (step_model.SimSettings(steps=1, warmup=0, max_seqs=64, single_seq_tokens_per_s=400.0), []),  # the smoke's
])
def test_every_variant_prices_as_with_the_plain_simulator(monkeypatch, st, recipe):
    fast = _ranked([*SMALL_32B, *recipe], st)
    assert len(fast) == 13
    with monkeypatch.context() as m:
        m.setattr(rollout_model, "EngineSim", ReferenceEngineSim)
        m.setattr(step_model, "generation", reference_generation)
        assert _ranked([*SMALL_32B, *recipe], st) == fast
