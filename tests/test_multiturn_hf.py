"""Multi-turn tool rollouts on the transformers engine: stop sequences stop exactly where the unstopped sample has the
sequence; resume_stream hands out what resume gives; and a multi-turn rollout's stored tokens are the engine's sampled
tokens plus the tool's tokens, exactly, with the engine's log-probs of its own tokens equal to Hugging Face's forward
over the whole trajectory (tool tokens in context)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from dapo_mcore.rollout import HFEngine, Response, SamplingParams
from dapo_mcore.rollout.multiturn import MultiTurnEngine, ToolCodec, ToolFormat, ToolPool
from dapo_mcore.telemetry.rollout_store import ROLLOUTS_DIR, Rollout, RolloutReader, RolloutStore
from dapo_mcore.tools.registry import ToolOutput
from tests.test_rollout_hf_engine import random_qwen2, reference_logprobs

pytestmark = pytest.mark.unit

EOS = 2
PROMPTS = [[1, 7, 9, 12], [1, 3], [1, 4, 4, 8, 9], [1, 20, 21]]
# A toy tokenizer over the tiny vocabulary: ids 10..29 are letters, four ids are the format's markers.
MARK = {"<code>": 5, "</code>": 6, "<interpreter>": 7, "</interpreter>": 8}
LETTERS = {i: chr(ord("a") + i - 10) for i in range(10, 30)}


def encode(text: str) -> list[int]:
    out, i = [], 0
    back = {v: k for k, v in LETTERS.items()}
    while i < len(text):
        for m, tid in MARK.items():
            if text.startswith(m, i):
                out.append(tid)
                i += len(m)
                break
        else:
            out.append(back.get(text[i], 29))
            i += 1
    return out


def decode(ids) -> str:
    names = {v: k for k, v in MARK.items()}
    return "".join(names.get(t) or LETTERS.get(t, "") for t in ids)


@pytest.fixture(scope="module")
def model():
    return random_qwen2(3)


def test_a_stop_sequence_cuts_the_sample_where_it_first_appears(model):
    """One row per call (rows that stop change which random draws the others get, as EOS does)."""
    engine = HFEngine(model, eos_token_ids=EOS, pad_token_id=0)
    params = [SamplingParams(n=1, max_new_tokens=24, temperature=1.5, seed=s) for s in range(16)]
    free = [engine.generate([PROMPTS[s % 4]], p)[0][0] for s, p in enumerate(params)]
    pairs: dict[tuple[int, int], int] = {}  # the most common adjacent pair, so that many samples hold it
    for r in free:
        for a, b in zip(r.token_ids, r.token_ids[1:], strict=False):
            pairs[(a, b)] = pairs.get((a, b), 0) + 1
    seq = max(pairs, key=pairs.get)
    stopped = 0
    for s, (p, f) in enumerate(zip(params, free, strict=True)):
        c = engine.generate([PROMPTS[s % 4]], dataclasses.replace(p, stop_sequences=(seq,)))[0][0]
        ids = f.token_ids
        at = next((j + 2 for j in range(len(ids) - 1) if tuple(ids[j:j + 2]) == seq), None)
        if at is None:
            assert c.token_ids == ids and c.finish_reason == f.finish_reason
        else:
            stopped += 1
            assert c.token_ids == ids[:at] and c.finish_reason == "stop" and c.logprobs == f.logprobs[:at]
    assert stopped >= 2


def test_resume_stream_hands_out_what_resume_gives(model):
    engine = HFEngine(model, eos_token_ids=EOS, pad_token_id=0, max_batch_rows=3)
    prefixes = [[11, 12], [], [13, 14, 15, 16], [17]]
    params = SamplingParams(n=1, max_new_tokens=20, temperature=1.0, seed=9)
    whole = engine.resume(PROMPTS, prefixes, params)
    streamed = list(engine.resume_stream(PROMPTS, prefixes, params))
    assert sorted(i for i, _ in streamed) == [0, 1, 2, 3]
    assert {i: r for i, r in streamed} == dict(enumerate(whole))


class Recording:
    """The inner engine with every turn it sampled recorded: (prompt, prefix, the Response it returned)."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.turns = engine, []
        self.weights_valid = True

    def resume_stream(self, prompts, prefixes, params):
        for i, r in self.engine.resume_stream(prompts, prefixes, params):
            self.turns.append((tuple(prompts[i]), list(prefixes[i]), r))
            yield i, r

    def resume(self, prompts, prefixes, params):  # pragma: no cover - MultiTurnEngine prefers the stream
        raise AssertionError("resume_stream is there")


def test_stored_tokens_are_the_engines_plus_the_tools_exactly(model, tmp_path):
    calls: list[str] = []

    def tool(text: str) -> ToolOutput:
        calls.append(text)
        return ToolOutput(text[::-1][:5] or "x", "ok" if len(text) % 3 else "error")

    inner = Recording(HFEngine(model, eos_token_ids=EOS, pad_token_id=0))
    codec = ToolCodec(encode, decode, ToolFormat())
    mt = MultiTurnEngine(inner, codec, ToolPool(tool, workers=2, deadline_s=10), max_calls=3, max_output_tokens=4)
    # </code> (id 6) is one token the random model writes now and then: at temperature 1.6, 40 tokens, many rows call
    params = SamplingParams(n=8, max_new_tokens=40, temperature=1.6, seed=5)
    out = mt.generate(PROMPTS, params)
    responses = [(p, r) for p, g in zip(PROMPTS, out, strict=True) for r in g]
    total = sum(r.tool_calls for _, r in responses)
    assert total >= 8 and mt.pool.take_counters().calls == total
    assert 1 <= len(calls) <= total  # a </code> without <code> gets its error text without reaching the tool
    store = RolloutStore(tmp_path / ROLLOUTS_DIR)
    store.append_step(0, [Rollout(np.array(p), np.array(r.token_ids), np.array(r.logprobs, dtype=np.float32), 0.0,
                                  False, r.finish_reason, False, i, 0, loss_mask=np.array(r.loss_mask),
                                  tool_calls=r.tool_calls, tool_errors=r.tool_errors)
                          for i, (p, r) in enumerate(responses)])
    stored = RolloutReader(tmp_path / ROLLOUTS_DIR).read_step(0)
    for (prompt, r), s in zip(responses, stored, strict=True):
        # rebuild the trajectory from what the engine sampled, turn by turn, and the tool output between turns
        turns = [(pre, t) for p, pre, t in inner.turns if p == tuple(prompt) and len(pre) <= len(r.token_ids)
                 and r.token_ids[:len(pre)] == pre and r.token_ids[len(pre):len(pre) + t.length] == t.token_ids]
        rebuilt, mask = [], []
        for pre, t in sorted(turns, key=lambda x: len(x[0])):
            if len(pre) < len(rebuilt) or rebuilt != pre[:len(rebuilt)]:
                continue
            tool_ids = pre[len(rebuilt):]  # what the rollout appended between two turns: the tool's tokens
            if tool_ids:
                assert tool_ids[0] == MARK["<interpreter>"]
                text = decode(tool_ids[1:-1]) if tool_ids[-1] == MARK["</interpreter>"] else None
                if text is not None:
                    assert tool_ids == codec.result_ids(text, 4, 10**6)[0]
            rebuilt += tool_ids + t.token_ids
            mask += [False] * len(tool_ids) + [True] * t.length
        tail = r.token_ids[len(rebuilt):]  # the last call's output, cut by the budget
        assert all(not m for m in r.loss_mask[len(rebuilt):])
        assert rebuilt + tail == r.token_ids and mask + [False] * len(tail) == r.loss_mask
        assert s.response_ids.tolist() == r.token_ids and s.loss_mask.tolist() == r.loss_mask
        assert s.tool_calls == r.tool_calls
        # the engine's log-probs of its own tokens = HF's forward over the whole trajectory, tool tokens in context
        ref = reference_logprobs(model, prompt, r.token_ids, 1.6)
        own = torch.tensor(r.loss_mask)
        assert torch.allclose(torch.tensor(r.logprobs)[own], ref[own].float(), atol=1e-4)
        assert all(math.isnan(x) for x, m in zip(r.logprobs, r.loss_mask, strict=True) if not m)
        assert len(r.token_ids) <= 40


def test_the_real_python_tool_through_the_engine(model):
    from dapo_mcore.tools.registry import get_tool
    from dapo_mcore.tools.sandbox import Sandbox

    tool = get_tool("python", Sandbox(timeout_s=5, memory_mb=256, backend="none"))
    inner = HFEngine(model, eos_token_ids=EOS, pad_token_id=0)
    mt = MultiTurnEngine(inner, ToolCodec(encode, decode), ToolPool(tool, workers=2, deadline_s=10), max_calls=1,
                         max_output_tokens=6)
    out = mt.generate(PROMPTS[:2], SamplingParams(n=4, max_new_tokens=40, temperature=1.6, seed=5))
    called = [r for g in out for r in g if r.tool_calls]
    assert called and all(r.tool_errors == r.tool_calls for r in called)  # random letters are no Python
    assert mt.pool.take_counters().calls == len(called)


def test_engine_groups_share_the_tool_columns():
    """Several engine groups broadcast their responses (rollout.scheduling.gather): the loss mask and the tool counts
    travel with the tokens."""
    from dapo_mcore.rollout.protocol import Response
    from dapo_mcore.rollout.scheduling.gather import pack_responses, unpack_responses

    nan = float("nan")
    share = [[Response([5, 6, 7, 8], [-1.0, nan, nan, -0.5], "stop", loss_mask=[True, False, False, True],
                       tool_calls=1, tool_errors=1), Response([3], [-0.1], "length")]]
    got = unpack_responses(*pack_responses([4], share))[4]
    assert got[0].token_ids == [5, 6, 7, 8] and got[0].loss_mask == [True, False, False, True]
    assert (got[0].tool_calls, got[0].tool_errors) == (1, 1) and math.isnan(got[0].logprobs[1])
    assert got[1].loss_mask is None and got[1].tool_calls == 0 and got[1].token_ids == [3]


def test_a_closed_resume_stream_keeps_what_each_row_had_decoded(model):
    """Partial rollouts abort a turn mid-decode: every row not handed out keeps exactly the tokens (and log-probs) the
    uninterrupted call gives it first, and says whether it had ended; a chunk not started has none."""
    engine = HFEngine(model, eos_token_ids=EOS, pad_token_id=0, max_batch_rows=3)
    prefixes = [[11, 12], [], [13, 14, 15, 16], [17]]
    params = SamplingParams(n=1, max_new_tokens=20, temperature=1.0, seed=9)
    whole = engine.resume(PROMPTS, prefixes, params)
    stream = engine.resume_stream(PROMPTS, prefixes, params)
    handed = dict([next(iter(stream))])
    stream.close()
    left = stream.unfinished()
    assert sorted([*handed, *left]) == [0, 1, 2, 3] and left[3] == (Response([], [], "length"), False)
    (first,) = handed.values()
    for i, (r, ended) in left.items():
        assert r.token_ids == whole[i].token_ids[:r.length] and r.logprobs == whole[i].logprobs[:r.length]
        assert ended == (r.length == whole[i].length) and r.length == (0 if i == 3 else first.length)


def test_a_stop_sequence_may_begin_in_the_prefix(model):
    """A response cut inside a two-token ``</code>`` and continued stops where the whole one stops: after the one
    token that completes the sequence."""
    engine = HFEngine(model, eos_token_ids=EOS, pad_token_id=0)
    longer = 0
    for s in range(4):
        params = SamplingParams(n=1, max_new_tokens=12, temperature=1.5, seed=s)
        prompt, prefix = PROMPTS[s % 4], [11, 12, 13 + s]
        free = engine.resume([prompt], [prefix], params)[0]
        longer += free.length > 1  # the old check (new tokens only) would not have stopped these
        cut = dataclasses.replace(params, stop_sequences=((prefix[-1], free.token_ids[0]),))
        whole = engine.resume([prompt], [prefix], cut)[0]
        assert whole.token_ids == free.token_ids[:1] and whole.finish_reason == "stop"
        assert dict(iter(engine.resume_stream([prompt], [prefix], cut)))[0] == whole
    assert longer >= 2
