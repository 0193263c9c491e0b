"""What a person watching a run sees: a live progress line (steps/s, ETA) and an end-of-run summary.

In a terminal the line is a rich progress bar under the log; in logs and pipes every progress log line carries
the rate and the ETA instead. The summary is computed from the run directory (``metrics.jsonl`` + the ledger), so
a resumed run is summarized from its first step, and the same text can be printed for any finished run.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from dapo_mcore.telemetry import keys, lanes

log = logging.getLogger(__name__)


def format_seconds(seconds: float) -> str:
    """``75.0 -> '1m15s'``, ``3725 -> '1h02m'``, ``4.2 -> '4.2s'``."""
    if seconds != seconds or seconds < 0:  # nan
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def async_fields(m: dict[str, Any]) -> str:
    """The async mode's part of the step line: how many versions the trained tokens lag (mean/max), the trainer's
    wait for rollouts and the engines' wait for weights this step ("" in sync mode)."""
    if "async/lag_mean" not in m:
        return ""
    return (f" lag={m['async/lag_mean']:.2f}/{int(m.get('async/lag_max', 0))}"
            f" wait_rollouts={m.get('async/trainer_wait_s', float('nan')):.2f}s"
            f" engines_wait={m.get('async/engine_wait_weights_s', float('nan')):.2f}s")


class ProgressLine:
    """Steps/s and ETA over the steps this process ran; a rich bar when ``live``.

    The clock starts one step before the first update (that step's own duration is known from ``time/step``),
    so setup time before the first step does not dilute the rate.
    """

    def __init__(self, total: int, live: bool):
        self.total = total
        self.first_step: int | None = None
        self.t0 = 0.0
        self._bar: Any = None
        self._task: Any = None
        if live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("[bold]DAPO"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TextColumn("ETA"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}"))
            self._task = self._bar.add_task("steps", total=total, rate="", info="")
            self._bar.start()

    def update(self, step: int, step_seconds: float, info: str = "") -> tuple[float, float]:
        """Record that ``step`` finished; returns (steps per second, seconds left)."""
        now = time.monotonic()
        if self.first_step is None:
            self.first_step, self.t0 = step - 1, now - max(step_seconds, 1e-9)
        done = step - self.first_step
        rate = done / max(now - self.t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        if self._bar is not None:
            self._bar.update(self._task, completed=step, rate=f"{rate:.2f} steps/s", info=info)
        return rate, eta

    @property
    def live(self) -> bool:
        return self._bar is not None

    def note(self, info: str) -> None:
        """Show ``info`` (progress inside the running step) beside the bar."""
        if self._bar is not None:
            self._bar.update(self._task, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class StepProgress:
    """Progress inside a step, on rank 0: the phase, the dynamic-sampling batch k of max, the usable groups so far
    of the step's target, and the tokens generated.

    Fed by ``ColocatedRollouts`` (``begin`` at a step's first generation, ``batch`` after each generation call) and
    by the phase timer (``phase``). On a terminal the text goes into the live bar (``bar()``, once it exists); in
    logs (Slurm, pipes) it is a log line at most every ``every_s`` seconds, the first one ``every_s`` after the
    step started, so steps shorter than that add no line.
    """

    def __init__(self, target: int, max_batches: int, every_s: float, bar: Any = None, clock: Any = time.monotonic):
        self.target, self.max_batches, self.every_s = target, max_batches, every_s
        self._bar, self._clock = bar, clock
        self.step, self.batches, self.current, self.usable, self.tokens, self.phase_name = 0, 0, 0, 0, 0, ""
        self._last = clock()

    def begin(self, step: int) -> None:
        self.step, self.batches, self.current, self.usable, self.tokens = step, 0, 0, 0, 0
        self._last = self._clock()

    def batch(self, index: int, groups: list[Any]) -> None:
        """Generation call ``index`` (0-based) of the step returned ``groups`` (``algo.dynamic_sampling.Group``)."""
        self.batches = self.current = max(self.batches, index + 1)
        self.usable += sum(1 for g in groups if g.is_usable())
        self.tokens += sum(g.num_tokens() for g in groups)
        self._show()

    def phase(self, name: str) -> None:
        if name == "step":  # the phase around a whole step (and its checkpoint): nothing to show yet
            return
        self.phase_name = name
        if name == "generate":
            self.current = self.batches + 1
        self._show()

    def text(self) -> str:
        most = f"/{self.max_batches}" if self.max_batches else ""
        return (f"step {self.step}: {self.phase_name or 'starting'}, batch {self.current}{most}, usable groups "
                f"{min(self.usable, self.target)}/{self.target}, {self.tokens:,} tokens generated")

    def _show(self) -> None:
        bar = self._bar() if self._bar is not None else None
        if bar is not None and bar.live:
            bar.note(self.text())
            return
        now = self._clock()
        if now - self._last >= self.every_s:
            self._last = now
            log.info("%s", self.text())


def process_age() -> float:
    """Wall seconds since this process started (imports, the tiny base model's pre-training, setup included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def run_summary(run_dir: Path, process_seconds: float | None = None, first_step_here: int | None = None) -> str:
    """The end-of-run summary of a run directory: held-out start -> end, steps, wall time, generated tokens
    kept/rejected, where the time went, and the commands to run next. ``process_seconds``: this process's wall time
    from its start; ``first_step_here``: the first step it ran (a resumed run ran the earlier ones elsewhere)."""
    from dapo_mcore.telemetry.diagnose import load_run

    records = load_run(run_dir)
    last = records[-1] if records else {}
    steps = [r[keys.STEP] for r in records if keys.TRAIN_LR in r or keys.TRAIN_LOSS in r]
    lines = [f"run finished: {len(steps)} steps" + (f" ({steps[0]}-{steps[-1]})" if steps else "")]
    wall = last.get(keys.cost_seconds_key("step", cumulative=True))
    if wall is not None:
        lines[0] += f", {format_seconds(wall)} of step time (the steps alone, every process of the run)"
    if process_seconds is not None:
        ran = (f"steps {first_step_here}-{steps[-1]}; steps {steps[0]}-{first_step_here - 1} ran before the resume"
               if first_step_here and steps and first_step_here > steps[0] else "every step")
        lines.append(f"this process: {format_seconds(process_seconds)} of wall time from its start ({ran}; imports, "
                     "model building, the base model's pre-training or cache load, evaluations and checkpoints "
                     "included)")
    evals = [(int(r.get("eval/policy_version", r[keys.STEP])), r[keys.EVAL_AVG_AT_K], r.get(keys.EVAL_K))
             for r in records if keys.EVAL_AVG_AT_K in r]  # async: the version evaluated, not the line it landed in
    if evals:
        k = f"avg@{int(evals[-1][2])}" if evals[-1][2] else "avg@k"
        lines.append(f"held-out {k}: {evals[0][1]:.3f} (step {evals[0][0]}) -> {evals[-1][1]:.3f} "
                     f"(step {evals[-1][0]})")
    gen = last.get(keys.cost_key("tokens_generated", cumulative=True))
    kept = last.get(keys.cost_key("tokens_generated_kept", cumulative=True))
    rej = last.get(keys.cost_key("tokens_generated_rejected", cumulative=True))
    if gen:
        surplus = last.get(keys.cost_key("tokens_generated_surplus", cumulative=True)) or 0
        aborted = last.get(keys.cost_key("tokens_generated_aborted", cumulative=True)) or 0
        filtered = (rej or 0) - surplus
        lines.append(f"generated tokens: {int(gen):,} = kept for training {int(kept or 0):,} ({(kept or 0) / gen:.0%}) "
                     f"+ rejected by dynamic sampling {int(filtered):,} ({filtered / gen:.0%})"
                     + (f" + surplus groups {int(surplus):,} ({surplus / gen:.0%})" if surplus else "")
                     + (f" + aborted {int(aborted):,} ({aborted / gen:.0%})" if aborted else ""))
        buffered = int(last.get("sampling/tokens_partial_buffered", 0) or 0)
        if buffered:  # partial rollouts: counted when their group ends, and the run ended first
            lines[-1] += f", and {buffered:,} in partial groups left unfinished"
    if wall:
        shares = []
        for phase in keys.PHASES:
            if phase == keys.STEP_PHASE:
                continue
            s = last.get(keys.cost_seconds_key(phase, cumulative=True))
            if s and s >= 0.005 * wall:  # sub-0.5% phases are noise in the line
                shares.append((s, phase))
        other = wall - sum(last.get(keys.cost_seconds_key(p, cumulative=True), 0.0)
                           for p in keys.PHASES if p != keys.STEP_PHASE)
        names = lanes.TRAINER_LABELS if "async/trainer_wait_s" in last else {}
        parts = [f"{names.get(p, p)} {s / wall:.0%}" for s, p in sorted(shares, reverse=True)]
        if other > 0.005 * wall:
            parts.append(f"other {other / wall:.0%}")
        lines.append("step time by phase: " + ", ".join(parts))
    base = next((r for r in records if r[keys.STEP] == 0 and keys.time_key("eval") in r), None)
    if base is not None:
        lines.append(f"base evaluation (step 0, before the steps): {format_seconds(float(base[keys.time_key('eval')]))}")
    lines.append(f"run dir: {run_dir}")
    exe = _command_name()
    lines.append(f"next: {exe} report {run_dir}  |  {exe} diagnose {run_dir}  |  {exe} rollouts {run_dir}  |  "
                 f"{exe} eval {Path(run_dir) / 'config.yaml'} --checkpoint {run_dir}")
    return "\n".join(lines)


def _command_name() -> str:
    """How the user started us (``.venv/bin/dapo-mcore`` pastes without activating the venv): the launcher's
    ``DAPO_MCORE_COMMAND``, this process's own ``dapo-mcore`` script, or (``torchrun -m dapo_mcore.cli``, srun) the
    ``dapo-mcore`` next to this Python (relative to the working directory when under it); else ``dapo-mcore``."""
    import os
    import sys

    named = os.environ.get("DAPO_MCORE_COMMAND")
    if named:
        return named
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "dapo-mcore":
        return argv0
    script = Path(sys.executable).parent / "dapo-mcore"
    if not script.is_file():
        return "dapo-mcore"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)
