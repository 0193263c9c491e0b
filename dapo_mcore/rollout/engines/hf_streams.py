"""The HF engine's streams: finished groups of a ``stream`` call (``abort``, partial groups, ``ticks``) and finished
responses of a ``resume_stream`` call (``close``, the unfinished ones as far as they got)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from dapo_mcore.rollout.protocol import PartialGroup, Response, SamplingParams

__all__ = ["_HFGroupStream", "_HFResumeStream"]


class _HFGroupStream:
    """Finished groups of one ``HFEngine.stream`` call, chunk by chunk (``max_batch_rows`` rows at a time)."""

    def __init__(self, engine: Any, prompts: list[list[int]], params: SamplingParams,
                 generator: torch.Generator, stop_ids: Tensor) -> None:
        self.engine, self.prompts, self.params = engine, prompts, params
        self.generator, self.stop_ids = generator, stop_ids
        self._decoding: Iterator | None = None
        self._state: tuple[Tensor, Tensor, Tensor, Tensor] | None = None  # tokens, logps, n_gen, stopped
        self._start = 0
        self._pending: set[int] = set()
        self._partials: list[PartialGroup] = []

    def __iter__(self) -> Iterator[tuple[int, list[Response]]]:
        for ended in self._steps():
            for p in ended:
                yield self._finished(p)

    def ticks(self) -> Iterator[list[tuple[int, list[Response]]]]:
        """One list per decode step: the groups whose last sample ended in it (often none), as ``__iter__`` yields
        them. Several engine groups advance their streams tick by tick and exchange what ended
        (``rollout.scheduling.engine_groups``), so where each stream stands at an exchange is decided by the seed, not
        by speed."""
        for ended in self._steps():
            yield [self._finished(p) for p in ended]

    @torch.inference_mode()
    def _steps(self) -> Iterator[list[int]]:
        """Decode step by step, chunk by chunk; per step, the chunk positions of the prompts whose group ended."""
        n, per_chunk = self.params.n, max(1, self.engine.max_batch_rows // self.params.n)
        for start in range(0, len(self.prompts), per_chunk):
            chunk = self.prompts[start:start + per_chunk]
            left = [n] * len(chunk)
            self._pending, self._start = set(range(len(chunk))), start
            self._decoding = self.engine._decode(chunk, self.params, self.stop_ids, self.generator)
            for tokens, logps, n_gen, stopped, finished in self._decoding:
                self._state = (tokens, logps, n_gen, stopped)
                for row in finished:
                    left[row // n] -= 1
                yield sorted({row // n for row in finished if left[row // n] == 0})
            self._decoding = None

    def _finished(self, p: int) -> tuple[int, list[Response]]:
        """Chunk position ``p``'s ended group, handed out (no longer pending for ``abort``)."""
        assert self._state is not None
        tokens, logps, n_gen, stopped = self._state
        self._pending.discard(p)
        rows = slice(p * self.params.n, (p + 1) * self.params.n)
        chunk = self.prompts[self._start:]
        return self._start + p, self.engine._to_responses(
            tokens[rows], logps[rows], n_gen[rows], stopped[rows], self.params,
            self.engine._row_routes(chunk, self.params.n, n_gen[rows], first_row=rows.start))

    def abort(self, keep_partial: bool = False) -> int:
        """Stop decoding; the tokens generated for groups not yet yielded (discarded), or with ``keep_partial``
        0 and those groups kept for ``partials()``."""
        aborted = 0
        if self._decoding is not None:
            self._decoding.close()
            self._decoding = None
            if self._state is not None:
                n = self.params.n
                tokens, logps, n_gen, stopped = self._state
                for p in sorted(self._pending):
                    rows = slice(p * n, (p + 1) * n)
                    if keep_partial:
                        responses = self.engine._to_responses(tokens[rows], logps[rows], n_gen[rows], stopped[rows],
                                                           self.params)
                        done = [bool(s) or int(g) >= self.params.max_new_tokens
                                for s, g in zip(stopped[rows].tolist(), n_gen[rows].tolist(), strict=True)]
                        self._partials.append(PartialGroup(self._start + p, responses, done))
                    else:
                        aborted += int(n_gen[rows].sum())
        self._pending = set()
        return aborted

    def partials(self) -> list[PartialGroup]:
        """The groups ``abort(keep_partial=True)`` kept, in prompt order."""
        return list(self._partials)


class _HFResumeStream:
    """The responses of one ``HFEngine.resume_stream`` call as they end, chunk by chunk (``max_batch_rows`` rows at a
    time); ``unfinished()`` after ``close()``: the others as far as they got."""

    def __init__(self, engine: Any, prompts: list[list[int]], prefixes: list[list[int]], params: SamplingParams,
                 generator: torch.Generator, stop_ids: Tensor) -> None:
        self.engine, self.prompts, self.prefixes, self.params = engine, prompts, prefixes, params
        self.generator, self.stop_ids = generator, stop_ids
        self._handed: set[int] = set()
        self._state: tuple | None = None  # the current chunk: start, tokens, logps, n_gen, stopped, budgets
        self._decoding: Iterator | None = None
        self._closed = False

    @torch.inference_mode()
    def __iter__(self) -> Iterator[tuple[int, Response]]:
        engine, step = self.engine, self.engine.max_batch_rows
        for start in range(0, len(self.prompts), step):
            if self._closed:
                return
            chunk = slice(start, start + step)
            rows, budgets, carry, tail = engine._resume_rows(self.prompts[chunk], self.prefixes[chunk], self.params)
            self._decoding = engine._decode(rows, tail, self.stop_ids, self.generator, budgets, carry)
            for tokens, logps, n_gen, stopped, finished in self._decoding:
                self._state = (start, tokens, logps, n_gen, stopped, budgets)
                for row in finished:
                    one = slice(row, row + 1)
                    self._handed.add(start + row)
                    yield start + row, engine._to_responses(tokens[one], logps[one], n_gen[one], stopped[one],
                                                            tail)[0]
            self._decoding = None

    def close(self) -> None:
        """Stop decoding (what was decoded stays for ``unfinished``)."""
        self._closed = True
        if self._decoding is not None:
            self._decoding.close()
            self._decoding = None

    def unfinished(self) -> dict[int, tuple[Response, bool]]:
        """Every response not handed out: ``(its new tokens and log-probs so far, whether it had ended)``; one still
        decoding has finish_reason "length" as a placeholder, one whose chunk had not started no tokens."""
        out: dict[int, tuple[Response, bool]] = {}
        start, tokens, logps, n_gen, stopped, budgets = self._state or (0, None, None, None, None, None)
        for i in range(len(self.prompts)):
            if i in self._handed:
                continue
            row = i - start
            if tokens is None or not 0 <= row < tokens.shape[0]:
                out[i] = Response([], [], "length"), False
                continue
            n, stop = int(n_gen[row]), bool(stopped[row])
            lp = logps[row, :n].tolist() if self.params.logprobs != "none" else []
            out[i] = Response(tokens[row, :n].tolist(), lp, "stop" if stop else "length"), stop or n >= int(budgets[row])
        return out
