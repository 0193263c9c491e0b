"""The rollout engine contract: sampling parameters, responses, prompt filtering and the `Engine` protocol.

Every engine (``HFEngine`` on CPU, ``VLLMEngine`` on GPU) takes prompts as token ids and returns, per
prompt, ``n`` :class:`Response` objects carrying the sampled token ids and one log-probability per token.

Engine life cycle inside one DAPO step (colocated with the trainer)::

    engine.update_weights(buckets)   # weights awake, new weights loaded (KV cache may still be asleep)
    engine.wake()                    # KV cache allocated: ready to generate
    engine.generate(prompts, params)
    engine.sleep()                   # give GPU memory back to the trainer

On CPU ``sleep``/``wake`` are no-ops; the order is the same so the trainer has one code path.

An engine that can also hand back each prompt's group as soon as its n samples have ended implements
:class:`StreamingEngine` (``HFEngine`` does); the rollout scheduler then stops generating, and aborts what is in
flight, once a step holds enough usable groups (``rollout.schedule.streaming``). One that can also hand back the
aborted groups as far as they got and continue them later implements :class:`ResumingEngine` (partial rollouts,
``rollout.schedule.partial``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from torch import Tensor

__all__ = [
    "Engine",
    "EngineError",
    "FinishReason",
    "GroupStream",
    "LogprobsMode",
    "PartialGroup",
    "PartialGroupStream",
    "PromptFilterResult",
    "ResumingEngine",
    "Response",
    "SamplingParams",
    "StreamingEngine",
    "TickingEngine",
    "WeightBucket",
    "filter_prompts",
]

FinishReason = Literal["stop", "length"]
LogprobsMode = Literal["processed", "raw", "none"]
WeightBucket = list[tuple[str, Tensor]]
"""One bucket of a weight sync: (Hugging Face parameter name, full unsharded tensor) pairs."""


class EngineError(RuntimeError):
    """A rollout engine failed or was used wrongly; the message says what to change."""


@dataclass
class SamplingParams:
    """How to sample responses. Mirrors the fields both engines support, nothing more."""

    n: int = 1
    """Responses per prompt (the group size G)."""
    temperature: float = 1.0
    """Softmax temperature. 0 = greedy (argmax); log-probs are then those of temperature 1."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability mass reaches top_p (1 = off)."""
    top_k: int = -1
    """Sample from the k most likely tokens only (-1 = off; 1 = greedy)."""
    max_new_tokens: int = 16
    """Maximum response length; a response that reaches it ends with finish_reason "length"."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response (finish_reason "stop"), besides the engine's EOS ids."""
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token id sequences that end a response when its last generated tokens equal one (finish_reason "stop", the
    sequence kept): how a multi-turn rollout stops at ``</code>``, whatever its tokenizer makes of it."""
    seed: int | None = None
    """Seed of the sampling RNG. Same seed, prompts and params -> same responses (per engine). None = fresh."""
    logprobs: LogprobsMode = "processed"
    """Which log-probability each Response carries per sampled token y_t with model logits z_t:

    - ``"processed"`` (default): ``log_softmax(z_t / temperature)[y_t]`` over the FULL vocabulary, i.e.
      temperature-scaled but BEFORE top-k/top-p truncation. This is exactly what the actor computes for the
      old/new policy log-probs, so engine and actor are comparable token by token. (temperature 0 counts as 1.)
      vLLM returns this with ``LLM(logprobs_mode="processed_logprobs")`` only when top_k and top_p are off:
      its processed log-probs are taken after top-k/top-p masking, i.e. renormalised over the kept tokens.
      VLLMEngine therefore refuses "processed" together with top_k/top_p truncation.
    - ``"raw"``: ``log_softmax(z_t)[y_t]``, the untempered model distribution (vLLM's default
      ``logprobs_mode="raw_logprobs"``, which ignores temperature, penalties, top-k and top-p).
    - ``"none"``: no log-probs (Response.logprobs is empty); for evaluation, where nothing consumes them.
    """

    def validate(self) -> None:
        """Raise ValueError naming the fix for an impossible setting."""
        if self.n < 1:
            raise ValueError(f"n={self.n}: ask for at least one response per prompt (n >= 1).")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} < 0; use 0 for greedy or a positive value.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]; use 1.0 to turn nucleus sampling off.")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k}: use -1 (off) or a positive k.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
        if self.logprobs not in ("processed", "raw", "none"):
            raise ValueError(f"logprobs={self.logprobs!r}; use 'processed', 'raw' or 'none'.")
        if any(len(seq) == 0 for seq in self.stop_sequences):
            raise ValueError("stop_sequences holds an empty sequence; every stop sequence needs at least one token id.")

    @property
    def greedy(self) -> bool:
        """True when sampling degenerates to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1


@dataclass
class Response:
    """One sampled response."""

    token_ids: list[int]
    """Generated token ids; on finish_reason "stop" the last one is the EOS/stop token."""
    logprobs: list[float]
    """One log-prob per token (see SamplingParams.logprobs), or empty when logprobs="none"."""
    finish_reason: FinishReason
    """"stop": ended by an EOS/stop token; "length": reached max_new_tokens."""
    stale_tokens: int = 0
    """Leading tokens sampled by an earlier policy (partial rollouts, ``rollout.schedule.partial``): their log-probs
    are that policy's. 0 for a response sampled in one go."""
    routed_experts: Any = None
    """MoE models, transformers engine: int16 ``[prompt + response tokens, MoE layers, top_k]``, the experts each
    token was routed to while sampling (-1 where not recorded: the last token); None otherwise
    (rollout/correction/routes.py)."""
    versions: list[tuple[int, int]] | None = None
    """The policy versions that produced the tokens, as ``(version, tokens)`` runs, oldest first, covering every
    token (a continued partial rollout has two); None until the rollout side stamps them (an engine's raw output)."""
    loss_mask: list[bool] | None = None
    """Multi-turn tool use: False on the tokens of tool output (appended by the rollout, log-prob NaN), True on the
    model's own; None where every token is the model's."""
    tool_calls: int = 0
    """Tool calls the response made (multi-turn tool use)."""
    tool_errors: int = 0
    """Of those, the calls whose output was an error (the code failed, timed out, flooded, or no sandbox)."""

    @property
    def length(self) -> int:
        """Number of generated tokens (EOS included)."""
        return len(self.token_ids)


@dataclass
class PromptFilterResult:
    """Which prompts may be generated from, and why the others were rejected."""

    kept: list[int] = field(default_factory=list)
    """Indices (into the input list) of acceptable prompts, in input order."""
    rejected: dict[int, str] = field(default_factory=dict)
    """Index -> reason ("empty", "too_long", "out_of_vocab") for each rejected prompt."""

    @property
    def counts(self) -> dict[str, int]:
        """Number of rejected prompts per reason."""
        return dict(Counter(self.rejected.values()))

    def describe(self) -> str:
        """Human-readable summary, e.g. ``"2 of 10 prompts rejected: empty=1, too_long=1"``."""
        total = len(self.kept) + len(self.rejected)
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())) or "none"
        return f"{len(self.rejected)} of {total} prompts rejected: {reasons}"


def filter_prompts(prompts: Sequence[Sequence[int]], max_prompt_len: int,
                   vocab_size: int | None = None) -> PromptFilterResult:
    """Split prompts into usable ones and rejected ones (empty, longer than ``max_prompt_len``, bad ids).

    The trainer calls this before generation, drops the rejected prompts and counts them by reason.
    """
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len={max_prompt_len} must be >= 1.")
    result = PromptFilterResult()
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            result.rejected[i] = "empty"
        elif len(prompt) > max_prompt_len:
            result.rejected[i] = "too_long"
        elif vocab_size is not None and (min(prompt) < 0 or max(prompt) >= vocab_size):
            result.rejected[i] = "out_of_vocab"
        else:
            result.kept.append(i)
    return result


def check_resume(prompts: Sequence[Sequence[int]], prefixes: Sequence[Sequence[int]], params: SamplingParams,
                 vocab_size: int | None) -> None:
    """Raise EngineError for a ``ResumingEngine.resume`` request no engine can serve: n != 1, one prefix per prompt
    missing, a prefix that leaves no token to sample, or prefix tokens outside the vocabulary (engines call this;
    the prompts themselves go through :func:`check_prompts`)."""
    if params.n != 1:
        raise EngineError(f"resume() continues one response per prompt: params.n={params.n}, use n=1 (pass a "
                          f"prompt once per response to continue).")
    if len(prefixes) != len(prompts):
        raise EngineError(f"resume(): {len(prompts)} prompts but {len(prefixes)} prefixes; pass one per prompt.")
    for i, prefix in enumerate(prefixes):
        if len(prefix) >= params.max_new_tokens:
            raise EngineError(f"resume(): prefix {i} has {len(prefix)} tokens, max_new_tokens="
                              f"{params.max_new_tokens} leaves none to sample; a response that reached the limit "
                              f"has ended (done), pass only unfinished ones.")
        if vocab_size is not None and prefix and (min(prefix) < 0 or max(prefix) >= vocab_size):
            raise EngineError(f"resume(): prefix {i} has token ids outside the vocabulary [0, {vocab_size}).")


def check_prompts(prompts: Sequence[Sequence[int]], max_prompt_len: int, vocab_size: int | None) -> None:
    """Raise EngineError if any prompt would be rejected by :func:`filter_prompts` (engines call this)."""
    result = filter_prompts(prompts, max_prompt_len, vocab_size)
    if result.rejected:
        first = sorted(result.rejected.items())[:5]
        raise EngineError(f"{result.describe()} (first: {first}); drop them with "
                          f"dapo_mcore.rollout.filter_prompts(prompts, max_prompt_len={max_prompt_len}) first.")


@runtime_checkable
class Engine(Protocol):
    """A rollout engine. Implementations: HFEngine (CPU/small models), VLLMEngine (GPU)."""

    weights_valid: bool
    """False while the engine holds no usable weights (vLLM sleep level 2 discarded them, or it started from dummy
    weights): a full ``update_weights`` must come before the next ``wake``."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Response]]:
        """Sample ``params.n`` responses for each prompt; result[i][j] is sample j of prompt i."""
        ...

    def update_weights(self, buckets: Iterable[WeightBucket]) -> None:
        """Load one full weight sync (every parameter exactly once, HF names, full tensors)."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (weights and/or KV cache) while the trainer runs."""
        ...

    def wake(self) -> None:
        """Re-acquire everything generation needs (weights if still asleep, then the KV cache)."""
        ...

    def close(self) -> None:
        """Free all resources; the engine is unusable afterwards."""
        ...


@runtime_checkable
class GroupStream(Protocol):
    """Finished groups of one streamed generation call."""

    def __iter__(self) -> Iterator[tuple[int, list[Response]]]:
        """``(prompt index, its n responses)`` as each group's last sample ends, in completion order."""
        ...

    def abort(self) -> int:
        """Stop generating (requests in flight are dropped); returns the tokens those requests had generated."""
        ...


@dataclass
class PartialGroup:
    """A group that was still in flight when its stream was aborted with ``abort(keep_partial=True)``."""

    index: int
    """Position of the prompt in the stream call."""
    responses: list[Response]
    """Its n responses as they stood: ended ones whole, the others cut where decoding stopped (with log-probs)."""
    done: list[bool]
    """Which responses had ended (EOS/stop token or max_new_tokens); the others are continued by ``resume``."""

    def num_tokens(self) -> int:
        """Tokens generated so far for this group."""
        return sum(r.length for r in self.responses)


@runtime_checkable
class PartialGroupStream(GroupStream, Protocol):
    """A stream that can hand back the groups it aborted, as far as they got (partial rollouts)."""

    def abort(self, keep_partial: bool = False) -> int:
        """Like ``GroupStream.abort``; with ``keep_partial`` the in-flight groups are kept for ``partials()`` and their
        tokens are not in the returned count (groups whose decoding never started are neither)."""
        ...

    def partials(self) -> list[PartialGroup]:
        """After ``abort(keep_partial=True)``: every group that was in flight, in prompt order."""
        ...


@runtime_checkable
class StreamingEngine(Engine, Protocol):
    """An engine that also streams finished groups."""

    def stream(self, prompts: list[list[int]], params: SamplingParams) -> GroupStream:
        """Start sampling ``params.n`` responses per prompt; iterate the result for finished groups."""
        ...


@runtime_checkable
class TickingEngine(StreamingEngine, Protocol):
    """A streaming engine whose streams also have ``ticks()``: one list per decode step of the groups that ended in
    it. Several engine groups can then stream together, in lockstep (``rollout.scheduling.engine_groups``)."""

    stream_ticks: bool
    """True: ``stream()``'s result has ``ticks()``."""


@runtime_checkable
class ResumingEngine(StreamingEngine, Protocol):
    """A streaming engine that can also continue responses cut short by an abort (partial rollouts)."""

    def stream(self, prompts: list[list[int]], params: SamplingParams) -> PartialGroupStream:
        ...

    def resume(self, prompts: list[list[int]], prefixes: list[list[int]], params: SamplingParams) -> list[Response]:
        """Continue one response per prompt: ``prefixes[i]`` (the tokens it had, 0 to ``params.max_new_tokens - 1``;
        an empty prefix is a plain generation)
        is fed after ``prompts[i]`` at the positions it was sampled at, and up to ``params.max_new_tokens -
        len(prefixes[i])`` new tokens are sampled. ``params.n`` must be 1. Returns only the new tokens (with their
        log-probs), finish_reason as for the whole response; the prompt limits apply to ``prompts`` alone."""
        ...
