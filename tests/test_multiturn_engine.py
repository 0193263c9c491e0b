"""MultiTurnEngine on a scripted inner engine: token-in/token-out (stored tokens = the engine's sampled tokens plus
the tool's tokens, exactly), the loss mask and NaN log-probs on tool tokens, max_calls, the response budget, tool
faults as error text and counters, and tool calls that start while the engine still decodes the others."""

from __future__ import annotations

import math
import threading
import time

import pytest

from dapo_mcore.rollout.multiturn import MultiTurnEngine, ToolCodec, ToolPool
from dapo_mcore.rollout.protocol import Response, SamplingParams
from dapo_mcore.tools.registry import ToolOutput

pytestmark = pytest.mark.unit

MARKERS = {"<code>": 1, "</code>": 2, "<interpreter>": 3, "</interpreter>": 4}
EOS = 0


def encode(text: str) -> list[int]:
    out, i = [], 0
    while i < len(text):
        for m, tid in MARKERS.items():
            if text.startswith(m, i):
                out.append(tid)
                i += len(m)
                break
        else:
            out.append(ord(text[i]) + 10)
            i += 1
    return out


def decode(ids) -> str:
    back = {v: k for k, v in MARKERS.items()}
    return "".join(back.get(t, "") if t < 10 else chr(t - 10) for t in ids)


CODEC = ToolCodec(encode, decode)


def model_tokens(prefix: list[int]) -> list[int]:
    """The prefix with the tool spans (<interpreter> ... </interpreter>, as the rollout appends them) cut out."""
    out, inside = [], False
    for t in prefix:
        if t == 3:
            inside = True
        elif t == 4 and inside:
            inside = False
        elif not inside:
            out.append(t)
    return out


class ScriptedEngine:
    """Each prompt's model writes a fixed script (token ids); ``resume`` goes on from the model tokens of the
    prefix, stopping at a stop sequence, EOS or the budget. Log-probs: -(position + 1) / 100 in the script.
    ``stream_order``: with it, ``resume_stream`` reports the rows in that order (completion order) and records when."""

    weights_valid = True

    def __init__(self, scripts: dict[int, str], stream: bool = False, events: list | None = None,
                 pause: float = 0.05) -> None:
        self.scripts = {k: encode(v) + [EOS] for k, v in scripts.items()}
        self.pause = pause
        self.calls: list[tuple[list[list[int]], list[list[int]], SamplingParams]] = []
        self.events = events if events is not None else []
        if stream:
            self.resume_stream = self._resume_stream

    def _one(self, prompt: list[int], prefix: list[int], params: SamplingParams) -> Response:
        script = self.scripts[prompt[0]]
        at = len(model_tokens(prefix))
        budget = params.max_new_tokens - len(prefix)
        toks: list[int] = []
        for t in script[at:]:
            toks.append(t)
            if t == EOS or any(tuple(toks[-len(s):]) == tuple(s) for s in params.stop_sequences if len(toks) >= len(s)):
                return Response(toks, [-(at + j + 1) / 100 for j in range(len(toks))], "stop")
            if len(toks) == budget:
                break
        return Response(toks, [-(at + j + 1) / 100 for j in range(len(toks))], "length")

    def resume(self, prompts, prefixes, params):
        self.calls.append((prompts, prefixes, params))
        return [self._one(p, q, params) for p, q in zip(prompts, prefixes, strict=True)]

    def _resume_stream(self, prompts, prefixes, params):
        self.calls.append((prompts, prefixes, params))
        outs = [self._one(p, q, params) for p, q in zip(prompts, prefixes, strict=True)]
        for k in sorted(range(len(outs)), key=lambda k: len(outs[k].token_ids)):  # shortest turn ends first
            self.events.append(("ended", prompts[k][0]))
            yield k, outs[k]
            time.sleep(self.pause)  # the others are still decoding


def calc_tool(text: str) -> ToolOutput:
    return ToolOutput(str(eval(text, {}, {})))  # test tool: arithmetic only


def make(engine, tool=calc_tool, max_calls=4, max_out=64, deadline=5.0, workers=4):
    pool = ToolPool(tool, workers=workers, deadline_s=deadline)
    return MultiTurnEngine(engine, CODEC, pool, max_calls=max_calls, max_output_tokens=max_out), pool


def params(max_new=200, n=1, seed=3):
    return SamplingParams(n=n, max_new_tokens=max_new, seed=seed)


def test_tokens_are_the_engines_plus_the_tools_exactly():
    scripts = {7: "Let me compute.<code>6*7</code> so Answer: 42", 8: "<code>2**10</code>then<code>1/4</code>ok"}
    inner = ScriptedEngine(scripts)
    mt, pool = make(inner)
    out = mt.generate([[7, 9], [8]], params(n=2))
    assert [len(g) for g in out] == [2, 2]
    r = out[0][0]
    model = [encode("Let me compute.<code>6*7</code>"), encode(" so Answer: 42") + [EOS]]
    tool = encode("<interpreter>42</interpreter>")
    assert r.token_ids == model[0] + tool + model[1]
    assert r.loss_mask == [True] * len(model[0]) + [False] * len(tool) + [True] * len(model[1])
    assert r.tool_calls == 1 and r.tool_errors == 0 and r.finish_reason == "stop"
    # the engine's log-probs on its own tokens, NaN on the tool's
    engine_lp = [-(j + 1) / 100 for j in range(len(model[0]) + len(model[1]))]
    assert [lp for lp, m in zip(r.logprobs, r.loss_mask, strict=True) if m] == engine_lp
    assert all(math.isnan(lp) for lp, m in zip(r.logprobs, r.loss_mask, strict=True) if not m)
    r2 = out[1][1]
    assert decode(r2.token_ids) == ("<code>2**10</code><interpreter>1024</interpreter>then<code>1/4</code>"
                                    "<interpreter>0.25</interpreter>ok")
    assert r2.tool_calls == 2 and sum(not m for m in r2.loss_mask) == 2 * 2 + len("1024") + len("0.25")
    # every turn continued from the exact token list so far (never re-tokenized), with </code> as a stop sequence
    for _, _, p in inner.calls:
        assert p.n == 1 and CODEC.close_ids in p.stop_sequences
    assert inner.calls[1][1][0] == model[0] + tool
    assert pool.take_counters().calls == 2 * 1 + 2 * 2


def test_max_calls_then_the_response_just_goes_on():
    inner = ScriptedEngine({5: "<code>1+1</code><code>2+2</code><code>3+3</code>end"})
    mt, pool = make(inner, max_calls=2)
    r = mt.generate([[5]], params())[0][0]
    assert decode(r.token_ids) == ("<code>1+1</code><interpreter>2</interpreter><code>2+2</code><interpreter>4"
                                   "</interpreter><code>3+3</code>end")
    assert r.tool_calls == 2 and pool.take_counters().calls == 2


def test_turns_are_clamped_to_the_budget_and_tool_output_is_cut_to_fit():
    inner = ScriptedEngine({5: "<code>'x'*50</code>after"})
    mt, _ = make(inner, max_out=8)
    r = mt.generate([[5]], params(max_new=200))[0][0]
    assert decode(r.token_ids) == "<code>'x'*50</code><interpreter>xxxxxxxx</interpreter>after"  # max_output_tokens
    call = len(encode("<code>'x'*50</code>"))
    for budget in (call + 5, call + 1, call):
        r = make(ScriptedEngine({5: "<code>'x'*50</code>after"}), max_out=8)[0].generate([[5]], params(budget))[0][0]
        assert len(r.token_ids) == budget and r.finish_reason == "length"
        assert len(r.loss_mask) == len(r.logprobs) == budget
        assert r.token_ids[call:] == encode("<interpreter>xxxxxxxx</interpreter>")[:budget - call]
    inner = ScriptedEngine({5: "<code>1</code>" + "y" * 40})
    r = make(inner)[0].generate([[5]], params(max_new=30))[0][0]
    assert decode(r.token_ids) == "<code>1</code><interpreter>1</interpreter>" + "y" * 24
    assert r.finish_reason == "length"
    # the second turn continues the 6 tokens so far: the engine samples at most 30 - 6 (resume's budget)
    assert [len(q[0]) for _, q, _ in inner.calls] == [0, 6] and inner.calls[1][2].max_new_tokens == 30


def test_tool_faults_become_error_text_and_counters():
    def faulty(text: str) -> ToolOutput:
        if text == "raise":
            raise RuntimeError("tool exploded\nsecond line")
        if text == "hang":
            time.sleep(1.5)
            return ToolOutput("late")
        if text == "box":
            return ToolOutput("sandbox failure: no user namespaces", "sandbox_failure")
        return ToolOutput("fine")

    scripts = {1: "<code>raise</code>a", 2: "<code>hang</code>b", 3: "<code>box</code>c", 4: "<code>ok</code>d",
               5: "no call</code>e"}
    mt, pool = make(ScriptedEngine(scripts), tool=faulty, deadline=0.5)
    out = [g[0] for g in mt.generate([[k] for k in scripts], params())]
    texts = [decode(r.token_ids) for r in out]
    assert texts[0] == "<code>raise</code><interpreter>RuntimeError: tool exploded</interpreter>a"
    assert "TimeoutError" in texts[1] and texts[1].endswith("</interpreter>b")
    assert texts[2] == "<code>box</code><interpreter>sandbox failure: no user namespaces</interpreter>c"
    assert texts[3].endswith("<interpreter>fine</interpreter>d")
    assert "SyntaxError" in texts[4] and texts[4].endswith("</interpreter>e")
    assert [r.tool_errors for r in out] == [1, 1, 1, 0, 1]
    c = pool.take_counters()
    assert (c.calls, c.errors, c.timeouts, c.sandbox_failures) == (5, 4, 1, 1)
    assert pool.take_counters().calls == 0


def test_a_call_starts_while_the_engine_still_decodes_the_others():
    events: list = []

    def tool(text: str) -> ToolOutput:
        events.append(("call", text))
        return ToolOutput(text)

    inner = ScriptedEngine({1: "<code>1</code>x", 2: "a long first turn before its call<code>2</code>y"},
                           stream=True, events=events)
    mt, _ = make(inner, tool=tool)
    out = mt.generate([[1], [2]], params())
    assert decode(out[0][0].token_ids) == "<code>1</code><interpreter>1</interpreter>x"
    first_turn = events[:events.index(("ended", 2)) + 1]
    assert ("call", "1") in first_turn  # prompt 1's call ran before prompt 2's turn had ended


def test_same_seed_same_turn_seeds_and_determinism():
    scripts = {1: "<code>1</code><code>2</code>z"}
    a, b = ScriptedEngine(scripts), ScriptedEngine(scripts)
    ra = make(a)[0].generate([[1]], params(seed=11))
    rb = make(b)[0].generate([[1]], params(seed=11))
    assert ra == rb
    seeds = [p.seed for _, _, p in a.calls]
    assert len(seeds) == 3 and len(set(seeds)) == 3 and seeds[0] == 11


def test_pool_is_bounded_and_thread_safe():
    active, peak, lock = [0], [0], threading.Lock()

    def tool(text: str) -> ToolOutput:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return ToolOutput(text)

    pool = ToolPool(tool, workers=3, deadline_s=10)
    calls = [pool.submit(str(i)) for i in range(12)]
    assert [pool.output(c).text for c in calls] == [str(i) for i in range(12)]
    assert peak[0] <= 3 and pool.take_counters().calls == 12


def test_tool_metrics_against_a_recount():
    from dapo_mcore.rollout.multiturn.stats import tool_metrics

    def resp(calls, errors):
        return Response([1], [0.0], "stop", tool_calls=calls, tool_errors=errors)

    groups = [([resp(2, 1), resp(0, 0), resp(1, 0)], [True, False, True]), ([resp(0, 0), resp(3, 3)], [True, False])]
    m = tool_metrics(groups)
    assert m["tools/calls_per_response"] == pytest.approx(6 / 5)
    assert m["tools/error_rate"] == pytest.approx(4 / 6)
    assert m["tools/acc_with_calls"] == pytest.approx(2 / 3) and m["tools/acc_without_calls"] == pytest.approx(1 / 2)
    assert tool_metrics([([resp(0, 0)], [True])]) == {"tools/calls_per_response": 0.0, "tools/acc_without_calls": 1.0}
    assert tool_metrics([]) == {}


def test_a_burst_of_calls_waits_its_turn_without_timing_out():
    """The deadline counts from when a worker takes a call up: 12 calls of 50 ms on one worker, a 0.2 s deadline."""
    def tool(text: str) -> ToolOutput:
        time.sleep(0.05)
        return ToolOutput(text)

    pool = ToolPool(tool, workers=1, deadline_s=0.2)
    calls = [pool.submit(str(i)) for i in range(12)]
    assert [pool.output(c).kind for c in calls] == ["ok"] * 12
    assert pool.take_counters().timeouts == 0


def test_workers_that_all_hang_do_not_hang_the_rollout():
    release = threading.Event()

    def tool(text: str) -> ToolOutput:
        release.wait(5)
        return ToolOutput(text)

    pool = ToolPool(tool, workers=1, deadline_s=0.1)
    calls = [pool.submit(str(i)) for i in range(3)]  # the first hangs its worker; the others never start
    assert [pool.output(c).kind for c in calls] == ["timeout"] * 3
    release.set()
    assert pool.take_counters().timeouts == 3


def test_vllm_requests_take_one_token_stop_sequences_and_leave_longer_ones_to_the_engine():
    """vLLM stops on single ids: a longer sequence's first token must not stop it (VLLMEngine cuts the samples on the
    returned ids, tests/test_multiturn_vllm.py)."""
    from dapo_mcore.rollout.engines.vllm_engine import build_requests, stops_on_sequences

    params = SamplingParams(n=2, max_new_tokens=8, stop_token_ids=(9,), stop_sequences=((31,),), seed=1)
    _, sampling = build_requests([[1, 2]], params, "processed")
    assert sampling[0]["stop_token_ids"] == [9, 31] and not stops_on_sequences(params)
    longer = SamplingParams(stop_token_ids=(9,), stop_sequences=((31, 32), (30,)))
    _, sampling = build_requests([[1, 2]], longer, "processed")
    assert sampling[0]["stop_token_ids"] == [9, 30] and stops_on_sequences(longer)


# ---------------------------------------------------------------- streaming and partial rollouts


def _same(a, b) -> bool:
    """Responses equal field by field, NaN log-probs (tool tokens) equal to NaN."""
    def key(r):
        return (r.token_ids, [None if math.isnan(x) else x for x in r.logprobs], r.finish_reason, r.loss_mask,
                r.tool_calls, r.tool_errors)
    return key(a) == key(b)


SCRIPTS = {1: "<code>6*7</code>so 42", 2: "a long first turn, no call at all", 3: "<code>2</code>b<code>3</code>c",
           4: "<code>1</code><code>2</code><code>x</code>d"}


def test_the_stream_hands_out_what_generate_gives():
    whole = make(ScriptedEngine(SCRIPTS))[0].generate([[k] for k in SCRIPTS], params(n=2))
    stream = make(ScriptedEngine(SCRIPTS, stream=True, pause=0.0))[0].stream([[k] for k in SCRIPTS], params(n=2))
    got = dict(iter(stream))
    assert sorted(got) == [0, 1, 2, 3]
    assert all(_same(a, b) for i, g in enumerate(whole) for a, b in zip(g, got[i], strict=True))


@pytest.mark.parametrize("max_calls", [1, 2, 4])
def test_resumed_from_any_point_a_response_is_the_whole_one(max_calls):
    """Cut anywhere an abort can cut (after any model token, so also right after a </code> whose call had not
    answered, or after a whole tool output): resumed and joined it is the uninterrupted response, exactly, tool
    columns, counts and max_calls included."""
    from dapo_mcore.rollout.scheduling.partial import join

    for key, script in SCRIPTS.items():
        full = make(ScriptedEngine({key: script}), max_calls=max_calls)[0].generate([[key]], params())[0][0]
        cuts = [c for c in range(len(full.token_ids)) if c == 0 or full.loss_mask[c - 1] or full.loss_mask[c]]
        for c in cuts:
            ends = [j + 1 for j in range(c) if not full.loss_mask[j] and full.loss_mask[j + 1]]  # whole tool outputs
            starts = [max([0] + [k for k in range(j) if full.loss_mask[k]]) + 1 for j in ends]
            errors = sum("Error" in decode(full.token_ids[a:b]) for a, b in zip(starts, ends, strict=True))
            prefix = Response(full.token_ids[:c], full.logprobs[:c], "length", loss_mask=full.loss_mask[:c],
                              tool_calls=len(ends), tool_errors=errors, versions=[(0, c)])
            mt, pool = make(ScriptedEngine({key: script}), max_calls=max_calls)
            tail = mt.resume([[key]], [prefix], params())[0]
            assert _same(join(prefix, tail, 1), full), (key, c)
            assert pool.take_counters().calls == full.tool_calls - len(ends)


def test_aborted_during_a_call_the_group_is_kept_and_resumes_exactly():
    """Prompt 1's turn ends in </code> first (its call starts), prompt 2 then ends: the consumer has what it needs
    and aborts while prompt 1's call is in flight. The kept partial stops at the </code> with no call counted; the
    call is given up (its late answer is never read); resumed, prompt 1 runs the call and is the whole response."""
    from dapo_mcore.rollout.scheduling.partial import join

    release = threading.Event()
    started: list[str] = []

    def slow(text: str) -> ToolOutput:
        started.append(text)
        release.wait(5)
        return ToolOutput(str(eval(text, {}, {})))

    scripts = {1: "<code>6*7</code>so 42", 2: "a longer turn than the first"}
    mt, pool = make(ScriptedEngine(scripts, stream=True), tool=slow)
    stream = mt.stream([[1], [2]], params())
    first = next(iter(stream))
    assert first[0] == 1 and started == ["6*7"]
    assert stream.abort(keep_partial=True) == 0
    release.set()
    (kept,) = stream.partials()
    r = kept.responses[0]
    assert kept.index == 0 and kept.done == [False]
    assert decode(r.token_ids) == "<code>6*7</code>" and r.tool_calls == 0 and r.loss_mask == [True] * r.length
    assert pool.take_counters().calls == 0
    r.versions = [(0, r.length)]
    tail = mt.resume([[1]], [r], params())[0]
    whole = make(ScriptedEngine(scripts))[0].generate([[1]], params())[0][0]
    assert _same(join(r, tail, 1), whole) and tail.tool_calls == 1


def test_aborting_drops_what_the_groups_in_flight_had():
    mt, _ = make(ScriptedEngine({1: "<code>1</code>x", 2: "a longer turn than the first"}, stream=True))
    stream = mt.stream([[1], [2]], params(n=2))
    assert next(iter(stream))[0] == 1
    # group 0's two responses each had their first turn (4 tokens: <code>1</code>) before the abort
    assert stream.abort() == 2 * len(encode("<code>1</code>")) and stream.partials() == []


def test_the_rollout_side_continues_buffered_tool_responses_whole():
    """ColocatedRollouts hands a multi-turn engine the buffered Responses themselves (their loss mask and call
    counts), not only their token ids: continued, each is the uninterrupted response, tool columns included."""
    from types import SimpleNamespace

    from dapo_mcore.config import load_config
    from dapo_mcore.rollout.pipeline.colocated import ColocatedRollouts
    from dapo_mcore.rollout.protocol import PartialGroup
    from dapo_mcore.rollout.scheduling.partial import Buffered
    from dapo_mcore.telemetry.timers import PhaseTimer

    scripts = {1: "<code>6*7</code>so 42", 4: "<code>1</code><code>2</code><code>x</code>d"}
    whole = make(ScriptedEngine(scripts), max_calls=2)[0].generate([[1], [4]], params())
    # prompt 1 aborted during its call; prompt 4 after its second (last allowed) call: its third </code> runs nothing
    cuts = (len(encode("<code>6*7</code>")), len(encode("<code>1</code><interpreter>1</interpreter><code>2</code>"
                                                        "<interpreter>2</interpreter>")))
    partials = []
    for (r,), c in zip(whole, cuts, strict=True):
        partials.append(Response(r.token_ids[:c], r.logprobs[:c], "length", loss_mask=r.loss_mask[:c],
                                 tool_calls=sum(1 for j in range(c) if not r.loss_mask[j] and r.loss_mask[j + 1]),
                                 versions=[(0, c)]))
    records = [SimpleNamespace(ground_truth="42", prompt=[k]) for k in scripts]
    verdict = SimpleNamespace(score=1.0, acc=True, pred="42")
    side = ColocatedRollouts(load_config("examples/tiny_cpu.yaml"), engine=make(ScriptedEngine(scripts), max_calls=2)[0],
                             scheduler=SimpleNamespace(sampler=SimpleNamespace(records=records)),
                             tokenizer=SimpleNamespace(decode=lambda ids, **_: decode(ids)),
                             score=lambda texts, truths: [verdict] * len(texts), encode_prompt=lambda rec: rec.prompt,
                             timer=PhaseTimer())
    groups = side._resume_and_score([Buffered(i, PartialGroup(0, [p], [False]), 0) for i, p in enumerate(partials)],
                                    SamplingParams(n=1, max_new_tokens=200, seed=3), 0, version=1)
    for g, (w,), p in zip(groups, whole, partials, strict=True):
        (r,) = g.responses
        assert _same(r, w) and r.stale_tokens == p.length and r.versions == [(0, p.length), (1, w.length - p.length)]


def test_the_wait_for_calls_after_decoding_is_counted():
    """A call made at the very end of a turn is waited for before the next turn: the pool counts that wait (the tool
    time decoding did not hide) apart from the calls' own seconds."""
    def slow(text: str) -> ToolOutput:
        time.sleep(0.4)
        return ToolOutput(text)

    mt, pool = make(ScriptedEngine({1: "<code>1</code>x"}, stream=True, pause=0.0), tool=slow)
    start = time.monotonic()
    mt.generate([[1]], params())
    wall = time.monotonic() - start
    c = pool.take_counters()
    assert c.calls == 1 and 0.1 < c.waited <= wall and c.seconds >= 0.4
    assert pool.take_counters().waited == 0.0


def test_an_evaluation_leaves_no_tool_calls_in_the_next_steps_counters():
    """ColocatedRollouts.eval_groups: the calls an evaluation made are dropped from the pool's counters, so the next
    step batch's ``tools/*`` count only its own rollouts' calls."""
    from types import SimpleNamespace

    from dapo_mcore.rollout.pipeline.colocated import ColocatedRollouts
    from dapo_mcore.tools.registry import ToolOutput

    engine, pool = make(ScriptedEngine({}))

    def generate_and_score(records, params, slot, timed=True):
        for _ in range(3):
            pool.record(ToolOutput("4"))  # three calls made while evaluating
        return ["groups"]

    src = SimpleNamespace(engine=engine, cfg=SimpleNamespace(train=SimpleNamespace(seed=0)),
                          sampling=lambda eval_mode, seed: None, _generate_and_score=generate_and_score)
    src._drop_tool_counters = lambda: ColocatedRollouts._drop_tool_counters(src)
    src._tool_pool = lambda: ColocatedRollouts._tool_pool(src)
    pool.record(ToolOutput("1"))  # a call of the step before: already taken by its batch in a run
    pool.take_counters()
    assert ColocatedRollouts.eval_groups(src, [], 5) == ["groups"]
    assert pool.take_counters().calls == 0
