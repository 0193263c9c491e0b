"""Per-step metrics: TensorBoard scalars under ``run_dir/tensorboard`` and ``run_dir/metrics.jsonl``.

One flat ``{key: number}`` dict per step (key names in ``telemetry/keys.py``). Both sinks are
flushed every step, so a killed run keeps what it logged. Only rank 0 writes: other ranks build the
writer with ``enabled=False`` and every call is a no-op there.

Resume: open with ``resume_step=N`` (the first step that will be logged again); the JSON file
drops its lines with ``step >= N`` and TensorBoard is given ``purge_step=N`` so its readers discard
the orphaned events of the interrupted run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dapo_mcore.errors import naming
from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.jsonl import StepLogFile, read_jsonl

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _as_number(key: str, value: Any) -> float | int:
    """Plain Python number for ``value`` (bool/int/float, numpy or 1-element torch scalars)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    if hasattr(value, "item"):
        item = value.item()
        if isinstance(item, bool | int | float):
            return int(item) if isinstance(item, bool) else item
    raise ValueError(f"metric {key!r} has non-numeric value {value!r} ({type(value).__name__}); log numbers only")


class MetricsWriter:
    """Write each step's metrics to TensorBoard and ``metrics.jsonl`` (rank 0 only).

    Args:
        run_dir: the run directory; created if missing.
        enabled: False on every rank but 0; then nothing is opened or written.
        resume_step: first step that will be logged again after a resume (None for a fresh run).
        sinks: more destinations of each record, with ``log(record)`` and ``close()`` (`wandb_sink.WandbSink`).
    """

    def __init__(self, run_dir: Path, enabled: bool = True, resume_step: int | None = None,
                 sinks: list[Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.sinks = list(sinks or [])
        self._jsonl: StepLogFile | None = None
        self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = StepLogFile(self.run_dir / METRICS_FILE, resume_step=resume_step)
        # Imported here: torch's tensorboard writer is only needed on the writing rank.
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=resume_step)
        _quiet_tensorboard_thread_errors()

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` for ``step`` (must come after the last logged step)."""
        if not self.enabled:
            return
        assert self._jsonl is not None and self._tb is not None
        if keys.STEP in metrics and metrics[keys.STEP] != step:
            raise ValueError(f"metrics[{keys.STEP!r}]={metrics[keys.STEP]} disagrees with step={step}")
        record: dict[str, float | int] = {keys.STEP: int(step)}
        for key, value in metrics.items():
            if key != keys.STEP:
                record[key] = _as_number(key, value)
        with naming(self.run_dir / METRICS_FILE):
            self._jsonl.write(record)
        # TensorBoard writes in a thread and re-raises its OSError here without the path: name it.
        with naming(self.run_dir / TENSORBOARD_DIR):
            for key, value in record.items():
                if key != keys.STEP:
                    self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            tb, self._tb = self._tb, None
            with naming(self.run_dir / TENSORBOARD_DIR):
                tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quiet_tensorboard_thread_errors() -> None:
    """TensorBoard's writer thread dies on a full disk and prints its traceback, then re-raises the OSError in the
    writing thread (where MetricsWriter names the path): keep only the one line that follows from that."""
    if getattr(threading.excepthook, "_dapo_quiet_tb", False):
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            logger.debug("TensorBoard writer thread: %s (re-raised by the next write)", args.exc_value)
            return
        previous(args)

    hook._dapo_quiet_tb = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` in step order ([] if none were logged)."""
    return read_jsonl(Path(run_dir) / METRICS_FILE)
