"""Bounded staleness in async mode (``rollout.pipeline.max_staleness`` = K > 1) in real runs, and its pieces.

At the real shape (trainer DP=2 beside two engine ranks, 4 processes) with K = 2: batch k is sampled by version
max(0, k - 2), no trained token lags more than 2 (the histogram), each checkpoint holds the batches generated ahead,
and kill -9 of a trainer rank (during a weight transfer) or of an engine rank (as it starts a batch) resumes to the
uninterrupted record. With partial rollouts (K = 2: the engines lead by one, prefixes lag two) a trained response
holds tokens of two versions, and a run killed mid-generation resumes exactly too. Units: the carry drops a partial
group past the bound and counts it; the trainer's correction weighs the rollout log-probs against the recomputed
pi_old (the proximal policy), never the current one; a bypass preset is refused where the engines lead by more than
one version, and K > 1 in sync mode; the engines' version receiver stages no more than its bound.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from dapo_mcore.config import load_config
from tests.test_async import EXACT, ROOT, TWO_ENGINES, _rows, _same, _train

K2 = ("rollout.pipeline.max_staleness=2", "checkpoint.keep_last=3")
STEPS = 4


@pytest.fixture(scope="module")
def reference_k2(cli_env, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("async_k2") / "reference"
    proc = _train(run, cli_env, STEPS, 4, *TWO_ENGINES, *K2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.e2e
def test_k2_samples_batch_k_by_version_k_minus_2_and_no_token_lags_more(reference_k2):
    rows = _rows(reference_k2)
    assert sorted(rows) == [1, 2, 3, 4]
    assert [rows[s]["async/policy_version"] for s in rows] == [0.0, 0.0, 0.0, 1.0]  # max(0, k - 2), k = step - 1
    assert [rows[s]["async/lag_max"] for s in rows] == [0.0, 1.0, 2.0, 2.0]
    for step, r in rows.items():
        hist = {int(k.rsplit("_", 1)[1]): v for k, v in r.items() if k.startswith("staleness/tokens_lag_")}
        assert sorted(hist) == [0, 1, 2], hist  # the bound's keys, nothing beyond K
        lag = (step - 1) - int(r["async/policy_version"])
        assert hist[lag] == sum(hist.values()) > 0, (step, hist)  # one version per batch without partial rollouts
        assert r["async/dropped_stale_groups"] == 0.0
    # A checkpoint after step s holds the batches the engines generated ahead: s .. s + K - 1 (not past the last).
    assert not (reference_k2 / "checkpoints" / "step_000004" / "rollouts_pending.pkl").exists()
    for step, want in ((2, [2, 3]), (3, [3])):
        held = pickle.loads((reference_k2 / "checkpoints" / f"step_{step:06d}" / "rollouts_pending.pkl").read_bytes())
        assert [m["step"] for m in held["batches"]] == want, (step, held["batches"])
        assert [m["version"] for m in held["batches"]] == [max(0, k - 2) for k in want]


@pytest.mark.e2e
@pytest.mark.parametrize("fault", ["publish:2:1", "generate:3@3"])
def test_k2_kill9_of_a_trainer_or_an_engine_rank_resumes_exactly(reference_k2, cli_env, tmp_path, fault):
    """Trainer rank 0 dies sending version 2; engine rank 1 (job rank 3) dies starting batch 3 (version 1's first)."""
    run = tmp_path / "run"
    killed = _train(run, cli_env, STEPS, 4, *TWO_ENGINES, *K2, fault=fault)
    assert killed.returncode != 0 and killed.stderr.count("killing this process (SIGKILL)") == 1, killed.stderr[-3000:]
    assert len(_rows(run)) < STEPS
    resumed = _train(run, cli_env, STEPS, 4, *TWO_ENGINES, *K2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint" in resumed.stderr
    _same(reference_k2, run, (*EXACT, "staleness/tokens_lag_2"))


PARTIAL = ("rollout.pipeline.engine_ranks=2", "rollout.pipeline.max_staleness=2", "rollout.schedule.streaming=true",
           "rollout.schedule.stream_chunk_prompts=16", "rollout.schedule.partial=true",
           "rollout.schedule.exchange_every=2", "train.prompts_per_step=4", "rollout.schedule.order=completion")


@pytest.mark.e2e
def test_k2_partial_rollouts_continue_across_a_weight_update_and_resume_exactly(cli_env, tmp_path):
    """Step 4's batch (version 2) continues groups batch 3 (version 1) aborted in flight, after the update between the
    two batches: a trained response holds tokens of both, at lags 2 and 1; kill -9 of engine rank 0 as it starts
    batch 4 resumes to the same record."""
    from dapo_mcore.telemetry.rollout_store import ROLLOUTS_DIR, RolloutReader

    ref, run = tmp_path / "reference", tmp_path / "run"
    proc = _train(ref, cli_env, 4, 3, *PARTIAL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(ref)
    assert rows[4]["staleness/tokens_lag_1"] > 0 and rows[4]["staleness/tokens_lag_2"] > 0, rows[4]
    assert all(r["staleness/tokens_lag_0"] == 0 for s, r in rows.items() if s > 1)  # never fresher than one behind
    kept = [r for r in RolloutReader(ref / ROLLOUTS_DIR).read_step(4) if r.kept]
    assert any(0 < r.stale_tokens < r.response_len for r in kept)  # version 1's prefix, version 2's tail
    killed = _train(run, cli_env, 4, 3, *PARTIAL, fault="generate:3@2")
    assert killed.returncode != 0 and "killing this process (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    resumed = _train(run, cli_env, 4, 3, *PARTIAL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint" in resumed.stderr
    _same(ref, run, (*EXACT, "staleness/tokens_lag_1", "staleness/tokens_lag_2", "sampling/tokens_stale_kept"))


# ---- units ---------------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_carry_drops_a_partial_group_past_the_bound_and_counts_it():
    """Buffered groups sampled by version 1 and 2; the batch for step 4 with K = 2: version 1's oldest token would lag
    3, so that group is dropped (its tokens counted), version 2's (lag 2) is continued; one never started is kept."""
    from dapo_mcore.algo.dynamic_sampling import SamplingStats
    from dapo_mcore.algo.schedule_config import ScheduleConfig
    from dapo_mcore.rollout.protocol import PartialGroup, Response
    from dapo_mcore.rollout.scheduling.partial import PartialBuffer
    from dapo_mcore.rollout.scheduling.scheduler import RolloutScheduler

    buf = PartialBuffer()
    old = PartialGroup(0, [Response([5, 6, 7], [-1.0] * 3, "length"), Response([5], [-1.0], "length")], [False, True])
    newer = PartialGroup(1, [Response([8, 9], [-1.0] * 2, "length"), Response([], [], "length")], [False, False])
    unstarted = PartialGroup(2, [Response([], [], "length")] * 2, [False, False])
    buf.add([10, 11, 12], [old], step=2, version=1)
    buf.add([10, 11, 12], [newer, unstarted], step=3, version=2)
    assert [r.versions for r in old.responses] == [[(1, 3)], [(1, 1)]]
    state = buf.state_dict()
    buf.load_state_dict(state)  # the versions survive a checkpoint
    sched = RolloutScheduler(ScheduleConfig(), None, n=2, target=1, gen_batch_prompts=1, max_rounds=0, max_lag=2)
    stats = SamplingStats()
    kept = sched.fresh_enough(buf.take(), 4, stats)
    assert [b.index for b in kept] == [11, 12]
    assert (stats.groups_dropped_stale, stats.tokens_dropped_stale) == (1, 4)
    assert sched.fresh_enough(kept, 5, SamplingStats()) == [kept[1]]  # at step 5 version 2 would lag 3 too


@pytest.mark.unit
def test_join_keeps_each_tokens_version_in_runs():
    from dapo_mcore.rollout.protocol import Response
    from dapo_mcore.rollout.scheduling.partial import join, runs, stale_response

    prefix = Response([1, 2], [-0.1, -0.2], "length", versions=[(3, 2)])
    joined = join(prefix, Response([7, 8, 9], [-0.3] * 3, "stop"), 4)
    assert (joined.versions, joined.stale_tokens, joined.token_ids) == ([(3, 2), (4, 3)], 2, [1, 2, 7, 8, 9])
    assert join(prefix, Response([7], [-0.3], "stop"), 3).versions == [(3, 3)]  # one version: one run
    assert stale_response(prefix).versions == [(3, 2)]
    assert runs([(1, 0), (2, 1), (2, 2), (3, 0)]) == [(2, 3)]


@pytest.mark.unit
def test_the_correction_weighs_the_rollout_logprobs_against_the_recomputed_pi_old():
    """Decoupled objective: the trainer's old-log-prob pass sets pi_old (the proximal policy, the ratio's
    denominator) to the actor's recomputed log-probs, and token TIS weighs min(pi_old / pi_rollout, cap): against the
    behaviour policy's log-probs, not against the policy being trained (which the pass never sees)."""
    import types

    from dapo_mcore.actor.megatron_actor import TrainSample
    from dapo_mcore.trainer import Trainer

    cfg = load_config(ROOT / "examples" / "tiny_cpu.yaml", ["rollout.pipeline.mode=async", "algo.tis_cap=2.0",
                                                             "rollout.pipeline.max_staleness=2"])
    g = torch.Generator().manual_seed(0)
    behaviour = [torch.randn(5, generator=g) - 2, torch.randn(3, generator=g) - 2]
    proximal = [b + torch.randn(b.shape, generator=g) for b in behaviour]  # pi_old after K versions of drift
    samples = [TrainSample([1, 2], list(range(len(b))), 1.0, loss_mask=torch.ones(len(b)),
                           extra={"engine_logp": b, "stale_tokens": 0, "versions": [(0, len(b))]})
               for b in behaviour]
    actor = types.SimpleNamespace(compute_logprobs=lambda s: ([p.clone() for p in proximal], None),
                                  routing_mismatch=None)
    trainer = Trainer(cfg, types.SimpleNamespace(actor=actor))
    trainer.old_logprobs(samples)
    for s, p, b in zip(samples, proximal, behaviour, strict=True):
        assert torch.equal(s.old_logprobs, p)
        torch.testing.assert_close(s.tis_weights, torch.exp(p - b).clamp(max=2.0))


@pytest.mark.unit
def test_bypass_stays_accepted_one_version_behind():
    """One-step-off (and partial rollouts at K = 2, whose engines lead by one) keep bypass as before."""
    for extra in ([], ["rollout.pipeline.max_staleness=2", "rollout.schedule.streaming=true",
                       "rollout.schedule.partial=true"]):
        cfg = load_config(ROOT / "examples" / "tiny_cpu.yaml", ["rollout.pipeline.mode=async",
                                                                 "algo.rollout_correction.preset=bypass_ppo_clip", *extra])
        cfg.validate(2)


@pytest.mark.unit
def test_the_version_receiver_stages_at_most_its_bound_ahead_and_hands_the_stop_on():
    """K = 3 (lead 3): at most 2 versions on the host, the one being loaded included; each version loaded and
    released lets one more in, in order; the trainer's stop reaches every later take."""
    import threading
    import time

    from dapo_mcore.rollout.pipeline.async_channels import VersionReceiver

    class Stop(Exception):
        pass

    received, gate = [], threading.Semaphore(0)

    def receive():
        if len(received) == 4:
            raise Stop
        received.append(len(received))
        gate.release()
        return {"version": received[-1]}, [], 0.0

    def settle(n):
        for _ in range(n):
            assert gate.acquire(timeout=10)
        time.sleep(0.2)  # a receiver that ignored its bound would have taken another by now

    rx = VersionReceiver(receive, 2, Stop)
    settle(2)
    assert received == [0, 1]
    (header, _, _), _ = rx.take()
    settle(0)
    assert header["version"] == 0 and received == [0, 1]  # version 0 is still being loaded: no third copy
    rx.release()
    settle(1)
    assert received == [0, 1, 2]
    versions = []
    for _ in range(3):
        versions.append(rx.take()[0][0]["version"])
        rx.release()
    assert versions == [1, 2, 3]
    for _ in range(2):
        with pytest.raises(Stop):
            rx.take()
