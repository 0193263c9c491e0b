"""Multi-turn tool rollouts on the real vLLM engine (CPU build), imported by engine_checks.py into its data-parallel
run (two engine groups, each with its own prompts, vLLM's DP engines stepping together).

The marker that ends a call is TWO token ids, so the engine must stop on a sequence vLLM cannot stop on itself. A toy
tokenizer over the random model's vocabulary: ``</code>`` is the adjacent pair the model writes most often (so calls
happen), ``<code>`` its most frequent other token; letters for the rest. Every check is an assert here; the counts go
into the rank's JSON.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import torch

from dapo_mcore.rollout import SamplingParams
from dapo_mcore.rollout.multiturn import MultiTurnEngine, ToolCodec, ToolFormat, ToolPool
from dapo_mcore.tools.registry import ToolOutput

TOL = 1e-4
RES_OPEN, RES_CLOSE = 3, 4
MAX_NEW = 24  # prompts of <= 7 tokens: within the engine's max_model_len (32 + 6)
TEMP = 1.3


def pick_markers(groups, eos: int) -> tuple[tuple[int, int], int]:
    """The most frequent adjacent pair (``</code>``) and the most frequent other token (``<code>``) of the samples,
    none of them EOS, the tool's markers or below 5; ties broken by the smaller ids (deterministic)."""
    pairs, singles = Counter(), Counter()
    for g in groups:
        for r in g:
            ids = [t for t in r.token_ids if t >= 5 and t != eos]
            singles.update(ids)
            pairs.update((a, b) for a, b in zip(r.token_ids, r.token_ids[1:], strict=False)
                         if min(a, b) >= 5 and eos not in (a, b))
    pair = min(pairs, key=lambda p: (-pairs[p], p))
    opener = min((t for t in singles if t not in pair), key=lambda t: (-singles[t], t))
    return pair, opener


def toy_codec(pair: tuple[int, int], opener: int, vocab: int) -> ToolCodec:
    marks = {opener: "<code>", pair[0]: "</", pair[1]: "code>", RES_OPEN: "<interpreter>", RES_CLOSE: "</interpreter>"}
    letters = {t: chr(ord("a") + k) for k, t in enumerate(t for t in range(5, vocab) if t not in marks)}
    back = {c: t for t, c in letters.items()}
    words = {"<code>": [opener], "</code>": list(pair), "<interpreter>": [RES_OPEN], "</interpreter>": [RES_CLOSE]}

    def encode(text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            word = next((w for w in words if text.startswith(w, i)), None)
            out += words[word] if word else [back.get(text[i], min(back.values()))]
            i += len(word) if word else 1
        return out

    def decode(ids) -> str:
        return "".join(marks.get(t) or letters.get(t, "") for t in ids)

    return ToolCodec(encode, decode, ToolFormat())


def tool(text: str) -> ToolOutput:
    """Deterministic in the call's text: reversed, or an error for an empty call."""
    return ToolOutput(text[::-1]) if text else ToolOutput("EmptyCall", "error")


class Recording:
    """The engine with every turn recorded: (prompt, prefix, the new tokens); the rest (groups_step_together,
    any_group_busy, ...) the engine's own."""

    def __init__(self, engine) -> None:
        self.engine, self.turns, self.rounds = engine, [], []

    def resume_stream(self, prompts, prefixes, params):
        self.rounds.append(len(prompts))  # 0: this group had nothing left and stepped with the others
        for i, r in self.engine.resume_stream(prompts, prefixes, params):
            self.turns.append((tuple(prompts[i]), list(prefixes[i]), r))
            yield i, r

    def __getattr__(self, name):
        return getattr(self.engine, name)


def check_stop_sequence(engine, prompts, pair, eos: int) -> dict:
    """The same requests and seeds with and without the two-token stop: each sample cut right after the first pair
    of the unstopped sample (tokens exactly, log-probs within TOL), the others unchanged."""
    free_p = SamplingParams(n=8, temperature=TEMP, max_new_tokens=MAX_NEW, seed=21)
    free = engine.generate(prompts, free_p)
    cut = engine.generate(prompts, dataclasses.replace(free_p, stop_sequences=(pair,)))
    stopped = 0
    for fg, cg in zip(free, cut, strict=True):
        for f, c in zip(fg, cg, strict=True):
            ids = f.token_ids
            at = next((j + 2 for j in range(len(ids) - 1) if (ids[j], ids[j + 1]) == pair), None)
            if at is None:
                assert (c.token_ids, c.finish_reason) == (ids, f.finish_reason), (c, f)
                at = len(ids)
            else:
                stopped += 1
                assert c.token_ids == ids[:at] and c.finish_reason == "stop", (pair, c, f)
            assert max((abs(a - b) for a, b in zip(c.logprobs, f.logprobs[:at], strict=True)), default=0) < TOL
    assert stopped >= 2, (pair, stopped)
    return {"stop_sequence_cut": stopped}


def multiturn_checks(engine, model, prompts: list[list[int]], eos: int, ref_logprobs) -> dict:
    """A multi-turn rollout with a two-token ``</code>``: stored tokens = the engine's sampled tokens of every turn +
    the tool's tokens, exactly; loss_mask False exactly on the tool tokens; each tool span = the tool's output for the
    call the turn before made; the model tokens' log-probs = a plain forward over the whole trajectory."""
    free = engine.generate(prompts, SamplingParams(n=8, temperature=TEMP, max_new_tokens=MAX_NEW, seed=21))
    pair, opener = pick_markers(free, eos)
    res = check_stop_sequence(engine, prompts, pair, eos)
    codec = toy_codec(pair, opener, model.config.vocab_size)
    inner = Recording(engine)
    mt = MultiTurnEngine(inner, codec, ToolPool(tool, workers=2, deadline_s=30), max_calls=2, max_output_tokens=3)
    # turn 0 samples what check_stop_sequence's cut call did (same requests and seeds): its cut samples make calls
    out = mt.generate(prompts, SamplingParams(n=8, temperature=TEMP, max_new_tokens=MAX_NEW, seed=21))
    counters = mt.pool.take_counters()
    mt.pool.close()
    turns_of: dict[tuple, list] = {}
    for p, pre, r in inner.turns:
        turns_of.setdefault(p, []).append((pre, r))
    calls = tool_tokens = 0
    for prompt, group in zip(prompts, out, strict=True):
        for r in group:
            rebuilt, mask, made = [], [], 0
            while True:
                # the turn that continued this response from exactly what it held so far
                pre, t = next((pre, t) for pre, t in turns_of[tuple(prompt)]
                              if pre == rebuilt and r.token_ids[len(pre):len(pre) + t.length] == t.token_ids)
                rebuilt += t.token_ids
                mask += [True] * t.length
                if t.finish_reason != "stop" or tuple(t.token_ids[-2:]) != pair:
                    break  # EOS or the budget: the response ends with this turn
                assert pair not in zip(t.token_ids, t.token_ids[1:-1], strict=False)  # cut at the FIRST </code>
                if made < mt.max_calls:
                    text = codec.call_text(t.token_ids)
                    answer = tool(text).text if text is not None else "SyntaxError: </code> without <code>"
                    span, _ = codec.result_ids(answer, 3, MAX_NEW - len(rebuilt))
                    assert r.token_ids[len(rebuilt):len(rebuilt) + len(span)] == span, (r.token_ids, rebuilt, span)
                    rebuilt += span
                    mask += [False] * len(span)
                    made += 1
                    tool_tokens += len(span)
                if len(rebuilt) >= MAX_NEW:
                    break
            assert rebuilt == r.token_ids and mask == r.loss_mask and made == r.tool_calls, (r, rebuilt, mask)
            calls += made
            ref = ref_logprobs(model, prompt, r.token_ids, TEMP)
            own = torch.tensor(r.loss_mask)
            assert torch.allclose(torch.tensor(r.logprobs)[own], ref[own].float(), atol=TOL), r
            assert all(math.isnan(x) for x, m in zip(r.logprobs, r.loss_mask, strict=True) if not m)
    assert calls == counters.calls and calls >= res["stop_sequence_cut"], (calls, counters, res)
    res.update(turns=len(inner.turns), rounds=len(inner.rounds), idle_rounds=inner.rounds.count(0), tool_calls=calls, tool_tokens=tool_tokens, pair=list(pair),
               responses=sum(len(g) for g in out))
    return res
