"""A multi-turn response reaches the actor's batch with its tool tokens masked: make_samples composes the tool mask
with the overlong filter, and the engine/trainer mismatch and the correction skip the tool tokens' NaN log-probs."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch

from dapo_mcore.config import load_config
from dapo_mcore.rollout.protocol import Response

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
NAN = math.nan


def group(responses, rewards):
    from dapo_mcore.rollout.scheduling.groups import GroupData

    return GroupData(record=None, prompt_ids=[1, 2], responses=responses, scores=rewards, acc=[r > 0 for r in rewards],
                     rewards=rewards, gen_batch=0)


def tool_response(finish="stop"):
    return Response([5, 6, 7, 8, 9, 2], [-1.0, -0.5, NAN, NAN, -0.2, -0.1], finish,
                    loss_mask=[True, True, False, False, True, True], tool_calls=1)


def trainer_for(overrides, actor_lp):
    from dapo_mcore.trainer import Trainer

    cfg = load_config(ROOT / "examples" / "tiny_cpu.yaml", overrides)
    actor = types.SimpleNamespace(compute_logprobs=lambda s: ([lp.clone() for lp in actor_lp], None),
                                  routing_mismatch=None)
    return Trainer(cfg, types.SimpleNamespace(actor=actor))


def test_tool_tokens_leave_the_loss_mask_and_the_overlong_filter_still_applies():
    trainer = trainer_for(["algo.overlong_filter=true"], [])
    plain = Response([5, 6, 2], [-1.0, -1.0, -1.0], "stop")
    samples = trainer.make_samples([group([tool_response(), tool_response("length"), plain], [1.0, -1.0, -1.0])])
    assert samples[0].loss_mask.tolist() == [1, 1, 0, 0, 1, 1]
    assert samples[1].loss_mask.tolist() == [0] * 6  # truncated: overlong filter
    assert samples[2].loss_mask.tolist() == [1, 1, 1]
    assert samples[0].extra["model_tokens"].tolist() == [True, True, False, False, True, True]


@pytest.mark.parametrize("correction", [[], ["algo.tis_cap=2.0"],
                                        ["algo.rollout_correction.preset=geo_rs"]])
def test_mismatch_and_correction_skip_tool_tokens(correction):
    actor_lp = [torch.tensor([-1.1, -0.4, -3.0, -4.0, -0.2, -0.3]), torch.tensor([-1.0, -1.2, -0.9])]
    trainer = trainer_for(correction, actor_lp)
    plain = Response([5, 6, 2], [-1.0, -1.0, -1.0], "stop")
    samples = trainer.make_samples([group([tool_response(), plain], [1.0, -1.0])])
    out = trainer.old_logprobs(samples)
    assert all(math.isfinite(v) for v in out.values()), out
    assert out["mismatch/tokens"] == 4 + 3
    d = [-1.0 + 1.1, -0.5 + 0.4, -0.2 + 0.2, -0.1 + 0.3, 0.0, 0.2, -0.1]
    assert out["mismatch/kl_k1"] == pytest.approx(sum(d) / 7, abs=1e-6)
    for s in samples:
        if s.tis_weights is not None:
            assert torch.isfinite(s.tis_weights[s.loss_mask > 0]).all()
