"""Prompt sampler: epoch coverage and exact resume."""

import json

import pytest

from dapo_mcore.data.sampler import PromptSampler

pytestmark = pytest.mark.unit


def test_every_prompt_once_per_epoch_and_seeded():
    s = PromptSampler(10, batch_size=5, seed=1)
    first = s.next_batch() + s.next_batch()
    assert sorted(first) == list(range(10)) and s.epoch == 1
    second = s.next_batch() + s.next_batch()
    assert sorted(second) == list(range(10)) and second != first
    t = PromptSampler(10, batch_size=5, seed=1)
    assert t.next_batch() + t.next_batch() == first
    assert PromptSampler(10, 5, seed=2).next_batch() != first[:5]


def test_batches_cross_epoch_boundaries():
    s = PromptSampler(7, batch_size=3, seed=0)
    stream = [i for _ in range(7) for i in s.next_batch()]  # 21 indices = 3 epochs
    for e in range(3):
        assert sorted(stream[7 * e: 7 * e + 7]) == list(range(7))


def test_resume_continues_exactly():
    ref = PromptSampler(13, batch_size=4, seed=5)
    expected = [ref.next_batch() for _ in range(12)]
    s = PromptSampler(13, batch_size=4, seed=5)
    got = [s.next_batch() for _ in range(5)]
    state = json.loads(json.dumps(s.state_dict()))
    resumed = PromptSampler(13, batch_size=4, seed=5)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(7)]
    assert got == expected


def test_resume_rejects_a_different_run():
    s = PromptSampler(13, batch_size=4, seed=5)
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(13, batch_size=4, seed=6).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="num_prompts"):
        PromptSampler(12, batch_size=4, seed=5).load_state_dict(s.state_dict())


def test_no_shuffle_and_bad_args():
    assert PromptSampler(5, 5, shuffle=False).next_batch() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="empty"):
        PromptSampler(0, 2)
