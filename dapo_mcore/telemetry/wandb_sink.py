"""Weights & Biases as a third metrics sink beside metrics.jsonl and TensorBoard (``telemetry.wandb``).

Rank 0 only (``MetricsWriter`` calls it where it writes the jsonl): every record the jsonl gets, with its step, and
the resolved config as the W&B run's config. The run's W&B id is kept in ``RUN_DIR/wandb_run_id``, so a requeued or
resumed job logs into the same W&B run (``resume="allow"``). W&B files go under ``RUN_DIR/wandb/``; with
``WANDB_MODE=offline`` (wandb reads it itself) nothing is sent and ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads
later. The x axis is our ``step`` (``define_metric``), not W&B's internal counter: after a resume the steps since
the last checkpoint are logged again (the jsonl drops its copies of them, W&B keeps both at the same step).

A kill -9 loses what W&B's writer had not flushed (it writes its ``.wandb`` log in 32 KiB blocks): on a resume,
`WandbSink.backfill` reads the run's local ``.wandb`` logs and logs again every metrics.jsonl row none of them holds,
so W&B gets every row the jsonl has.
"""

from __future__ import annotations

import json
import logging
import secrets
import struct
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
        self.run_dir, self.run_id = run_dir, run_id
        self.run.define_metric(keys.STEP)
        self.run.define_metric("*", step_metric=keys.STEP)
        log.info("W&B run %s (%s): %s", run_id, self.run.settings.mode, self.run.dir)

    def log(self, record: Mapping[str, float | int]) -> None:
        """One jsonl record (it holds ``step``)."""
        self.run.log(dict(record))

    def backfill(self, metrics_file: Path) -> int:
        """Log the rows of `metrics_file` (the jsonl, already cut back to the resume step) that no local ``.wandb``
        log of this W&B run holds (lost to a kill -9 before W&B flushed them); how many."""
        if not Path(metrics_file).is_file():
            return 0
        have = logged_rows(self.run_dir, self.run_id)
        missing = []
        for line in Path(metrics_file).read_text().splitlines():
            row = json.loads(line) if line.strip() else None
            if isinstance(row, dict) and keys.STEP in row and _row_key(row) not in have:
                missing.append(row)
        for row in missing:
            self.run.log(row)
        if missing:
            log.info("W&B: logged again %d metrics row(s) it had not received before the last stop (steps %s)",
                     len(missing), ", ".join(str(r[keys.STEP]) for r in missing[:10]))
        return len(missing)

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()


def _row_key(row: Mapping[str, Any]) -> tuple[int, tuple[str, ...]]:
    return int(row[keys.STEP]), tuple(sorted(k for k in row if not k.startswith("_")))


def logged_rows(run_dir: Path, run_id: str) -> set[tuple[int, tuple[str, ...]]]:
    """(step, metric names) of each history row in the local ``.wandb`` logs of W&B run `run_id` under
    RUN_DIR/wandb (offline or online runs alike); a log torn by a kill -9 is read up to its last whole record."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    rows = set()
    for path in sorted(Path(run_dir, WANDB_DIR).glob(f"*run-*/run-{run_id}.wandb")):
        for data in _log_records(path.read_bytes()):
            record = pb.Record()
            try:
                record.ParseFromString(data)
            except DecodeError:
                break
            if record.WhichOneof("record_type") != "history":
                continue
            row = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            if keys.STEP in row:
                try:
                    rows.add(_row_key({**row, keys.STEP: json.loads(row[keys.STEP])}))
                except (ValueError, TypeError):
                    continue
    return rows


def _log_records(data: bytes, block: int = 32768):
    """The records of a ``.wandb`` log (LevelDB's log format after a 7-byte header: 32 KiB blocks of ``crc32 u32 |
    length u16 | type u8 | data`` chunks, type 1 full, 2-4 first/middle/last); stops at a torn tail."""
    if data[:4] != b":W&B":
        return
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # the rest of the block is padding
            pos += left
            continue
        if pos + 7 + length > len(data) or kind > 4:
            return
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield buf
            buf = b""
