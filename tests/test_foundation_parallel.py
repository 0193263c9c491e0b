"""Foundation: the tiny Qwen2 on Megatron-Core over two gloo processes (CPU compatibility layer applied).

TP=2 gives the same full-vocab logits as TP=1 and as Hugging Face; PP=2 runs forward and backward through
Megatron's pipeline schedule with finite, non-zero gradients on both stages. The processes run once per pytest
session (tests/dist_scripts/harness.py) and also serve tests/test_actor_*.py.
"""

from __future__ import annotations

import pytest

from tests.dist_scripts.harness import run_all

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs():
    return run_all()


def test_tp2_logits_equal_tp1_and_hf(runs):
    tp1, hf = runs["ref"]["logits"], runs["hf"]["logits"]
    assert tp1.shape == hf.shape == (2, 11, runs["spec"]["vocab_size"])  # vocab padding stripped (37 of 64 rows)
    assert (tp1 - hf).abs().max().item() <= 1e-5
    for rank in range(2):
        tp2 = runs["multi"][rank]["tp2_pp1_dp1"]["logits"]
        assert tp2.shape == tp1.shape
        assert (tp2 - tp1).abs().max().item() <= 1e-5, rank
    assert hf.std() > 0.1  # random weights, not a degenerate model


def test_pp2_forward_backward_gives_finite_grads_on_both_stages(runs):
    stages = {}
    for rank in range(2):
        grads = runs["multi"][rank]["tp1_pp2_dp1"]["grads"]
        stages[grads["stage"]] = grads
    assert sorted(stages) == [0, 1]
    for stage, grads in stages.items():
        assert grads["num_params"] > 0 and grads["all_finite"], (stage, grads)
        assert grads["num_nonzero"] == grads["num_params"], (stage, grads)  # every parameter got a gradient
    # Each stage holds one of the two layers; together they hold every parameter of the TP=1 model once, plus the
    # output layer that the last stage keeps tied to the first stage's embedding.
    ref = runs["ref"]["grads"]["num_params"]
    assert stages[0]["num_params"] + stages[1]["num_params"] == ref + 1
    assert runs["multi"][0]["tp1_pp2_dp1"]["logits"].equal(runs["multi"][1]["tp1_pp2_dp1"]["logits"])
