"""Streaming over several engine groups: two gloo ranks, each its own transformers engine, stream a
step together. The kept batch equals a one-process reference that generates each group's share in full and keeps
the first usable groups in prompt order; every rank holds the same step; partial rollouts buffer and resume the same
groups on every rank; the whole step repeats exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.gloo_workers import run_gloo_workers

pytestmark = pytest.mark.distributed

N, TARGET, CHUNK, MAX_NEW = 4, 3, 4, 12
STOP_IDS = [2, 3, 4, 5]  # 4 of 32 tokens end a response: lengths vary, so groups end at different decode steps


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _score(texts, truths):
    from dapo_mcore.reward.result import RewardResult

    out = []
    for t in texts:
        ok = sum(map(int, t.split())) % 3 == 0
        out.append(RewardResult(1.0 if ok else -1.0, ok, t))
    return out


def _config(exchange_every: int, partial: bool, order: str = "prompt"):
    from dapo_mcore.config import Config

    cfg = Config()
    cfg.rollout.n, cfg.rollout.max_new_tokens, cfg.rollout.temperature = N, MAX_NEW, 1.0
    cfg.train.prompts_per_step = TARGET
    s = cfg.rollout.schedule
    s.streaming, s.stream_chunk_prompts, s.exchange_every, s.partial = True, CHUNK, exchange_every, partial
    s.order = order
    cfg.algo.overlong_shaping = False
    return cfg


def _parts(rank: int, world: int, exchange_every: int, partial: bool, order: str = "prompt"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_mcore.data.records import PromptRecord
    from dapo_mcore.data.sampler import PromptSampler
    from dapo_mcore.model.presets import preset_config
    from dapo_mcore.rollout import HFEngine
    from dapo_mcore.rollout.pipeline.colocated import ColocatedRollouts, EngineGroups
    from dapo_mcore.rollout.scheduling.scheduler import RolloutScheduler
    from dapo_mcore.telemetry.timers import PhaseTimer

    torch.manual_seed(0)  # the same weights on every rank, as after a weight sync
    model = Qwen2ForCausalLM(Qwen2Config(**preset_config("tiny"))).float().eval()
    engine = HFEngine(model, eos_token_ids=STOP_IDS, pad_token_id=0)
    records = [PromptRecord(prompt=f"q{i}", ground_truth="", data_source="t", index=i) for i in range(40)]
    cfg = _config(exchange_every, partial, order)
    sampler = PromptSampler(records, seed=3)
    scheduler = RolloutScheduler(cfg.rollout.schedule, sampler, n=N, target=TARGET, gen_batch_prompts=8,
                                 max_rounds=0, seed=3)
    rollouts = ColocatedRollouts(cfg, engine=engine, scheduler=scheduler, tokenizer=_Tokenizer(), score=_score,
                                 encode_prompt=lambda rec: [1, 6 + rec.index % 20, 7 + rec.index // 20],
                                 timer=PhaseTimer(), groups=EngineGroups(count=world, index=rank, leader=True),
                                 streams=True)
    return rollouts, engine, sampler


def _summary(batch):
    return dict(kept=[(g.record.index, [r.token_ids for r in g.responses]) for g in batch.kept],
                generated=[(g.record.index, g.kept, [r.token_ids for r in g.responses], [r.stale_tokens for r in
                                                                                       g.responses])
                           for g in batch.generated],
                stats=dataclasses.asdict(batch.stats))


def _reference_kept(rollouts, engine, sampler, world: int) -> list:
    """One process: every chunk's prompts split round robin over ``world`` groups, each share generated in full
    with its group's seed, scored, and the first TARGET usable groups kept in prompt order (chunk after chunk)."""
    from dapo_mcore.rollout.pipeline.colocated import step_seed

    kept, slot = [], 0
    while len(kept) < TARGET:
        indices, _ = sampler.next_selected(CHUNK)
        prompts = [rollouts.encode_prompt(sampler.records[i]) for i in indices]
        params = dataclasses.replace(rollouts.sampling(seed=step_seed(rollouts.cfg.train.seed, 0, slot)), n=N)
        slot += 1
        out = [None] * len(indices)
        for g in range(world):
            mine = list(range(g, len(indices), world))
            got = engine.generate([prompts[i] for i in mine], dataclasses.replace(params, seed=params.seed
                                                                                  + 1_000_003 * g))
            for i, responses in zip(mine, got, strict=True):
                out[i] = responses
        for i, responses in zip(indices, out, strict=True):
            acc = [r.acc for r in _score([" ".join(map(str, r.token_ids)) for r in responses], [])]
            if 0 < sum(acc) < N and len(kept) < TARGET:
                kept.append((i, [r.token_ids for r in responses]))
    return kept


def _reference_round(rollouts, engine, sampler, world: int) -> list:
    """One process: the first round's 8 prompts split round robin over ``world`` groups, each share generated in full
    with its group's seed: ``(index, responses' tokens, decode step its group ended, usable)`` in prompt order."""
    from dapo_mcore.rollout.pipeline.colocated import step_seed

    indices, _ = sampler.next_selected(8)
    prompts = [rollouts.encode_prompt(sampler.records[i]) for i in indices]
    params = dataclasses.replace(rollouts.sampling(seed=step_seed(rollouts.cfg.train.seed, 0, 0)), n=N)
    out = [None] * len(indices)
    for g in range(world):
        mine = list(range(g, len(indices), world))
        got = engine.generate([prompts[i] for i in mine], dataclasses.replace(params, seed=params.seed + 1_000_003 * g))
        for i, responses in zip(mine, got, strict=True):
            acc = [r.acc for r in _score([" ".join(map(str, r.token_ids)) for r in responses], [])]
            out[i] = (indices[i], [r.token_ids for r in responses], max(r.length for r in responses),
                      0 < sum(acc) < N)
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for every in (1, 4):
        rollouts, engine, sampler = _parts(rank, world, every, partial=False)
        out[f"every{every}"] = _summary(rollouts.step_batch(0, stop=lambda: False))
    rollouts, engine, sampler = _parts(rank, world, 1, partial=False)
    out["reference"] = _reference_kept(rollouts, engine, sampler, world)
    # Partial rollouts: two steps; the groups in flight at step 0's fill are buffered and continued at step 1.
    for run in ("a", "b"):
        rollouts, engine, sampler = _parts(rank, world, 2, partial=True)
        first = _summary(rollouts.step_batch(0, stop=lambda: False))
        buffered = [(b.index, [r.token_ids for r in b.group.responses], b.group.done)
                    for b in rollouts.scheduler.partials.items]
        second = _summary(rollouts.step_batch(1, stop=lambda: False))
        out[f"partial_{run}"] = dict(first=first, buffered=buffered, second=second)
    # Completion order: the whole round of 8 streams at once over both groups; groups are taken as they end.
    for run in ("a", "b"):
        rollouts, engine, sampler = _parts(rank, world, 1, partial=True, order="completion")
        first = _summary(rollouts.step_batch(0, stop=lambda: False))
        buffered = [(b.index, [r.token_ids for r in b.group.responses], b.group.done)
                    for b in rollouts.scheduler.partials.items]
        second = _summary(rollouts.step_batch(1, stop=lambda: False))
        out[f"completion_{run}"] = dict(first=first, buffered=buffered, second=second)
    rollouts, engine, sampler = _parts(rank, world, 1, partial=False)
    out["completion_reference"] = _reference_round(rollouts, engine, sampler, world)
    queue.put((rank, out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    return run_gloo_workers(_worker, 2)


def test_every_rank_holds_the_same_step(results):
    assert results[0] == results[1]


def test_kept_batch_equals_the_one_process_reference_whatever_the_exchange_interval(results):
    got = results[0]
    assert len(got["reference"]) == TARGET
    for every in (1, 4):
        assert got[f"every{every}"]["kept"] == got["reference"], every


def test_streaming_over_groups_stopped_early(results):
    stats = results[0]["every1"]["stats"]
    assert stats["tokens_aborted"] > 0, "the step filled while groups were in flight on some engine"
    generated = results[0]["every1"]["generated"]
    assert sum(kept for _, kept, _, _ in generated) == TARGET


def test_partial_rollouts_over_groups_buffer_continue_and_repeat(results):
    a, b = results[0]["partial_a"], results[0]["partial_b"]
    assert a == b, "the same seed gives the same two steps"
    assert a["buffered"], "groups were in flight when step 0 filled"
    assert a["first"]["stats"]["tokens_aborted"] == 0  # kept, not dropped
    resumed = {g[0]: g[2] for g in a["second"]["generated"][:len(a["buffered"])]}  # resumed groups come first
    for idx, prefixes, done in a["buffered"]:
        tokens = resumed[idx]
        for prefix, whole, ended in zip(prefixes, tokens, done, strict=True):
            assert whole[:len(prefix)] == prefix, "a resumed response starts with its buffered prefix"
            if ended:
                assert whole == prefix
    assert a["second"]["stats"]["groups_resumed"] == len(a["buffered"])
    stale = [s for _, _, _, st in a["second"]["generated"][:len(a["buffered"])] for s in st]
    assert sum(stale) == sum(len(p) for _, ps, _ in a["buffered"] for p in ps)


@pytest.mark.parametrize("together", [True, False])
def test_a_group_with_nothing_to_resume_keeps_a_lockstep_engine_in_step(monkeypatch, together):
    """One response to continue, two engine groups: group 1 has none. vLLM's data-parallel engines step together, so
    its engine still runs a one-token placeholder (as an idle share of a generation call does); an engine without
    that constraint is left alone. The tail comes from group 0's share (the exchange is stood in for here)."""
    from dapo_mcore.config import Config
    from dapo_mcore.rollout.pipeline import colocated
    from dapo_mcore.rollout.pipeline.colocated import ColocatedRollouts, EngineGroups
    from dapo_mcore.rollout.protocol import Response, SamplingParams

    class Recorder:
        groups_step_together = together

        def __init__(self):
            self.calls = []

        def generate(self, prompts, params):
            self.calls.append(("generate", len(prompts), params.n, params.max_new_tokens))
            return [[Response([7], [-0.1], "length")] for _ in prompts]

        def resume(self, prompts, prefixes, params):
            self.calls.append(("resume", len(prompts)))
            return [Response([8], [-0.2], "stop") for _ in prompts]

    tail = Response([9, 2], [-0.3, -0.4], "stop")
    monkeypatch.setattr(colocated, "broadcast_shares", lambda positions, shares, sender, routes_to=None: [{0: [tail]}])
    engine = Recorder()
    source = ColocatedRollouts(Config(), engine=engine, scheduler=None, tokenizer=None, score=None,
                               encode_prompt=None, timer=None, groups=EngineGroups(2, 1, True))
    out = source._resume([(0, 0)], [[1, 5]], [[6]], SamplingParams(n=1, max_new_tokens=8, seed=3))
    assert out == [tail]
    assert engine.calls == ([("generate", 1, 1, 1)] if together else [])


def test_completion_order_takes_groups_as_they_end_over_two_groups(results):
    """Exchanging every decode step, a group ends at the decode step of its longest response: the kept batch is the
    first TARGET usable groups by (end step, prompt position), with the tokens a full generation samples."""
    got = results[0]
    a, b = got["completion_a"], got["completion_b"]
    assert a == b, "the same seed gives the same two steps"
    ref = got["completion_reference"]
    by_end = [r for _, r in sorted(enumerate(ref), key=lambda kv: (kv[1][2], kv[0]))]
    want = [(idx, tokens) for idx, tokens, _, usable in by_end if usable][:TARGET]
    assert len(want) == TARGET
    assert a["first"]["kept"] == want
    # prompt order would have kept a different batch from the same responses
    in_prompt_order = [(idx, tokens) for idx, tokens, _, usable in ref if usable][:TARGET]
    assert want != in_prompt_order
    # groups that had not ended were buffered (none dropped) and come first at the next step, continued
    assert a["first"]["stats"]["tokens_aborted"] == 0 and a["buffered"]
    ended = {g[0] for g in a["first"]["generated"]}
    assert {idx for idx, _, _ in a["buffered"]} == {r[0] for r in ref} - ended
    resumed = {g[0]: g[2] for g in a["second"]["generated"][:len(a["buffered"])]}
    for idx, prefixes, _ in a["buffered"]:
        assert all(whole[:len(p)] == p for p, whole in zip(prefixes, resumed[idx], strict=True))
    assert a["second"]["stats"]["groups_resumed"] == len(a["buffered"])
