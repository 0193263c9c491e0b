"""The DAPO training loop, read top to bottom.

    batch (rollout side: generate -> score -> overlong shaping -> dynamic sampling) -> advantages -> old log-probs
      -> mini-batch updates -> publish weights -> log / eval / checkpoint

The rollout side is one component behind ``rollout.pipeline.source.RolloutSource``: the trainer asks it for a step's
batch and hands it the new weights; how the batch is produced (engine groups, streaming, staged groups, partial
rollouts) is its business. Every rank runs this loop and holds the same batch; the actor splits the work over
data-parallel ranks itself. Rank 0 writes metrics, the ledger and the rollout store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import torch

from dapo_mcore.actor.megatron_actor import TrainSample
from dapo_mcore.algo.advantages import group_advantages
from dapo_mcore.algo.dynamic_sampling import DynamicSamplingExhausted
from dapo_mcore.algo.metrics import average_updates
from dapo_mcore.config import Config, ConfigError
from dapo_mcore.errors import UserError
from dapo_mcore.rollout.pipeline.source import RolloutInterrupted, StepBatch
from dapo_mcore.rollout.protocol import EngineError
from dapo_mcore.rollout.scheduling.groups import GroupData
from dapo_mcore.run.components import Components
from dapo_mcore.run.directory import prepare_run_dir
from dapo_mcore.run.runtime import build_components, read_config
from dapo_mcore.signals import faults
from dapo_mcore.telemetry import keys, staleness
from dapo_mcore.telemetry.evaluation import eval_after

log = logging.getLogger(__name__)

EXIT_REQUEUE = 75      # EX_TEMPFAIL: checkpointed on a signal; Slurm requeues and the run resumes
EXIT_INTERRUPTED = 130


class _Signals:
    """Stop requests, honoured at the end of the current step (checkpoint, then exit).

    SIGUSR1/SIGTERM/SIGHUP (Slurm's pre-emption warning, scancel, a closed terminal) ask for a requeue: exit 75. The first SIGINT (Ctrl-C)
    does the same but exits 130; a second SIGINT abandons the step at once (KeyboardInterrupt), keeping the last
    checkpoint. ``restore()`` puts the previous handlers back.
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self.last_step = False
        """The trainer is in the run's last step: a stop then finishes the run (exit 0), not a requeue."""
        self._interrupts = 0
        self._previous = {sig: signal.signal(sig, self._handle)
                          for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
        from dapo_mcore.signals import startup

        startup.disarm()  # start-up is over (dapo_mcore.signals.startup): a Ctrl-C now checkpoints after the step
        if startup.recorded() is not None:  # it came as the async run started, before this handler
            self._handle(startup.recorded(), None)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
        self.requested = self.requested or name
        code = 0 if self.last_step else self.exit_code  # what stop_exit will return (the last step: the run is done)
        ending = " (the run's last step: it finishes)" if self.last_step else ""
        if signum == signal.SIGINT:
            log.warning("SIGINT received: will checkpoint after this step%s and exit %d (Ctrl-C again to abandon "
                        "the step at once)", ending, code)
        else:
            log.warning("%s received: will checkpoint after this step%s and exit %d", name, ending, code)

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.requested == "SIGINT" else EXIT_REQUEUE

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def stop_exit(self, step: int, steps: int) -> int:
        """The exit code of a stop asked for by the step that just ended: the requeue/interrupt code, or 0 when that
        step was the run's last (a finished run is not requeued; the late signal is said, then ignored)."""
        if step < steps:
            return self.exit_code
        log.warning("%s arrived during the last step: the run finished its %d steps and is checkpointed; exiting 0 "
                    "(nothing to resume)", self.requested or "a stop signal on another rank", steps)
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP):  # the exit code is decided (cli._shield_exit)
            self._previous[sig] = signal.SIG_IGN
        return 0


class Trainer:
    """Owns the components of a run and steps through the DAPO loop."""

    def __init__(self, cfg: Config, parts: Components):
        self.cfg, self.p = cfg, parts
        self.step = 0
        self.signals: _Signals | None = None

    # ---- phases of a step --------------------------------------------------------------------------------
    def collect(self) -> StepBatch:
        """The step's scored, shaped and filtered rollouts, from the rollout side (``rollout.pipeline.source``)."""
        with self._engine_awake():
            return self.p.rollouts.step_batch(self.step, stop=self._stop_requested)

    def _stop_requested(self) -> bool:
        """A stop signal on any rank (a collective: the rollout side polls it at the same points on every rank)."""
        return self.p.any_rank(self.signals is not None and self.signals.requested is not None)

    @contextlib.contextmanager
    def _engine_awake(self) -> Iterator[None]:
        """Colocated phases: the actor's grads and optimizer state leave the GPU (if configured) while the
        engine holds its KV cache; everything returns before training. Async mode: the engines have their own ranks."""
        if not self.p.rollouts.colocated:
            yield
            return
        if not self.p.rollouts.weights_valid:
            # vLLM sleep level 2 discards the weights (e.g. an evaluation's sleep after the step's sync): resync
            # first. Every rank's engine follows the same states, so all ranks take this collective together.
            self.sync_weights()
        self.p.actor.offload()
        self.p.rollouts.wake()
        try:
            yield
        finally:
            self.p.rollouts.sleep()
            self.p.actor.reload()

    def make_samples(self, groups: list[GroupData]) -> list[TrainSample]:
        """Group-normalized advantages broadcast to every token of each response (+ the overlong filter mask)."""
        a = self.cfg.algo
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        adv = group_advantages(rewards, norm_by_std=a.norm_adv_by_std, eps=a.adv_eps,
                               estimator=a.advantage_estimator)
        samples = []
        for gi, g in enumerate(groups):
            for ri, resp in enumerate(g.responses):
                # tool output (multi-turn) is not the model's: it counts in no loss, denominator or metric
                model = (torch.ones(resp.length, dtype=torch.bool) if resp.loss_mask is None
                         else torch.tensor(resp.loss_mask, dtype=torch.bool))
                mask = model.float()
                if a.overlong_filter and resp.finish_reason == "length":
                    mask = torch.zeros(resp.length)
                samples.append(TrainSample(g.prompt_ids, list(resp.token_ids), float(adv[gi, ri]), loss_mask=mask,
                                           extra={"engine_logp": torch.tensor(resp.logprobs, dtype=torch.float32),
                                                  "model_tokens": model,
                                                  "stale_tokens": resp.stale_tokens, "versions": resp.versions,
                                                  "routed_experts": resp.routed_experts}))
        return samples

    def old_logprobs(self, samples: list[TrainSample]) -> dict[str, float]:
        """The actor's log-probs of the rollout tokens, compared with what the engine reported: ``mismatch/*`` over
        the tokens the current policy sampled, ``partial/*`` over those an older one did (partial rollouts: the
        policy's drift over a step plus the engine mismatch)."""
        from dapo_mcore.rollout.correction.mismatch import MismatchStats, apply_correction, mismatch_metrics

        logps, _ = self.p.actor.compute_logprobs(samples)
        actor_lp, engine_lp = [], []
        for s, lp in zip(samples, logps, strict=True):
            s.old_logprobs = lp
            actor_lp.append(lp)
            engine_lp.append(s.extra["engine_logp"])
        corr_metrics = apply_correction(samples, self.cfg.algo.correction)  # weights and rejection per sample
        flat_a, flat_e = torch.cat(actor_lp).unsqueeze(0), torch.cat(engine_lp).unsqueeze(0)
        stale = torch.cat([torch.arange(len(lp)) < s.extra.get("stale_tokens", 0) for s, lp in zip(samples, actor_lp,
                                                                                            strict=True)]).unsqueeze(0)
        model = torch.cat([s.extra.get("model_tokens", torch.ones(len(lp), dtype=torch.bool))  # tool tokens: NaN
                           for s, lp in zip(samples, actor_lp, strict=True)]).unsqueeze(0)
        out = mismatch_metrics(flat_e, flat_a, ~stale & model, self.cfg.algo.tis_cap)
        if bool(stale.any()):
            out.update(MismatchStats.from_tensors(flat_e, flat_a, stale & model, self.cfg.algo.tis_cap
                                                  ).metrics("partial/"))
        if self.p.actor.routing_mismatch is not None:  # MoE: experts used vs the engine's
            out["moe/routing_mismatch_frac"] = self.p.actor.routing_mismatch
        return {**out, **corr_metrics}

    def bypass_old_logprobs(self, samples: list[TrainSample]) -> dict[str, float]:
        """Bypass mode (algo.rollout_correction bypass): no old-log-prob pass, pi_old := the engine's log-probs. The
        correction's weights and rejection use pi_theta inside the loss (the actor), its metrics come with training."""
        for s in samples:
            s.old_logprobs = s.extra["engine_logp"]
        return {"rollout_corr/bypass": 1.0}

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
        self.p.rollouts.publish(self.p.actor.export_hf_weights())

    # ---- evaluation ----------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        with self._engine_awake():
            groups = self.p.rollouts.eval_groups(self.p.eval_records, self.step)
        return self._eval_metrics(groups, self.step)

    def _eval_metrics(self, groups: list[GroupData], version: int) -> dict[str, float]:
        """The held-out scores of an evaluation's groups; async mode labels them with the policy version evaluated
        (an evaluation behind the trainer lands in a later step's line: ``rollout.pipeline.async_source``)."""
        from dapo_mcore.telemetry.evaluation import summarize

        truth_norm = [self.p.normalize(g.record.ground_truth) for g in groups]
        result = summarize([g.acc for g in groups], [g.preds for g in groups],
                           [[p is not None and p == t for p in g.preds] for g, t in zip(groups, truth_norm, strict=True)],
                           [[r.length for r in g.responses] for g in groups])
        labels = {} if self.p.rollouts.colocated else {"eval/policy_version": float(version)}
        return {**result.as_metrics(), **labels}

    def _evaluated_behind(self) -> bool:
        """Async mode: the engines evaluate this step's version while the trainer trains the next step."""
        return not self.p.rollouts.colocated and self.p.rollouts.evaluates_behind(self.step)

    # ---- the loop ------------------------------------------------------------------------------------------
    def run_step(self) -> tuple[dict[str, Any], list[GroupData]]:
        """One DAPO step; returns its metrics and every group generated (kept or rejected)."""
        p = self.p
        batch = self.collect()
        groups, generated, stats = batch.kept, batch.generated, batch.stats
        samples = self.make_samples(groups)
        if self.cfg.algo.correction.bypass:  # the phase is skipped: profile shows it so (rollout_corr/bypass)
            mismatch = self.bypass_old_logprobs(samples)
        else:
            with p.timer.phase("old_logprobs"):
                mismatch = self.old_logprobs(samples)
        with p.timer.phase("train"):
            train_metrics = self.train(groups, samples)
        with p.timer.phase("sync_weights"):
            self.sync_weights()
        metrics = self._step_metrics(groups, generated, stats, samples, train_metrics, mismatch)
        if self.cfg.rollout.tools.enabled:  # calls (the ledger's counters) and calls per response, error rate, acc
            from dapo_mcore.rollout.multiturn.stats import tool_metrics

            metrics.update(batch.tools)
            metrics.update(tool_metrics((g.responses, g.acc) for g in generated))
        if batch.policy_version is not None:
            metrics.update(self._pipeline_metrics(batch, samples))
            late = p.rollouts.late_eval()  # async: an evaluation the engines ran while the trainer trained
            if late is not None:
                metrics.update(self._eval_metrics(late[1], late[0]))
        elif self.cfg.rollout.schedule.partial:  # sync: partial prefixes are one step old, the rest fresh
            metrics.update(staleness.metrics(staleness.histogram(self._lags(samples, self.step)), 1))
        from dapo_mcore.telemetry.perf import StepWork

        work = StepWork.of(self.p.actor.s.hf_config, [len(s.prompt_ids) + len(s.response_ids) for s in samples],
                           self.cfg.train.epochs)
        metrics["train/tokens"] = float(work.train_tokens)
        self.p.step_work = work
        return metrics, generated

    def _lags(self, samples: list[TrainSample], version: int) -> list[tuple[int, int]]:
        """``(lag, tokens)`` runs of the trained tokens: lag = this step's version (steps done) minus the version that
        produced the token (``Response.versions``; ``version`` for a response without them)."""
        pairs = []
        for s in samples:
            runs = s.extra.get("versions") or [(version, len(s.response_ids))]
            assert sum(n for _, n in runs) == len(s.response_ids), (runs, len(s.response_ids))
            pairs += [(self.step - v, n) for v, n in runs]
        return pairs

    def _pipeline_metrics(self, batch: StepBatch, samples: list[TrainSample]) -> dict[str, float]:
        """Async mode: how many policy versions the trained tokens lag (each token's producing version travels with
        it, ``Response.versions``), the groups dropped for lagging too far, and who waited for whom."""
        pairs = self._lags(samples, batch.policy_version)
        lags, counts = [lag for lag, _ in pairs], [n for _, n in pairs]
        tokens = sum(counts)
        lag_max = max((lag for lag, c in zip(lags, counts, strict=True) if c), default=0)
        limit = self.cfg.rollout.pipeline.max_staleness
        assert lag_max <= limit, f"a trained token lags {lag_max} policy versions > max_staleness={limit}"
        seconds = dict(self.p.rollouts.last)
        generation = seconds.get("engine_generate_s", 0.0) + seconds.get("engine_reward_s", 0.0)
        hidden = 0.0 if generation <= 0 else min(1.0, max(0.0, 1.0 - seconds.get("trainer_wait_s", 0.0) / generation))
        return {**staleness.metrics(staleness.histogram(zip(lags, counts, strict=True)), limit),
                "async/lag_mean": sum(lag * c for lag, c in zip(lags, counts, strict=True)) / max(tokens, 1),
                "async/lag_max": float(lag_max), "async/policy_version": float(batch.policy_version),
                "async/overlap_frac": hidden, "async/dropped_stale_groups": float(batch.stats.groups_dropped_stale),
                **{f"async/{k}": float(v) for k, v in seconds.items()}}

    def _step_metrics(self, groups, generated, stats, samples, tm, mismatch) -> dict[str, Any]:
        from dapo_mcore.algo.metrics import response_length_stats

        kept_resp = [r for g in groups for r in g.responses]
        lengths = torch.tensor([r.length for r in kept_resp], dtype=torch.float32)
        truncated = torch.tensor([r.finish_reason == "length" for r in kept_resp])
        all_acc = [a for g in generated for a in g.acc]
        adv = torch.tensor([s.advantage for s in samples])
        m: dict[str, Any] = {
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
        # A step whose updates were all skipped (every token rejected or masked) trained nothing: no loss, not NaN.
        m.update({k: tm[name] for k, name in ((keys.TRAIN_LOSS, "loss"), (keys.TRAIN_GRAD_NORM, "grad_norm"))
                  if name in tm})
        m.update({k: v for k, v in tm.items() if k.startswith(("moe/", "lora/"))})  # MoE router; LoRA update norms
        lens = response_length_stats(lengths, truncated, prefix="")
        m.update({keys.ROLLOUT_RESP_LEN_MEAN: lens["mean"], keys.ROLLOUT_RESP_LEN_MAX: lens["max"],
                  keys.ROLLOUT_RESP_LEN_MIN: lens["min"], keys.ROLLOUT_TRUNCATED_FRAC: lens["truncated_frac"]})
        renamed = {"mismatch/mean_abs_diff": keys.MISMATCH_LOGP_ABS_DIFF_MEAN,
                   "mismatch/max_abs_diff": keys.MISMATCH_LOGP_ABS_DIFF_MAX, "mismatch/kl_k1": keys.MISMATCH_KL}
        m.update({renamed.get(k, k): v for k, v in mismatch.items()})
        m.update({k: v for k, v in tm.items() if k.startswith("rollout_corr/")})  # bypass: measured in training
        m.update(stats.as_metrics())
        return m

    def run(self) -> int:
        p, cfg = self.p, self.cfg
        signals = self.signals = _Signals()
        self.step = p.start_step
        _log_correction(cfg)
        if self.step >= cfg.train.steps:
            log.info("run already finished %d steps; nothing to do", self.step)
        try:
            if self.step == 0 and eval_after(cfg, 0, fresh_start=True):
                with p.timer.phase("eval"):
                    base = self.evaluate()
                p.log_base_eval(base, p.timer.pop_step())
            while self.step < cfg.train.steps:
                rollouts_at_start = p.rollouts.snapshot()
                p.profile_window(self.step + 1, starting=True)
                faults.point("step", self.step + 1)
                signals.last_step = self.step + 1 == cfg.train.steps
                try:
                    with p.timer.phase("step"):
                        metrics, generated = self.run_step()
                        self.step += 1
                        if eval_after(cfg, self.step, fresh_start=False) and not self._evaluated_behind():
                            with p.timer.phase("eval"):
                                metrics.update(self.evaluate())
                except RolloutInterrupted:
                    p.timer.pop_step()
                    p.rollouts.rollback(rollouts_at_start)  # the abandoned step's prompts come again
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
                if stop and signals.stop_exit(self.step, cfg.train.steps) == 0:
                    return 0
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
            if os.path.exists(os.path.join(cfg.run.dir, "checkpoints", "latest")):
                after = (f"the last checkpoint in {cfg.run.dir}/checkpoints is intact and the run resumes from it "
                         "with the same command")
            else:
                after = "no checkpoint was written yet: the same command starts the run again"
            log.error("the rollout engine failed during step %d: %s. The step was abandoned; %s.", self.step + 1,
                      exc, after)
            return 1
        finally:
            signals.restore()
            p.close()
        return 0


def _log_correction(cfg: Config) -> None:
    """Say once which rollout correction the run applies (diagnose and report name it too)."""
    c, a = cfg.algo.correction, cfg.algo
    if not c.active:
        return
    name = (f"algo.tis_cap={a.tis_cap}" if a.tis_cap is not None else
            f"preset {a.rollout_correction.preset}" if a.rollout_correction.preset else "algo.rollout_correction")
    log.info("rollout correction: %s (is_level=%s, is_threshold=%s, rs=%s, rs_thresholds=%s, bypass=%s)", name,
             c.is_level, c.is_threshold, c.rs, c.rs_thresholds, c.bypass)


def _cpu_threads() -> None:
    """One intra-op thread per process on CPU unless OMP_NUM_THREADS says otherwise: the tiny default's
    kernels are too small to split, and two ranks on two cores with two threads each spin against each other."""
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def train_main(config_path: str, overrides: list[str]) -> int:
    """``dapo-mcore train``: validate, prepare the run directory, build everything, run the loop."""
    _cpu_threads()
    cfg, launch = read_config(config_path, overrides)
    bridge = None
    if cfg.rollout.pipeline.mode == "async":  # the last rollout.pipeline.engine_ranks ranks run the engines only
        from dapo_mcore.rollout.pipeline.bridge import init_split_world

        role, bridge = init_split_world(launch, cfg.parallel.backend, cfg.parallel.timeout_minutes,
                                        cfg.rollout.pipeline.engine_ranks)
        if not role.trainer:
            from dapo_mcore.run.async_runtime import run_engine_ranks

            try:
                return run_engine_ranks(cfg, launch, bridge)
            finally:
                bridge.close()
    try:
        try:
            prepare_run_dir(cfg, launch)
            parts = build_components(cfg, launch, bridge=bridge)
        except (UserError, ConfigError) as exc:  # a refusal (another run in run.dir, ...): the engine ranks hear it, not a lost peer
            if bridge is not None:
                bridge.start(str(exc))
            raise
        return Trainer(cfg, parts).run()
    finally:
        if bridge is not None:
            bridge.close()  # the weights group, also when the run failed


def eval_main(config_path: str, overrides: list[str], checkpoint: str | None, as_json: bool = False) -> int:
    """``dapo-mcore eval``: held-out avg@k / pass@k / maj@k of a checkpoint (or the base model)."""
    _cpu_threads()
    # An async run's checkpoints evaluate like any other: the engines share the evaluating ranks.
    cfg, launch = read_config(config_path, [*overrides, "rollout.pipeline.mode=sync"])
    parts = build_components(cfg, launch, resume=False, checkpoint=checkpoint, for_eval=True)
    trainer = Trainer(cfg, parts)
    trainer.step = parts.start_step  # the checkpoint's step: the in-training eval's sampling seeds, so both agree
    try:
        metrics = trainer.evaluate()
    finally:
        parts.close()
    if launch.rank == 0:
        from dapo_mcore.telemetry.evaluation import format_scores

        sys.stdout.write(format_scores(metrics, as_json))
    return 0


__all__ = ["Trainer", "train_main", "eval_main", "EXIT_REQUEUE"]
