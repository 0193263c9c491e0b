"""The DAPO training loop, read top to bottom.

    generate -> score -> overlong shaping -> dynamic sampling (refill) -> advantages -> old log-probs
      -> mini-batch updates -> weight sync -> log / eval / checkpoint

Every rank runs this loop. Engine groups split each generation batch and one rank per group shares its responses;
each response is scored on one rank and the verdicts are shared, so every rank holds the same rollout batch; the
actor splits the work over data-parallel ranks itself. Rank 0 writes metrics, the ledger and the rollout store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dapo_mcore.actor.megatron_actor import TrainSample
from dapo_mcore.algo.advantages import group_advantages
from dapo_mcore.algo.dynamic_sampling import DynamicSamplingExhausted, Group, SamplingStats
from dapo_mcore.algo.metrics import average_updates
from dapo_mcore.algo.overlong import overlong_penalty
from dapo_mcore.config import Config
from dapo_mcore.data.records import PromptRecord
from dapo_mcore.rollout.gather import apply_once, broadcast_shares, merge_shares, plan_shares
from dapo_mcore.rollout.partial import Buffered, join, stale_response
from dapo_mcore.rollout.protocol import EngineError, Response, SamplingParams
from dapo_mcore.runtime import Components, build_components, prepare_run_dir, read_config
from dapo_mcore.telemetry import keys

log = logging.getLogger(__name__)

EXIT_REQUEUE = 75      # EX_TEMPFAIL: checkpointed on a signal; Slurm requeues and the run resumes
EXIT_INTERRUPTED = 130


@dataclass
class GroupData:
    """One prompt's G rollouts and their scores (the payload of a dynamic-sampling Group)."""

    record: PromptRecord
    prompt_ids: list[int]
    responses: list[Response]
    scores: list[float]
    acc: list[bool]
    rewards: list[float]
    gen_batch: int
    preds: list[str | None] = field(default_factory=list)
    kept: bool = False

    def joined(self, rest: GroupData) -> GroupData:
        """This group's responses followed by ``rest``'s (a staged group's first stage and its completion)."""
        return dataclasses.replace(self, responses=self.responses + rest.responses, scores=self.scores + rest.scores,
                                   acc=self.acc + rest.acc, rewards=self.rewards + rest.rewards,
                                   preds=self.preds + rest.preds)


class _Signals:
    """Stop requests, honoured at the end of the current step (checkpoint, then exit).

    SIGUSR1/SIGTERM (Slurm's pre-emption warning, scancel) ask for a requeue: exit 75. The first SIGINT (Ctrl-C)
    does the same but exits 130; a second SIGINT abandons the step at once (KeyboardInterrupt), keeping the last
    checkpoint. ``restore()`` puts the previous handlers back.
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self._interrupts = 0
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
        self.requested = self.requested or name
        if signum == signal.SIGINT:
            log.warning("SIGINT received: will checkpoint after this step and exit %d (Ctrl-C again to abandon the "
                        "step at once)", self.exit_code)
        else:
            log.warning("%s received: will checkpoint after this step and exit %d", name, self.exit_code)

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.requested == "SIGINT" else EXIT_REQUEUE

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _Preempted(Exception):
    """A stop signal arrived while dynamic sampling was still refilling: the step is abandoned."""


class Trainer:
    """Owns the components of a run and steps through the DAPO loop."""

    def __init__(self, cfg: Config, parts: Components):
        self.cfg, self.p = cfg, parts
        self.step = 0
        self.signals: _Signals | None = None

    # ---- one generation batch: generate, score, shape ---------------------------------------------------
    def _sampling(self, eval_mode: bool = False, seed: int = 0) -> SamplingParams:
        r, e = self.cfg.rollout, self.cfg.eval
        return SamplingParams(
            n=e.k if eval_mode else r.n, temperature=e.temperature if eval_mode else r.temperature,
            top_p=e.top_p if eval_mode else r.top_p, top_k=r.top_k,
            max_new_tokens=(e.max_new_tokens or r.max_new_tokens) if eval_mode else r.max_new_tokens,
            seed=seed, logprobs="none" if eval_mode else "processed")

    def _generate_and_score(self, records: list[PromptRecord], params: SamplingParams, gen_batch: int,
                            timed: bool = True) -> list[GroupData]:
        """Generate and score; ``timed=False`` inside evaluation, whose time is its own phase."""
        p = self.p

        def phase(name: str):
            return p.timer.phase(name) if timed else contextlib.nullcontext()

        prompt_ids = [p.encode_prompt(rec) for rec in records]
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
        """Streamed generation (one engine group): each group is scored as soon as it finishes."""
        prompt_ids = [self.p.encode_prompt(rec) for rec in records]
        engine_stream = self.p.engine.stream(prompt_ids, params)

        def scored() -> Iterator[tuple[int, Group]]:
            with self.p.timer.phase("generate"):
                for i, responses in engine_stream:
                    yield i, _group(self._scored_groups([records[i]], [prompt_ids[i]], [responses], gen_batch)[0])

        return _Stream(scored(), engine_stream.abort, getattr(engine_stream, "partials", None))

    def _resume_and_score(self, buffered: list[Buffered], params: SamplingParams, gen_batch: int) -> list[GroupData]:
        """Partial rollouts: continue the unfinished responses of the groups the last step aborted (one engine
        group, as streaming), then score the whole groups."""
        records = [self.p.sampler.records[b.index] for b in buffered]
        prompt_ids = [self.p.encode_prompt(rec) for rec in records]
        todo = [(gi, ri) for gi, b in enumerate(buffered) for ri, done in enumerate(b.group.done) if not done]
        tails = []
        if todo:  # groups that ended in the step that filled the batch need no engine call
            with self.p.timer.phase("generate"):
                tails = self.p.engine.resume([prompt_ids[gi] for gi, _ in todo],
                                             [buffered[gi].group.responses[ri].token_ids for gi, ri in todo], params)
        outputs = [[stale_response(r) for r in b.group.responses] for b in buffered]
        for (gi, ri), tail in zip(todo, tails, strict=True):
            outputs[gi][ri] = join(buffered[gi].group.responses[ri], tail)
        with self.p.timer.phase("reward"):
            return self._scored_groups(records, prompt_ids, outputs, gen_batch)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Response]]:
        """Each engine group generates its share (``rollout.gather.plan_shares``); every rank gets all the results.

        An engine group is one rank for the transformers engine and the ranks of one vLLM tensor-parallel group for
        vLLM (they see the same share, and only the group's leader sends it). Every group calls the engine on every
        generation batch, even with fewer samples than groups, because vLLM's data-parallel engines step together.
        Each share has its own seed, derived from the batch seed.
        """
        groups, me = self.p.gen_groups, self.p.gen_group_index
        if groups == 1:
            return self.p.engine.generate(prompts, params)
        if not prompts:
            return []
        share = plan_shares(len(prompts), params.n, groups)[me]
        seed = (params.seed or 0) + 1_000_003 * me
        if share.idle:  # a one-token placeholder keeps this group's engine in step with the others
            self.p.engine.generate([prompts[0]], dataclasses.replace(params, n=1, max_new_tokens=1, seed=seed))
            local: list[list[Response]] = []
        else:
            local = self.p.engine.generate([prompts[i] for i in share.indices],
                                           dataclasses.replace(params, n=share.n, seed=seed))
        shares = broadcast_shares(share.indices, local, sender=self.p.gen_group_leader)
        return merge_shares(shares, len(prompts), params.n)

    def _score(self, records: list[PromptRecord], outputs: list[list[Response]]) -> list[Any]:
        """Decode and verify every response once over all ranks (each rank its strided share) and share the
        verdicts: ranks cannot disagree on one (a worker timeout, a custom reward) and then hold different batches."""
        p = self.p
        items = [(r.token_ids, rec.ground_truth) for rec, group in zip(records, outputs, strict=True) for r in group]

        def verify(share: list[tuple[list[int], str]]) -> list[Any]:
            texts = [p.tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in share]
            return p.score(texts, [truth for _, truth in share])

        return apply_once(verify, items)

    def _shape_rewards(self, scores: list[float], responses: list[Response]) -> list[float]:
        a = self.cfg.algo
        if not a.overlong_shaping:
            return list(scores)
        lengths = torch.tensor([r.length for r in responses])
        penalty = overlong_penalty(lengths, a.overlong_max_len, a.overlong_cache_len, a.overlong_penalty_factor)
        return [s + float(pen) for s, pen in zip(scores, penalty, strict=True)]

    # ---- phases of a step --------------------------------------------------------------------------------
    def collect(self) -> tuple[list[GroupData], list[GroupData], SamplingStats]:
        """generate -> score -> shape, until the batch holds enough usable groups (the scheduler decides which
        prompts to generate and when the step is full: ``rollout.scheduler``)."""

        def params(n: int, slot: int) -> SamplingParams:
            # A pre-emption signal is honoured between generation calls too: one step can draw many batches.
            if slot > 0 and self.p.any_rank(self.signals.requested is not None):
                raise _Preempted()
            return dataclasses.replace(self._sampling(seed=_seed(self.cfg.train.seed, self.step, slot)), n=n)

        def generate(records: list[PromptRecord], n: int, slot: int) -> list[Group]:
            return [_group(g) for g in self._generate_and_score(records, params(n, slot), slot)]

        def stream(records: list[PromptRecord], n: int, slot: int) -> _Stream:
            return self._stream_and_score(records, params(n, slot), slot)

        def resume(buffered: list[Buffered], slot: int) -> list[Group]:
            return [_group(g) for g in self._resume_and_score(buffered, params(1, slot), slot)]

        streams = self.p.engine_streams
        with self._engine_awake():
            kept, generated, stats = self.p.scheduler.collect(generate, GroupData.joined, self.step,
                                                              stream if streams else None, resume if streams else None)
        return [g.payload for g in kept], [g.payload for g in generated], stats

    @contextlib.contextmanager
    def _engine_awake(self) -> Iterator[None]:
        """Colocated phases: the actor's grads and optimizer state leave the GPU (if configured) while the
        engine holds its KV cache; everything returns before training."""
        if not self.p.engine.weights_valid:
            # vLLM sleep level 2 discards the weights (e.g. an evaluation's sleep after the step's sync): resync
            # first. Every rank's engine follows the same states, so all ranks take this collective together.
            self.sync_weights()
        self.p.actor.offload()
        self.p.engine.wake()
        try:
            yield
        finally:
            self.p.engine.sleep()
            self.p.actor.reload()

    def make_samples(self, groups: list[GroupData]) -> list[TrainSample]:
        """Group-normalized advantages broadcast to every token of each response (+ the overlong filter mask)."""
        a = self.cfg.algo
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        adv = group_advantages(rewards, norm_by_std=a.norm_adv_by_std, eps=a.adv_eps)
        samples = []
        for gi, g in enumerate(groups):
            for ri, resp in enumerate(g.responses):
                mask = torch.ones(resp.length)
                if a.overlong_filter and resp.finish_reason == "length":
                    mask = torch.zeros(resp.length)
                samples.append(TrainSample(g.prompt_ids, list(resp.token_ids), float(adv[gi, ri]), loss_mask=mask,
                                           extra={"engine_logp": torch.tensor(resp.logprobs, dtype=torch.float32),
                                                  "stale_tokens": resp.stale_tokens}))
        return samples

    def old_logprobs(self, samples: list[TrainSample]) -> dict[str, float]:
        """The actor's log-probs of the rollout tokens, compared with what the engine reported: ``mismatch/*`` over
        the tokens the current policy sampled, ``partial/*`` over those an older one did (partial rollouts: the
        policy's drift over a step plus the engine mismatch)."""
        from dapo_mcore.rollout.mismatch import MismatchStats, mismatch_metrics, tis_weights

        logps, _ = self.p.actor.compute_logprobs(samples)
        actor_lp, engine_lp = [], []
        for s, lp in zip(samples, logps, strict=True):
            s.old_logprobs = lp
            if self.cfg.algo.tis_cap is not None:
                s.tis_weights = tis_weights(lp, s.extra["engine_logp"], self.cfg.algo.tis_cap)
            actor_lp.append(lp)
            engine_lp.append(s.extra["engine_logp"])
        flat_a, flat_e = torch.cat(actor_lp).unsqueeze(0), torch.cat(engine_lp).unsqueeze(0)
        stale = torch.cat([torch.arange(len(lp)) < s.extra.get("stale_tokens", 0) for s, lp in zip(samples, actor_lp,
                                                                                            strict=True)]).unsqueeze(0)
        out = mismatch_metrics(flat_e, flat_a, ~stale, self.cfg.algo.tis_cap)
        if bool(stale.any()):
            out.update(MismatchStats.from_tensors(flat_e, flat_a, stale, self.cfg.algo.tis_cap).metrics("partial/"))
        return out

    def train(self, groups: list[GroupData], samples: list[TrainSample]) -> dict[str, float]:
        """Mini-batch updates: prompts_per_step / mini_batch_prompts optimizer steps per epoch."""
        t, n = self.cfg.train, self.cfg.rollout.n
        lr = self.lr_at(self.step)
        per_update: list[dict[str, float]] = []
        for _ in range(t.epochs):
            for start in range(0, len(groups), t.mini_batch_prompts):
                mini = samples[start * n:(start + t.mini_batch_prompts) * n]
                per_update.append(self.p.actor.train_mini_batch(mini, lr))
        out = average_updates(per_update)  # a skipped (all-masked) mini-batch does not pull averages toward 0
        out["lr"] = lr
        return out

    def lr_at(self, step: int) -> float:
        o = self.cfg.optim
        return o.lr if o.warmup_steps == 0 else o.lr * min(1.0, (step + 1) / o.warmup_steps)

    def sync_weights(self) -> None:
        self.p.engine.update_weights(self.p.actor.export_hf_weights())

    # ---- evaluation ----------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        from dapo_mcore.evaluation import summarize

        records = self.p.eval_records
        params = self._sampling(eval_mode=True, seed=_seed(self.cfg.train.seed + 7919, self.step, 0))
        with self._engine_awake():
            groups = self._generate_and_score(records, params, 0, timed=False)
        truth_norm = [self.p.normalize(g.record.ground_truth) for g in groups]
        result = summarize([g.acc for g in groups], [g.preds for g in groups],
                           [[p is not None and p == t for p in g.preds] for g, t in zip(groups, truth_norm, strict=True)],
                           [[r.length for r in g.responses] for g in groups])
        return result.as_metrics()

    # ---- the loop ------------------------------------------------------------------------------------------
    def run_step(self) -> tuple[dict[str, Any], list[GroupData]]:
        """One DAPO step; returns its metrics and every group generated (kept or rejected)."""
        p = self.p
        groups, generated, stats = self.collect()
        samples = self.make_samples(groups)
        with p.timer.phase("old_logprobs"):
            mismatch = self.old_logprobs(samples)
        with p.timer.phase("train"):
            train_metrics = self.train(groups, samples)
        with p.timer.phase("sync_weights"):
            self.sync_weights()
        kept = {id(g) for g in groups}
        for g in generated:
            g.kept = id(g) in kept
        metrics = self._step_metrics(groups, generated, stats, samples, train_metrics, mismatch)
        from dapo_mcore.telemetry.perf import StepWork

        work = StepWork.of(self.p.actor.s.hf_config, [len(s.prompt_ids) + len(s.response_ids) for s in samples],
                           self.cfg.train.epochs)
        metrics["train/tokens"] = float(work.train_tokens)
        self.p.step_work = work
        return metrics, generated

    def _step_metrics(self, groups, generated, stats, samples, tm, mismatch) -> dict[str, Any]:
        from dapo_mcore.algo.metrics import response_length_stats

        kept_resp = [r for g in groups for r in g.responses]
        lengths = torch.tensor([r.length for r in kept_resp], dtype=torch.float32)
        truncated = torch.tensor([r.finish_reason == "length" for r in kept_resp])
        all_acc = [a for g in generated for a in g.acc]
        adv = torch.tensor([s.advantage for s in samples])
        m: dict[str, Any] = {
            keys.TRAIN_LOSS: tm.get("loss", math.nan), keys.TRAIN_GRAD_NORM: tm.get("grad_norm", math.nan),
            keys.TRAIN_LR: tm["lr"], keys.TRAIN_CLIPFRAC: tm.get("clipfrac", 0.0),
            keys.TRAIN_CLIPFRAC_LOW: tm.get("clipfrac_low", 0.0), keys.TRAIN_CLIPFRAC_HIGH: tm.get("clipfrac_high", 0.0),
            keys.TRAIN_DUAL_CLIPFRAC: tm.get("dual_clipfrac", 0.0), keys.TRAIN_PPO_KL: tm.get("ppo_kl", 0.0),
            keys.TRAIN_ENTROPY: tm.get("entropy", 0.0), "train/updates": tm["updates"],
            "train/skipped_updates": tm["skipped_updates"],
            keys.ROLLOUT_REWARD_MEAN: sum(r for g in generated for r in g.rewards) / max(len(all_acc), 1),
            keys.ROLLOUT_ACC_MEAN: sum(all_acc) / max(len(all_acc), 1),
            # Mixed-outcome groups among everything generated, whether or not dynamic sampling filters on it.
            keys.ROLLOUT_USABLE_GROUP_FRAC: sum(0 < sum(g.acc) < len(g.acc) for g in generated) / len(generated),
            keys.ROLLOUT_GEN_BATCHES: stats.gen_batches,
            keys.ROLLOUT_ADV_MEAN: float(adv.mean()), keys.ROLLOUT_ADV_STD: float(adv.std()) if adv.numel() > 1 else 0.0,
            "rollout/kept_acc_mean": sum(a for g in groups for a in g.acc) / max(len(kept_resp), 1),
        }
        lens = response_length_stats(lengths, truncated, prefix="")
        m.update({keys.ROLLOUT_RESP_LEN_MEAN: lens["mean"], keys.ROLLOUT_RESP_LEN_MAX: lens["max"],
                  keys.ROLLOUT_RESP_LEN_MIN: lens["min"], keys.ROLLOUT_TRUNCATED_FRAC: lens["truncated_frac"]})
        renamed = {"mismatch/mean_abs_diff": keys.MISMATCH_LOGP_ABS_DIFF_MEAN,
                   "mismatch/max_abs_diff": keys.MISMATCH_LOGP_ABS_DIFF_MAX, "mismatch/kl_k1": keys.MISMATCH_KL}
        m.update({renamed.get(k, k): v for k, v in mismatch.items()})
        m.update(stats.as_metrics())
        return m

    def run(self) -> int:
        p, cfg = self.p, self.cfg
        signals = self.signals = _Signals()
        self.step = p.start_step
        if self.step >= cfg.train.steps:
            log.info("run already finished %d steps; nothing to do", self.step)
        try:
            if self.step == 0 and cfg.eval.at_start and cfg.train.steps > 0:
                with p.timer.phase("eval"):
                    base = self.evaluate()
                p.timer.pop_step()
                p.log_base_eval(base)
            while self.step < cfg.train.steps:
                sampler_at_start = p.sampler.state_dict()
                schedule_at_start = p.scheduler.snapshot() if p.scheduler is not None else None
                p.profile_window(self.step + 1, starting=True)
                try:
                    with p.timer.phase("step"):
                        metrics, generated = self.run_step()
                        self.step += 1
                        if (cfg.eval.every and self.step % cfg.eval.every == 0) or self.step == cfg.train.steps:
                            with p.timer.phase("eval"):
                                metrics.update(self.evaluate())
                except _Preempted:
                    p.timer.pop_step()
                    p.sampler.load_state_dict(sampler_at_start)  # the abandoned step's prompts come again
                    if schedule_at_start is not None:  # and its partial groups (rollout.schedule.partial)
                        p.scheduler.rollback(schedule_at_start)
                    p.save(self.step)
                    log.warning("stop signal during generation of step %d: step abandoned, checkpointed at step %d; "
                                "exiting %d", self.step + 1, self.step, signals.exit_code)
                    return signals.exit_code
                # The step is recorded (metrics, ledger, rollouts) before its checkpoint, so the checkpoint's
                # ledger includes it; checkpoint seconds (and their wall time) are accounted to the next step.
                p.log_step(self.step, metrics, generated)
                p.profile_window(self.step, starting=False)
                stop = p.any_rank(signals.requested is not None)  # every rank must take the same branch
                if stop or self.step == cfg.train.steps or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                    with p.timer.phase("step"), p.timer.phase("checkpoint"):
                        p.save(self.step)
                if stop:
                    log.warning("checkpointed at step %d after %s; exiting %d (resume with the same command)", self.step,
                                signals.requested or "a signal on another rank", signals.exit_code)
                    return signals.exit_code
        except KeyboardInterrupt:
            log.error("interrupted during step %d: the step was abandoned; the last good checkpoint is kept "
                      "(resume with the same command)", self.step + 1)
            return EXIT_INTERRUPTED
        except DynamicSamplingExhausted as exc:
            log.error("%s", exc)
            return 1
        except EngineError as exc:
            log.error("the rollout engine failed during step %d: %s. The step was abandoned; the last checkpoint "
                      "in %s/checkpoints is intact and the run resumes from it.", self.step + 1, exc, cfg.run.dir)
            return 1
        finally:
            signals.restore()
            p.close()
        return 0


def _group(g: GroupData) -> Group:
    return Group(acc=g.acc, payload=g, response_lengths=[r.length for r in g.responses],
                 stale_tokens=sum(r.stale_tokens for r in g.responses))


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


def _seed(base: int, step: int, batch: int) -> int:
    """A distinct, reproducible seed per (run seed, step, generation batch)."""
    return (base * 1_000_003 + step * 10_007 + batch) % (2**62)


def _cpu_threads() -> None:
    """One intra-op thread per process on CPU unless OMP_NUM_THREADS says otherwise: the tiny default's
    kernels are too small to split, and two ranks on two cores with two threads each spin against each other."""
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def train_main(config_path: str, overrides: list[str]) -> int:
    """``dapo-mcore train``: validate, prepare the run directory, build everything, run the loop."""
    _cpu_threads()
    cfg, launch = read_config(config_path, overrides)
    prepare_run_dir(cfg, launch)
    parts = build_components(cfg, launch)
    return Trainer(cfg, parts).run()


def eval_main(config_path: str, overrides: list[str], checkpoint: str | None) -> int:
    """``dapo-mcore eval``: held-out avg@k / pass@k / maj@k of a checkpoint (or the base model)."""
    _cpu_threads()
    cfg, launch = read_config(config_path, overrides)
    parts = build_components(cfg, launch, resume=False, checkpoint=checkpoint, for_eval=True)
    trainer = Trainer(cfg, parts)
    try:
        metrics = trainer.evaluate()
    finally:
        parts.close()
    if launch.rank == 0:
        for k, v in metrics.items():
            sys.stdout.write(f"{k}: {v:.4f}\n")
    return 0


__all__ = ["Trainer", "train_main", "eval_main", "EXIT_REQUEUE"]
