"""The synchronous rollout side: engines colocated with the trainer, generating between training phases.

    generate (engine groups) -> score (once over all ranks) -> overlong shaping -> the scheduler's decisions
    (dynamic sampling, streaming with abort, staged groups, partial rollouts) -> the step's batch

Every rank runs this. Engine groups split each generation call and one rank per group shares its responses; each
response is scored on one rank and the verdicts are shared, so every rank holds the same batch. Seeds are a pure
function of the run's seed, the step and the generation call, so the batch is too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dapo_mcore.algo.dynamic_sampling import Group
from dapo_mcore.algo.overlong import overlong_penalty
from dapo_mcore.data.records import PromptRecord
from dapo_mcore.rollout.pipeline.source import RolloutInterrupted, StepBatch
from dapo_mcore.rollout.protocol import Response, SamplingParams, WeightBucket
from dapo_mcore.rollout.scheduling.engine_groups import (
    EngineGroups,
    EngineGroupStream,
    ExchangeTally,
    round_robin,
)
from dapo_mcore.rollout.scheduling.gather import apply_once, broadcast_shares, merge_shares, plan_shares
from dapo_mcore.rollout.scheduling.groups import GroupData, as_group
from dapo_mcore.rollout.scheduling.partial import Buffered, join, runs, stale_response

__all__ = ["ColocatedRollouts", "EngineGroups", "step_seed"]

EVAL_SEED_OFFSET = 7919
"""Held-out generation draws from its own seed stream (run seed + this), apart from the training rollouts'."""


def step_seed(base: int, step: int, batch: int) -> int:
    """A distinct, reproducible seed per (run seed, step, generation call)."""
    return (base * 1_000_003 + step * 10_007 + batch) % (2**62)


class ColocatedRollouts:
    """The synchronous RolloutSource (``rollout.pipeline.source``); in async mode the engine ranks' rollout side.

    Args:
        cfg: the run's config (``rollout``, ``eval``, ``algo``'s overlong shaping, ``train.seed``).
        engine: the rollout engine (``rollout.protocol.Engine``).
        scheduler: ``rollout.scheduling.scheduler.RolloutScheduler`` (None for evaluation only).
        tokenizer: decodes responses for the verifier.
        score: ``score(texts, ground_truths) -> results`` with ``.score``, ``.acc``, ``.pred``.
        encode_prompt: a PromptRecord -> prompt token ids.
        timer: the run's ``telemetry.timers.PhaseTimer`` (``generate`` and ``reward`` phases).
        groups: the engine-group layout.
        streams: the engine streams finished groups and the scheduler may abort (with several engine groups the
            engine's streams advance in ticks: ``rollout.scheduling.engine_groups``).
    """

    def __init__(self, cfg: Any, *, engine: Any, scheduler: Any, tokenizer: Any,
                 score: Callable[[list[str], list[str]], list], encode_prompt: Callable[[Any], list[int]],
                 timer: Any, groups: EngineGroups | None = None, streams: bool = False) -> None:
        self.cfg, self.engine, self.scheduler, self.tokenizer = cfg, engine, scheduler, tokenizer
        self.score, self.encode_prompt, self.timer = score, encode_prompt, timer
        self.groups = groups or EngineGroups()
        self.streams = streams
        self.exchanges = ExchangeTally()
        """Exchanges between engine groups while streaming (several groups) since start, and their wall seconds."""
        self.progress: Any = None
        """Rank 0's ``telemetry.progress.StepProgress`` (batches, usable groups, tokens inside a step), else None."""
        self.version: int | None = None
        """The policy version the engine holds (async mode: set by the engine loop before each batch); None: the
        synchronous loop's, the number of steps done. Every token of a batch is stamped with the version that produced
        it (``Response.versions``)."""
        self.lockstep = getattr(engine, "groups_step_together", False)
        """The engine groups step together (vLLM's data-parallel engines): a group with nothing to stream or resume
        still streams (nothing) and ticks, or runs a one-token placeholder."""

    colocated = True
    """The engines share the trainer's devices (``Trainer`` offloads the actor around generation)."""

    # ---- the interface ------------------------------------------------------------------------------------
    @property
    def weights_valid(self) -> bool:
        return self.engine.weights_valid

    def wake(self) -> None:
        self.engine.wake()

    def sleep(self) -> None:
        self.engine.sleep()

    def publish(self, weights: Iterable[WeightBucket]) -> None:
        self.engine.update_weights(weights)

    def step_batch(self, step: int, stop: Callable[[], bool]) -> StepBatch:
        """generate -> score -> shape, until the batch holds enough usable groups (the scheduler decides which
        prompts to generate and when the step is full: ``rollout.scheduling.scheduler``)."""

        def params(n: int, slot: int) -> SamplingParams:
            # A pre-emption signal is honoured between generation calls too: one step can draw many batches.
            if slot > 0 and stop():
                raise RolloutInterrupted()
            return dataclasses.replace(self.sampling(seed=step_seed(self.cfg.train.seed, step, slot)), n=n)

        def generate(records: list[PromptRecord], n: int, slot: int) -> list[Group]:
            return self._noted(slot, [as_group(g) for g in self._generate_and_score(records, params(n, slot), slot)])

        def stream(records: list[PromptRecord], n: int, slot: int) -> _Stream:
            return self._stream_and_score(records, params(n, slot), slot)

        version = step if self.version is None else self.version

        def resume(buffered: list[Buffered], slot: int) -> list[Group]:
            return self._noted(slot, [as_group(g) for g in self._resume_and_score(buffered, params(1, slot), slot,
                                                                                  version)])

        if self.progress is not None:
            self.progress.begin(step + 1)  # ``step`` steps are done: this batch is for step + 1
        kept, generated, stats = self.scheduler.collect(generate, GroupData.joined, step,
                                                        stream if self.streams else None,
                                                        resume if self.streams else None, version)
        batch = StepBatch([g.payload for g in kept], [g.payload for g in generated], stats,
                          tools=self._tool_counters())
        chosen = {id(g) for g in batch.kept}
        for g in batch.generated:
            g.kept = id(g) in chosen
            for r in g.responses:  # sampled whole by this batch's version (continued ones were stamped by join)
                if r.versions is None:
                    r.versions = runs([(version, r.length)])
        return batch

    def _tool_counters(self) -> dict[str, float]:
        """Multi-turn tool use: the calls every engine group made since the last step (each counts its own share;
        summed over the groups' leaders), as ``tools/*`` metrics the cost ledger reads."""
        pool = self._tool_pool()
        if pool is None:
            return {}
        c = pool.take_counters()
        values = torch.tensor([c.calls, c.errors, c.timeouts, c.sandbox_failures, c.seconds, c.waited],
                              dtype=torch.float64)
        if self.groups.count > 1:
            import torch.distributed as dist

            from dapo_mcore.collectives.device import collective_device

            device = collective_device()
            summed = device.to(values * float(self.groups.leader))
            dist.all_reduce(summed)
            values = device.host(summed)
        names = ("calls", "errors", "timeouts", "sandbox_failures", "seconds", "waited")
        return {f"tools/{name}": float(v) for name, v in zip(names, values.tolist(), strict=True)}

    def _noted(self, slot: int, groups: list[Group]) -> list[Group]:
        if self.progress is not None:
            self.progress.batch(slot, groups)
        return groups

    def eval_groups(self, records: list[PromptRecord], step: int) -> list[GroupData]:
        params = self.sampling(eval_mode=True, seed=step_seed(self.cfg.train.seed + EVAL_SEED_OFFSET, step, 0))
        groups = self._generate_and_score(records, params, 0, timed=False)
        self._drop_tool_counters()
        return groups

    def _drop_tool_counters(self) -> None:
        """An evaluation's tool calls are not the next step's: the pool's counters start again after it, so a step's
        ``tools/*`` and cost-ledger counts hold its own rollouts' calls only (each rank drops its own: no collective)."""
        pool = self._tool_pool()
        if pool is not None:
            pool.take_counters()

    def _tool_pool(self) -> Any:
        """The tool pool of a multi-turn engine (None without tool use)."""
        from dapo_mcore.rollout.multiturn import MultiTurnEngine

        return self.engine.pool if isinstance(self.engine, MultiTurnEngine) else None

    def snapshot(self) -> Any:
        sched = self.scheduler
        return sched.sampler.state_dict(), sched.snapshot()

    def rollback(self, snap: Any) -> None:
        sampler_state, schedule = snap
        self.scheduler.sampler.load_state_dict(sampler_state)  # the abandoned step's prompts come again
        self.scheduler.rollback(schedule)  # and its partial groups (rollout.schedule.partial)

    # ---- one generation call: generate, score, shape --------------------------------------------------------
    def sampling(self, eval_mode: bool = False, seed: int = 0) -> SamplingParams:
        r, e = self.cfg.rollout, self.cfg.eval
        return SamplingParams(
            n=e.k if eval_mode else r.n, temperature=e.temperature if eval_mode else r.temperature,
            top_p=e.top_p if eval_mode else r.top_p, top_k=r.top_k,
            max_new_tokens=(e.max_new_tokens or r.max_new_tokens) if eval_mode else r.max_new_tokens,
            seed=seed, logprobs="none" if eval_mode else "processed")

    def _generate_and_score(self, records: list[PromptRecord], params: SamplingParams, gen_batch: int,
                            timed: bool = True) -> list[GroupData]:
        """Generate and score; ``timed=False`` inside evaluation, whose time is its own phase."""

        def phase(name: str):
            return self.timer.phase(name) if timed else contextlib.nullcontext()

        prompt_ids = [self.encode_prompt(rec) for rec in records]
        with phase("generate"):
            outputs = self._generate(prompt_ids, params)
        with phase("reward"):
            return self._scored_groups(records, prompt_ids, outputs, gen_batch)

    def _scored_groups(self, records: list[PromptRecord], prompt_ids: list[list[int]],
                       outputs: list[list[Response]], gen_batch: int) -> list[GroupData]:
        results = self._score(records, outputs)
        groups, start = [], 0
        for i, rec in enumerate(records):
            res = results[start:start + len(outputs[i])]
            start += len(outputs[i])
            scores = [float(x.score) for x in res]
            groups.append(GroupData(rec, prompt_ids[i], outputs[i], scores, [bool(x.acc) for x in res],
                                    self._shape_rewards(scores, outputs[i]), gen_batch, [x.pred for x in res]))
        return groups

    def _stream_and_score(self, records: list[PromptRecord], params: SamplingParams, gen_batch: int) -> _Stream:
        """Streamed generation: each group is scored as soon as it finishes (with several engine groups, as soon as
        the exchange after it has brought it to every rank)."""
        prompt_ids = [self.encode_prompt(rec) for rec in records]
        if self.groups.count > 1:
            return self._stream_over_groups(records, prompt_ids, params, gen_batch)
        engine_stream = self.engine.stream(prompt_ids, params)

        def scored() -> Iterator[tuple[int, Group]]:
            with self.timer.phase("generate"):
                for i, responses in engine_stream:
                    yield i, as_group(self._scored_groups([records[i]], [prompt_ids[i]], [responses], gen_batch)[0])

        return _Stream(scored(), engine_stream.abort, getattr(engine_stream, "partials", None))

    def _stream_over_groups(self, records: list[PromptRecord], prompt_ids: list[list[int]], params: SamplingParams,
                            gen_batch: int) -> _Stream:
        mine = round_robin(len(records), self.groups)
        local = (self.engine.stream([prompt_ids[i] for i in mine],
                                    dataclasses.replace(params, seed=self.groups.seed(params.seed)))
                 if mine or self.lockstep else None)
        stream = EngineGroupStream(local, mine, self.groups, self.cfg.rollout.schedule.exchange_every, self.exchanges)

        def scored() -> Iterator[tuple[int, Group]]:
            with self.timer.phase("generate"):
                for ended in stream.ticks():  # the same list on every rank: score it once over all of them
                    groups = self._scored_groups([records[p] for p, _ in ended], [prompt_ids[p] for p, _ in ended],
                                                 [rs for _, rs in ended], gen_batch)
                    for (pos, _), group in zip(ended, groups, strict=True):
                        stream.claim(pos)
                        yield pos, as_group(group)

        return _Stream(scored(), stream.abort, stream.partials)

    def _resume_and_score(self, buffered: list[Buffered], params: SamplingParams, gen_batch: int,
                          version: int) -> list[GroupData]:
        """Partial rollouts: continue the unfinished responses of the groups the last step aborted (split over the
        engine groups round robin), then score the whole groups."""
        records = [self.scheduler.sampler.records[b.index] for b in buffered]
        prompt_ids = [self.encode_prompt(rec) for rec in records]
        todo = [(gi, ri) for gi, b in enumerate(buffered) for ri, done in enumerate(b.group.done) if not done]
        tails = []
        whole = getattr(self.engine, "resumes_trajectories", False)  # multi-turn: the loss mask and tool counts too
        if todo:  # groups that ended in the step that filled the batch need no engine call
            with self.timer.phase("generate"):
                tails = self._resume(todo, [prompt_ids[gi] for gi, _ in todo],
                                     [buffered[gi].group.responses[ri] if whole
                                      else buffered[gi].group.responses[ri].token_ids for gi, ri in todo], params)
        outputs = [[stale_response(r) for r in b.group.responses] for b in buffered]
        for (gi, ri), tail in zip(todo, tails, strict=True):
            outputs[gi][ri] = join(buffered[gi].group.responses[ri], tail, version)
        with self.timer.phase("reward"):
            return self._scored_groups(records, prompt_ids, outputs, gen_batch)

    def _resume(self, todo: list[Any], prompts: list[list[int]], prefixes: list[Any],
                params: SamplingParams) -> list[Response]:
        """The continued tails of ``todo``'s responses, every engine group its round-robin share, on every rank."""
        if self.groups.count == 1:
            return self.engine.resume(prompts, prefixes, params)
        mine = round_robin(len(todo), self.groups)
        seed = self.groups.seed(params.seed)
        if mine:
            local = self.engine.resume([prompts[k] for k in mine], [prefixes[k] for k in mine],
                                       dataclasses.replace(params, seed=seed))
        else:
            local = []
            if self.lockstep:  # a one-token placeholder keeps vLLM's DP in step
                self.engine.generate([prompts[0]], dataclasses.replace(params, n=1, max_new_tokens=1, seed=seed))
        shares = broadcast_shares(mine, [[tail] for tail in local], sender=self.groups.leader,
                                  routes_to=self.groups.routes_to)
        merged = {k: rs[0] for share in shares for k, rs in share.items()}
        return [merged[k] for k in range(len(todo))]

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Response]]:
        """Each engine group generates its share (``rollout.scheduling.gather.plan_shares``); every rank gets all the
        results.

        Every group calls the engine on every generation call, even with fewer samples than groups, because vLLM's
        data-parallel engines step together. Each share has its own seed, derived from the call's seed.
        """
        g = self.groups
        if g.count == 1:
            return self.engine.generate(prompts, params)
        if not prompts:
            return []
        share = plan_shares(len(prompts), params.n, g.count)[g.index]
        seed = g.seed(params.seed)
        if share.idle:  # a one-token placeholder keeps this group's engine in step with the others
            self.engine.generate([prompts[0]], dataclasses.replace(params, n=1, max_new_tokens=1, seed=seed))
            local: list[list[Response]] = []
        else:
            local = self.engine.generate([prompts[i] for i in share.indices],
                                         dataclasses.replace(params, n=share.n, seed=seed))
        shares = broadcast_shares(share.indices, local, sender=g.leader, routes_to=g.routes_to)
        return merge_shares(shares, len(prompts), params.n)

    def _score(self, records: list[PromptRecord], outputs: list[list[Response]]) -> list[Any]:
        """Decode and verify every response once over all ranks (each rank its strided share) and share the
        verdicts: ranks cannot disagree on one (a worker timeout, a custom reward) and then hold different batches."""
        items = [(r.token_ids, rec.ground_truth) for rec, group in zip(records, outputs, strict=True) for r in group]

        def verify(share: list[tuple[list[int], str]]) -> list[Any]:
            texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in share]
            return self.score(texts, [truth for _, truth in share])

        return apply_once(verify, items)

    def _shape_rewards(self, scores: list[float], responses: list[Response]) -> list[float]:
        a = self.cfg.algo
        if not a.overlong_shaping:
            return list(scores)
        lengths = torch.tensor([r.length for r in responses])
        penalty = overlong_penalty(lengths, a.overlong_max_len, a.overlong_cache_len, a.overlong_penalty_factor)
        return [s + float(pen) for s, pen in zip(scores, penalty, strict=True)]


@dataclass
class _Stream:
    """Scored groups of a streamed generation call (the scheduler's StreamFn result)."""

    groups: Any
    """A generator of ``(position, Group)``."""
    engine_abort: Any
    partials: Any = None
    """The engine stream's ``partials`` (a PartialGroupStream), else None."""

    def __iter__(self) -> Iterator[tuple[int, Group]]:
        return self.groups

    def abort(self, keep_partial: bool = False) -> int:
        self.groups.close()  # leaves the generate phase before the next one starts
        return self.engine_abort(keep_partial=True) if keep_partial else self.engine_abort()
