"""The live pieces of a run (``Components``) and the verbs the trainer uses on them: save a checkpoint, log a step
(metrics, cost ledger, rollout store, progress), the profiler window, close."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.actor.parallel import LaunchEnv
from dapo_mcore.config import Config

log = logging.getLogger(__name__)


@dataclass
class Components:
    """The live pieces of a run (see module docstring)."""

    cfg: Config
    launch: LaunchEnv
    actor: Any
    engine: Any
    tokenizer: Any
    sampler: Any
    eval_records: list
    timer: Any
    score: Callable[[list[str], list[str]], list]
    normalize: Callable[[str], str]
    encode_prompt: Callable[[Any], list[int]]
    start_step: int = 0
    gen_groups: int = 1
    """Engine groups that split each generation batch (ranks for the transformers engine, vLLM TP groups for vLLM)."""
    gen_group_index: int = 0
    gen_group_leader: bool = True
    """This rank sends its engine group's responses to the others (the first rank of each group)."""
    step_work: Any = None
    """The last step's model FLOPs and tokens (telemetry.perf.StepWork), for tokens/s and MFU."""
    peak_flops: float | None = None
    progress: Any = None
    """The live progress line (rank 0; telemetry.progress.ProgressLine), created at the first logged step."""
    started: float = field(default_factory=time.monotonic)
    profiler: Any = None
    writer: Any = None
    ledger: Any = None
    store: Any = None
    scheduler: Any = None
    """rollout.scheduling.scheduler.RolloutScheduler: which prompts a step generates and when it is full."""
    model_files: tuple[Path | None, Path | None] = (None, None)
    """(tokenizer dir, model dir) the run starts from: their tokenizer and generation-config files are kept verbatim in
    RUN_DIR/tokenizer (what `convert mcore-to-hf` copies into an export)."""
    engine_streams: bool = False
    """Streaming generation aborts in-flight requests once a step is full: rollout.schedule.streaming with an engine
    that streams finished groups (in ticks, with several engine groups; otherwise streaming works chunk by chunk)."""
    rollouts: Any = None
    """The rollout side (rollout.pipeline.source.RolloutSource): what the trainer asks for a step's batch."""
    _closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0

    def trainer_state(self, step: int, rollout_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint after ``step`` steps resumes from; ``rollout_state`` is the async engines' sampler and
        schedule state after the pending batch (``rollout.pipeline.async_source``), else the trainer's own."""
        state = {"step": step, **(rollout_state if rollout_state is not None else self.scheduler.checkpoint_state())}
        if self.ledger is not None:
            state["ledger"] = self.ledger.state_dict()
        return state

    def save(self, step: int) -> Path:
        from dapo_mcore.actor.checkpoint import save_checkpoint
        from dapo_mcore.rollout.scheduling.partial import PARTIALS_FILE, split_partials

        rollout_state, extra = None, {}
        if not self.rollouts.colocated:
            from dapo_mcore.rollout.pipeline.async_source import PENDING_FILE

            rollout_state, pending = self.rollouts.checkpoint_payload(step)
            if pending is not None:
                extra[PENDING_FILE] = pending
        state = self.trainer_state(step, rollout_state)
        partials = split_partials(state)  # the buffered groups' tokens go to a binary file, not trainer_state.json
        if partials is not None:
            extra[PARTIALS_FILE] = partials
        return save_checkpoint(Path(self.cfg.run.dir) / "checkpoints", step, self.actor, state,
                               self.cfg.checkpoint.keep_last, extra_files=extra)

    def log_step(self, step: int, metrics: dict[str, Any], generated: list) -> None:
        """Per-phase seconds and the cost ledger join the step's metrics; rank 0 writes everything."""
        seconds = self.timer.pop_step()
        if not self.is_main:
            return
        from dapo_mcore.telemetry.timers import PhaseTimer

        metrics.update(PhaseTimer.as_metrics(seconds))
        if self.step_work is not None:
            metrics.update(self.step_work.metrics(seconds, self.launch.world_size, self.peak_flops,
                                                  _decoded_tokens(metrics)))
        self.ledger.record_step(step, **_ledger_counts(metrics), phase_seconds=seconds,
                                num_devices=self.launch.world_size)
        metrics.update(self.ledger.as_metrics())
        self.writer.log(step, metrics)
        if self.store is not None:
            self.store.append_step(step, _rollouts(generated))
        self._report_progress(step, metrics)

    def _report_progress(self, step: int, metrics: dict[str, Any]) -> None:
        """The live line (rank 0): steps/s and ETA; after the last step, the run's summary."""
        from dapo_mcore.telemetry.progress import ProgressLine, format_seconds, process_age, run_summary

        total = self.cfg.train.steps
        if self.progress is None:
            self.progress = ProgressLine(total, live=_live_terminal())
            self._closers.append(self.progress.close)
        evals = f"held-out {metrics['eval/avg_at_k']:.3f}" if "eval/avg_at_k" in metrics else ""
        rate, eta = self.progress.update(step, float(metrics.get("time/step", 0.0)), evals)
        _print_progress(step, total, metrics, self.cfg.run.log_every,
                        f"{rate:.2f} steps/s ETA {format_seconds(eta)}")
        if step == total:
            self.progress.close()
            log.info("%s", run_summary(Path(self.cfg.run.dir), process_age(), self.start_step + 1))

    def profile_window(self, step: int, starting: bool) -> None:
        """Start torch.profiler before step ``run.profile_steps[0]``; stop after ``[1]`` and write
        ``RUN_DIR/profile/trace_rank{r}.json`` (chrome://tracing, Perfetto) and a per-op summary table."""
        window = self.cfg.run.profile_steps
        if not window:
            return
        if starting and step == window[0] and self.profiler is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
            log.info("torch.profiler on for steps %d..%d", window[0], window[1])
        elif not starting and step == window[1] and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            out = Path(self.cfg.run.dir) / "profile"
            out.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(out / f"trace_rank{self.launch.rank}.json"))
            sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
            (out / f"summary_rank{self.launch.rank}.txt").write_text(
                self.profiler.key_averages().table(sort_by=sort, row_limit=40))
            self.profiler = None
            log.info("torch.profiler trace written to %s", out)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (a MAX all-reduce; collective)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        from dapo_mcore.collectives.device import collective_device

        device = collective_device()
        t = device.to(torch.tensor([1 if flag else 0], dtype=torch.int32))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(device.host(t).item())

    def log_base_eval(self, metrics: dict[str, Any], seconds: dict[str, float] | None = None) -> None:
        """Held-out scores of the starting model, logged as step 0, with its time (``time/eval`` of step 0: before
        the first step, so in no step's wall time; ``profile`` and the run summary show it on its own line)."""
        if self.is_main:
            from dapo_mcore.telemetry.timers import PhaseTimer

            self.writer.log(0, {**metrics, **PhaseTimer.as_metrics(seconds or {})})
            log.info("step 0 (base model): heldout avg@%d=%.3f pass@%d=%.3f", int(metrics["eval/k"]),
                     metrics["eval/avg_at_k"], int(metrics["eval/k"]), metrics["eval/pass_at_k"])

    def close(self) -> None:
        for closer in reversed(self._closers):
            closer()
        self._closers.clear()


def _decoded_tokens(metrics: dict[str, Any]) -> int:
    """Tokens the engine decoded during this step: the generated ones, the aborted ones, and with partial rollouts
    those carried to the next step, less the prefixes of resumed groups (decoded in the step before)."""
    m = {k: int(metrics.get(f"sampling/{k}", 0)) for k in (
        "tokens_generated", "tokens_aborted", "tokens_partial_buffered", "tokens_resumed_stale")}
    return m["tokens_generated"] + m["tokens_aborted"] + m["tokens_partial_buffered"] - m["tokens_resumed_stale"]


def _ledger_counts(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        "prompts_generated": int(metrics.get("sampling/groups_generated", 0)),
        "prompts_kept": int(metrics.get("sampling/groups_kept", 0)),
        "rollouts_generated": int(metrics.get("sampling/rollouts_generated", 0)),
        "rollouts_kept": int(metrics.get("sampling/rollouts_kept", 0)),
        "tokens_generated": int(metrics.get("sampling/tokens_generated", 0))
        + int(metrics.get("sampling/tokens_aborted", 0)) + int(metrics.get("sampling/tokens_dropped_stale", 0)),
        "tokens_generated_kept": int(metrics.get("sampling/tokens_kept", 0)),
        "tokens_trained": int(metrics.get("train/tokens", 0)),
        "tokens_generated_surplus": int(metrics.get("sampling/tokens_surplus", 0)),
        "tokens_generated_aborted": int(metrics.get("sampling/tokens_aborted", 0))
        + int(metrics.get("sampling/tokens_dropped_stale", 0)),
        "prompts_skipped": int(metrics.get("sampling/prompts_history_skipped", 0)),
        "tool_calls": int(metrics.get("tools/calls", 0)),
        "tool_errors": int(metrics.get("tools/errors", 0)),
        "tool_timeouts": int(metrics.get("tools/timeouts", 0)),
        "tool_sandbox_failures": int(metrics.get("tools/sandbox_failures", 0)),
        "tool_seconds": float(metrics.get("tools/seconds", 0.0)),
    }


def _rollouts(generated: list) -> list:
    import numpy as np

    from dapo_mcore.telemetry.rollout_store import Rollout

    out = []
    for gi, g in enumerate(generated):
        for r, reward, acc in zip(g.responses, g.rewards, g.acc, strict=True):
            out.append(Rollout(prompt_ids=np.asarray(g.prompt_ids, dtype=np.int64),
                               response_ids=np.asarray(r.token_ids, dtype=np.int64),
                               logprobs=np.asarray(r.logprobs, dtype=np.float32) if r.logprobs else None,
                               reward=float(reward), acc=bool(acc), finish_reason=r.finish_reason, kept=g.kept,
                               group_id=gi, gen_batch=g.gen_batch, stale_tokens=r.stale_tokens,
                               stop_token=r.token_ids[-1] if r.finish_reason == "stop" and r.token_ids else -1,
                               loss_mask=None if r.loss_mask is None else np.asarray(r.loss_mask, dtype=bool),
                               tool_calls=r.tool_calls, tool_errors=r.tool_errors))
    return out


def _live_terminal() -> bool:
    """A rich progress bar only where a person watches (a terminal), never in logs, pipes or tests."""
    import sys

    return sys.stdout.isatty() and sys.stderr.isatty()


def _loss_text(m: dict[str, Any]) -> str:
    """The step line's loss; a step without an update says why instead of printing nan."""
    if "train/loss" in m:
        return f"{m['train/loss']:.4f}"
    if m.get("rollout_corr/rejected_token_frac", 0.0) >= 1.0:
        return "- (no update: the rollout correction rejected every token)"
    return "- (no update: every token masked)"


def _print_progress(step: int, total: int, m: dict[str, Any], every: int, pace: str = "") -> None:
    if every and (step % every == 0 or step == total):
        from dapo_mcore.telemetry.progress import async_fields

        evals = f" heldout_avg@k={m['eval/avg_at_k']:.3f}" if "eval/avg_at_k" in m else ""
        evals = async_fields(m) + evals
        log.info("step %d/%d  acc=%.3f usable=%.2f batches=%d loss=%s ent=%.3f clip=%.3f len=%.1f %.2fs%s  %s",
                 step, total, m.get("rollout/acc_mean", float("nan")), m.get("rollout/usable_group_frac", float("nan")),
                 int(m.get("rollout/gen_batches", 0)), _loss_text(m),
                 m.get("train/entropy", float("nan")), m.get("train/clipfrac", float("nan")),
                 m.get("rollout/resp_len_mean", float("nan")), m.get("time/step", float("nan")), evals, pace)
