"""MultiTurnEngine: multi-turn tool-use rollouts (ReTool) on top of any engine that can continue a response.

A response is sampled in turns. Every turn continues each live response from its tokens so far with the inner
engine's ``resume`` (the prefix is prefilled at the positions it was sampled at, and the turn is clamped to what is
left of ``max_new_tokens``); a turn ends at EOS, at the limit, or at ``</code>``. A ``</code>`` hands the block's
code to the tool pool at once, while the engine keeps decoding the other responses of the turn (engines with
``resume_stream`` report each response as it ends); after the turn, each call's output is appended as
``<interpreter>`` ... ``</interpreter>`` TOKENS (tokenized once, trimmed to fit) and the response goes on in the
next turn, up to ``max_calls`` calls. A ``</code>`` past ``max_calls`` runs nothing: the response just goes on.

What a response carries: every token (the model's and the tool's), the engine's log-prob of each model token and
NaN for each tool token, ``loss_mask`` (False on tool tokens: they count in no loss, denominator or metric),
``tool_calls`` and ``tool_errors``.

Engines that step together (``groups_step_together``: vLLM's data-parallel engines, one per engine group) run the
same number of turns: the turn loop goes on while any group has a live response (``any_group_busy``), a group with
none calling the engine with no prompts.

Determinism: which responses a turn decodes, and that turn's seed (``params.seed`` and the turn's number), depend
on the data alone, never on how fast a tool answered, so every rank of a run samples the same batch and a resumed
run samples the same tokens again (tool outputs being deterministic functions of the code).

Streaming and partial rollouts: ``stream`` hands out each group as soon as its responses have all ended; aborted
with ``keep_partial``, it keeps the groups in flight as far as they got (``turns.TurnStream``), and ``resume``
continues them: a response aborted during its tool call runs that call first, then goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from dapo_mcore.rollout.multiturn.format import ToolCodec
from dapo_mcore.rollout.multiturn.pool import ToolPool
from dapo_mcore.rollout.multiturn.turns import TurnStream, _Trajectory
from dapo_mcore.rollout.protocol import EngineError, Response, SamplingParams, WeightBucket
from dapo_mcore.tools.registry import ToolOutput

__all__ = ["MultiTurnEngine"]

logger = logging.getLogger(__name__)


class MultiTurnEngine:
    """Wraps an engine with ``resume`` (and, for overlap, ``resume_stream``); see the module docstring.

    Args:
        engine: the inner engine (its weights, sleep/wake and close are its own).
        codec: the tool format bound to the run's tokenizer.
        pool: where calls run (its counters feed the cost ledger).
        max_calls: most tool calls per response.
        max_output_tokens: most tokens of one call's output.
    """

    resumes_trajectories = True
    """``resume`` takes the buffered Responses themselves as prefixes (their loss mask and tool counts), not only
    their token ids (``rollout.schedule.partial``)."""

    def __init__(self, engine: Any, codec: ToolCodec, pool: ToolPool, *, max_calls: int,
                 max_output_tokens: int) -> None:
        if not hasattr(engine, "resume"):
            raise EngineError(f"{type(engine).__name__} cannot continue a response (no resume()); multi-turn tool "
                              "rollouts need one (rollout.engine=hf)")
        if max_calls < 1 or max_output_tokens < 1:
            raise EngineError(f"max_calls={max_calls} and max_output_tokens={max_output_tokens} must be >= 1")
        self.engine, self.codec, self.pool = engine, codec, pool
        self.max_calls, self.max_output_tokens = max_calls, max_output_tokens

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Response]]:
        """Sample ``params.n`` multi-turn responses per prompt; result[i][j] is sample j of prompt i."""
        out: list[list[Response]] = [[] for _ in prompts]
        for i, responses in self.stream(prompts, params):
            out[i] = responses
        return out

    def stream(self, prompts: list[list[int]], params: SamplingParams) -> TurnStream:
        """Like ``generate``, but yields ``(prompt index, responses)`` as each prompt's n samples have all ended
        (``protocol.GroupStream``); ``abort(keep_partial=True)`` keeps the groups in flight, tool columns and all,
        for ``partials()``. The same seed, prompts and params give the same responses as ``generate``."""
        params.validate()
        rows = [_Trajectory(list(p)) for p in prompts for _ in range(params.n)]
        return TurnStream(self, rows, params)

    def resume(self, prompts: list[list[int]], prefixes: list[Response] | list[list[int]],
               params: SamplingParams) -> list[Response]:
        """Continue one response per prompt (``protocol.ResumingEngine.resume``; partial rollouts). A prefix that is a
        Response keeps its loss mask and tool counts (``max_calls`` counts them); one that ends in a ``</code>`` whose
        call had not answered (aborted during the call) runs that call first. Returns only the new part, its own
        tool columns."""
        if params.n != 1 or len(prefixes) != len(prompts):
            raise EngineError(f"resume() continues one response per prompt: n={params.n}, {len(prompts)} prompts, "
                              f"{len(prefixes)} prefixes")
        params.validate()
        rows = [_Trajectory.continuing(p, q) for p, q in zip(prompts, prefixes, strict=True)]
        stream = TurnStream(self, rows, params, resumed=True)
        for _ in stream:
            pass
        return [r.response(params.logprobs != "none") for r in rows]

    def _continue(self, prompts: list[list[int]], prefixes: list[list[int]], params: SamplingParams) -> Any:
        """One turn of the inner engine: iterate for each response as it ends (in completion order where it can
        tell); the HF engine's stream also has ``close`` and ``unfinished`` (an abort keeps the turn's tokens)."""
        stream = getattr(self.engine, "resume_stream", None)
        if stream is not None:
            return stream(prompts, prefixes, params)
        return enumerate(self.engine.resume(prompts, prefixes, params))

    def _more_turns(self, mine: bool) -> bool:
        """Another turn: this engine has live responses (``mine``) or, where engine groups step together (vLLM's
        data-parallel engines), any group has; a group with none then runs the turn with no prompts (its engine
        steps with the others) until every group is done."""
        if getattr(self.engine, "groups_step_together", False):
            return bool(self.engine.any_group_busy(mine))
        return mine

    def _unanswered(self, row: _Trajectory) -> bool:
        """A resumed response whose last turn ended in ``</code>`` and whose call never answered."""
        return (row.calls < self.max_calls and row.tokens[row.segment:] != [] and
                self.codec.ends_call(row.tokens[row.segment:]))

    def _call(self, row: _Trajectory) -> Any:
        """Start the call that ``row``'s text since its last tool output ends with."""
        text = self.codec.call_text(row.tokens[row.segment:])
        return self.pool.submit(text) if text is not None else ToolOutput(
            f"SyntaxError: {self.codec.fmt.call_close} without {self.codec.fmt.call_open}", "error")

    def _ended(self, row: _Trajectory, resp: Response, call: bool = True) -> None:
        """``row``'s turn ended with ``resp`` (added): finished, a call (started, unless ``call`` is False: an
        aborted rollout leaves it for the resume), or a ``</code>`` past max_calls."""
        if resp.finish_reason != "stop" or not self.codec.ends_call(row.tokens[row.segment:]):
            row.finish = resp.finish_reason
        elif row.calls >= self.max_calls:
            row.goes_on = True
        elif call:
            row.pending = self._call(row)

    def _after_turn(self, rows: list[_Trajectory], live: list[int], max_new: int) -> list[int]:
        """Append each call's output (in row order); the responses that go on to the next turn."""
        nxt = []
        for i in live:
            row = rows[i]
            if row.pending is not None:
                out = (self.pool.record(row.pending) if isinstance(row.pending, ToolOutput)
                       else self.pool.output(row.pending))
                row.pending = None
                ids, _ = self.codec.result_ids(out.text, self.max_output_tokens, max_new - len(row.tokens))
                row.add_tool(ids, out)
            elif not row.goes_on:
                continue
            row.goes_on = False
            if len(row.tokens) >= max_new:
                row.finish = "length"
            else:
                nxt.append(i)
        return nxt

    # ------------------------------------------------------------------ the inner engine's life cycle
    @property
    def weights_valid(self) -> bool:
        return self.engine.weights_valid

    def update_weights(self, buckets: Iterable[WeightBucket]) -> None:
        self.engine.update_weights(buckets)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        self.pool.close()
        self.engine.close()

    def __getattr__(self, name: str) -> Any:  # vocab_size, max_prompt_len, ... of the inner engine
        if name in ("engine", "stream_ticks"):  # turns do not stream in decode-step ticks (one engine group streams)
            raise AttributeError(name)
        return getattr(self.engine, name)
