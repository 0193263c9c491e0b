"""VLLMEngine with stop sequences of several tokens (vLLM stops on single ids only) and under MultiTurnEngine, on a
scripted fake of vLLM's step API: samples cut right after the sequence as the unstopped sample has it, the stopped
request aborted, ``resume_stream`` handing out what ``resume`` gives, token-in/token-out over the turns, and
data-parallel engines (which step together) running the same number of turns when one group has more calls to make.
The real vLLM runs in the ``vllm`` tier (tests/test_rollout_vllm_cpu.py)."""

from __future__ import annotations

import math
import threading

import pytest

from dapo_mcore.rollout import SamplingParams, VLLMEngine, VLLMEngineOptions
from dapo_mcore.rollout.engines.vllm_outputs import stop_sequence_end
from dapo_mcore.rollout.multiturn import MultiTurnEngine, ToolCodec, ToolPool
from dapo_mcore.tools.registry import ToolOutput
from tests.test_rollout_vllm import TINY, FakeCompletion, FakeLogprob, FakeRequestOutput, FakeStreamingBackend

pytestmark = pytest.mark.unit

EOS = 2
OPEN, CLOSE, RES_OPEN, RES_CLOSE = 5, (6, 7), 8, 9  # "</code>" is two tokens
LETTERS = {i: chr(ord("a") + i - 10) for i in range(10, 30)}


def encode(text: str) -> list[int]:
    marks = {"<code>": [OPEN], "</code>": list(CLOSE), "<interpreter>": [RES_OPEN], "</interpreter>": [RES_CLOSE]}
    back = {v: k for k, v in LETTERS.items()}
    out, i = [], 0
    while i < len(text):
        m = next((m for m in marks if text.startswith(m, i)), None)
        out += marks[m] if m else [back.get(text[i], 29)]
        i += len(m) if m else 1
    return out


def decode(ids) -> str:
    names = {OPEN: "<code>", CLOSE[0]: "</", CLOSE[1]: "code>", RES_OPEN: "<interpreter>", RES_CLOSE: "</interpreter>"}
    return "".join(names.get(t) or LETTERS.get(t, "") for t in ids)


def script(tokens: list[int]) -> list[int]:
    """The scripted model: given prompt + prefix, what it writes next. A prompt [1, c, ...] asks for c calls (its
    code the letters after the call count): each call is <code>xy</code> followed by a token the stop must cut; after
    the calls, an answer and EOS. A call's last token alone (7) is written as a letter would be, and never stops."""
    calls = tokens.count(RES_CLOSE)
    if calls < tokens[1]:
        return [7, OPEN, 10 + calls, tokens[2], *CLOSE, 21, 22, EOS]
    return [20 + calls, EOS]


def scripted_outputs(inputs, sampling) -> list[FakeRequestOutput]:
    outs = []
    for r, (inp, sp) in enumerate(zip(inputs, sampling, strict=True)):
        comps = []
        for j in range(sp["n"]):
            toks = script(inp["prompt_token_ids"])[:sp["max_tokens"]]
            lps = [{t: FakeLogprob(-0.01 * (k + 1) - j)} for k, t in enumerate(toks)]
            comps.append(FakeCompletion(j, toks, lps if sp["logprobs"] is not None else None,
                                        "stop" if toks[-1] == EOS else "length"))
        outs.append(FakeRequestOutput(str(r), comps, inp["prompt_token_ids"]))
    return outs


class ScriptedVLLM(FakeStreamingBackend):
    """vLLM's generate and step API (DELTA outputs, one token per sample and step) over :func:`script`."""

    def generate(self, inputs, sampling):
        self.calls.append(("generate", len(inputs)))
        self.requests.append((inputs, sampling))
        return scripted_outputs(inputs, sampling)

    def add_requests(self, request_ids, inputs, sampling):
        self.calls.append(("add_requests", len(inputs)))
        for rid, inp, sp, out in zip(request_ids, inputs, sampling, scripted_outputs(inputs, sampling), strict=True):
            self.requests.append(([inp], [sp]))
            out.request_id = rid
            self.queue.insert(0, out)
            self.made[rid] = [0] * len(out.outputs)

    def any_engine_busy(self, busy):
        return busy


def engine(backend=None) -> VLLMEngine:
    options = VLLMEngineOptions(model_path="/models/tiny", logprobs="processed")
    return VLLMEngine(options, TINY, backend=backend or ScriptedVLLM(), world_size=1)


def test_stop_sequence_end_finds_the_first_sequence_that_ends_in_the_new_tokens():
    stops = [(6, 7), (9,)]
    assert stop_sequence_end([1, 6, 7, 6, 7], 0, stops) == 3
    assert stop_sequence_end([1, 6, 7, 6, 7], 2, stops) == 3  # completed by the new token at position 2
    assert stop_sequence_end([1, 6, 7, 6, 7], 3, stops) == 5
    assert stop_sequence_end([6, 1, 7, 9], 0, stops) == 4 and stop_sequence_end([6, 1, 7], 0, stops) is None


def test_a_multi_token_stop_cuts_each_sample_right_after_it_and_aborts_the_request():
    eng = engine()
    backend = eng.backend
    prompts = [[1, 1, 12], [1, 0, 13], [1, 1, 14, 15]]
    free = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=20, seed=3))
    assert "generate" in backend.calls[-1]  # no stop sequence of several tokens: vLLM's own generate
    params = SamplingParams(n=2, max_new_tokens=20, seed=3, stop_sequences=(CLOSE,))
    got = eng.generate(prompts, params)
    requests = [s for _, (s,) in backend.requests[-3:]]
    assert all(s["stop_token_ids"] == [] and s["seed"] == 3 + 2 * i for i, s in enumerate(requests))
    for f, g in zip(free, got, strict=True):
        for a, b in zip(f, g, strict=True):
            ids = a.token_ids
            at = stop_sequence_end(ids, 0, [CLOSE])
            if at is None:
                assert b == a
            else:  # cut right after </code>, the sequence kept, the log-probs of the kept tokens
                assert b.token_ids == ids[:at] and b.logprobs == a.logprobs[:at] and b.finish_reason == "stop"
                assert a.token_ids[at:] == [21, 22, EOS]
    assert [len(g[0].token_ids) for g in got] == [6, 2, 6]
    aborted = [c[1] for c in backend.calls if c[0] == "abort"]
    assert aborted == [("dapo-stream-1-2",), ("dapo-stream-1-0",)]  # the stopped requests, in the step they stopped
    # budget first: a sample that reaches max_new_tokens inside the sequence ends "length", nothing cut
    short = eng.generate(prompts[:1], SamplingParams(n=1, max_new_tokens=5, seed=3, stop_sequences=(CLOSE,)))
    assert short[0][0].token_ids == [7, OPEN, 10, 12, 6] and short[0][0].finish_reason == "length"


def test_resume_stream_hands_out_what_resume_gives():
    eng = engine()
    prompts, prefixes = [[1, 1, 12], [1, 2, 13], [1, 0, 4]], [[3], [7, OPEN, 10, 13, *CLOSE, RES_OPEN, RES_CLOSE], []]
    params = SamplingParams(n=1, max_new_tokens=30, seed=8, stop_sequences=(CLOSE,))
    whole = eng.resume(prompts, prefixes, params)
    streamed = list(eng.resume_stream(prompts, prefixes, params))
    assert sorted(i for i, _ in streamed) == [0, 1, 2] and dict(streamed) == dict(enumerate(whole))
    assert [r.token_ids for r in whole] == [[7, OPEN, 10, 12, *CLOSE], [7, OPEN, 11, 13, *CLOSE], [20, EOS]]
    budgets = [s["max_tokens"] for _, (s,) in eng.backend.requests[-3:]]
    assert budgets == [29, 22, 30]


def _multiturn(eng: VLLMEngine, calls: list[str]) -> MultiTurnEngine:
    def tool(text: str) -> ToolOutput:
        calls.append(text)
        return ToolOutput(text[::-1] + "z")

    return MultiTurnEngine(eng, ToolCodec(encode, decode), ToolPool(tool, workers=2, deadline_s=10), max_calls=3,
                           max_output_tokens=4)


def test_a_multi_turn_rollout_on_vllm_stores_the_engines_tokens_and_the_tools_exactly():
    calls: list[str] = []
    mt = _multiturn(engine(), calls)
    prompts = [[1, 2, 12], [1, 0, 13], [1, 1, 14]]
    out = mt.generate(prompts, SamplingParams(n=2, max_new_tokens=40, seed=1))
    mt.close()
    assert sorted(calls) == ["ac", "ac", "ae", "ae", "bc", "bc"]  # <code>xy</code>: the letters between the markers
    for prompt, group in zip(prompts, out, strict=True):
        for r in group:
            want, mask = [], []
            for c in range(prompt[1]):  # each turn: the model's call, cut right after </code>; then the tool's tokens
                code = "ab"[c] + LETTERS[prompt[2]]
                turn, result = [7, OPEN, 10 + c, prompt[2], *CLOSE], [RES_OPEN, *encode(code[::-1] + "z"), RES_CLOSE]
                want += turn + result
                mask += [True] * len(turn) + [False] * len(result)
            want += [20 + prompt[1], EOS]
            mask += [True, True]
            assert r.token_ids == want and r.loss_mask == mask and r.tool_calls == prompt[1] and r.tool_errors == 0
            assert all(math.isnan(x) != m for x, m in zip(r.logprobs, r.loss_mask, strict=True))
            assert r.finish_reason == "stop"


def rows(out) -> list:
    return [(r.token_ids, r.loss_mask, r.tool_calls, r.finish_reason) for g in out for r in g]


class OrAcrossThreads:
    """An all-reduce (OR) between engines in threads, as vLLM's data-parallel CPU group does; every call names what
    it is (``has_unfinished`` or ``any_engine_busy``) and both engines must make the same call, or it fails."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=20)
        self.slots: list = [None] * n

    def __call__(self, rank: int, kind: str, value: bool) -> bool:
        self.slots[rank] = (kind, value)
        self.barrier.wait()
        kinds, result = {k for k, _ in self.slots}, any(v for _, v in self.slots)
        self.barrier.wait()
        assert len(kinds) == 1, f"the engines' collectives crossed: {kinds}"
        return result


class DataParallelVLLM(ScriptedVLLM):
    def __init__(self, reduce: OrAcrossThreads, rank: int) -> None:
        super().__init__()
        self.reduce, self.rank, self.dummy_steps, self.turns_asked = reduce, rank, 0, 0

    def has_unfinished(self):
        return self.reduce(self.rank, "has_unfinished", bool(self.queue))

    def any_engine_busy(self, busy):
        self.turns_asked += 1
        return self.reduce(self.rank, "any_engine_busy", busy)

    def step(self):
        if not self.queue:
            self.dummy_steps += 1
            return []
        return super().step()


def test_data_parallel_engines_run_the_same_turns_when_one_group_has_more_calls():
    """Group 0's prompts make two calls, group 1's none: group 1 finishes in its first turn and must keep stepping
    (dummy batches) through group 0's next two turns, or group 0's first step waits on it for ever (the barrier's
    timeout). Each group's responses are what a single engine gives for its prompts."""
    reduce = OrAcrossThreads(2)
    backends = [DataParallelVLLM(reduce, r) for r in range(2)]
    shares = [[[1, 2, 12], [1, 1, 13]], [[1, 0, 14]]]
    params = SamplingParams(n=2, max_new_tokens=40, seed=1)
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            mt = _multiturn(engine(backends[rank]), [])
            results[rank] = mt.generate(shares[rank], params)
            mt.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            results[rank] = exc
            reduce.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(isinstance(v, BaseException) for v in results.values()), results
    for rank in range(2):
        alone = _multiturn(engine(), [])
        assert rows(results[rank]) == rows(alone.generate(shares[rank], params))
        alone.close()
    assert backends[0].turns_asked == backends[1].turns_asked == 4  # 3 turns, then "no group is busy"
    assert backends[1].dummy_steps > 0 and backends[0].dummy_steps == 0


def test_an_abort_after_a_sequence_stop_aborts_only_what_still_runs():
    """A request stopped on a sequence was aborted in vLLM when it stopped; the consumer's abort of what is pending
    (the same step's other groups) does not abort it again, and its group stays whole for partials()."""
    eng = engine(ScriptedVLLM(steps_per_call=8))  # both requests end within one call
    params = SamplingParams(n=1, max_new_tokens=20, seed=3, stop_sequences=(CLOSE,))
    stream = eng.stream([[1, 1, 12], [1, 0, 13]], params)
    it = iter(stream)
    first = next(it)
    assert stream.abort(keep_partial=True) == 0
    aborted = [c[1] for c in eng.backend.calls if c[0] == "abort"]
    parts = stream.partials()
    assert first[0] == 1 and aborted == [("dapo-stream-1-0",)], (first, aborted)
    assert [p.index for p in parts] == [0] and parts[0].done == [True]
    assert parts[0].responses[0].token_ids == [7, OPEN, 10, 12, *CLOSE]
