"""The rollout scheduler: gathers one step's usable groups, paying for as few thrown-away rollouts as it can.

With every ``rollout.schedule`` switch off it is DAPO's published loop (``algo.dynamic_sampling.collect_groups``):
draw ``rollout.gen_batch_prompts`` prompts, generate G responses each, keep the mixed groups, repeat until
``train.prompts_per_step`` are kept, drop the rest. The switches (see ``ScheduleConfig``) change what is drawn
and generated, never how a kept group is trained:

- streaming: rounds are generated in chunks and the step stops after the chunk that fills it;
- adaptive: a round's size follows the usable fraction seen in earlier steps;
- staged groups: k < G responses first; only groups whose first k are mixed are completed;
- prompt history: the sampler skips prompts that were all right / all wrong lately (``data.prompt_history``);
- partial rollouts: the groups a streamed step aborted are continued first thing at the next step
  (``rollout.schedule.partial``).

Decisions are taken in prompt order over shared, scored groups (``rollout.schedule.order: prompt``), or in the
order the groups end with ``order: completion`` (a whole round streams at once, no drain between chunks); an end is
counted in decode steps and engine-group exchanges, never in seconds, so either way the kept batch is a pure function
of the seed, the data and the world size, and every rank holds the same one. Generation itself
goes through the trainer's ``generate`` callback (engine groups, gather), so any layout works.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

from dapo_mcore.algo.dynamic_sampling import Group, SamplingStats, collect_groups, exhausted_error
from dapo_mcore.algo.schedule_config import ScheduleConfig
from dapo_mcore.rollout.protocol import PartialGroup, Response
from dapo_mcore.rollout.scheduling.partial import Buffered, PartialBuffer

__all__ = ["RolloutScheduler", "GenerateFn", "MergeFn", "ResumeFn", "round_size"]

log = logging.getLogger(__name__)

GenerateFn = Callable[[list[Any], int, int], list[Group]]
"""``generate(records, responses_per_prompt, slot)``: one scored Group per record, in order. ``slot`` counts the
generation calls of the step from 0 (the trainer derives the seed from it; slot > 0 may honour a stop signal)."""
MergeFn = Callable[[Any, Any], Any]
"""Joins the payloads of a group's first stage and its completion (staged groups)."""
StreamFn = Callable[[list[Any], int, int], Any]
"""``stream(records, responses_per_prompt, slot)``: like GenerateFn, but returns a stream to iterate for
``(position in records, scored Group)`` as groups finish, with ``abort() -> tokens dropped`` (the shape of
``rollout.protocol.GroupStream``; with partial rollouts ``abort(keep_partial=True)`` and ``partials()`` as in
``PartialGroupStream``)."""
ResumeFn = Callable[[list[Buffered], int], list[Group]]
"""``resume(buffered, slot)``: the buffered partial groups continued by the current policy, one scored Group each,
in order (partial rollouts)."""


def round_size(need: int, estimate: float | None, base: int, margin: float, cap: int, floor: float) -> int:
    """Prompts for the next round: ``base`` without an estimate, else ``ceil(need / max(estimate, floor) * margin)``
    clamped to ``[1, cap]``."""
    if estimate is None:
        return min(base, cap)
    return max(1, min(cap, math.ceil(need / max(estimate, floor) * margin)))


class RolloutScheduler:
    """One step's group collection (see module docstring).

    Args:
        cfg: the ``rollout.schedule`` switches.
        sampler: a ``data.sampler.PromptSampler`` (with a ``PromptHistory`` when ``cfg.history``).
        n: responses per prompt (G).
        target: usable groups per step (train.prompts_per_step).
        gen_batch_prompts: the fixed round size (and the first adaptive round's size).
        max_rounds: most rounds per step (algo.max_gen_batches; 0 = no limit).
        dynamic_sampling: False (GRPO) takes one batch unfiltered; only with every switch off.
        seed: the run's seed (the staged-group audit draws).
        max_lag: the most policy versions a trained token may lag (``rollout.pipeline.max_staleness``): a buffered
            partial group whose oldest token would lag more in the batch being collected is dropped, not continued.
    """

    def __init__(self, cfg: ScheduleConfig, sampler: Any, *, n: int, target: int, gen_batch_prompts: int,
                 max_rounds: int, dynamic_sampling: bool = True, seed: int = 0, max_lag: int = 1) -> None:
        self.cfg, self.sampler, self.n, self.target, self.max_lag = cfg, sampler, n, target, max_lag
        self.gen_batch_prompts, self.max_rounds, self.dynamic_sampling, self.seed = (
            gen_batch_prompts, max_rounds, dynamic_sampling, seed)
        self.usable_estimate: float | None = None
        """Running usable-group fraction (adaptive rounds); None until the first step ends."""
        self.partials = PartialBuffer()
        """Groups the last streamed step aborted, continued at the next (rollout.schedule.partial)."""

    def collect(self, generate: GenerateFn, merge: MergeFn, step: int = 0, stream: StreamFn | None = None,
                resume: ResumeFn | None = None, version: int | None = None
                ) -> tuple[list[Group], list[Group], SamplingStats]:
        """``(kept, generated, stats)``: the step's kept groups (exactly ``target``, prompt order), every group it
        generated (kept or not, in decision order) and the sampling counters. With ``stream`` (an engine that
        streams finished groups, over every engine group), streamed chunks are aborted as soon as the step is full; with
        ``resume`` too and ``partial`` on, the aborted groups are kept and continued at the next step. ``version`` is
        the policy version generating the batch for step ``step`` (the synchronous loop's: ``step``)."""
        if not self.cfg.enabled:
            generated: list[Group] = []

            def batch(i: int) -> list[Group]:
                groups = generate(self.sampler.next_batch(self.gen_batch_prompts), self.n, i)
                generated.extend(groups)
                return groups

            kept, stats = collect_groups(batch, self.target, self.max_rounds, enabled=self.dynamic_sampling)
            return kept, generated, stats
        return self._collect_scheduled(generate, merge, step, stream, resume, step if version is None else version)

    def _collect_scheduled(self, generate: GenerateFn, merge: MergeFn, step: int, stream: StreamFn | None,
                           resume: ResumeFn | None, version: int) -> tuple[list[Group], list[Group], SamplingStats]:
        stats, kept, generated = SamplingStats(), [], []
        slots = itertools.count()
        history = self.sampler.history
        partial = self.cfg.partial and stream is not None and resume is not None
        items = self.fresh_enough(self.partials.take(), step, stats)
        if items:
            if resume is None:
                raise ValueError("the scheduler holds partial groups but was given no resume callback")
            for item, group in zip(items, resume(items, next(slots)), strict=True):
                generated.append(group)
                stats.groups_resumed += 1
                stats.tokens_resumed_stale += group.stale_tokens
                if history is not None:
                    history.record(item.index, group.num_correct(), len(group.acc))
                self._decide(group, False, kept, stats)
        while len(kept) < self.target:
            if self.max_rounds and stats.gen_batches >= self.max_rounds:
                raise exhausted_error(stats, self.target, self.max_rounds)
            size, drawn = self.next_round_size(self.target - len(kept)), 0
            stats.gen_batches += 1
            while drawn < size and len(kept) < self.target:
                chunked = self.cfg.streaming and self.cfg.order == "prompt"
                take = min(size - drawn, self.cfg.stream_chunk_prompts) if chunked else size - drawn
                indices, skipped = self.sampler.next_selected(take)
                stats.prompts_history_skipped += skipped
                if not indices:
                    break
                drawn += len(indices)
                records = [self.sampler.records[i] for i in indices]
                if self.cfg.streaming and stream is not None and not self.cfg.stage_responses:
                    keep = (indices, step, version) if partial else None
                    groups = stream(records, self.n, next(slots))
                    decided = (self._stream_completion(groups, len(records), kept, stats, keep)
                               if self.cfg.order == "completion" else self._stream_chunk(groups, kept, stats, keep))
                else:
                    decided = enumerate(self._generate(records, generate, merge, slots, step))
                for pos, (group, staged_out) in decided:
                    generated.append(group)
                    if history is not None:
                        history.record(indices[pos], group.num_correct(), len(group.acc))
                    self._decide(group, staged_out, kept, stats)
        self._update_estimate(stats)
        stats.tokens_stale_kept = sum(g.stale_tokens for g in kept)
        stats.tokens_partial_buffered = self.partials.num_tokens()
        return kept, generated, stats

    def _stream_chunk(self, groups: Any, kept: list[Group], stats: SamplingStats,
                      keep: tuple[list[int], int] | None) -> Iterator[tuple[int, tuple[Group, bool]]]:
        """Hands out streamed groups in prompt order (each as soon as every earlier one has finished) while the
        caller decides them; once the step is full the stream is aborted and the groups that had finished out of
        order are handed out too (surplus or rejected: they cost their tokens). With ``keep`` (the chunk's sampler
        indices and the step: partial rollouts) the groups in flight go to the partial buffer instead of being
        dropped."""
        done: dict[int, Group] = {}
        nxt = 0
        for pos, group in groups:
            done[pos] = group
            while nxt in done and len(kept) < self.target:
                yield nxt, (done.pop(nxt), False)
                nxt += 1
            if len(kept) >= self.target:
                if keep is None:
                    stats.tokens_aborted += groups.abort()
                else:
                    stats.tokens_aborted += groups.abort(keep_partial=True)
                    self.partials.add(keep[0], groups.partials(), keep[1], keep[2])
                break
        for pos in sorted(done):
            yield pos, (done[pos], False)

    def _stream_completion(self, groups: Any, count: int, kept: list[Group], stats: SamplingStats,
                           keep: tuple[list[int], int] | None) -> Iterator[tuple[int, tuple[Group, bool]]]:
        """Hands out streamed groups in the order they end while the caller decides them; once the step is full the
        stream is aborted. With ``keep`` (partial rollouts) the groups in flight go to the partial buffer, and so do
        the ``count`` prompts' groups that never started (empty prefixes: the next step generates them whole)."""
        ended: set[int] = set()
        for pos, group in groups:
            ended.add(pos)
            yield pos, (group, False)
            if len(kept) >= self.target:
                break
        else:
            return
        if keep is None:
            stats.tokens_aborted += groups.abort()
            return
        stats.tokens_aborted += groups.abort(keep_partial=True)
        inflight = list(groups.partials())
        seen = ended | {p.index for p in inflight}
        unstarted = [PartialGroup(pos, [Response([], [], "length") for _ in range(self.n)], [False] * self.n)
                     for pos in range(count) if pos not in seen]
        self.partials.add(keep[0], sorted(inflight + unstarted, key=lambda p: p.index), keep[1], keep[2])

    def fresh_enough(self, items: list[Buffered], step: int, stats: SamplingStats) -> list[Buffered]:
        """The buffered groups the batch for step ``step`` may continue: a group whose oldest token would lag more
        than ``max_lag`` versions when that step trains is dropped (its prompt is not drawn again) and counted in
        ``groups_dropped_stale``, its tokens in ``tokens_dropped_stale`` (decoded, so they count as generated)."""
        out = []
        for item in items:
            oldest = item.oldest_version
            if oldest is not None and step - oldest > self.max_lag:
                stats.groups_dropped_stale += 1
                stats.tokens_dropped_stale += item.group.num_tokens()
                log.info("partial group of prompt %d dropped: its oldest token (version %d) would lag %d versions at "
                         "step %d, more than rollout.pipeline.max_staleness=%d", item.index, oldest, step - oldest,
                         step + 1, self.max_lag)
            else:
                out.append(item)
        return out

    def _decide(self, group: Group, staged_out: bool, kept: list[Group], stats: SamplingStats) -> None:
        """Prompt order: the first ``target`` usable groups are kept, later usable ones are surplus."""
        if staged_out:
            stats.record(group, "stage_skipped")
            if len(group.acc) == self.n:  # completed only to measure the staging bias
                stats.groups_stage_audited += 1
                stats.groups_stage_audit_usable += int(group.is_usable())
        elif not group.is_usable():
            stats.record(group, "rejected")
        elif len(kept) < self.target:
            kept.append(group)
            stats.record(group, "kept")
        else:
            stats.record(group, "surplus")

    def _generate(self, records: list[Any], generate: GenerateFn, merge: MergeFn, slots: Iterator[int],
                  step: int) -> list[tuple[Group, bool]]:
        """Generate the chunk's groups; with staged groups, ``(group, True)`` marks a group skipped at stage one."""
        k = self.cfg.stage_responses
        if not k:
            return [(g, False) for g in generate(records, self.n, next(slots))]
        first = generate(records, k, next(slots))
        audit = random.Random(f"stage-audit:{self.seed}:{step}:{next(slots)}")
        complete = [i for i, g in enumerate(first)
                    if g.is_usable() or audit.random() < self.cfg.stage_audit_fraction]
        rest = generate([records[i] for i in complete], self.n - k, next(slots)) if complete else []
        out = [(g, True) for g in first]
        for i, tail in zip(complete, rest, strict=True):
            head = first[i]
            joined = Group(acc=list(head.acc) + list(tail.acc), payload=merge(head.payload, tail.payload),
                           response_lengths=list(head.response_lengths or []) + list(tail.response_lengths or []))
            out[i] = (joined, not head.is_usable())
        return out

    def next_round_size(self, need: int) -> int:
        """Prompts to generate in the next round of this step."""
        if not self.cfg.adaptive:
            return self.gen_batch_prompts
        cap = self.cfg.adaptive_max_prompts or 4 * self.gen_batch_prompts
        return round_size(need, self.usable_estimate, self.gen_batch_prompts, self.cfg.adaptive_margin, cap,
                          self.cfg.adaptive_min_fraction)

    def _update_estimate(self, stats: SamplingStats) -> None:
        if not stats.groups_generated:
            return
        frac = (stats.groups_kept + stats.groups_surplus) / stats.groups_generated
        w = self.cfg.adaptive_ema
        self.usable_estimate = frac if self.usable_estimate is None else w * frac + (1 - w) * self.usable_estimate

    def snapshot(self) -> tuple[float | None, list[Buffered]]:
        """What ``rollback`` needs to undo a step abandoned on a signal (cheap: buffered groups are never mutated)."""
        return self.usable_estimate, list(self.partials.items)

    def rollback(self, snap: tuple[float | None, list[Buffered]]) -> None:
        self.usable_estimate, self.partials.items = snap[0], list(snap[1])

    def state_dict(self) -> dict[str, Any]:
        """JSON-able, a copy (what a checkpoint stores)."""
        return {"usable_estimate": self.usable_estimate, "partials": self.partials.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.usable_estimate = state["usable_estimate"]
        self.partials.load_state_dict(state.get("partials", []))

    def checkpoint_state(self) -> dict[str, Any]:
        """The rollout side's part of a trainer checkpoint: the sampler's state, and the schedule's when a
        ``rollout.schedule`` switch is on (``trainer_state.json``'s ``sampler`` and ``schedule``)."""
        state: dict[str, Any] = {"sampler": self.sampler.state_dict()}
        if self.cfg.enabled:
            state["schedule"] = self.state_dict()
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Undo ``checkpoint_state`` (a checkpoint without a ``schedule`` leaves the schedule as it is)."""
        self.sampler.load_state_dict(state["sampler"])
        if state.get("schedule") is not None:
            self.load_state_dict(state["schedule"])
