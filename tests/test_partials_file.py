"""Partial rollouts in a checkpoint: the buffered groups' tokens and log-probs go to a binary file beside
``trainer_state.json`` (``partials.pt``), which names it; a resume reads them back exactly, and a checkpoint written
before (the groups base64-packed inside ``trainer_state.json``) still loads."""

from __future__ import annotations

import json

import pytest

from dapo_mcore.rollout.protocol import PartialGroup, Response
from dapo_mcore.rollout.scheduling.partial import PARTIALS_FILE, PartialBuffer, join_partials, split_partials

pytestmark = pytest.mark.unit


def _buffer() -> PartialBuffer:
    buf = PartialBuffer()
    lp = [-0.1, -1e-300, -123.456789012345678, -7.25]
    buf.add([11, 12], [PartialGroup(0, [Response([1, 2, 3], lp[:3], "length"), Response([9], [lp[3]], "stop")],
                                    [False, True]),
                       PartialGroup(1, [Response([4] * 500, [-0.5] * 500, "length")], [False])], step=3)
    return buf


def _as_tuples(buf: PartialBuffer) -> list:
    return [(b.index, b.step, b.group.index, b.group.done,
             [(r.token_ids, r.logprobs, r.finish_reason, r.versions) for r in b.group.responses]) for b in buf.items]


def test_the_buffer_goes_to_a_binary_file_and_comes_back_exactly(tmp_path):
    buf = _buffer()
    state = {"step": 4, "schedule": {"usable_estimate": 0.5, "partials": buf.state_dict()}}
    blob = split_partials(state)
    (tmp_path / PARTIALS_FILE).write_bytes(blob)
    text = json.dumps(state)
    assert state["schedule"]["partials"] == {"file": PARTIALS_FILE, "groups": 2}
    assert len(text) < 200  # no token or log-prob in trainer_state.json any more (it held ~5 kB of base64 here)
    loaded = json.loads(text)
    join_partials(loaded, tmp_path)
    back = PartialBuffer()
    back.load_state_dict(loaded["schedule"]["partials"])
    assert _as_tuples(back) == _as_tuples(buf)


def test_an_inline_checkpoint_still_loads_and_a_missing_file_is_one_line(tmp_path):
    from dapo_mcore.errors import UserError

    buf = _buffer()
    old = json.loads(json.dumps({"step": 4, "schedule": {"partials": buf.state_dict()}}))  # the form written before
    join_partials(old, tmp_path)
    back = PartialBuffer()
    back.load_state_dict(old["schedule"]["partials"])
    assert _as_tuples(back) == _as_tuples(buf)
    assert split_partials({"step": 1, "schedule": {"partials": []}}) is None  # nothing buffered: no file
    with pytest.raises(UserError) as err:
        join_partials({"schedule": {"partials": {"file": PARTIALS_FILE, "groups": 2}}}, tmp_path)
    assert "\n" not in str(err.value) and PARTIALS_FILE in str(err.value)


def test_tool_columns_of_a_buffered_response_survive_the_file_and_the_join(tmp_path):
    """Multi-turn tool use: a buffered response's loss mask, NaN log-probs of its tool tokens and its call counts
    come back from the checkpoint exactly, and joined with its continuation the mask runs end to end."""
    import math

    from dapo_mcore.rollout.scheduling.partial import join

    nan = float("nan")
    called = Response([5, 6, 7, 8, 9], [-0.1, nan, nan, -0.2, -0.3], "length", loss_mask=[True, False, False, True,
                                                                                            True], tool_calls=1,
                      tool_errors=1)
    buf = PartialBuffer()
    buf.add([3], [PartialGroup(0, [called, Response([4], [-0.4], "length")], [False, False])], step=2)
    state = {"schedule": {"partials": buf.state_dict()}}
    (tmp_path / PARTIALS_FILE).write_bytes(split_partials(state))
    loaded = json.loads(json.dumps(state))
    join_partials(loaded, tmp_path)
    back = PartialBuffer()
    back.load_state_dict(loaded["schedule"]["partials"])
    r, plain = back.items[0].group.responses
    assert r.token_ids == called.token_ids and r.loss_mask == called.loss_mask
    assert (r.tool_calls, r.tool_errors) == (1, 1) and [math.isnan(x) for x in r.logprobs] == [False, True, True,
                                                                                               False, False]
    assert plain.loss_mask is None and plain.tool_calls == 0
    tail = Response([10, 11, 12], [-0.5, nan, -0.6], "stop", loss_mask=[True, False, True], tool_calls=1)
    joined = join(r, tail, 3)
    assert joined.loss_mask == called.loss_mask + tail.loss_mask and joined.tool_calls == 2 and joined.tool_errors == 1
    assert join(plain, tail, 3).loss_mask == [True, True, False, True]
    assert join(plain, Response([1], [-1.0], "stop"), 3).loss_mask is None
