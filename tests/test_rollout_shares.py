"""Engine groups always take part in every generation (vLLM data parallel steps together), shares travel from one
rank per group in bounded chunks, and every response is scored once so ranks cannot disagree on a verdict."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from dapo_mcore.rollout.protocol import EngineError, Response
from dapo_mcore.rollout.scheduling.gather import merge_shares, plan_shares
from tests.gloo_workers import run_gloo_workers


@pytest.mark.unit
@pytest.mark.parametrize(("prompts", "n", "groups"), list(itertools.product([1, 2, 3, 5, 30, 64], [1, 2, 4, 16, 32],
                                                                          [1, 2, 4, 32])))
def test_plan_covers_every_sample_once_and_idles_only_without_samples_to_give(prompts, n, groups):
    shares = plan_shares(prompts, n, groups)
    assert len(shares) == groups
    per_prompt = [0] * prompts
    for share in shares:
        for i in share.indices:
            per_prompt[i] += share.n
        assert share.idle == (share.n == 0 or not share.indices)
    assert per_prompt == [n] * prompts
    idle = sum(s.idle for s in shares)
    assert idle == max(0, groups - prompts * n) if prompts < groups else idle == 0
    if prompts >= groups:  # unchanged from the prompt-strided split (reproducible runs keep their rollouts)
        assert [s.indices for s in shares] == [list(range(g, prompts, groups)) for g in range(groups)]


@pytest.mark.unit
def test_merge_refuses_a_prompt_with_missing_responses():
    r = Response(token_ids=[1], logprobs=[], finish_reason="stop")
    assert merge_shares([{0: [r]}, {0: [r], 1: [r, r]}], 2, 2) == [[r, r], [r, r]]
    with pytest.raises(EngineError, match="prompt 1 has 1 responses"):
        merge_shares([{0: [r, r], 1: [r]}], 2, 2)


class _RecordingEngine:
    """The transformers engine, recording each generate call (prompt count, n, max_new_tokens)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.n, params.max_new_tokens))
        return self.engine.generate(prompts, params)


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _rollouts(rank: int, score):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_mcore.config import Config
    from dapo_mcore.data.records import PromptRecord
    from dapo_mcore.model.presets import preset_config
    from dapo_mcore.rollout import HFEngine
    from dapo_mcore.rollout.pipeline.colocated import ColocatedRollouts, EngineGroups

    torch.manual_seed(0)  # the same weights on both ranks, as after a weight sync
    model = Qwen2ForCausalLM(Qwen2Config(**preset_config("tiny"))).float().eval()
    engine = _RecordingEngine(HFEngine(model, eos_token_ids=2, pad_token_id=0))
    rollouts = ColocatedRollouts(Config(), engine=engine, scheduler=None, tokenizer=_Tokenizer(), score=score,
                                 encode_prompt=lambda rec: [1, 5 + rec.index, 9], timer=None,
                                 groups=EngineGroups(count=2, index=rank, leader=True))
    records = [PromptRecord(prompt=f"q{i}", ground_truth="4", data_source="t", index=i) for i in range(3)]
    return rollouts, engine, records


def _verdict(rank: int):
    from dapo_mcore.reward.result import RewardResult

    # Deliberately rank-dependent: a reward (or a timed worker pool) that answers differently on each rank.
    return lambda texts, truths: [RewardResult(1.0 if rank == 0 else -1.0, rank == 0, f"r{rank}") for _ in texts]


def _worker(rank: int, world: int, port: int, queue) -> None:
    from dapo_mcore.rollout.protocol import SamplingParams
    from dapo_mcore.rollout.scheduling.gather import broadcast_shares

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    rollouts, engine, records = _rollouts(rank, _verdict(rank))
    for name, recs, n in (("one_prompt_n4", records[:1], 4), ("one_prompt_n1", records[:1], 1),
                          ("three_prompts", records, 2)):
        engine.calls.clear()
        groups = rollouts._generate_and_score(recs, SamplingParams(n=n, temperature=1.0, max_new_tokens=6, seed=11),
                                             0, timed=False)
        out[name] = dict(calls=list(engine.calls), responses=[[r.token_ids for r in g.responses] for g in groups],
                         scores=[g.scores for g in groups], preds=[g.preds for g in groups])
    # One sender (as in a vLLM TP group): the non-sender's share is ignored; tiny chunks exercise the chunking.
    r = Response(token_ids=list(range(10 * rank, 10 * rank + 7)), logprobs=[-0.5] * 7, finish_reason="length")
    out["leader_only"] = broadcast_shares([rank], [[r]], sender=rank == 0, chunk_elems=3)
    queue.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_one_prompt_every_group_generates_and_ranks_agree():
    got = run_gloo_workers(_worker, 2)
    a, b = got[0], got[1]
    # Item 2: with one prompt both engine groups generate (the samples are split), or run a placeholder.
    assert a["one_prompt_n4"]["calls"] == [(1, 2, 6)] and b["one_prompt_n4"]["calls"] == [(1, 2, 6)]
    assert a["one_prompt_n1"]["calls"] == [(1, 1, 6)] and b["one_prompt_n1"]["calls"] == [(1, 1, 1)]
    assert a["three_prompts"]["calls"] == [(2, 2, 6)] and b["three_prompts"]["calls"] == [(1, 2, 6)]
    for name, n in (("one_prompt_n4", 4), ("one_prompt_n1", 1), ("three_prompts", 2)):
        assert a[name]["responses"] == b[name]["responses"], name
        assert all(len(g) == n for g in a[name]["responses"]), name
        # Item 6: each verdict comes from exactly one rank, so both ranks hold the same scores.
        assert a[name]["scores"] == b[name]["scores"] and a[name]["preds"] == b[name]["preds"], name
    flat = [s for g in a["one_prompt_n4"]["scores"] for s in g]
    assert flat == [1.0, -1.0, 1.0, -1.0]  # strided over the two ranks, not all from one rank's verdict
    want = [{0: [Response(token_ids=list(range(7)), logprobs=[-0.5] * 7, finish_reason="length")]}]
    assert a["leader_only"] == want and b["leader_only"] == want
