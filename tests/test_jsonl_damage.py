"""A damaged line in the middle of metrics.jsonl: readers skip it with a warning, a resume keeps a copy; report,
diagnose and profile still work (one shared reader, telemetry.jsonl)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore.telemetry.jsonl import StepLogFile, read_jsonl

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DAMAGE = ["{\"step\": 3, \"train/lo\x00\x00ss\": 1", "\xff\xfe garbage", "[1, 2]", "{\"no_step\": 1}"]


def _write(path: Path, steps: int, bad_at: int, bad: str) -> None:
    lines = [json.dumps({"step": s, "train/loss": float(s)}) for s in range(steps)]
    lines.insert(bad_at, bad)
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", errors="surrogateescape"))


@pytest.mark.parametrize("bad", DAMAGE)
def test_readers_skip_a_damaged_middle_line_naming_it(tmp_path, caplog, bad):
    path = tmp_path / "metrics.jsonl"
    _write(path, 6, 3, bad)
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, 3, 4, 5]
    assert f"{path}: skipping 1 damaged line(s) (line 4:" in caplog.text


def test_a_resume_drops_the_damaged_line_but_keeps_the_file_as_it_was(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    _write(path, 6, 2, "\xff garbage")
    before = path.read_bytes()
    with caplog.at_level(logging.WARNING):
        log = StepLogFile(path, resume_step=4)
    log.write({"step": 4, "train/loss": 9.0})
    log.close()
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, 3, 4]
    assert (tmp_path / "metrics.jsonl.damaged-1").read_bytes() == before
    assert "kept as" in caplog.text


def test_report_diagnose_and_profile_work_on_a_run_with_a_damaged_line(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(REPO / "tests" / "data" / "tiny_run", run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[40] = lines[40][: len(lines[40]) // 2]  # a middle line cut short (a second writer, a bad disk)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for command in ("report", "diagnose", "profile"):
        proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", command, str(run_dir)], capture_output=True,
                              text=True, cwd=REPO)
        assert proc.returncode == 0, (command, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and "skipping 1 damaged line(s) (line 41" in proc.stderr, command
