"""vLLM's outputs as Responses: finished ``RequestOutput``s (``generate``) and the per-step deltas of a streamed
call (``VLLMEngine.stream``), which an abort can hand back as partial groups, and which stops samples on stop
sequences of several token ids (vLLM itself stops on single ids only). Pure Python: vLLM is never imported here (the
objects are duck-typed), so all of it is tested on CPU with fakes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dapo_mcore.rollout.protocol import EngineError, FinishReason, PartialGroup, Response, SamplingParams

if TYPE_CHECKING:
    from dapo_mcore.rollout.engines.vllm_backend import VLLMBackend

__all__ = ["VLLMGroupStream", "completion_tokens", "responses_from_outputs", "stop_sequence_end"]


def _sampled_logprob(entry: Any, token_id: int, where: str) -> float:
    try:
        return float(entry[token_id].logprob)
    except (KeyError, TypeError, IndexError) as exc:
        raise EngineError(f"{where}: vLLM returned no log-prob for the sampled token {token_id}") from exc


def _check_finish(reason: str | None, where: str) -> FinishReason:
    if reason not in ("stop", "length"):
        raise EngineError(f"{where}: finish_reason={reason!r} (aborted?); expected stop/length")
    return reason  # type: ignore[return-value]


def completion_tokens(c: Any, logprobs: str, where: str) -> tuple[list[int], list[float]]:
    """Token ids and sampled-token log-probs of one ``CompletionOutput`` (a whole response or, with
    ``RequestOutputKind.DELTA``, the tokens one engine step added)."""
    token_ids = [int(t) for t in c.token_ids]
    lps: list[float] = []
    if logprobs != "none":
        if c.logprobs is None or len(c.logprobs) != len(token_ids):
            got = None if c.logprobs is None else len(c.logprobs)
            raise EngineError(f"{where}: {got} log-prob entries for {len(token_ids)} tokens")
        lps = [_sampled_logprob(e, t, where) for e, t in zip(c.logprobs, token_ids, strict=True)]
    return token_ids, lps


def responses_from_outputs(outputs: Sequence[Any], n: int, logprobs: str) -> list[list[Response]]:
    """Convert vLLM ``RequestOutput``s (``.outputs``: ``CompletionOutput`` with ``index``, ``token_ids``,
    ``logprobs`` (per token a mapping ``token id -> Logprob(.logprob)``) and ``finish_reason``) into
    Responses, in request order and completion index order."""
    result = []
    for r, out in enumerate(outputs):
        comps = sorted(out.outputs, key=lambda c: c.index)
        if len(comps) != n:
            raise EngineError(f"request {r}: vLLM returned {len(comps)} completions, expected n={n}")
        group = []
        for c in comps:
            where = f"request {r} completion {c.index}"
            reason = _check_finish(c.finish_reason, where)
            token_ids, lps = completion_tokens(c, logprobs, where)
            routes = getattr(c, "routed_experts", None)  # vLLM with enable_return_routed_experts (MoE R3)
            if routes is not None:
                from dapo_mcore.rollout.correction.routes import routes_from_vllm

                routes = routes_from_vllm(routes, len(out.prompt_token_ids) + len(token_ids))
            group.append(Response(token_ids=token_ids, logprobs=lps, finish_reason=reason, routed_experts=routes))
        result.append(group)
    return result


@dataclass
class _Sample:
    """One sample of a streamed request as far as its deltas got."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    cut: bool = False
    """Ended on a stop sequence: vLLM may still be decoding it (a request's other samples run on), its later deltas
    are dropped."""


def stop_sequence_end(tokens: Sequence[int], start: int, stops: Sequence[tuple[int, ...]]) -> int | None:
    """The length ``tokens`` is cut to at the first stop sequence that ends at one of the positions ``start``..: the
    end of the earliest match among the tokens (of one call: a sequence never spans a resumed prefix), the sequence
    kept; None without one. As ``HFEngine``'s decode loop stops."""
    for end in range(max(start, 0) + 1, len(tokens) + 1):
        if any(end >= len(s) and tuple(tokens[end - len(s):end]) == s for s in stops):
            return end
    return None


class VLLMGroupStream:
    """Finished groups of one ``VLLMEngine.stream`` call (see ``protocol.PartialGroupStream``).

    Every step's deltas are added to their samples before any group of that step is yielded, so what an abort hands
    back (or counts) is every token vLLM had returned for the requests still pending. ``params.stop_sequences`` are
    checked on the returned token ids, step by step: a sample whose tokens come to end with one is cut right after it
    (finish ``stop``), and a request whose samples have all ended so is aborted in vLLM at once (its group is
    yielded as finished). Whether and where a sample stops depends on its own tokens alone."""

    def __init__(self, backend: VLLMBackend, request_ids: list[str], params: SamplingParams) -> None:
        self.backend, self.params = backend, params
        self.position = {rid: i for i, rid in enumerate(request_ids)}
        self.pending = set(request_ids)
        self._samples = {rid: [_Sample() for _ in range(params.n)] for rid in request_ids}
        self._partials: list[PartialGroup] | None = None
        self._stops = [tuple(s) for s in params.stop_sequences]
        self._stopped: set[str] = set()  # requests this stream aborted in vLLM after their samples stopped

    def __iter__(self) -> Iterator[tuple[int, list[Response]]]:
        while self.pending:
            if not self.backend.has_unfinished():
                raise EngineError(f"vLLM has no unfinished requests but {len(self.pending)} streamed requests never "
                                  "finished")
            for rid in self._take(self.backend.step()):
                if rid not in self.pending:  # aborted while this step's groups were being handed out
                    return
                self.pending.discard(rid)
                yield self.position[rid], self._group(rid)

    def ticks(self) -> Iterator[list[tuple[int, list[Response]]]]:
        """One list per engine step: the groups whose last sample ended in it (often none). The loop runs while any of
        vLLM's data-parallel engines has requests (``has_unfinished`` is a collective over them there, and a step
        of an engine with none left runs vLLM's dummy batch), so every engine group takes the same number of ticks
        and the groups stream in lockstep (``rollout.scheduling.engine_groups``), also one that serves no prompt."""
        while self.backend.has_unfinished():
            ended = []
            for rid in self._take(self.backend.step()):
                self.pending.discard(rid)
                ended.append((self.position[rid], self._group(rid)))
            yield ended
        if self.pending:
            raise EngineError(f"vLLM has no unfinished requests but {len(self.pending)} streamed requests never "
                              "finished")

    def _take(self, outputs: list[Any]) -> list[str]:
        """Add one step's deltas to their samples; the requests that finished in it, in output order (those whose
        samples all stopped on a stop sequence too, aborted in vLLM here)."""
        finished, stopped = [], []
        for out in outputs:
            rid = out.request_id
            if rid in self._stopped:  # more of this step's outputs of a request that has just stopped
                continue
            if rid not in self.pending:
                raise EngineError(f"vLLM returned request {rid!r}, not one of this stream's pending requests")
            for c in out.outputs:
                self._add(rid, c)
            if out.finished:
                finished.append(rid)
            elif self._stops and all(s.finish_reason is not None for s in self._samples[rid]):
                self._stopped.add(rid)
                stopped.append(rid)
                finished.append(rid)
        if stopped:
            self.backend.abort(stopped)
        return finished

    def _add(self, rid: str, c: Any) -> None:
        """One sample's delta: its tokens added, then cut at a stop sequence that has appeared."""
        where = f"request {rid} completion {c.index}"
        if 0 <= c.index < self.params.n and self._samples[rid][c.index].cut:
            return  # a sample that stopped on a sequence while vLLM decodes its request's other samples
        if not 0 <= c.index < self.params.n or self._samples[rid][c.index].finish_reason is not None:
            raise EngineError(f"{where}: not a running sample (n={self.params.n})")
        sample = self._samples[rid][c.index]
        token_ids, lps = completion_tokens(c, self.params.logprobs, where)
        start = len(sample.token_ids)
        sample.token_ids += token_ids
        sample.logprobs += lps
        sample.finish_reason = c.finish_reason
        end = stop_sequence_end(sample.token_ids, start, self._stops) if self._stops else None
        if end is not None:
            del sample.token_ids[end:], sample.logprobs[end:]
            sample.finish_reason, sample.cut = "stop", True

    def _group(self, rid: str, unfinished: str | None = None) -> list[Response]:
        """The request's samples as Responses; a sample still running says ``unfinished`` (None: none may be)."""
        return [Response(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=_check_finish(
            s.finish_reason or unfinished, f"request {rid} completion {j}")) for j, s in enumerate(self._samples[rid])]

    def _partial(self, rid: str) -> PartialGroup:
        # An unfinished sample says "length" until resume() tells how the whole response ends; `done` tells them apart.
        return PartialGroup(index=self.position[rid], responses=self._group(rid, unfinished="length"),
                            done=[s.finish_reason is not None for s in self._samples[rid]])

    def abort(self, keep_partial: bool = False) -> int:
        """Abort every request not yet yielded. Without ``keep_partial``: the tokens they had generated (every
        sample's, finished or not). With it: 0, and the requests that had any token are kept for ``partials()``."""
        if keep_partial and self._partials is None:
            self._partials = []
        if not self.pending:
            return 0
        ids = sorted(self.pending, key=self.position.__getitem__)
        running = [rid for rid in ids if rid not in self._stopped]  # a request stopped on a sequence is aborted
        if running:
            self.backend.abort(running)
        self.pending.clear()
        if keep_partial:
            self._partials = [self._partial(rid) for rid in ids if any(s.token_ids for s in self._samples[rid])]
            return 0
        return sum(len(s.token_ids) for rid in ids for s in self._samples[rid])

    def partials(self) -> list[PartialGroup]:
        """The groups ``abort(keep_partial=True)`` kept, in prompt order (samples that had ended are ``done``)."""
        if self._partials is None:
            raise EngineError("partials() before abort(keep_partial=True): only a stream aborted with keep_partial "
                              "keeps its in-flight groups.")
        return self._partials
