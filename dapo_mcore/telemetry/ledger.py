"""The cost ledger: what each step spent, and the running totals, so runs can be compared on cost.

Per step it counts prompts and rollouts generated / kept / rejected (dynamic sampling rejects groups
without mixed outcomes, and surplus groups are dropped: both cost generation and are counted as
rejected), tokens generated (split kept / rejected), tokens trained, seconds per phase and
device-seconds (devices x step wall seconds). ``as_metrics()`` gives ``cost/step/*`` and
``cost/total/*`` keys; each step is also one line of ``run_dir/ledger.jsonl``. ``state_dict()`` goes
into the checkpoint; ``load_state_dict()`` restores the totals exactly and drops the ledger lines
of steps after the checkpoint at once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.jsonl import StepLogFile

logger = logging.getLogger(__name__)

LEDGER_FILE = "ledger.jsonl"
_STATE_VERSION = 1


def _check_counts(counts: Mapping[str, int]) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r}: counts must be non-negative ints")
    for what in ("prompts", "rollouts", "tokens"):
        gen = f"{what}_generated"
        kept = f"{what}_generated_kept" if what == "tokens" else f"{what}_kept"
        if counts[kept] > counts[gen]:
            raise ValueError(f"{kept}={counts[kept]} exceeds {gen}={counts[gen]}; kept is a subset of generated")


class CostLedger:
    """Per-step and cumulative cost counters (see module docstring).

    Args:
        run_dir: where ``ledger.jsonl`` goes; None keeps the ledger in memory only.
        enabled: False on every rank but 0 (counters are still kept, nothing is written).
    """

    def __init__(self, run_dir: Path | None = None, enabled: bool = True) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.enabled = enabled
        self.last_step: int | None = None
        self.step_counts: dict[str, float] = {}
        self.step_seconds: dict[str, float] = {}
        self.total_counts: dict[str, float] = {name: 0 for name in keys.COST_COUNTERS}
        self.total_seconds: dict[str, float] = {}
        self._resume_step: int | None = None
        self._log: StepLogFile | None = None

    def record_step(
        self,
        step: int,
        *,
        prompts_generated: int,
        prompts_kept: int,
        rollouts_generated: int,
        rollouts_kept: int,
        tokens_generated: int,
        tokens_generated_kept: int,
        tokens_trained: int,
        phase_seconds: Mapping[str, float],
        num_devices: int,
        tokens_generated_surplus: int = 0,
        tokens_generated_aborted: int = 0,
        prompts_skipped: int = 0,
        tool_calls: int = 0,
        tool_errors: int = 0,
        tool_timeouts: int = 0,
        tool_sandbox_failures: int = 0,
        tool_seconds: float = 0.0,
    ) -> dict[str, float]:
        """Add one step's costs; returns ``as_metrics()``.

        ``tokens_generated`` counts every generated response token (kept or not); ``tokens_trained``
        counts the tokens the update passes processed. ``phase_seconds`` is ``PhaseTimer.pop_step()``
        and must contain the ``step`` phase (the step's wall time, used for device-seconds).
        """
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"step {step} is not after the last recorded step {self.last_step}")
        if num_devices < 1:
            raise ValueError(f"num_devices={num_devices}; pass the number of devices the job holds (>= 1)")
        if keys.STEP_PHASE not in phase_seconds:
            raise ValueError(
                f"phase_seconds has no {keys.STEP_PHASE!r} entry (got {sorted(phase_seconds)}); "
                f"wrap the whole step in timer.phase({keys.STEP_PHASE!r})"
            )
        counts = {
            "prompts_generated": prompts_generated, "prompts_kept": prompts_kept,
            "rollouts_generated": rollouts_generated, "rollouts_kept": rollouts_kept,
            "tokens_generated": tokens_generated, "tokens_generated_kept": tokens_generated_kept,
            "tokens_trained": tokens_trained, "tokens_generated_surplus": tokens_generated_surplus,
            "tokens_generated_aborted": tokens_generated_aborted, "prompts_skipped": prompts_skipped,
            "tool_calls": tool_calls, "tool_errors": tool_errors, "tool_timeouts": tool_timeouts,
            "tool_sandbox_failures": tool_sandbox_failures,
        }
        _check_counts(counts)
        if tool_errors > tool_calls or tool_timeouts + tool_sandbox_failures > tool_errors or tool_seconds < 0:
            raise ValueError(f"tool_errors={tool_errors} (of which tool_timeouts={tool_timeouts}, tool_sandbox_failures="
                             f"{tool_sandbox_failures}) must lie within tool_calls={tool_calls}; tool_seconds="
                             f"{tool_seconds} >= 0")
        counts["tool_seconds"] = float(tool_seconds)
        if tokens_generated_kept + tokens_generated_aborted + tokens_generated_surplus > tokens_generated:
            raise ValueError(f"tokens_generated_kept={tokens_generated_kept} + tokens_generated_aborted="
                             f"{tokens_generated_aborted} + tokens_generated_surplus={tokens_generated_surplus} "
                             f"exceed tokens_generated={tokens_generated}; they are disjoint parts of it")
        counts["prompts_rejected"] = prompts_generated - prompts_kept
        counts["rollouts_rejected"] = rollouts_generated - rollouts_kept
        counts["tokens_generated_rejected"] = tokens_generated - tokens_generated_kept - tokens_generated_aborted
        counts["device_seconds"] = num_devices * float(phase_seconds[keys.STEP_PHASE])
        self.step_counts = {name: counts[name] for name in keys.COST_COUNTERS}
        self.step_seconds = {phase: float(s) for phase, s in phase_seconds.items()}
        for name, value in self.step_counts.items():
            self.total_counts[name] += value
        for phase, s in self.step_seconds.items():
            self.total_seconds[phase] = self.total_seconds.get(phase, 0.0) + s
        self.last_step = step
        metrics = self.as_metrics()
        self._write({keys.STEP: step, **metrics})
        return metrics

    def as_metrics(self) -> dict[str, float]:
        """``cost/step/*`` for the last recorded step and ``cost/total/*`` since the run began."""
        out: dict[str, float] = {}
        for name in keys.COST_COUNTERS:
            if self.step_counts:
                out[keys.cost_key(name, cumulative=False)] = self.step_counts[name]
            out[keys.cost_key(name, cumulative=True)] = self.total_counts[name]
        for phase, s in self.step_seconds.items():
            out[keys.cost_seconds_key(phase, cumulative=False)] = s
        for phase, s in self.total_seconds.items():
            out[keys.cost_seconds_key(phase, cumulative=True)] = s
        out[keys.COST_TOTAL_DEVICE_HOURS] = self.total_counts["device_seconds"] / 3600.0
        return out

    def _write(self, record: dict[str, Any]) -> None:
        if not self.enabled or self.run_dir is None:
            return
        if self._log is None:
            self._open_log()
        assert self._log is not None
        self._log.write(record)

    def _open_log(self) -> None:
        """Open ``ledger.jsonl``, dropping the lines at or after the resume step (once: a reopen appends)."""
        assert self.run_dir is not None
        self._log = StepLogFile(self.run_dir / LEDGER_FILE, resume_step=self._resume_step)
        self._resume_step = None

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the totals exactly (JSON-serializable)."""
        return {
            "version": _STATE_VERSION,
            "last_step": self.last_step,
            "total_counts": dict(self.total_counts),
            "total_seconds": dict(self.total_seconds),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the totals; ledger lines after ``state["last_step"]`` are dropped from the file at once."""
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"ledger state version {state['version']} is not {_STATE_VERSION}; cannot resume it")
        if self.step_counts:
            raise ValueError("load_state_dict() after record_step(); restore the ledger before the first step")
        missing = set(keys.COST_COUNTERS) - set(state["total_counts"]) - set(keys.COST_COUNTERS_ADDED)
        if missing:
            raise ValueError(f"ledger state lacks counters {sorted(missing)}")
        self.last_step = state["last_step"]
        self.total_counts = {name: state["total_counts"].get(name, 0) for name in keys.COST_COUNTERS}
        self.total_seconds = dict(state["total_seconds"])
        self.step_counts, self.step_seconds = {}, {}
        # Nothing survives from a checkpoint taken before the first step.
        self._resume_step = -(2**62) if self.last_step is None else self.last_step + 1
        if self.enabled and self.run_dir is not None:
            # Cut the file now, like metrics.jsonl and the rollout store, not at the next step's write: a run that
            # stops again before that write must not leave ledger lines of steps the checkpoint never saw.
            self.close()
            self._open_log()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
