"""Advantages, dynamic sampling, overlong shaping, metrics and AlgoConfig vs hand-derived/naive values."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from dapo_mcore.algo import (
    AlgoConfig,
    DynamicSamplingExhausted,
    Group,
    broadcast_to_tokens,
    collect_groups,
    group_advantages,
    overlong_filter_mask,
    overlong_penalty,
    usable_groups,
)
from dapo_mcore.algo.metrics import (
    advantage_stats,
    response_length_stats,
    reward_stats,
    usable_group_fraction,
)

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- advantages
def test_group_advantages_match_naive():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(-1, 2, (6, 5), generator=g).double()
    rewards[0] = 1.0  # constant group -> zero advantage
    adv = group_advantages(rewards)
    for i, row in enumerate(rewards.tolist()):
        mu, sd = statistics.mean(row), statistics.stdev(row)  # stdev: divisor n - 1
        for j, r in enumerate(row):
            assert adv[i, j].item() == pytest.approx((r - mu) / (sd + 1e-6), abs=1e-12)
    assert adv[0].abs().max() == 0
    nostd = group_advantages(rewards, norm_by_std=False)
    assert torch.allclose(nostd, rewards - rewards.mean(1, keepdim=True))


def test_group_of_one_uses_mean0_std1():
    adv = group_advantages(torch.tensor([[1.0], [-1.0]]), eps=1e-6)
    assert adv.squeeze().tolist() == pytest.approx([1 / (1 + 1e-6), -1 / (1 + 1e-6)])


def test_two_of_four_known_value():
    # rewards 1,1,-1,-1: mean 0, unbiased std = sqrt(4/3)
    adv = group_advantages(torch.tensor([[1.0, 1.0, -1.0, -1.0]]))
    assert adv[0, 0].item() == pytest.approx(1 / (math.sqrt(4 / 3) + 1e-6))


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert out.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


# ---------------------------------------------------------------- dynamic sampling
def test_usable_groups_on_accuracy():
    acc = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0], [0, 1, 1]])
    assert usable_groups(acc).tolist() == [False, False, True, True]
    assert usable_group_fraction(acc) == 0.5


def make_source(batches: list[list[list[int]]], lengths: int = 10):
    calls = []

    def gen(i: int) -> list[Group]:
        calls.append(i)
        return [Group(acc=[bool(a) for a in accs], payload=(i, k), response_lengths=[lengths] * len(accs))
                for k, accs in enumerate(batches[i])]

    return gen, calls


def test_collect_refills_and_drops_surplus():
    mixed, right, wrong = [1, 0], [1, 1], [0, 0]
    gen, calls = make_source([[mixed, right, wrong], [wrong, mixed], [mixed, mixed, mixed]])
    kept, st = collect_groups(gen, target_groups=3, max_gen_batches=10, enabled=True)
    assert calls == [0, 1, 2]
    assert [g.payload for g in kept] == [(0, 0), (1, 1), (2, 0)]
    assert (st.gen_batches, st.groups_generated, st.groups_kept, st.groups_rejected, st.groups_surplus) == (3, 8, 3, 3, 2)
    assert (st.groups_all_correct, st.groups_all_wrong) == (1, 2)
    assert (st.rollouts_generated, st.rollouts_kept, st.rollouts_rejected, st.rollouts_surplus) == (16, 6, 6, 4)
    assert (st.tokens_generated, st.tokens_kept, st.tokens_rejected) == (160, 60, 100)
    assert st.usable_fraction == pytest.approx(5 / 8)
    assert st.as_metrics()["sampling/groups_surplus"] == 2.0


def test_collect_raises_after_max_batches_with_fix():
    gen, calls = make_source([[[1, 1], [0, 0]]] * 5)
    with pytest.raises(DynamicSamplingExhausted, match="max_gen_batches") as info:
        collect_groups(gen, target_groups=1, max_gen_batches=3, enabled=True)
    assert calls == [0, 1, 2]
    assert info.value.stats.groups_rejected == 6
    assert "more prompts per batch" in str(info.value)
    assert "algo.dynamic_sampling=false rollout.gen_batch_prompts=1" in str(info.value)  # the whole way out
    assert "new run.dir, or add run.overwrite=true" in str(info.value)  # which the run-dir check would refuse


def test_collect_unlimited_and_disabled():
    gen, calls = make_source([[[0, 0]]] * 12 + [[[1, 0]]])
    kept, st = collect_groups(gen, target_groups=1, max_gen_batches=0, enabled=True)
    assert len(calls) == 13 and st.gen_batches == 13 and len(kept) == 1
    gen, calls = make_source([[[0, 0], [1, 1], [1, 0]]])
    kept, st = collect_groups(gen, target_groups=2, max_gen_batches=1, enabled=False)
    assert [g.payload for g in kept] == [(0, 0), (0, 1)] and st.groups_surplus == 1 and st.groups_rejected == 0


def test_collect_rejects_empty_source():
    with pytest.raises(ValueError, match="no groups"):
        collect_groups(lambda i: [], target_groups=1, max_gen_batches=0)


# ---------------------------------------------------------------- overlong
def naive_r_length(n: int, lmax: int, lcache: int) -> float:
    if n <= lmax - lcache:
        return 0.0
    if n <= lmax:
        return ((lmax - lcache) - n) / lcache
    return -1.0


def test_overlong_penalty_matches_definition():
    lengths = torch.tensor([0, 100, 16384, 16385, 18432, 20479, 20480, 20481, 50000])
    got = overlong_penalty(lengths, 20480, 4096, factor=1.0)
    for n, v in zip(lengths.tolist(), got.tolist(), strict=True):
        assert v == pytest.approx(naive_r_length(n, 20480, 4096), abs=1e-7)
    assert got[4].item() == pytest.approx(-0.5)
    assert overlong_penalty(lengths, 20480, 4096, factor=0.5).min().item() == pytest.approx(-0.5)


def test_overlong_filter_mask():
    mask = torch.ones(3, 4)
    out = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert out.sum(-1).tolist() == [4, 0, 4]


# ---------------------------------------------------------------- metrics
def test_step_metrics():
    m = response_length_stats(torch.tensor([3, 5, 10]), torch.tensor([False, False, True]))
    assert m == {"response_length/mean": 6.0, "response_length/max": 10.0, "response_length/min": 3.0,
                 "response_length/truncated_frac": pytest.approx(1 / 3)}
    r = reward_stats(torch.tensor([1.0, -1.0, -1.5]), torch.tensor([True, False, False]))
    assert r["reward/mean"] == pytest.approx(-0.5) and r["reward/acc"] == pytest.approx(1 / 3)
    a = advantage_stats(torch.tensor([[1.0, 9.0], [-2.0, 0.0]]), torch.tensor([[1, 0], [1, 1]]))
    assert a["advantage/max"] == 1.0 and a["advantage/abs_mean"] == pytest.approx(1.0)


# ---------------------------------------------------------------- config
def test_presets_and_validation():
    dapo = AlgoConfig.from_preset("dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.loss_agg, dapo.dynamic_sampling) == (0.2, 0.28, "token-mean", True)
    grpo = AlgoConfig.from_preset("grpo", max_gen_batches=0)
    assert (grpo.clip_high, grpo.loss_agg, grpo.dynamic_sampling, grpo.overlong_shaping) == (
        0.2, "seq-mean-token-mean", False, False)
    for bad, match in [({"kl_coef": 0.1}, "no KL term"), ({"entropy_coef": 0.01}, "entropy_coef=0"),
                       ({"loss_agg": "mean"}, "valid: token-mean"), ({"dual_clip_c": 1.0}, "> 1"),
                       ({"overlong_cache_len": 30000}, "overlong_cache_len"), ({"tis_cap": 0.5}, ">= 1")]:
        with pytest.raises(ValueError, match=match):
            AlgoConfig.from_preset("dapo", **bad)
    with pytest.raises(ValueError, match="valid: dapo, grpo"):
        AlgoConfig.from_preset("ppo")
    with pytest.raises(ValueError, match="unknown AlgoConfig field"):
        AlgoConfig.from_preset("dapo", clip_hi=0.3)
