"""The pure parts of the rollout model (``dapo-mcore plan`` and ``benchmarks/rollout_sim.py``): prompt groups, an engine model, policies.

A *group* is one prompt's G responses: G response lengths and one usable flag (mixed outcomes, 0 < #correct < G).
:class:`PromptPool` draws an endless, seeded stream of groups for one stage of training; every policy reads the same
stream. :class:`EngineSim` is an event-driven model of continuous-batching decode over several engines: each engine
runs at most ``max_seqs`` sequences, every running sequence gains one token per decode iteration, and an iteration
takes ``t0 + t1 * n`` seconds with n sequences running (a memory-bound decode: a fixed weight read plus a per-sequence
part). A freed slot takes the next waiting sequence of its engine at once (FIFO). Prefill is not modelled.

The generation policies make one DAPO step each:
- :func:`batch_and_filter_step`: today's dynamic sampling. Draw ``gen_batch_prompts`` prompts, wait for the longest
  response, keep usable groups in batch order, draw again until ``prompts_per_step`` are kept; usable groups beyond that
  are surplus. With ``adaptive`` each round is sized from a usable-fraction estimate instead (adaptive over-sampling);
  with ``chunk`` each round is generated in chunks (today's streaming switch over several engine groups). A batch is
  split over the engines as ``rollout.scheduling.gather.plan_shares`` does (:func:`spread`).
- :func:`streaming_step`: prompts stream into the engines, each group is scored when its last response ends (or, with
  ``order="prompt"``, once every earlier prompt's group has ended too, as the trainer's scheduler decides), and the
  step stops once enough usable groups are kept; everything in flight is aborted. With ``partial=True`` the aborted
  groups are carried into the next step (queued first) and continue from the tokens they have, for at most
  ``max_staleness`` further steps. Here that argument counts carries; the product carries a group once (continued at
  the very next step and finished there), so 1 models it, in sync mode and in async mode alike (where the prefix then
  lags ``rollout.pipeline.max_staleness`` versions: the engines' lead plus this one carry).
Token accounting per step: each group's tokens are counted once, in the step that decides its fate (kept, rejected,
surplus, aborted); carried groups move tokens between steps (``carried_in`` / ``carried_out``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

_EPS = 1e-6  # tokens: a running sequence with less left than this has finished (float round-off of the clock)


@dataclass(frozen=True)
class Stage:
    """One stage of training: how long responses are and how groups split into usable / all-correct / all-wrong."""

    name: str
    mean_len: float
    """Mean response length in tokens before the cap (over all groups)."""
    all_correct: float
    """Share of groups whose G responses are all right."""
    all_wrong: float
    """Share of groups whose G responses are all wrong."""

    @property
    def usable(self) -> float:
        return 1.0 - self.all_correct - self.all_wrong

    def __post_init__(self) -> None:
        if self.mean_len <= 0 or min(self.all_correct, self.all_wrong) < 0 or self.usable <= 0:
            raise ValueError(f"stage {self.name!r}: need mean_len > 0 and all_correct, all_wrong >= 0 with a sum < 1")


@dataclass(frozen=True)
class LengthModel:
    """Response lengths: lognormal with a shared per-group factor, shifted by the group's outcome, capped.

    log L = mu + shift(outcome) + g + e with g ~ N(0, sigma_group) per group and e ~ N(0, sigma_resp) per response,
    rounded and clipped to [min_len, cap]; mu is set so that the uncapped mean is the stage's ``mean_len``.
    """

    sigma_group: float = 0.5
    sigma_resp: float = 0.6
    cap: int = 20480
    min_len: int = 1
    shift_all_correct: float = -0.3
    """Log-length shift of all-correct groups (easy prompts get shorter answers)."""
    shift_all_wrong: float = 0.4
    """Log-length shift of all-wrong groups (hard prompts: long, often truncated answers)."""

    def mu(self, stage: Stage) -> float:
        """Location of log L that gives the stage's uncapped mean length."""
        shift_mean = (stage.usable + stage.all_correct * math.exp(self.shift_all_correct)
                      + stage.all_wrong * math.exp(self.shift_all_wrong))
        var = self.sigma_group**2 + self.sigma_resp**2
        return math.log(stage.mean_len) - var / 2 - math.log(shift_mean)


class PromptPool:
    """An endless seeded stream of groups of one stage; the same seed gives the same stream whatever is taken at once."""

    def __init__(self, stage: Stage, group_size: int, lengths: LengthModel, seed: int, chunk: int = 1024) -> None:
        self.stage, self.group_size, self.lengths, self.chunk = stage, group_size, lengths, chunk
        self._rng = np.random.default_rng(seed)
        self._len = np.zeros((0, group_size), dtype=np.int64)
        self._usable = np.zeros(0, dtype=bool)
        self._next = 0

    def _draw_chunk(self) -> None:
        m, s, n = self.lengths, self.stage, self.chunk
        outcome = self._rng.choice(3, size=n, p=[s.usable, s.all_correct, s.all_wrong])
        shift = np.array([0.0, m.shift_all_correct, m.shift_all_wrong])[outcome]
        g = self._rng.normal(0.0, m.sigma_group, size=n) if m.sigma_group > 0 else np.zeros(n)
        e = self._rng.normal(0.0, m.sigma_resp, size=(n, self.group_size)) if m.sigma_resp > 0 else 0.0
        raw = np.exp(m.mu(s) + shift[:, None] + g[:, None] + e)
        length = np.clip(np.rint(raw), m.min_len, m.cap).astype(np.int64)
        self._len = np.concatenate([self._len[self._next:], length])
        self._usable = np.concatenate([self._usable[self._next:], outcome == 0])
        self._next = 0

    def take(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The next k groups: lengths ``[k, G]`` and usable flags ``[k]``."""
        while len(self._usable) - self._next < k:
            self._draw_chunk()
        sl = slice(self._next, self._next + k)
        self._next += k
        return self._len[sl].copy(), self._usable[sl].copy()


@dataclass(frozen=True)
class EngineModel:
    """N engines of continuous batching; one decode iteration takes ``t0 + t1 * n`` seconds with n sequences running."""

    engines: int
    max_seqs: int
    t0: float
    t1: float

    @classmethod
    def from_throughput(cls, engines: int, max_seqs: int, full_tokens_per_s: float,
                        single_tokens_per_s: float) -> EngineModel:
        """From the decode rate of a full engine (max_seqs running) and of one lone sequence, tokens/s per engine."""
        t0, t_full = 1.0 / single_tokens_per_s, max_seqs / full_tokens_per_s
        if t_full < t0:
            raise ValueError(f"full_tokens_per_s={full_tokens_per_s} is more than max_seqs={max_seqs} lone sequences "
                             f"at {single_tokens_per_s} tokens/s; lower it or raise single_tokens_per_s")
        return cls(engines, max_seqs, t0, (t_full - t0) / max_seqs)


class EngineSim:
    """Event-driven continuous batching (see module docstring). Sequences are added per group with a target engine.

    Each engine keeps a token clock (the tokens every running sequence of it has decoded since the start): between
    two events on an engine its running count n is fixed, so its clock runs at 1 / (t0 + t1 n) tokens a second and a
    sequence admitted at clock c with r tokens left finishes at clock c + r. An event is the next such finish over
    all engines (a heap of the engines' next finish times), so one event costs O(log) work, not a pass over every
    slot of every engine.

    ``plan --rank-variants`` runs millions of events, so the hot path (:meth:`advance`) is written flat, on local
    names, with the iteration time of each running count computed once; every clock and time is the
    same float operation, in the same order, as the plain form (``tests/rollout_model_reference.py``, checked equal by
    ``tests/test_rollout_fast.py``)."""

    def __init__(self, model: EngineModel) -> None:
        self.model = model
        e = model.engines
        self.queues: list[deque[int]] = [deque() for _ in range(e)]
        self.now = 0.0
        self.seq_len: list[int] = []
        self.seq_base: list[float] = []
        self.seq_group: list[int] = []
        self.seq_done: list[bool] = []
        self.group_left: list[int] = []
        self.group_seqs: list[list[int]] = []
        self.feeder = None
        """Optional callable(engine) -> bool that adds a group to that engine when its queue runs dry."""
        self._dirty = set(range(e))
        self._n = [0] * e  # running sequences per engine
        self._clock = [0.0] * e  # each engine's token clock at real time _synced[e]
        self._synced = [0.0] * e
        self._running: list[list[tuple[float, int, int]]] = [[] for _ in range(e)]  # heap: (finish clock, slot, seq)
        self._free = [list(range(model.max_seqs)) for _ in range(e)]  # heap of free slots (lowest first)
        self._events: list[tuple[float, int, int]] = []  # heap: (time, engine, version)
        self._version = [0] * e
        self._where: dict[int, tuple[int, float]] = {}  # running seq -> (engine, finish clock)
        self._total = 0
        self._iter = [model.t0 + model.t1 * n for n in range(model.max_seqs + 1)]  # seconds per iteration at n running
        self._slack = _EPS * (model.t0 + model.t1 * model.max_seqs)  # _EPS tokens, in seconds at most

    def _iteration(self, e: int) -> float:
        return self._iter[self._n[e]]

    def add_group(self, engine: int, lengths: np.ndarray, progress: np.ndarray | None = None) -> int:
        """Queue one group's responses on ``engine``; ``progress`` tokens already generated each (partial rollouts)."""
        gid = len(self.group_left)
        first, lens = len(self.seq_len), lengths.tolist()
        if progress is None and lengths.dtype.kind in "iu" and min(lens) > _EPS:  # fresh: none finished
            k = len(lens)
            seqs = list(range(first, first + k))
            self.seq_len += lens
            self.seq_base += [0.0] * k
            self.seq_group += [gid] * k
            self.seq_done += [False] * k
            self.queues[engine].extend(seqs)
            self.group_left.append(k)
            self.group_seqs.append(seqs)
            self._dirty.add(engine)
            return gid
        prog = [0.0] * len(lens) if progress is None else progress.tolist()
        seqs, left, queue = [], 0, self.queues[engine]
        for n, p in zip(lens, prog, strict=True):
            sid = len(self.seq_len)
            self.seq_len.append(int(n))
            self.seq_base.append(float(p))
            self.seq_group.append(gid)
            done = p >= n - _EPS
            self.seq_done.append(done)
            seqs.append(sid)
            if not done:
                queue.append(sid)
                left += 1
        assert left > 0, "a group with every response finished is complete; do not queue it"
        self.group_left.append(left)
        self.group_seqs.append(seqs)
        self._dirty.add(engine)
        return gid

    def wake(self) -> None:
        """Let every engine ask the feeder again at the next event (the admission budget grew)."""
        self._dirty = set(range(self.model.engines))

    def progress(self, gid: int) -> np.ndarray:
        """Tokens generated so far by each response of a group (their full length once finished)."""
        out = []
        for s in self.group_seqs[gid]:
            if self.seq_done[s]:
                out.append(float(self.seq_len[s]))
            elif s in self._where:
                e, finish = self._where[s]
                clock = self._clock[e] + (self.now - self._synced[e]) / self._iteration(e)
                out.append(self.seq_len[s] - (finish - clock))
            else:
                out.append(self.seq_base[s])
        return np.array(out)

    def advance(self, until_group: bool = False) -> list[int] | None:
        """Run to the next finishing response(s); the groups that completed then, or None when nothing is left.

        ``until_group``: go on through the events that complete no group, to the first one that does (what a
        caller that only acts on completed groups would do, call after call)."""
        cap, feeder, eps = self.model.max_seqs, self.feeder, _EPS
        it, n_run, clock, synced = self._iter, self._n, self._clock, self._synced
        queues, running, free, where = self.queues, self._running, self._free, self._where
        seq_len, seq_base, seq_group, group_left, seq_done = (self.seq_len, self.seq_base, self.seq_group,
                                                              self.group_left, self.seq_done)
        version, events, slack = self._version, self._events, self._slack
        heappush, heappop = heapq.heappush, heapq.heappop
        while True:
            if self._dirty:  # sync each engine that changed, admit up to max_seqs, schedule its next event
                now, admitted = self.now, 0
                for e in sorted(self._dirty):
                    n = n_run[e]
                    clock[e] += (now - synced[e]) / it[n]
                    synced[e] = now
                    c, q, heap = clock[e], queues[e], running[e]
                    if n < cap:
                        slots = free[e]
                        while n < cap:
                            if not q and not (feeder is not None and feeder(e)):
                                break
                            s = q.popleft()
                            finish = c + seq_len[s] - seq_base[s]
                            heappush(heap, (finish, heappop(slots), s))
                            where[s] = (e, finish)
                            n += 1
                            admitted += 1
                        n_run[e] = n
                    version[e] += 1
                    if heap:
                        heappush(events, (now + (heap[0][0] - c) * it[n], e, version[e]))
                self._total += admitted
                self._dirty = set()
            if not self._total:
                return None
            while events[0][2] != version[events[0][1]]:
                heappop(events)
            t = events[0][0]
            limit = t + slack
            engines = []
            while events and events[0][0] <= limit:
                _, e, v = heappop(events)
                if v == version[e]:
                    engines.append(e)
            self.now = t
            finished = []
            for e in sorted(engines) if len(engines) > 1 else engines:
                clock[e] += (t - synced[e]) / it[n_run[e]]
                synced[e] = t
                c, heap, before = clock[e], running[e], len(finished)
                while heap and heap[0][0] - c <= eps:
                    _, slot, s = heappop(heap)
                    finished.append((e, slot, s))
                if len(finished) > before:
                    self._dirty.add(e)  # refilled and rescheduled at the next event
                else:  # within the slack but not yet done: its own time again
                    version[e] += 1
                    heappush(events, (t + (heap[0][0] - c) * it[n_run[e]], e, version[e]))
            if len(finished) > 1:
                finished.sort()  # slot order within an engine, engines in order
            completed = []
            for e, slot, s in finished:
                heappush(free[e], slot)
                del where[s]
                n_run[e] -= 1
                seq_done[s] = True
                g = seq_group[s]
                group_left[g] -= 1
                if group_left[g] == 0:
                    completed.append(g)
            self._total -= len(finished)
            if completed or not until_group:
                return completed


@dataclass(frozen=True)
class Recipe:
    """The step's shape: groups to keep, responses per group, generation batch, batch limit."""

    prompts_per_step: int
    group_size: int
    gen_batch_prompts: int
    max_gen_batches: int


@dataclass
class StepResult:
    """What one simulated step took and generated (tokens by the fate of their group)."""

    wall_s: float = 0.0
    groups_kept: int = 0
    prompts_drawn: int = 0
    gen_batches: int = 0
    kept: float = 0.0
    rejected: float = 0.0
    surplus: float = 0.0
    aborted: float = 0.0
    carried_in: float = 0.0
    carried_out: float = 0.0
    usable_seen: int = 0
    """Usable groups among those completed (kept or surplus)."""
    groups_done: int = 0
    """Groups completed (scored)."""
    kept_stale: float = 0.0
    """Tokens of kept groups generated in earlier steps (by an older policy: partial rollouts)."""
    kept_lengths: list[float] = field(default_factory=list)
    """Mean response length of each kept group (to see which groups a policy favours)."""

    @property
    def generated(self) -> float:
        """Tokens generated during this step."""
        return self.kept + self.rejected + self.surplus + self.aborted + self.carried_out - self.carried_in


def adaptive_round(missing: int, usable_estimate: float, margin: float, cap: int) -> int:
    """Prompts for a round that should yield ``missing`` usable groups: missing / usable fraction x margin, capped."""
    return max(1, min(cap, math.ceil(missing / max(usable_estimate, 1e-9) * margin - 1e-9)))  # 220.00000000000003 is 220


def spread(sim: EngineSim, lengths: np.ndarray) -> None:
    """Queue a batch of groups over the engines as ``rollout.scheduling.gather.plan_shares`` splits it.

    With at least as many groups as engines, group i goes whole to engine i mod N; with fewer, the engines
    g = p, p + k, ... share group p's responses (engine g takes responses g // k, g // k + helpers, ...).
    """
    k, engines = len(lengths), sim.model.engines
    if k >= engines:
        for i in range(k):
            sim.add_group(i % engines, lengths[i])
        return
    for g in range(engines):
        p = g % k
        part = lengths[p][g // k::len(range(p, engines, k))]
        if len(part):
            sim.add_group(g, part)


def batch_and_filter_step(pool: PromptPool, recipe: Recipe, model: EngineModel,
                          adaptive: tuple[float, float, int] | None = None, chunk: int = 0) -> StepResult:
    """Today's dynamic sampling: whole generation batches, each waiting for its longest response.

    ``adaptive=(usable_estimate, margin, cap)`` sizes each round with :func:`adaptive_round` (adaptive over-sampling)
    instead of ``gen_batch_prompts``; the estimate is the caller's (e.g. the previous step's usable fraction).
    ``chunk > 0``: the trainer's streaming switch with several engine groups (no stream, so chunks): each round is
    generated ``chunk`` prompts at a time over all engines, each chunk waiting for its longest response, and the
    step stops after the chunk that fills it.
    """
    sim, res = EngineSim(model), StepResult()
    while res.groups_kept < recipe.prompts_per_step and res.gen_batches < recipe.max_gen_batches:
        size = recipe.gen_batch_prompts
        if adaptive is not None:
            size = adaptive_round(recipe.prompts_per_step - res.groups_kept, *adaptive)
        res.gen_batches += 1
        drawn = 0
        while drawn < size and res.groups_kept < recipe.prompts_per_step:
            lengths, usable = pool.take(min(size - drawn, chunk or size))
            drawn += len(usable)
            spread(sim, lengths)
            while sim.advance(until_group=True) is not None:
                pass
            _decide_batch(res, lengths, usable, recipe)
    res.wall_s = sim.now
    return res


def draw_batch_and_filter(pool: PromptPool, recipe: Recipe, chunk: int = 0) -> None:
    """Draw from ``pool`` exactly what :func:`batch_and_filter_step` (without ``adaptive``) draws, without simulating
    the engines: its rounds end on the usable flags alone, never on timing (a warm-up step whose result is not used)."""
    kept = batches = 0
    while kept < recipe.prompts_per_step and batches < recipe.max_gen_batches:
        batches += 1
        drawn = 0
        while drawn < recipe.gen_batch_prompts and kept < recipe.prompts_per_step:
            _, usable = pool.take(min(recipe.gen_batch_prompts - drawn, chunk or recipe.gen_batch_prompts))
            drawn += len(usable)
            kept = min(recipe.prompts_per_step, kept + int(usable.sum()))


def _decide_batch(res: StepResult, lengths: np.ndarray, usable: np.ndarray, recipe: Recipe) -> None:
    """Count a generated batch's groups in batch order: kept until the step is full, then surplus; or rejected."""
    res.prompts_drawn += len(usable)
    res.usable_seen += int(usable.sum())
    res.groups_done += len(usable)
    for i in range(len(usable)):
        tok = float(lengths[i].sum())
        if not usable[i]:
            res.rejected += tok
        elif res.groups_kept < recipe.prompts_per_step:
            res.groups_kept += 1
            res.kept += tok
            res.kept_lengths.append(tok / recipe.group_size)
        else:
            res.surplus += tok


@dataclass
class Carried:
    """An aborted group kept for the next step (partial rollouts)."""

    lengths: np.ndarray
    usable: bool
    progress: np.ndarray
    staleness: int


def _score(res: StepResult, sim: EngineSim, usable: bool, gid: int, recipe: Recipe) -> None:
    """Count a completed group as kept, rejected or surplus."""
    tok = float(sum(sim.seq_len[s] for s in sim.group_seqs[gid]))
    res.usable_seen += int(usable)
    res.groups_done += 1
    if not usable:
        res.rejected += tok
    elif res.groups_kept < recipe.prompts_per_step:
        res.groups_kept += 1
        res.kept += tok
        res.kept_stale += float(sum(sim.seq_base[s] for s in sim.group_seqs[gid]))
        res.kept_lengths.append(tok / recipe.group_size)
    else:
        res.surplus += tok


def _abort(res: StepResult, sim: EngineSim, groups: list[tuple[int, bool, int]], partial: bool,
           max_staleness: int) -> list[Carried]:
    """Abort the in-flight ``(gid, usable, staleness)`` groups: carry them (partial rollouts) or count them aborted."""
    carry = []
    for g, usable, staleness in groups:
        prog = sim.progress(g)
        if partial and staleness < max_staleness:
            lengths = np.array([sim.seq_len[s] for s in sim.group_seqs[g]])
            carry.append(Carried(lengths, usable, prog, staleness + 1 if prog.sum() > 0 else 0))
            res.carried_out += float(prog.sum())
        else:
            res.aborted += float(prog.sum())
    return carry


def streaming_step(pool: PromptPool, recipe: Recipe, model: EngineModel, carry: list[Carried], partial: bool,
                   max_staleness: int = 1, admit: tuple[float, float, int] | None = None, order: str = "completion",
                   chunk: int = 0) -> tuple[StepResult, list[Carried]]:
    """Streaming dynamic sampling with abort; with ``partial`` the aborted groups carry over. Returns the new carry.

    ``admit=(usable_estimate, margin, cap)`` bounds the fresh prompts (adaptive over-sampling of a stream): enough
    for the missing groups by :func:`adaptive_round`, counting in-flight groups at the estimate, topped up whenever
    that expectation falls below the target; without it the engines pull prompts until the step is full.
    ``order``: ``completion`` decides each group as it finishes; ``prompt`` decides groups in admission (prompt)
    order, each once every earlier one has finished, as the trainer's scheduler does (its kept batch is a pure
    function of seed and data): the step is full when the first ``prompts_per_step`` usable groups in prompt order
    and every group before them have finished; groups that finished out of order are then surplus or rejected.
    ``chunk > 0``: streaming over engine groups as ``rollout/scheduling/engine_groups.py`` does it: fresh prompts come
    in chunks of at most ``chunk`` (never across a round of ``gen_batch_prompts``), prompt i of a chunk queued on
    engine i mod N (round robin, no pulling by a free engine), and the next chunk starts once this one has drained;
    carried groups are resumed first, round robin, as a chunk of their own. Without it a free engine pulls the next
    prompt.
    """
    if order not in ("completion", "prompt"):
        raise ValueError(f"order={order!r}; use completion or prompt")
    if chunk:
        return _chunked_stream(pool, recipe, model, carry, partial, max_staleness, order, chunk)
    sim, res = EngineSim(model), StepResult()
    meta: dict[int, tuple[bool, int]] = {}  # gid -> (usable, staleness)
    stream = deque(carry)
    res.carried_in = float(sum(c.progress.sum() for c in carry))
    need = recipe.prompts_per_step
    budget = recipe.max_gen_batches * recipe.gen_batch_prompts
    if admit is not None:
        budget = min(budget, adaptive_round(max(need - len(carry) * admit[0], 1), *admit))

    def feed(engine: int) -> bool:
        if stream:
            c = stream.popleft()
            meta[sim.add_group(engine, c.lengths, c.progress)] = (c.usable, c.staleness)
            return True
        if res.prompts_drawn >= budget:
            return False
        lengths, usable = pool.take(1)
        res.prompts_drawn += 1
        meta[sim.add_group(engine, lengths[0])] = (bool(usable[0]), 0)
        return True

    sim.feeder = feed
    done: set[int] = set()
    finished: set[int] = set()  # prompt order: finished, maybe not yet decided
    head = 0  # prompt order: the next group to decide (group ids are admission order)
    while res.groups_kept < need:
        completed = sim.advance(until_group=True)
        if completed is None:
            break
        if order == "completion":
            for g in completed:
                done.add(g)
                _score(res, sim, meta[g][0], g, recipe)
        else:
            finished.update(completed)
            while head in finished and res.groups_kept < need:
                done.add(head)
                _score(res, sim, meta[head][0], head, recipe)
                head += 1
        if admit is None or not completed:
            continue
        pending = len(meta) - len(done) + len(stream) + budget - res.prompts_drawn
        if res.groups_kept + pending * admit[0] < need:  # bad luck: admit more, sized the same way
            budget += adaptive_round(need - res.groups_kept - pending * admit[0], *admit)
            budget = min(budget, recipe.max_gen_batches * recipe.gen_batch_prompts)
            sim.wake()
    for g in sorted(finished - done):  # finished out of prompt order after the step filled: surplus or rejected
        done.add(g)
        _score(res, sim, meta[g][0], g, recipe)
    res.wall_s = sim.now
    res.gen_batches = math.ceil(res.prompts_drawn / recipe.gen_batch_prompts)
    new_carry = list(stream)  # carried groups this step never reached keep their tokens and age
    res.carried_out = float(sum(c.progress.sum() for c in new_carry))
    in_flight = [(g, *meta[g]) for g in sorted(set(meta) - done)]
    new_carry += _abort(res, sim, in_flight, partial, max_staleness)
    if not partial:  # on-policy: nothing carries, not even the untouched prompts (they cost nothing)
        new_carry = []
    return res, new_carry


def _chunked_stream(pool: PromptPool, recipe: Recipe, model: EngineModel, carry: list[Carried], partial: bool,
                    max_staleness: int, order: str, chunk: int) -> tuple[StepResult, list[Carried]]:
    """:func:`streaming_step` with ``chunk > 0`` (see there)."""
    sim, res = EngineSim(model), StepResult()
    meta: dict[int, tuple[bool, int]] = {}
    res.carried_in = float(sum(c.progress.sum() for c in carry))
    need, budget = recipe.prompts_per_step, recipe.max_gen_batches * recipe.gen_batch_prompts
    for i, c in enumerate(carry):
        meta[sim.add_group(i % model.engines, c.lengths, c.progress)] = (c.usable, c.staleness)

    def next_chunk() -> bool:
        k = min(chunk, recipe.gen_batch_prompts - res.prompts_drawn % recipe.gen_batch_prompts,
                budget - res.prompts_drawn)
        if k <= 0:
            return False
        lengths, usable = pool.take(k)
        res.prompts_drawn += k
        for i in range(k):
            meta[sim.add_group(i % model.engines, lengths[i])] = (bool(usable[i]), 0)
        return True

    if not carry:
        next_chunk()
    done: set[int] = set()
    finished: set[int] = set()
    head = 0
    while res.groups_kept < need:
        completed = sim.advance(until_group=True)
        if completed is None:
            if next_chunk():
                continue
            break
        for g in completed if order == "completion" else ():
            done.add(g)
            _score(res, sim, meta[g][0], g, recipe)
        finished.update(completed if order == "prompt" else ())
        while head in finished and res.groups_kept < need:
            done.add(head)
            _score(res, sim, meta[head][0], head, recipe)
            head += 1
    for g in sorted(finished - done):
        done.add(g)
        _score(res, sim, meta[g][0], g, recipe)
    res.wall_s = sim.now
    res.gen_batches = math.ceil(res.prompts_drawn / recipe.gen_batch_prompts)
    in_flight = [(g, *meta[g]) for g in sorted(set(meta) - done)]
    new_carry = _abort(res, sim, in_flight, partial, max_staleness)
    return res, new_carry if partial else []
