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
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dapo_mcore.rollout.multiturn.format import ToolCodec
from dapo_mcore.rollout.multiturn.pool import ToolPool
from dapo_mcore.rollout.protocol import EngineError, Response, SamplingParams, WeightBucket
from dapo_mcore.tools.registry import ToolOutput

__all__ = ["MultiTurnEngine"]

logger = logging.getLogger(__name__)

_TURN_SEED_STRIDE = 2_654_435_761
"""Turn t samples with seed ``params.seed + t * stride`` (mod 2**62): a stride far from the ones that tell steps,
generation calls and engine groups apart (10_007, 1, 1_000_003), so no two of them draw the same random stream."""


@dataclass
class _Trajectory:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    finish: str | None = None
    pending: Any = None          # the call this turn made: ToolPool.submit's (future, start) or a ToolOutput
    goes_on: bool = False         # a turn that ended in a </code> past max_calls

    def add_model(self, resp: Response) -> None:
        self.tokens += resp.token_ids
        self.logprobs += resp.logprobs
        self.mask += [True] * resp.length

    def add_tool(self, ids: list[int], out: ToolOutput) -> None:
        self.tokens += ids
        self.logprobs += [math.nan] * len(ids)
        self.mask += [False] * len(ids)
        self.calls += 1
        self.errors += int(out.errored)

    def response(self, with_logprobs: bool) -> Response:
        assert self.finish in ("stop", "length")
        return Response(token_ids=list(self.tokens), logprobs=list(self.logprobs) if with_logprobs else [],
                        finish_reason=self.finish, loss_mask=list(self.mask), tool_calls=self.calls,
                        tool_errors=self.errors)


class MultiTurnEngine:
    """Wraps an engine with ``resume`` (and, for overlap, ``resume_stream``); see the module docstring.

    Args:
        engine: the inner engine (its weights, sleep/wake and close are its own).
        codec: the tool format bound to the run's tokenizer.
        pool: where calls run (its counters feed the cost ledger).
        max_calls: most tool calls per response.
        max_output_tokens: most tokens of one call's output.
    """

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
        params.validate()
        rows = [_Trajectory(list(p)) for p in prompts for _ in range(params.n)]
        stops = tuple(params.stop_sequences) + (self.codec.close_ids,)
        turn_params = dataclasses.replace(params, n=1, stop_sequences=stops)
        live = list(range(len(rows)))
        turn = 0
        while self._more_turns(bool(live)):
            seed = None if params.seed is None else (params.seed + _TURN_SEED_STRIDE * turn) % 2**62
            self._turn(rows, live, dataclasses.replace(turn_params, seed=seed))
            live = self._after_turn(rows, live, params.max_new_tokens)
            turn += 1
        with_lp = params.logprobs != "none"
        flat = [r.response(with_lp) for r in rows]
        return [flat[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _more_turns(self, mine: bool) -> bool:
        """Another turn: this engine has live responses (``mine``) or, where engine groups step together (vLLM's
        data-parallel engines), any group has; a group with none then runs the turn with no prompts (its engine
        steps with the others) until every group is done."""
        if getattr(self.engine, "groups_step_together", False):
            return bool(self.engine.any_group_busy(mine))
        return mine

    def _continue(self, prompts: list[list[int]], prefixes: list[list[int]], params: SamplingParams
                  ) -> Iterator[tuple[int, Response]]:
        """One turn of the inner engine: each response as it ends (in completion order where it can tell)."""
        stream = getattr(self.engine, "resume_stream", None)
        if stream is not None:
            yield from stream(prompts, prefixes, params)
        else:
            yield from enumerate(self.engine.resume(prompts, prefixes, params))

    def _turn(self, rows: list[_Trajectory], live: list[int], params: SamplingParams) -> None:
        """Decode one turn of every live response; a call starts as soon as its response's turn has ended."""
        prompts = [rows[i].prompt for i in live]
        prefixes = [list(rows[i].tokens) for i in live]
        for k, resp in self._continue(prompts, prefixes, params):
            row = rows[live[k]]
            row.add_model(resp)
            if resp.finish_reason != "stop" or not self.codec.ends_call(resp.token_ids):
                row.finish = resp.finish_reason
            elif row.calls >= self.max_calls:
                row.goes_on = True
            else:
                text = self.codec.call_text(resp.token_ids)
                row.pending = self.pool.submit(text) if text is not None else ToolOutput(
                    f"SyntaxError: {self.codec.fmt.call_close} without {self.codec.fmt.call_open}", "error")

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
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)
