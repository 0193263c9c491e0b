"""The async batch on the wire: token ids and log-probs as int32/float32 tensors, the rest pickled."""

from __future__ import annotations

import pickle

import pytest
import torch

from dapo_mcore.algo.dynamic_sampling import SamplingStats
from dapo_mcore.data.records import PromptRecord
from dapo_mcore.rollout.pipeline import wire
from dapo_mcore.rollout.pipeline.source import StepBatch
from dapo_mcore.rollout.protocol import Response
from dapo_mcore.rollout.scheduling.groups import GroupData
from dapo_mcore.rollout.scheduling.partial import runs

pytestmark = pytest.mark.unit


def _group(i: int, g: torch.Generator, kept: bool) -> GroupData:
    responses = []
    for j in range(3):
        n = int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(0, 151_000, (n,), generator=g).tolist()
        lps = (-torch.rand(n, generator=g)).tolist()  # float32 values, as the engines compute them
        stale = min(j, n)  # the first tokens an older version produced: each token's version travels too
        responses.append(Response(ids, lps, "stop" if j else "length", stale_tokens=stale,
                                  versions=runs([(1, stale), (2, n - stale)])))
    return GroupData(record=PromptRecord(f"p{i}", "1", "synthetic", i), prompt_ids=[1, i], responses=responses,
                     scores=[1.0, -1.0, 1.0], acc=[True, False, True], rewards=[1.0, -1.0, 1.0], gen_batch=0,
                     preds=["1", None, "1"], kept=kept)


def _message() -> dict:
    g = torch.Generator().manual_seed(0)
    generated = [_group(i, g, kept=i % 2 == 0) for i in range(5)]
    batch = StepBatch(kept=[x for x in generated if x.kept], generated=generated, stats=SamplingStats())
    return {"kind": "batch", "step": 3, "batch": batch, "state": {"sampler": [1, 2]}, "version": 2}


def test_a_batch_round_trips_through_tensors_equal_and_with_its_shared_groups_shared():
    message = _message()
    packed = wire.pack(message)
    assert packed.token_ids.dtype == torch.int32 and packed.logprobs.dtype == torch.float32
    tokens = sum(len(r.token_ids) for g in message["batch"].generated for r in g.responses)
    assert packed.token_ids.numel() == tokens  # kept groups (also generated) travel once
    got = wire.unpack(pickle.loads(pickle.dumps(packed)))
    assert got["batch"] == message["batch"] and got["state"] == message["state"] and got["step"] == 3
    assert all(any(k is x for x in got["batch"].generated) for k in got["batch"].kept)
    assert packed.nbytes < len(pickle.dumps(message))


def test_tool_use_responses_keep_their_loss_mask_and_counts_and_nan_log_probs():
    """Multi-turn tool use in async mode: the trainer must mask exactly the tool tokens the engine appended."""
    nan = float("nan")
    masks = [[True, False, False, True, True], [False, True], [True, True, False], []]
    tool = [Response(list(range(len(m))), [-0.5 if x else nan for x in m], "stop", loss_mask=m, tool_calls=k,
                     tool_errors=k // 2) for k, m in enumerate(masks)]
    group = GroupData(record=PromptRecord("p", "1", "synthetic", 0), prompt_ids=[1], responses=tool + [
        Response([4, 5], [-0.1, -0.2], "length")], scores=[0.0] * 5, acc=[False] * 5, rewards=[0.0] * 5, gen_batch=0,
        preds=[None] * 5, kept=True)
    message = {"kind": "batch", "step": 1, "version": 0,
               "batch": StepBatch(kept=[group], generated=[group], stats=SamplingStats(), tools={"tools/calls": 6.0})}
    got = wire.unpack(pickle.loads(pickle.dumps(wire.pack(message))))["batch"]
    assert got.tools == {"tools/calls": 6.0}
    for r, want in zip(got.kept[0].responses, group.responses, strict=True):
        assert (r.token_ids, r.loss_mask, r.tool_calls, r.tool_errors) == (want.token_ids, want.loss_mask,
                                                                          want.tool_calls, want.tool_errors)
        assert [x != x for x in r.logprobs] == [y != y for y in want.logprobs]  # NaN exactly on the tool tokens
    assert got.kept[0].responses[-1].loss_mask is None


def test_the_other_trainer_ranks_get_the_kept_groups_whole_and_the_rest_without_responses():
    message = _message()
    light = wire.unpack(wire.pack(wire.light(message)))
    assert light["batch"].kept == message["batch"].kept
    for got, want in zip(light["batch"].generated, message["batch"].generated, strict=True):
        assert got.acc == want.acc and got.rewards == want.rewards
        assert got.responses == (want.responses if want.kept else [])


def test_an_evaluation_and_an_error_round_trip():
    groups = _message()["batch"].generated
    assert wire.unpack(wire.pack({"kind": "eval", "version": 1, "groups": groups}))["groups"] == groups
    error = {"kind": "error", "error": "engine", "message": "x"}
    assert wire.unpack(wire.pack(error)) == error


def test_a_resume_with_other_engine_ranks_says_so_in_one_line(caplog):
    """The layout is not part of a run's identity, but the trajectory after the pending batch depends on it (a
    resume with another layout is logged, not accepted silently)."""
    import logging
    import types

    from dapo_mcore.rollout.pipeline.async_source import AsyncRollouts
    from dapo_mcore.rollout.pipeline.bridge import Role

    bridge = types.SimpleNamespace(role=Role(True, 0, 1, 2))
    cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(pipeline=types.SimpleNamespace(max_staleness=1),
                                                              schedule=types.SimpleNamespace(partial=False)))
    pending = pickle.dumps({"step": 2, "state": {"sampler": 1}, "engine_ranks": 1})  # one-step-off's older format
    with caplog.at_level(logging.INFO, logger="dapo_mcore.rollout.pipeline.async_source"):
        AsyncRollouts(cfg, bridge, None).resume_from(2, {}, pending)
        AsyncRollouts(cfg, types.SimpleNamespace(role=Role(True, 0, 1, 1)), None).resume_from(2, {}, pending)
    lines = [r.getMessage() for r in caplog.records if "engine_ranks" in r.getMessage()]
    assert len(lines) == 1 and "engine_ranks=2" in lines[0] and "came from 1" in lines[0], lines


def test_a_pending_file_written_before_the_rollout_sub_packages_still_loads():
    """A checkpoint's pending batches name their classes by module: one written while rollout/ was flat
    (``dapo_mcore.rollout.source.StepBatch``, ``...groups.GroupData``) must resume after the split."""
    from dapo_mcore.rollout.pipeline.async_source import load_pending

    message = _message()
    new = pickle.dumps({"batches": [message]}, protocol=0)  # protocol 0 names each class on a line of its own
    old = new.replace(b"dapo_mcore.rollout.pipeline.source\n", b"dapo_mcore.rollout.source\n")
    old = old.replace(b"dapo_mcore.rollout.scheduling.groups\n", b"dapo_mcore.rollout.groups\n")
    assert old != new and b"rollout.pipeline" not in old and b"rollout.scheduling" not in old
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(old)  # what resuming it read before
    assert load_pending(old) == load_pending(new) == {"batches": [message]}

def test_the_pipeline_lanes_draw_an_evaluation_behind_the_trainer_where_it_ran():
    """Evaluation off the trainer's path: the evaluation of version 2 ran on the engines at the start of step 3, before batch 4's generation,
    and the trainer waited for its remainder inside step 3's publish: drawn so, every second once."""
    from dapo_mcore.telemetry import lanes

    r = {"step": 3, "time/step": 2.0, "time/wait_rollouts": 1.0, "async/trainer_wait_s": 1.0, "time/train": 0.5,
         "async/trainer_wait_eval_s": 0.4, "async/trainer_wait_publish_s": 0.3, "time/sync_weights": 0.2,
         "async/engine_eval_s": 0.6, "eval/policy_version": 2.0}
    nxt = {"step": 4, "async/engine_generate_s": 1.0, "async/engine_reward_s": 0.1,
           "async/engine_wait_weights_s": 0.5, "async/weights_transfer_s": 0.5}  # the version taken before batch 4
    after = {"step": 5, "async/engine_wait_weights_s": 0.2, "async/weights_transfer_s": 0.2}  # the one after it
    trainer = lanes.trainer_segments(r, 0.0)
    assert [s.what for s in trainer] == ["wait for rollouts", "train", "wait for eval", "wait for rollouts", "publish",
                                         "other"]
    assert sum(s.width for s in trainer) == pytest.approx(2.0)
    engines = lanes.engine_segments(r, nxt, publish_end=1.7, after=after)
    assert [s.what for s in engines] == ["eval", "generate + score", "wait for weights", "receive weights"]
    assert engines[0].width == 0.6 and engines[-1].start + engines[-1].width == pytest.approx(1.7)
    assert [s.width for s in engines[2:]] == [0.2, 0.2]  # after batch 4: the next batch's wait and copy
    # The last version's evaluation (on the trainer's path, labelled with its own step) comes after the publish.
    last = dict(r, **{"eval/policy_version": 3.0})
    assert [s.what for s in lanes.engine_segments(last, nxt, publish_end=1.7)][-1] == "eval"
