"""The rollout simulator's pure parts (dapo_mcore/plan/rollout_model.py, dapo_mcore/plan/step_model.py) against hand-computed timelines and counts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks.rollout_sim import _trainer_phases, tiny_steps
from dapo_mcore.plan.rollout_model import (
    Carried,
    EngineModel,
    EngineSim,
    LengthModel,
    PromptPool,
    Recipe,
    Stage,
    StepResult,
    adaptive_round,
    batch_and_filter_step,
    spread,
    streaming_step,
)
from dapo_mcore.plan.step_model import Phases, async_step, async_steps, mean_step, sync_step


class ListPool:
    """A pool that hands out fixed groups in order (lengths per group, usable flags)."""

    def __init__(self, lengths: list[list[int]], usable: list[bool]) -> None:
        self.lengths, self.usable, self.next = lengths, usable, 0

    def take(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        sl = slice(self.next, self.next + k)
        assert self.next + k <= len(self.usable), "the test pool ran dry"
        self.next += k
        return np.array(self.lengths[sl]), np.array(self.usable[sl])


def test_engine_model_from_throughput():
    m = EngineModel.from_throughput(engines=4, max_seqs=100, full_tokens_per_s=5000.0, single_tokens_per_s=50.0)
    assert m.t0 == pytest.approx(0.02)
    assert m.t1 == pytest.approx((100 / 5000 - 0.02) / 100)
    assert 100 / (m.t0 + 100 * m.t1) == pytest.approx(5000.0)
    with pytest.raises(ValueError, match="lone sequences"):
        EngineModel.from_throughput(engines=1, max_seqs=10, full_tokens_per_s=1000.0, single_tokens_per_s=50.0)


def test_engine_iteration_time_depends_on_running_sequences():
    # t0=1, t1=0.5: two running -> 2 s per token, one running -> 1.5 s per token.
    sim = EngineSim(EngineModel(engines=1, max_seqs=2, t0=1.0, t1=0.5))
    g0 = sim.add_group(0, np.array([2, 4]))
    assert sim.advance() == [] and sim.now == pytest.approx(4.0)  # 2 tokens each at 2 s
    assert sim.progress(g0).tolist() == pytest.approx([2.0, 2.0])
    assert sim.advance() == [g0] and sim.now == pytest.approx(4.0 + 2 * 1.5)
    assert sim.advance() is None


def test_engine_slots_refill_fifo_and_engines_run_in_parallel():
    sim = EngineSim(EngineModel(engines=2, max_seqs=2, t0=1.0, t1=0.0))
    a = sim.add_group(0, np.array([3, 5]))
    b = sim.add_group(0, np.array([1]))  # waits for engine 0's first free slot (t=3), done at t=4
    c = sim.add_group(1, np.array([2]))
    events = []
    while (done := sim.advance()) is not None:
        events.append((sim.now, done))
    assert events == [(2.0, [c]), (3.0, []), (4.0, [b]), (5.0, [a])]


def test_prompt_pool_is_seeded_and_matches_the_stage():
    stage = Stage("s", mean_len=2000.0, all_correct=0.3, all_wrong=0.2)
    lengths = LengthModel(cap=10**9)
    one = PromptPool(stage, 4, lengths, seed=3, chunk=100)
    many = PromptPool(stage, 4, lengths, seed=3, chunk=100)
    a = np.concatenate([one.take(7)[0], one.take(250)[0], one.take(43)[0]])
    assert np.array_equal(a, many.take(300)[0])
    big = PromptPool(stage, 4, lengths, seed=0, chunk=4096)
    lens, usable = big.take(40000)
    assert usable.mean() == pytest.approx(0.5, abs=0.01)
    assert lens.mean() == pytest.approx(2000.0, rel=0.03)  # mu makes the uncapped mean the stage's
    capped = PromptPool(stage, 4, LengthModel(cap=3000, min_len=5), seed=0).take(2000)[0]
    assert capped.max() == 3000 and capped.min() >= 5


def test_length_mu_without_spread_or_shift_is_log_mean():
    m = LengthModel(sigma_group=0.0, sigma_resp=0.0, shift_all_correct=0.0, shift_all_wrong=0.0)
    assert m.mu(Stage("s", 123.0, 0.2, 0.3)) == pytest.approx(math.log(123.0))


def test_stage_rejects_impossible_shares():
    with pytest.raises(ValueError, match="all_correct"):
        Stage("bad", 100.0, all_correct=0.6, all_wrong=0.4)


def test_batch_and_filter_waits_for_each_batch_and_counts_surplus():
    # Need 2 groups; batches of 3. Batch 1 keeps one (3 tokens), rejects 8; batch 2 keeps its first (5), the
    # other two usable groups are surplus (2 + 5). One engine with room for all: a batch lasts its longest response.
    pool = ListPool([[1, 2], [3, 1], [2, 2], [4, 1], [1, 1], [2, 3]], [True, False, False, True, True, True])
    res = batch_and_filter_step(pool, Recipe(2, 2, 3, 5), EngineModel(1, 6, 1.0, 0.0))
    assert (res.groups_kept, res.gen_batches, res.prompts_drawn) == (2, 2, 6)
    assert (res.kept, res.rejected, res.surplus, res.aborted) == (8.0, 8.0, 7.0, 0.0)
    assert res.generated == 23.0 and res.wall_s == pytest.approx(3.0 + 4.0)
    assert res.kept_lengths == [1.5, 2.5]


def test_batch_and_filter_stops_at_the_batch_limit():
    pool = ListPool([[1]] * 4, [False] * 4)
    res = batch_and_filter_step(pool, Recipe(1, 1, 2, 2), EngineModel(1, 2, 1.0, 0.0))
    assert (res.groups_kept, res.gen_batches, res.rejected) == (0, 2, 4.0)


def test_adaptive_round_sizes_from_the_usable_estimate():
    assert adaptive_round(512, 0.3, 1.2, 2048) == 2048  # 512 / 0.3 x 1.2 = 2048.0
    assert adaptive_round(512, 0.25, 1.2, 2048) == 2048  # capped (2457.6)
    assert adaptive_round(100, 0.5, 1.1, 2048) == 220
    assert adaptive_round(1, 0.0, 1.2, 50) == 50


def test_adaptive_batch_and_filter_draws_what_the_estimate_asks():
    # Need 2 groups, estimate 0.5, margin 1.0: a first round of 4 prompts keeps 1 (usable: F T F F),
    # the second round asks for 1 / 0.5 = 2 prompts (T T): keeps 1, 1 surplus.
    pool = ListPool([[1]] * 6, [False, True, False, False, True, True])
    res = batch_and_filter_step(pool, Recipe(2, 1, 3, 5), EngineModel(1, 8, 1.0, 0.0), (0.5, 1.0, 10))
    assert (res.prompts_drawn, res.gen_batches, res.groups_kept, res.usable_seen) == (6, 2, 2, 3)
    assert (res.kept, res.rejected, res.surplus) == (2.0, 3.0, 1.0)


def _stream_pool() -> ListPool:
    # One engine, two slots, G=1: g0 (5) and g1 (1) start; g1 ends t=1 (rejected), g2 (1) ends t=2 (kept),
    # g3 (4) starts t=2; g0 ends t=5 (kept, the step is full), g3 has 3 of 4 tokens then.
    return ListPool([[5], [1], [1], [4], [2], [2]], [True, False, True, True, True, True])


def test_streaming_stops_when_full_and_aborts_in_flight():
    res, carry = streaming_step(_stream_pool(), Recipe(2, 1, 3, 10), EngineModel(1, 2, 1.0, 0.0), [], partial=False)
    assert res.wall_s == pytest.approx(5.0) and res.groups_kept == 2 and res.prompts_drawn == 4
    assert (res.kept, res.rejected, res.surplus, res.aborted) == (6.0, 1.0, 0.0, pytest.approx(3.0))
    assert carry == [] and res.generated == pytest.approx(10.0)


def test_partial_rollouts_carry_the_aborted_tokens_into_the_next_step():
    pool, recipe, model = _stream_pool(), Recipe(2, 1, 3, 10), EngineModel(1, 2, 1.0, 0.0)
    first, carry = streaming_step(pool, recipe, model, [], partial=True)
    assert first.aborted == 0.0 and first.carried_out == pytest.approx(3.0)
    assert len(carry) == 1 and carry[0].progress.tolist() == pytest.approx([3.0]) and carry[0].staleness == 1
    # Next step: the carried group needs 1 more token (done t=1, kept, 4 tokens); the fresh g4 (2) ends t=2.
    second, carry = streaming_step(pool, recipe, model, carry, partial=True)
    assert second.wall_s == pytest.approx(2.0) and second.kept == pytest.approx(6.0)
    assert second.kept_stale == pytest.approx(3.0)  # the carried group's 3 tokens came from the older policy
    assert second.carried_in == pytest.approx(3.0) and second.generated == pytest.approx(4.0)  # 1 + 2 + 1 decoded
    # The step ended with g5 one token in; it carries with staleness 1.
    assert [c.progress.tolist() for c in carry] == [pytest.approx([1.0])]


def test_partial_rollouts_drop_groups_past_the_staleness_bound():
    stale = Carried(np.array([10]), True, np.array([4.0]), staleness=1)
    pool = ListPool([[1], [1]], [True, True])
    res, carry = streaming_step(pool, Recipe(2, 1, 3, 10), EngineModel(1, 2, 1.0, 0.0), [stale], partial=True,
                                max_staleness=1)
    # The carried group (6 tokens left) and g0 run; g0 ends t=1, g1 ends t=2: full. The stale group is dropped.
    assert res.groups_kept == 2 and res.wall_s == pytest.approx(2.0)
    assert carry == [] and res.aborted == pytest.approx(6.0) and res.carried_in == pytest.approx(4.0)
    assert res.generated == pytest.approx(2.0 + 2.0)


def test_streaming_admission_bounds_the_fresh_prompts_and_tops_up():
    # usable estimate 1.0, margin 1: admit 2 prompts. t=1: g0 rejected, g1 kept; 1 missing and nothing pending,
    # so 1 more is admitted: g2 kept at t=2. Without admission both free slots take g2 and g3: g3 is surplus.
    pool, recipe, model = ListPool([[1]] * 4, [False, True, True, True]), Recipe(2, 1, 3, 10), EngineModel(1, 2, 1.0, 0.0)
    res, _ = streaming_step(pool, recipe, model, [], partial=False, admit=(1.0, 1.0, 100))
    assert (res.prompts_drawn, res.groups_kept, res.wall_s, res.surplus) == (3, 2, pytest.approx(2.0), 0.0)
    free, _ = streaming_step(ListPool([[1]] * 4, [False, True, True, True]), recipe, model, [], partial=False)
    assert (free.prompts_drawn, free.groups_kept, free.wall_s, free.surplus) == (4, 2, pytest.approx(2.0), 1.0)


def test_streaming_admission_counts_pending_prompts_before_topping_up():
    # estimate 0.5, margin 1.5: admit 6. t=1: g1 rejected; g0 in flight + 4 unfed prompts expect 2.5 >= 2 usable,
    # so no top-up; the step ends at t=3 (g2 kept t=2, g0 kept t=3) having drawn 4, g3 aborted after 1 token.
    pool = ListPool([[3], [1], [1], [2], [9], [9], [9], [9]], [True, False, True, True, True, True, True, True])
    res, _ = streaming_step(pool, Recipe(2, 1, 3, 10), EngineModel(1, 2, 1.0, 0.0), [], partial=False,
                            admit=(0.5, 1.5, 100))
    assert (res.prompts_drawn, res.groups_kept, res.wall_s) == (4, 2, pytest.approx(3.0))
    assert (res.kept, res.rejected, res.aborted) == (4.0, 1.0, pytest.approx(1.0))


def test_tiny_steps_reads_a_run(tmp_path):
    metrics = {"step": 3, "sampling/groups_generated": 64, "sampling/groups_all_correct": 32,
               "sampling/groups_all_wrong": 16}
    ledger = {"step": 3, "cost/step/tokens_generated": 2048, "cost/step/rollouts_generated": 512,
              "cost/step/prompts_kept": 16}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n" + json.dumps(metrics) + "\n")
    (tmp_path / "ledger.jsonl").write_text(json.dumps(ledger) + "\n")
    [(step, stage, tokens, kept)] = tiny_steps(tmp_path)
    assert (step, tokens, kept) == (3, 2048.0, 16)
    assert (stage.mean_len, stage.all_correct, stage.all_wrong) == (4.0, 0.5, 0.25)


# --- several engine groups, prompt-order decisions, the whole step -----------------------------------


def test_spread_splits_a_group_over_engines_like_plan_shares():
    # One group of 4 responses over 2 engines: engine 0 takes responses 0 and 2 (3, 2), engine 1 takes 1 and 3 (1, 2).
    sim = EngineSim(EngineModel(engines=2, max_seqs=1, t0=1.0, t1=0.0))
    spread(sim, np.array([[3, 1, 2, 2]]))
    assert [[sim.seq_len[s] for s in q] for q in sim.queues] == [[3, 2], [1, 2]]
    while sim.advance() is not None:
        pass
    assert sim.now == pytest.approx(5.0)  # one slot each: engine 0 runs 3 then 2


def test_chunked_rounds_wait_for_each_chunk_over_two_engines():
    # Need 2 groups, G=2, a round of 4 prompts in chunks of 2 over 2 engines (2 slots each, 1 s per token).
    # Chunk 1: g0 [1,3] usable on engine 0, g1 [2,2] rejected on engine 1: lasts 3 s. Chunk 2: g2 [4,1] usable
    # (engine 0, 4 s), g3 [1,1] usable (engine 1, 1 s): lasts 4 s, g3 is surplus. Wall 3 + 4.
    groups, usable = [[1, 3], [2, 2], [4, 1], [1, 1]], [True, False, True, True]
    model, recipe = EngineModel(2, 2, 1.0, 0.0), Recipe(2, 2, 4, 5)
    res = batch_and_filter_step(ListPool(groups, usable), recipe, model, chunk=2)
    assert (res.wall_s, res.prompts_drawn, res.gen_batches) == (pytest.approx(7.0), 4, 1)
    assert (res.kept, res.rejected, res.surplus) == (9.0, 4.0, 2.0)
    # The whole round at once: engine 0 runs g0 and g2 (slot 0: 1 then 4 -> t=5), engine 1 g1 and g3 (t=3): 5 s.
    whole = batch_and_filter_step(ListPool(groups, usable), recipe, model)
    assert (whole.wall_s, whole.kept, whole.surplus) == (pytest.approx(5.0), 9.0, 2.0)
    # A chunk that fills the step ends it: the second chunk is never drawn.
    early = batch_and_filter_step(ListPool(groups, [True, True, True, True]), recipe, model, chunk=2)
    assert (early.wall_s, early.prompts_drawn, early.kept) == (pytest.approx(3.0), 2, 8.0)


def test_prompt_order_streaming_waits_for_earlier_groups_two_engines():
    # Two engines with one slot each, G=1, need 2. t=0: g0 (4) on engine 0, g1 (1) on engine 1; t=1: g1 ends,
    # g2 (1) starts on engine 1; t=2: g2 ends, g3 (5) starts. In completion order g1 and g2 fill the step at t=2
    # (g0 aborted at 2 tokens, g3 at 0). In prompt order g0 must finish first: at t=4 g0 and g1 are kept, g2 (done
    # out of order) is surplus, and g3 is aborted at 2 tokens.
    groups, usable = [[4], [1], [1], [5], [9], [9]], [True, True, True, True, True, True]
    model, recipe = EngineModel(2, 1, 1.0, 0.0), Recipe(2, 1, 3, 10)
    done, _ = streaming_step(ListPool(groups, usable), recipe, model, [], partial=False)
    assert (done.wall_s, done.kept, done.surplus, done.aborted) == (pytest.approx(2.0), 2.0, 0.0, pytest.approx(2.0))
    ordered, _ = streaming_step(ListPool(groups, usable), recipe, model, [], partial=False, order="prompt")
    assert (ordered.wall_s, ordered.kept, ordered.surplus) == (pytest.approx(4.0), 5.0, 1.0)
    assert ordered.aborted == pytest.approx(2.0) and ordered.prompts_drawn == 4
    assert ordered.kept_lengths == [4.0, 1.0]  # prompt order keeps the long first group: no length bias
    with pytest.raises(ValueError, match="order="):
        streaming_step(ListPool(groups, usable), recipe, model, [], partial=False, order="random")


def test_prompt_order_rejects_earlier_unusable_groups_before_keeping():
    # One engine, two slots, G=1, need 1: g0 (3, unusable) and g1 (1, usable) start; g1 ends at t=1 but waits for g0
    # (t=3, rejected); then g1 is kept. g2 (1) started at t=1 and ended at t=2, out of order: surplus.
    pool = ListPool([[3], [1], [1], [7]], [False, True, True, True])
    res, _ = streaming_step(pool, Recipe(1, 1, 3, 10), EngineModel(1, 2, 1.0, 0.0), [], partial=False, order="prompt")
    assert (res.wall_s, res.rejected, res.kept, res.surplus) == (pytest.approx(3.0), 3.0, 1.0, 1.0)
    assert res.aborted == pytest.approx(1.0)  # g3 started at t=2


def test_sync_step_is_the_sum_of_its_phases():
    st = sync_step(Phases(generation=600.0, old_logprobs=60.0, train=180.0, weight_sync=2.0))
    assert (st.step, st.trainer_wait, st.engine_wait) == (842.0, 0.0, 0.0)


def test_async_step_trainer_slower_than_generation():
    # Engines generate batch k+1 in 10 s while the trainer needs 5 + 10 s on batch k: the engines wait 5 s.
    st = async_step(10.0, Phases(99.0, 5.0, 10.0, 0.0), transfer=1.0)
    assert (st.step, st.trainer_wait, st.engine_wait) == (16.0, 0.0, 5.0)
    assert (st.phases.generation, st.phases.weight_sync) == (10.0, 1.0)  # the next batch's generation, the transfer


def test_async_step_generation_slower_than_trainer():
    st = async_step(20.0, Phases(99.0, 5.0, 10.0, 0.0), transfer=1.0)
    assert (st.step, st.trainer_wait, st.engine_wait) == (21.0, 5.0, 0.0)


def test_async_steps_pair_each_batch_with_the_next_generation():
    trainer = [Phases(10.0, 2.0, 8.0, 0.0), Phases(30.0, 5.0, 20.0, 0.0)]
    steps = async_steps([10.0, 30.0], trainer, transfer=0.5)
    # Period 0: trainer on batch 0 (10 s) beside batch 1's generation (30 s); period 1: 25 s beside batch 0's 10 s.
    assert [s.step for s in steps] == [30.5, 25.5]
    assert mean_step(steps).step == pytest.approx(28.0) and mean_step(steps).trainer_wait == pytest.approx(10.0)
    with pytest.raises(ValueError, match="one generation time"):
        async_steps([1.0], trainer, 0.0)


def test_trainer_phases_follow_the_kept_length():
    from dapo_mcore.model.presets import preset_config
    from dapo_mcore.plan.planner import PlanInput
    from dapo_mcore.telemetry.flops import ModelShape, sequence_forward_flops

    p = PlanInput(model=preset_config("qwen2.5-32b"), tensor_parallel=8, pipeline_parallel=2, data_parallel=8,
                  recompute="selective")
    short, long = StepResult(kept_lengths=[900.0, 1100.0]), StepResult(kept_lengths=[5000.0])
    (lp_s, tr_s), (lp_l, tr_l) = _trainer_phases(p, [short, long], prompt_len=256)
    # Naive reference: 512 x 16 sequences of 256 + 1000 tokens, one forward each, on 128 GPUs at 35% of 989.4 TFLOP/s.
    fwd = sequence_forward_flops(ModelShape.from_hf(p.model), 256 + 1000) * 512 * 16
    assert lp_s == pytest.approx(fwd / (128 * 989.4e12 * 0.35))
    assert 3.0 < tr_s / lp_s < 3.2  # forward + backward (3x) plus selective recompute of core attention
    assert lp_l / lp_s > (256 + 5000) / (256 + 1000)  # attention grows faster than linearly


def test_chunked_stream_assigns_round_robin_and_drains_between_chunks():
    # Two engines, one slot each, G=1, need 2, chunks of 2, prompt order. Chunk 1: g0 (3, rejected) on engine 0,
    # g1 (1, usable) on engine 1, which then idles (no pulling): t=3 decides g0, g1. Chunk 2: g2 (2) on engine 0,
    # g3 (1) on engine 1: g3 ends at t=4 out of order, g2 at t=5 fills the step; g3 is surplus. A pulling stream
    # puts g2 on engine 1 at t=1 and is full at t=3.
    groups, usable = [[3], [1], [2], [1], [9], [9]], [False, True, True, True, True, True]
    model, recipe = EngineModel(2, 1, 1.0, 0.0), Recipe(2, 1, 4, 10)
    rr, _ = streaming_step(ListPool(groups, usable), recipe, model, [], partial=False, order="prompt", chunk=2)
    assert (rr.wall_s, rr.prompts_drawn, rr.kept, rr.rejected, rr.surplus) == (pytest.approx(5.0), 4, 3.0, 3.0, 1.0)
    pull, _ = streaming_step(ListPool(groups, usable), recipe, model, [], partial=False, order="prompt")
    assert pull.wall_s == pytest.approx(3.0) and pull.kept == 3.0


def test_chunked_stream_resumes_carried_groups_first_and_carries_unstarted_ones():
    # A carried group (2 of 5 tokens) resumes alone on engine 0 (3 s) before the first fresh chunk; need 1 is met by
    # it. With a chunk of 3 on one engine and one slot: g0 (2) ends t=2 and fills a need of 1; g1 and g2 never
    # started and carry with no tokens (staleness 0).
    carried = Carried(np.array([5]), True, np.array([2.0]), staleness=1)
    model, recipe = EngineModel(1, 1, 1.0, 0.0), Recipe(1, 1, 3, 10)
    res, carry = streaming_step(ListPool([[9]] * 3, [True] * 3), recipe, model, [carried], partial=True,
                                order="prompt", chunk=3)
    assert (res.wall_s, res.kept, res.kept_stale, res.prompts_drawn, carry) == (pytest.approx(3.0), 5.0, 2.0, 0, [])
    res, carry = streaming_step(ListPool([[2], [4], [4]], [True] * 3), recipe, model, [], partial=True,
                                order="prompt", chunk=3)
    assert (res.wall_s, res.kept, res.aborted) == (pytest.approx(2.0), 2.0, 0.0)
    assert [(c.progress.tolist(), c.staleness) for c in carry] == [([0.0], 0), ([0.0], 0)]


def test_variants_config_prices_the_configs_schedule_against_today(tmp_path, capsys):
    """``--variants config`` on a recipe whose own schedule is not ``today`` (it died with KeyError ('today', 0):
    the own row came first and needed today's step for its speed-up column); a 64-prompt cut of the fast recipe."""
    import yaml

    from benchmarks.rollout_sim import main

    recipe = yaml.safe_load(open("examples/qwen2.5-32b-fp8.yaml"))
    recipe["train"].update(prompts_per_step=64, mini_batch_prompts=32)
    recipe["rollout"]["gen_batch_prompts"] = 192
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["--smoke", "--variants", "config", "--config", str(tmp_path / "small.yaml"),
                 "--engine-gpus", "96"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln for ln in lines if ln.startswith("(")]
    assert [r.split(":")[0].split(" ")[0] for r in rows] == ["(a)", "(f')", "(g')"] * 3  # today, own sync, own async
    assert all(r.split()[-3] == "1.00" for r in rows[::3])  # today over itself
    assert "this config's schedule: sync_partial_done (colocated)" in lines[-2]
    assert lines[-1].startswith("sim_async_over_sync_speedup: ")
