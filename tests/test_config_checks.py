"""Config checks that used to pass silently: GRPO batch sizes, duplicate YAML keys, messages naming the one bad
key, and a skipped (all-masked) mini-batch that must not pull a step's averaged metrics toward zero."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from dapo_mcore.algo.metrics import average_updates
from dapo_mcore.config import ConfigError, load_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny_cpu.yaml"


def _error(overrides: list[str], path: Path = TINY) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides).validate(1)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


# ---- algo.dynamic_sampling=false trains on exactly one generation batch -------------------------------------
@pytest.mark.parametrize("gen", [8, 32])
def test_no_dynamic_sampling_needs_one_batch_of_exactly_the_training_prompts(gen):
    msg = _error(["algo.dynamic_sampling=false", f"rollout.gen_batch_prompts={gen}"])  # prompts_per_step=16
    assert f"rollout.gen_batch_prompts={gen}" in msg and "train.prompts_per_step=16" in msg
    assert "set rollout.gen_batch_prompts=16" in msg
    assert ("fewer groups" if gen < 16 else "surplus") in msg
    load_config(TINY, ["algo.dynamic_sampling=false", "rollout.gen_batch_prompts=16"]).validate(1)
    load_config(TINY, ["rollout.gen_batch_prompts=8"]).validate(1)  # dynamic sampling refills: any size works


# ---- duplicate keys ----------------------------------------------------------------------------------------
def test_duplicate_section_in_a_yaml_file_is_refused_naming_key_and_lines(tmp_path):
    bad = tmp_path / "dup.yaml"
    bad.write_text(TINY.read_text() + "\nalgo:\n  clip_high: 0.2\n")
    first = next(i for i, line in enumerate(TINY.read_text().splitlines(), 1) if line.startswith("algo:"))
    second = len(TINY.read_text().splitlines()) + 2
    msg = _error([], path=bad)
    assert "'algo' appears twice" in msg and f"lines {first} and {second}" in msg and "dup.yaml" in msg, msg


def test_duplicate_nested_key_is_refused_with_its_dotted_path(tmp_path):
    bad = tmp_path / "dup.yaml"
    bad.write_text("optim:\n  lr: 1.0e-3\n  warmup_steps: 2\n  lr: 1.0e-4\n")
    assert "'optim.lr' appears twice (lines 2 and 4)" in _error([], path=bad)
    ok = tmp_path / "ok.yaml"  # the same key name in two sections is not a duplicate
    ok.write_text("train:\n  steps: 3\neval:\n  every: 1\ncheckpoint:\n  every: 1\n")
    load_config(ok)


# ---- each message names the offending key alone -------------------------------------------------------------
@pytest.mark.parametrize("override, key, others", [
    ("optim.lr=-1e-3", "optim.lr=-0.001", ("warmup_steps", "grad_clip")),
    ("optim.lr=.nan", "optim.lr=nan", ("warmup_steps",)),
    ("optim.grad_clip=-1", "optim.grad_clip=-1", ("optim.lr", "warmup_steps")),
    ("train.steps=-1", "train.steps=-1", ("prompts_per_step", "epochs")),
    ("train.epochs=0", "train.epochs=0", ("prompts_per_step", "train.steps")),
    ("checkpoint.keep_last=0", "checkpoint.keep_last=0", ("checkpoint.every",)),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0", ("gen_batch_prompts",)),
    ("rollout.temperature=0", "rollout.temperature=0", ("top_p",)),
    ("eval.every=-1", "eval.every=-1", ("eval.k",)),
])
def test_a_bad_value_names_its_own_key_and_no_other(override, key, others):
    msg = _error([override])
    assert key in msg, msg
    assert not any(o in msg for o in others), msg


# ---- a skipped (all-masked) mini-batch does not pull the step's averages toward zero ------------------------
def test_average_updates_leaves_skipped_updates_out():
    ups = [{"loss": 0.4, "clipfrac": 0.2, "entropy": 1.0}, {"skipped": 1.0},
           {"loss": 0.2, "clipfrac": 0.1, "entropy": 0.5}]
    out = average_updates(ups)
    assert out == pytest.approx({"loss": 0.3, "clipfrac": 0.15, "entropy": 0.75, "updates": 2.0,
                                 "skipped_updates": 1.0})
    assert average_updates([{"skipped": 1.0}] * 2) == {"updates": 0.0, "skipped_updates": 2.0}


def test_average_updates_matches_a_naive_mean_when_nothing_is_skipped():
    import random

    rng = random.Random(0)
    ups = [{k: rng.uniform(-1, 1) for k in ("loss", "clipfrac", "entropy", "grad_norm")} for _ in range(7)]
    out = average_updates(ups)
    for k in ups[0]:
        naive = 0.0
        for u in ups:
            naive += u[k]
        assert out[k] == naive / len(ups)  # same summation order: bit-identical to the old plain mean
    assert out["updates"] == 7.0 and out["skipped_updates"] == 0.0


class _FakeActor:
    """Mini-batches whose responses are all masked are skipped, as MegatronActor.train_mini_batch does."""

    def train_mini_batch(self, samples, lr):
        if all(float(s.loss_mask.sum()) == 0 for s in samples):
            return {"skipped": 1.0}
        return {"loss": 0.5, "clipfrac": 0.25, "entropy": 2.0, "grad_norm": 1.0}


def test_trainer_step_metrics_ignore_an_all_masked_mini_batch():
    import torch

    from dapo_mcore.actor.megatron_actor import TrainSample
    from dapo_mcore.trainer import Trainer

    cfg = load_config(TINY, ["train.prompts_per_step=4", "train.mini_batch_prompts=2", "rollout.n=2"])
    trainer = Trainer(cfg, SimpleNamespace(actor=_FakeActor()))

    def sample(masked: bool) -> TrainSample:
        return TrainSample([1, 2], [3, 4], 1.0, loss_mask=torch.zeros(2) if masked else torch.ones(2))

    # 4 groups x 2 responses; the second mini-batch (groups 2-3) is all truncated under the overlong filter.
    samples = [sample(masked=i >= 4) for i in range(8)]
    out = trainer.train([object()] * 4, samples)
    assert (out["loss"], out["clipfrac"], out["entropy"]) == (0.5, 0.25, 2.0)
    assert (out["updates"], out["skipped_updates"]) == (1.0, 1.0)
    assert not math.isnan(out["lr"])
