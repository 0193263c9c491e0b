"""Prompt sampler: epoch coverage and exact resume."""

import json

import pytest

from dapo_mcore.data.sampler import PromptSampler

pytestmark = pytest.mark.unit


def test_every_prompt_once_per_epoch_and_seeded():
    s = PromptSampler(list(range(10)), seed=1)
    first = s.next_batch(5) + s.next_batch(5)
    assert sorted(first) == list(range(10)) and s.epoch == 1
    second = s.next_batch(5) + s.next_batch(5)
    assert sorted(second) == list(range(10)) and second != first
    t = PromptSampler(list(range(10)), seed=1)
    assert t.next_batch(5) + t.next_batch(5) == first
    assert PromptSampler(list(range(10)), seed=2).next_batch(5) != first[:5]


def test_returns_records_and_crosses_epoch_boundaries():
    recs = [f"p{i}" for i in range(7)]
    s = PromptSampler(recs, seed=0)
    stream = [r for _ in range(7) for r in s.next_batch(3)]  # 21 prompts = 3 epochs
    for e in range(3):
        assert sorted(stream[7 * e: 7 * e + 7]) == sorted(recs)


def test_resume_continues_exactly_even_with_varying_batch_sizes():
    sizes = [4, 3, 5, 4, 6, 2, 4, 7, 1, 4, 4, 3]
    ref = PromptSampler(list(range(13)), seed=5)
    expected = [ref.next_indices(n) for n in sizes]
    s = PromptSampler(list(range(13)), seed=5)
    got = [s.next_indices(n) for n in sizes[:5]]
    state = json.loads(json.dumps(s.state_dict()))
    resumed = PromptSampler(list(range(13)), seed=5)
    resumed.load_state_dict(state)
    got += [resumed.next_indices(n) for n in sizes[5:]]
    assert got == expected


def test_resume_rejects_a_different_run():
    s = PromptSampler(list(range(13)), seed=5)
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(list(range(13)), seed=6).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="num_prompts"):
        PromptSampler(list(range(12)), seed=5).load_state_dict(s.state_dict())


def test_no_shuffle_and_bad_args():
    assert PromptSampler(list(range(5)), shuffle=False).next_indices(5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="empty"):
        PromptSampler([])
    with pytest.raises(ValueError, match="batch size"):
        PromptSampler([1]).next_indices(0)
