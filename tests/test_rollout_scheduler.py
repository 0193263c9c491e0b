"""Rollout scheduler: all switches off is the published loop; each switch against a naive reference."""

import dataclasses
import json
import math
import random

import pytest

from dapo_mcore.algo.dynamic_sampling import DynamicSamplingExhausted, Group, collect_groups
from dapo_mcore.algo.schedule_config import ScheduleConfig
from dapo_mcore.data.prompt_history import PromptHistory, skip_probability
from dapo_mcore.data.sampler import PromptSampler
from dapo_mcore.rollout.scheduling.scheduler import RolloutScheduler, round_size

pytestmark = pytest.mark.unit

N, TARGET, BATCH = 8, 6, 10


def _p_correct(record: int) -> float:
    """A heterogeneous pool: a third always right, a third never, a third in between."""
    return (0.0, 1.0, 0.2 + 0.6 * ((record * 7) % 11) / 10)[record % 3]


def _acc(record: int, j: int, visit: int = 0) -> bool:
    return random.Random(f"{record}:{j}:{visit}").random() < _p_correct(record)


class FakeEngine:
    """generate(records, n, slot): response j of a record continues where its last call on this step stopped."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], int, int]] = []
        self.done: dict[int, int] = {}

    def __call__(self, records, n, slot):
        self.calls.append((list(records), n, slot))
        out = []
        for r in records:
            start = self.done.get(r, 0)
            self.done[r] = start + n
            acc = [_acc(r, j) for j in range(start, start + n)]
            out.append(Group(acc=acc, payload=(r, start), response_lengths=[1 + (r + j) % 4 for j in range(n)]))
        return out


def _merge(a, b):
    return a


def _scheduler(cfg: ScheduleConfig, prompts: int = 60, history: PromptHistory | None = None, **kw):
    sampler = PromptSampler(list(range(prompts)), seed=3, history=history)
    args = {"n": N, "target": TARGET, "gen_batch_prompts": BATCH, "max_rounds": 30, **kw}
    return RolloutScheduler(cfg, sampler, **args), sampler


def test_all_switches_off_is_collect_groups_exactly():
    sched, _ = _scheduler(ScheduleConfig())
    engine = FakeEngine()
    kept, generated, stats = sched.collect(engine, _merge)
    ref_sampler, ref_engine = PromptSampler(list(range(60)), seed=3), FakeEngine()
    ref_generated: list[Group] = []

    def batch(i):
        groups = ref_engine(ref_sampler.next_batch(BATCH), N, i)
        ref_generated.extend(groups)
        return groups

    ref_kept, ref_stats = collect_groups(batch, TARGET, 30)
    assert [g.payload for g in kept] == [g.payload for g in ref_kept]
    assert [g.payload for g in generated] == [g.payload for g in ref_generated]
    assert engine.calls == ref_engine.calls and stats == ref_stats and stats.groups_surplus > 0


def _naive_stream(chunk: int, target: int = TARGET) -> tuple[list[int], int]:
    """Reference: walk the sampler's order in rounds of BATCH cut into chunks; keep the first `target` usable."""
    order = PromptSampler(list(range(60)), seed=3)
    kept, drawn = [], 0
    while len(kept) < target:
        idx = order.next_indices(min(chunk, BATCH - drawn % BATCH))
        drawn += len(idx)
        for r in idx:
            usable = 0 < sum(_acc(r, j) for j in range(N)) < N
            if usable and len(kept) < target:
                kept.append(r)
    return kept, drawn


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_streaming_keeps_the_first_usable_groups_in_prompt_order_and_stops(chunk):
    sched, _ = _scheduler(ScheduleConfig(streaming=True, stream_chunk_prompts=chunk))
    kept, generated, stats = sched.collect(FakeEngine(), _merge)
    ref_kept, ref_drawn = _naive_stream(chunk)
    assert [g.payload[0] for g in kept] == ref_kept
    assert stats.groups_generated == len(generated) == ref_drawn
    assert stats.groups_kept == TARGET and stats.groups_surplus <= chunk - 1
    assert stats.tokens_generated == stats.tokens_kept + stats.tokens_rejected


def test_streaming_generates_less_than_batch_and_filter():
    off, _ = _scheduler(ScheduleConfig())
    on, _ = _scheduler(ScheduleConfig(streaming=True, stream_chunk_prompts=2))
    _, _, s_off = off.collect(FakeEngine(), _merge)
    _, _, s_on = on.collect(FakeEngine(), _merge)
    assert s_on.tokens_generated < s_off.tokens_generated and s_on.groups_kept == s_off.groups_kept == TARGET


def test_staged_groups_complete_only_mixed_first_stages():
    k = 3
    sched, _ = _scheduler(ScheduleConfig(stage_responses=k))
    engine = FakeEngine()
    kept, generated, stats = sched.collect(engine, _merge)
    # Reference over the same draw order: a prompt is kept iff its first k responses are mixed.
    order = PromptSampler(list(range(60)), seed=3)
    ref_kept, skipped, drawn = [], 0, 0
    while len(ref_kept) < TARGET:
        for r in order.next_indices(BATCH):
            drawn += 1
            if 0 < sum(_acc(r, j) for j in range(k)) < k:
                ref_kept.append(r) if len(ref_kept) < TARGET else None
            else:
                skipped += 1
    assert [g.payload[0] for g in kept] == ref_kept
    assert stats.groups_stage_skipped == skipped and stats.groups_generated == drawn
    assert all(len(g.acc) == N for g in kept) and all(len(g.acc) == k for g in generated if len(g.acc) != N)
    assert stats.rollouts_generated == k * skipped + N * (drawn - skipped)
    assert [n for _, n, _ in engine.calls] == [k, N - k] * (len(engine.calls) // 2)


def test_staged_audit_measures_the_bias_without_training_on_it():
    sched, _ = _scheduler(ScheduleConfig(stage_responses=2, stage_audit_fraction=1.0), prompts=300)
    kept, generated, stats = sched.collect(FakeEngine(), _merge)
    assert stats.groups_stage_audited == stats.groups_stage_skipped > 0
    full = [g for g in generated if len(g.acc) == N]
    usable_skipped = sum(g.is_usable() for g in full) - stats.groups_kept - stats.groups_surplus
    assert stats.groups_stage_audit_usable == usable_skipped > 0
    assert all(0 < sum(g.acc[:2]) < 2 for g in kept)


def test_round_size_matches_the_formula():
    for need, est, base, margin, cap, floor in [(16, None, 32, 1.2, 128, 0.05), (16, 0.5, 32, 1.2, 128, 0.05),
                                                (16, 0.01, 32, 1.2, 128, 0.05), (3, 0.9, 32, 1.0, 128, 0.05),
                                                (1, 1.0, 32, 1.0, 128, 0.05)]:
        want = min(base, cap) if est is None else max(1, min(cap, math.ceil(need / max(est, floor) * margin)))
        assert round_size(need, est, base, margin, cap, floor) == want


def test_adaptive_rounds_follow_the_observed_fraction_and_resume():
    cfg = ScheduleConfig(adaptive=True, adaptive_ema=0.5, adaptive_margin=1.0)
    sched, _ = _scheduler(cfg, prompts=400)
    _, _, s1 = sched.collect(FakeEngine(), _merge, step=0)
    frac1 = (s1.groups_kept + s1.groups_surplus) / s1.groups_generated
    assert sched.usable_estimate == pytest.approx(frac1)
    assert sched.next_round_size(TARGET) == math.ceil(TARGET / frac1)
    _, _, s2 = sched.collect(FakeEngine(), _merge, step=1)
    frac2 = (s2.groups_kept + s2.groups_surplus) / s2.groups_generated
    assert sched.usable_estimate == pytest.approx(0.5 * frac2 + 0.5 * frac1)
    again, _ = _scheduler(cfg, prompts=400)
    again.load_state_dict(json.loads(json.dumps(sched.state_dict())))
    assert again.usable_estimate == sched.usable_estimate


def test_exhausted_rounds_raise_with_counts():
    sched, _ = _scheduler(ScheduleConfig(streaming=True), max_rounds=2)
    engine = lambda records, n, slot: [Group(acc=[True] * n, payload=r) for r in records]  # noqa: E731
    with pytest.raises(DynamicSamplingExhausted, match="max_gen_batches=2"):
        sched.collect(engine, _merge)


# ---- prompt history ---------------------------------------------------------------------------------------

def test_skip_probability_matches_the_formula_and_decays():
    for streak, skips in [(0, 0), (1, 0), (2, 0), (5, 0), (3, 1), (3, 4)]:
        want = 0.0 if streak == 0 else min(0.9, 1 - 0.5 ** streak) * 0.5 ** skips
        assert skip_probability(streak, skips, 0.5, 0.9, 0.5) == pytest.approx(want)
    h = PromptHistory(0, 0.5, 0.9, 0.5)
    for _ in range(6):
        h.record(7, 0, 8)
    assert h.probability(7) == pytest.approx(0.9)  # capped: exploration
    h.record(7, 3, 8)
    assert h.probability(7) == 0.0  # a mixed visit clears the streak


def test_history_never_drops_a_prompt_forever_and_skips_at_the_rate():
    h = PromptHistory(1, 0.5, 0.9, 1.0)
    for i in range(2000):
        for _ in range(4):
            h.record(i, 8, 8)
    skipped = sum(h.should_skip(i) for i in range(2000))
    assert 0.87 < skipped / 2000 < 0.93
    h2 = PromptHistory(1, 0.5, 0.9, 0.5)
    h2.record(0, 8, 8)
    decisions = [h2.should_skip(0) for _ in range(40)]
    assert not all(decisions) and h2.probability(0) < 0.5


def test_history_skips_uniform_prompts_and_resumes_exactly():
    def run(sampler, steps):
        out = []
        for _ in range(steps):
            idx, skipped = sampler.next_selected(10)
            for i in idx:
                sampler.history.record(i, 8 * (i % 3 == 1), 8)  # a third always right, the rest always wrong
            out.append((idx, skipped))
        return out

    make = lambda: PromptSampler(list(range(30)), seed=4, history=PromptHistory(4, 0.5, 0.9, 0.5))  # noqa: E731
    ref = run(make(), 12)
    assert sum(s for _, s in ref) > 20
    first = make()
    got = run(first, 5)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    assert got + run(resumed, 7) == ref
    assert state["history"]["skipped_total"] == sum(s for _, s in ref[:5])


def test_history_with_scheduler_counts_skips():
    history = PromptHistory(3, 0.9, 0.9, 1.0)
    sched, sampler = _scheduler(ScheduleConfig(history=True), prompts=30, history=history)
    totals = [sched.collect(FakeEngine(), _merge, step=s)[2].prompts_history_skipped for s in range(6)]
    assert sum(totals) > 0 and sum(totals) == history.skipped_total


@pytest.mark.parametrize("field,value,match", [
    ("stage_responses", 1, "stage_responses"), ("stage_responses", 8, "stage_responses"),
    ("stream_chunk_prompts", 0, "stream_chunk_prompts"), ("adaptive_margin", 0.5, "adaptive_margin"),
    ("history_max_skip_prob", 1.0, "forever"), ("adaptive_ema", 0.0, "adaptive_ema"),
])
def test_config_refuses_bad_values_with_the_key(field, value, match):
    cfg = ScheduleConfig(**{field: value})
    with pytest.raises(ValueError, match=match):
        cfg.validate(n=8, dynamic_sampling=True)


def test_config_refuses_switches_without_dynamic_sampling():
    with pytest.raises(ValueError, match="dynamic_sampling=true"):
        ScheduleConfig(streaming=True).validate(n=8, dynamic_sampling=False)
    ScheduleConfig().validate(n=8, dynamic_sampling=False)


class FakeStream:
    """Groups of one call finish in a shuffled order; abort reports 1 token per unfinished response."""

    def __init__(self, groups, seed):
        self.order = list(range(len(groups)))
        random.Random(seed).shuffle(self.order)
        self.groups, self.given, self.aborted = groups, 0, 0

    def __iter__(self):
        for pos in self.order:
            self.given += 1
            yield pos, self.groups[pos]

    def abort(self):
        self.aborted = (len(self.groups) - self.given) * N
        return self.aborted


@pytest.mark.parametrize("chunk", [3, 7])
def test_engine_stream_decides_in_prompt_order_not_completion_order(chunk):
    cfg = ScheduleConfig(streaming=True, stream_chunk_prompts=chunk)
    chunked, _ = _scheduler(cfg)
    ref_kept, _, ref_stats = chunked.collect(FakeEngine(), _merge)
    streamed, _ = _scheduler(cfg)
    engine, streams = FakeEngine(), []

    def stream(records, n, slot):
        streams.append(FakeStream(engine(records, n, slot), seed=slot))
        return streams[-1]

    kept, generated, stats = streamed.collect(FakeEngine(), _merge, stream=stream)
    assert [g.payload for g in kept] == [g.payload for g in ref_kept]
    assert stats.tokens_aborted == sum(s.aborted for s in streams) == N * (len(streams[-1].groups) - streams[-1].given)
    assert stats.tokens_aborted > 0
    assert stats.groups_generated == len(generated) == ref_stats.groups_generated - stats.tokens_aborted // N
    assert stats.tokens_generated == stats.tokens_kept + stats.tokens_rejected


def test_presets_fill_the_switches_and_fields_beside_them_win():
    fast = ScheduleConfig(preset="partial_completion")
    assert (fast.streaming, fast.partial, fast.order, fast.adaptive, fast.history, fast.stage_responses) == \
        (True, True, "completion", False, False, 0)
    # paper = the published loop: equal, switch for switch, to no preset at all
    assert dataclasses.replace(ScheduleConfig(preset="paper"), preset=None) == ScheduleConfig()
    # a switch given beside the preset is the user's, also at its plain default
    assert ScheduleConfig(preset="partial_completion", partial=False).partial is False
    assert ScheduleConfig(preset="paper", streaming=True).streaming is True
    with pytest.raises(ValueError, match=r"rollout.schedule.preset='fast' is unknown; use one of paper, partial_completion"):
        ScheduleConfig(preset="fast").validate(n=8, dynamic_sampling=True)


def test_one_key_turns_a_preset_recipe_back_into_the_published_loop(tmp_path):
    from pathlib import Path

    import yaml

    from dapo_mcore.config import load_config
    from dapo_mcore.config.tree import to_dict

    recipe = tmp_path / "fast.yaml"
    tiny = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml").read_text())
    tiny.setdefault("algo", {})["tis_cap"] = 2.0
    tiny.setdefault("rollout", {})["schedule"] = {"preset": "partial_completion"}
    recipe.write_text(yaml.safe_dump(tiny))
    shipped = load_config(recipe)
    shipped.validate(1)
    assert (shipped.rollout.schedule.streaming, shipped.rollout.schedule.partial) == (True, True)
    paper = load_config(recipe, ["rollout.schedule.preset=paper"])
    paper.validate(1)
    assert not paper.rollout.schedule.enabled and not paper.rollout.schedule.partial
    assert paper.rollout.schedule.order == "prompt"
    # config.yaml records the effective switches beside the name, and reads back to the same schedule
    written = tmp_path / "config.yaml"
    written.write_text(yaml.safe_dump(to_dict(shipped)))
    assert load_config(written).rollout.schedule == shipped.rollout.schedule


def test_run_config_refuses_a_bad_schedule_naming_the_key():
    from pathlib import Path

    from dapo_mcore.config import ConfigError, load_config

    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=r"rollout.schedule.stage_responses=8 .*\[2, rollout.n=8\)"):
        load_config(tiny, ["rollout.schedule.stage_responses=8"]).validate(1)
    load_config(tiny, ["rollout.schedule.history=true", "rollout.schedule.streaming=true"]).validate(1)


def test_checkpoint_state_carries_history_and_estimate_only_when_switched_on():
    from types import SimpleNamespace

    from dapo_mcore.run.components import Components
    from dapo_mcore.run.runtime import _build_sampler, _build_scheduler

    def parts(*overrides):
        from dapo_mcore.config import load_config

        cfg = load_config(None, ["rollout.n=8", "train.prompts_per_step=4", "rollout.gen_batch_prompts=6",
                                 *overrides])
        sampler = _build_sampler(cfg, list(range(40)))
        return Components(cfg=cfg, launch=SimpleNamespace(rank=0), actor=None, engine=None, tokenizer=None,
                          sampler=sampler, eval_records=[], timer=None, score=None, normalize=None,
                          encode_prompt=None, scheduler=_build_scheduler(cfg, sampler))

    off = parts().trainer_state(1)
    assert set(off) == {"step", "sampler"} and "history" not in off["sampler"]
    on = parts("rollout.schedule.history=true", "rollout.schedule.adaptive=true")
    for s in range(3):
        on.scheduler.collect(FakeEngine(), _merge, step=s)
    state = json.loads(json.dumps(on.trainer_state(3)))
    assert state["schedule"]["usable_estimate"] == on.scheduler.usable_estimate
    resumed = parts("rollout.schedule.history=true", "rollout.schedule.adaptive=true")
    resumed.sampler.load_state_dict(state["sampler"])
    resumed.scheduler.load_state_dict(state["schedule"])
    a, b = on.scheduler.collect(FakeEngine(), _merge, step=3), resumed.scheduler.collect(FakeEngine(), _merge, step=3)
    assert [g.payload for g in a[1]] == [g.payload for g in b[1]] and a[2] == b[2]
    assert on.sampler.history.skipped_total == resumed.sampler.history.skipped_total > 0


class FakePartialStream(FakeStream):
    """FakeStream whose abort(keep_partial=True) hands back the unfinished groups, each response cut to 1 token."""

    def abort(self, keep_partial=False):
        from dapo_mcore.rollout.protocol import PartialGroup, Response

        if not keep_partial:
            return super().abort()
        left = sorted(self.order[self.given:])
        self.kept = [PartialGroup(pos, [Response([pos, j], [-0.5, -0.25], "length") for j in range(N)],
                                  [j % 2 == 0 for j in range(N)]) for pos in left]
        return 0

    def partials(self):
        return self.kept


def test_partial_rollouts_buffer_aborted_groups_and_continue_them_first_next_step():
    from dapo_mcore.rollout.protocol import Response

    cfg = ScheduleConfig(streaming=True, stream_chunk_prompts=5, partial=True)
    sched, sampler = _scheduler(cfg)
    engine, streams, resumed = FakeEngine(), [], []

    def stream(records, n, slot):
        streams.append(FakePartialStream(engine(records, n, slot), seed=slot))
        return streams[-1]

    def resume(items, slot):
        resumed.append((slot, [(b.index, b.step, b.group.index) for b in items]))
        # a continued group: the record's outcomes at visit 1, its stale tokens the prefixes' 2 per response
        return [Group(acc=[_acc(b.index, j, visit=1) for j in range(N)], payload=("resumed", b.index),
                      response_lengths=[5] * N, stale_tokens=2 * N) for b in items]

    kept, _, stats = sched.collect(engine, _merge, step=0, stream=stream, resume=resume)
    last = streams[-1]
    buffered = [(b.index, b.step, b.group.index) for b in sched.partials.items]
    assert stats.tokens_aborted == 0 and len(buffered) == len(last.order) - last.given > 0
    assert stats.tokens_partial_buffered == sum(2 * N for _ in buffered) and stats.groups_resumed == 0
    assert all(step == 0 for _, step, _ in buffered) and not resumed
    # the buffered groups are the records of the last chunk that had not finished
    assert sorted(i for i, _, _ in buffered) == sorted(last.groups[p].payload[0] for p in last.order[last.given:])
    state = json.loads(json.dumps(sched.state_dict()))

    kept1, generated1, stats1 = sched.collect(engine, _merge, step=1, stream=stream, resume=resume)
    assert resumed == [(0, buffered)]  # slot 0: before any new prompt is drawn
    assert stats1.tokens_partial_buffered == sched.partials.num_tokens()
    assert stats1.groups_resumed == len(buffered) and stats1.tokens_resumed_stale == 2 * N * len(buffered)
    assert [g.payload for g in generated1[:len(buffered)]] == [("resumed", i) for i, _, _ in buffered]
    usable_resumed = [g for g in generated1[:len(buffered)] if g.is_usable()][:TARGET]
    assert kept1[:len(usable_resumed)] == usable_resumed
    assert stats1.tokens_stale_kept == 2 * N * len(usable_resumed)

    again, _ = _scheduler(cfg)
    again.load_state_dict(state)
    assert [(b.index, b.step, b.group.index) for b in again.partials.items] == buffered
    pos = buffered[0][2]
    # each buffered token keeps the version that sampled it (step 0's) through the checkpoint
    assert again.partials.items[0].group.responses == [Response([pos, j], [-0.5, -0.25], "length", versions=[(0, 2)])
                                                       for j in range(N)]
    with pytest.raises(ValueError, match="no resume callback"):
        again.collect(FakeEngine(), _merge, step=1)


def test_partial_buffer_snapshot_rolls_an_abandoned_step_back():
    """The trainer snapshots the scheduler at a step's start; a step abandoned on a signal after its resume call
    took the buffer must give the buffered groups back (and the usable estimate), to be continued when it reruns."""
    from dapo_mcore.rollout.protocol import PartialGroup, Response

    sched, _ = _scheduler(ScheduleConfig(streaming=True, partial=True, adaptive=True))
    group = PartialGroup(0, [Response([1, 2], [-0.1, -0.2], "length") for _ in range(N)], [False] * N)
    sched.partials.add([7], [group], step=3)
    sched.usable_estimate = 0.25
    snap = sched.snapshot()
    taken = sched.partials.take()
    sched.usable_estimate = 0.5
    assert not sched.partials.items and taken[0].index == 7
    sched.rollback(snap)
    assert [(b.index, b.step) for b in sched.partials.items] == [(7, 3)] and sched.usable_estimate == 0.25
    assert sched.partials.items[0].group is group


def test_partial_needs_streaming_and_tis():
    from pathlib import Path

    from dapo_mcore.config import ConfigError, load_config

    with pytest.raises(ValueError, match="partial .* needs rollout.schedule.streaming=true"):
        ScheduleConfig(partial=True).validate(n=8, dynamic_sampling=True)
    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
    on = ["rollout.schedule.streaming=true", "rollout.schedule.partial=true"]
    with pytest.raises(ConfigError, match="set algo.tis_cap"):
        load_config(tiny, on).validate(1)
    load_config(tiny, [*on, "algo.tis_cap=2.0"]).validate(1)


def _naive_completion(streams_order: list[list[tuple[int, Group]]], target: int) -> list:
    """Reference: walk the streams' groups in the order they end; keep the first ``target`` usable ones."""
    kept = []
    for order in streams_order:
        for _, g in order:
            if g.is_usable() and len(kept) < target:
                kept.append(g.payload)
            if len(kept) == target:
                return kept
    return kept


def test_completion_order_streams_whole_rounds_and_keeps_groups_as_they_end():
    cfg = ScheduleConfig(streaming=True, stream_chunk_prompts=3, order="completion")
    sched, _ = _scheduler(cfg)
    engine, streams = FakeEngine(), []

    def stream(records, n, slot):
        streams.append(FakeStream(engine(records, n, slot), seed=slot))
        return streams[-1]

    kept, generated, stats = sched.collect(FakeEngine(), _merge, stream=stream)
    # one stream call per round (no chunks of 3, so no drain between chunks), every round whole
    assert [len(records) for records, _, _ in engine.calls] == [BATCH] * len(streams)
    ref = _naive_completion([[(p, s.groups[p]) for p in s.order] for s in streams], TARGET)
    assert [g.payload for g in kept] == ref
    last = streams[-1]
    assert [g.payload for g in generated[-last.given:]] == [last.groups[p].payload for p in last.order[:last.given]]
    assert stats.tokens_aborted == last.aborted == N * (BATCH - last.given) > 0
    # prompt order on the same streams keeps a different batch (decisions wait for earlier prompts)
    prompt_sched, _ = _scheduler(ScheduleConfig(streaming=True, stream_chunk_prompts=BATCH))
    engine2 = FakeEngine()
    prompt_kept, _, _ = prompt_sched.collect(FakeEngine(), _merge, stream=lambda r, n, s: FakeStream(engine2(r, n, s), s))
    assert [g.payload for g in prompt_kept] != ref


class FakeHalfStartedStream(FakePartialStream):
    """Like FakePartialStream, but only the first half of the unfinished groups had started decoding."""

    def partials(self):
        return self.kept[:len(self.kept) // 2]


def test_completion_order_partial_buffers_in_flight_and_unstarted_groups():
    cfg = ScheduleConfig(streaming=True, partial=True, order="completion")
    sched, _ = _scheduler(cfg)
    engine, streams = FakeEngine(), []

    def stream(records, n, slot):
        streams.append(FakeHalfStartedStream(engine(records, n, slot), seed=slot))
        return streams[-1]

    sched.collect(engine, _merge, step=4, stream=stream, resume=lambda items, slot: [])
    last = streams[-1]
    left = sorted(last.order[last.given:])
    items = sched.partials.items
    assert [b.group.index for b in items] == left and all(b.step == 4 for b in items)
    started = {p.index for p in last.partials()}
    for b in items:
        if b.group.index in started:
            assert [r.length for r in b.group.responses] == [2] * N
        else:  # never started: an empty prefix per response, none done (the next step generates them whole)
            assert [r.length for r in b.group.responses] == [0] * N and b.group.done == [False] * N
    assert len(started) < len(left)
    assert sched.partials.num_tokens() == 2 * N * len(started)
    # the empty prefixes survive a checkpoint (trainer_state.json) unchanged
    again, _ = _scheduler(cfg)
    again.load_state_dict(json.loads(json.dumps(sched.state_dict())))
    assert [(b.index, b.group.responses, b.group.done) for b in again.partials.items] == \
        [(b.index, b.group.responses, b.group.done) for b in items]


def test_completion_order_needs_streaming():
    with pytest.raises(ValueError, match="rollout.schedule.order=completion"):
        ScheduleConfig(order="completion").validate(n=8, dynamic_sampling=True)
    with pytest.raises(ValueError, match="use prompt or completion"):
        ScheduleConfig(streaming=True, order="arrival").validate(n=8, dynamic_sampling=True)
