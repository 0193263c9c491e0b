"""Step-keyed JSON-lines files (``metrics.jsonl``, ``ledger.jsonl``): append, read, truncate on resume.

Each line is one JSON object holding a ``step`` key. Lines are flushed as they are written, so a
killed run keeps everything up to its last complete line; a torn final line (the process died
mid-write) is dropped with a warning when the file is read or truncated. A damaged line in the middle is
skipped with a warning by readers, and copied aside before a resume rewrites the file (never a traceback).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, TextIO

from dapo_mcore.telemetry import keys

logger = logging.getLogger(__name__)


def _parse(path: Path) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """(records, [(line number, why)] of the lines that are not records). A torn last line is not counted."""
    data = path.read_bytes()
    lines = data.decode("utf-8", errors="replace").splitlines()
    records: list[dict[str, Any]] = []
    bad: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get(keys.STEP), int):
                raise ValueError(f"not a record with an integer {keys.STEP!r}")
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            if i == len(lines) - 1 and not data.endswith(b"\n"):
                logger.warning("%s: dropping a torn last line (%s)", path, err)
            else:
                bad.append((i + 1, str(err)))
            continue
        records.append(record)
    return records, bad


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete records of ``path`` in file order ([] if the file does not exist).

    A damaged line in the middle (bytes flipped by a disk, a line written by a second process) is skipped with a
    warning naming it: the rest of the run's record stays readable by report, diagnose and profile."""
    path = Path(path)
    if not path.exists():
        return []
    records, bad = _parse(path)
    if bad:
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:3]) + (" ..." if len(bad) > 3 else "")
        logger.warning("%s: skipping %d damaged line(s) (%s); the other %d records are read", path, len(bad), shown,
                       len(records))
    return records


def truncate_from_step(path: Path, from_step: int) -> int:
    """Rewrite ``path`` keeping only records with ``step < from_step``; returns how many were dropped.

    The rewrite goes through a temporary file and ``os.replace`` so a crash mid-truncation leaves
    either the old or the new file, never a mix. A file with damaged lines is first copied aside
    (``metrics.jsonl.damaged-N``): the rewrite drops them, the copy keeps what was written.
    """
    path = Path(path)
    if not path.exists():
        return 0
    records, bad = _parse(path)
    if bad:
        aside = _copy_aside(path)
        logger.warning("%s: %d damaged line(s) (first: line %d, %s) are dropped; the file as it was is kept as %s",
                       path, len(bad), bad[0][0], bad[0][1], aside)
    kept = [r for r in records if r[keys.STEP] < from_step]
    dropped = len(records) - len(kept)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if dropped:
        logger.info("%s: dropped %d records with step >= %d (resume)", path, dropped, from_step)
    return dropped


def _copy_aside(path: Path) -> Path:
    import shutil

    n = 1
    while (aside := path.with_name(f"{path.name}.damaged-{n}")).exists():
        n += 1
    shutil.copy2(path, aside)
    return aside


def last_step(path: Path) -> int | None:
    """The largest step recorded in ``path`` (None when empty or absent)."""
    records = read_jsonl(path)
    return max((r[keys.STEP] for r in records), default=None)


class StepLogFile:
    """Append-only writer of one record per step, refusing to write a step twice.

    ``resume_step`` (the first step that will be written again after a resume) drops every record
    with ``step >= resume_step`` on open; without it, existing records are kept and writing a step
    not after the last one raises.
    """

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_from_step(self.path, resume_step)
        elif self.path.exists():
            # A torn last line must not be followed by an appended record on the same line.
            truncate_from_step(self.path, 2**62)
        self._last_step = last_step(self.path)
        self._file: TextIO | None = self.path.open("a")

    @property
    def last_step(self) -> int | None:
        return self._last_step

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must hold an int ``step`` after the last one) and flush it to disk."""
        if self._file is None:
            raise ValueError(f"{self.path} is closed; open a new writer")
        step = record[keys.STEP]
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"{self.path}: step {step} is not after the last logged step {self._last_step}; "
                f"when resuming, open the writer with resume_step={step}"
            )
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._last_step = step

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
