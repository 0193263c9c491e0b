"""Weights & Biases as a third metrics sink beside metrics.jsonl and TensorBoard (``telemetry.wandb``).

Rank 0 only (``MetricsWriter`` calls it where it writes the jsonl): every record the jsonl gets, with its step, and
the resolved config as the W&B run's config. The run's W&B id is kept in ``RUN_DIR/wandb_run_id``, so a requeued or
resumed job logs into the same W&B run (``resume="allow"``). W&B files go under ``RUN_DIR/wandb/``; with
``WANDB_MODE=offline`` (wandb reads it itself) nothing is sent and ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads
later. The x axis is our ``step`` (``define_metric``), not W&B's internal counter: after a resume the steps since
the last checkpoint are logged again (the jsonl drops its copies of them, W&B keeps both at the same step).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dapo_mcore.errors import UserError
from dapo_mcore.telemetry import keys

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
WANDB_DIR = "wandb"


class WandbSink:
    """One W&B run per run directory, continued across resumes."""

    def __init__(self, run_dir: Path, settings: Any, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:  # validate() checks first; a broken install lands here
            raise UserError(f"telemetry.wandb.project={settings.project}: the wandb package does not import "
                            f"({exc}); pip install wandb, or unset telemetry.wandb.project") from exc
        self._wandb = wandb
        run_dir = Path(run_dir)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(6)  # W&B ids: lowercase letters and digits
            id_file.write_text(run_id + "\n")
        (run_dir / WANDB_DIR).mkdir(exist_ok=True)
        self.run = wandb.init(project=settings.project, entity=settings.entity, name=settings.name or run_dir.name,
                              group=settings.group, tags=list(settings.tags) or None, config=dict(config),
                              id=run_id, resume="allow", dir=str(run_dir),
                              settings=wandb.Settings(console="off", quiet=True, disable_git=True,
                                                      x_disable_stats=True))
        self.run.define_metric(keys.STEP)
        self.run.define_metric("*", step_metric=keys.STEP)
        log.info("W&B run %s (%s): %s", run_id, self.run.settings.mode, self.run.dir)

    def log(self, record: Mapping[str, float | int]) -> None:
        """One jsonl record (it holds ``step``)."""
        self.run.log(dict(record))

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()
