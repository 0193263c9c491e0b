"""W&B gets every metrics row after a kill -9: the rows its writer had not flushed are logged again on resume from
metrics.jsonl, and the rows it holds are not logged twice (offline mode: nothing is sent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
_LOG_THEN_DIE = """import os, signal, sys
from pathlib import Path
from dapo_mcore.config import WandbConfig
from dapo_mcore.telemetry.wandb_sink import WandbSink
run_dir, n = Path(sys.argv[1]), int(sys.argv[2])
sink = WandbSink(run_dir, WandbConfig(project="backfill"), {})
for step in range(1, n + 1):
    sink.log({"step": step, "reward/mean": step / 10})
os.kill(os.getpid(), signal.SIGKILL)  # as kill -9 does: no close, no flush
"""
_RESUME = """import sys
from pathlib import Path
from dapo_mcore.config import WandbConfig
from dapo_mcore.telemetry.wandb_sink import WandbSink
run_dir = Path(sys.argv[1])
sink = WandbSink(run_dir, WandbConfig(project="backfill"), {})
print(sink.backfill(run_dir / "metrics.jsonl"))
sink.close()
"""


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
            "WANDB_CONFIG_DIR": str(tmp_path / "wbconfig"), "WANDB_CACHE_DIR": str(tmp_path / "wbcache")}


@pytest.mark.parametrize("n", [6, 600])  # 6: W&B's log holds none of them; 600: some blocks were flushed
def test_rows_lost_to_a_kill_9_reach_wandb_on_resume(tmp_path, n):
    from dapo_mcore.telemetry.wandb_sink import RUN_ID_FILE, logged_rows

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    died = subprocess.run([sys.executable, "-c", _LOG_THEN_DIE, str(run_dir), str(n)], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert died.returncode == -9, died.stderr[-2000:]
    rows = [{"step": s, "reward/mean": s / 10} for s in range(1, n + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    before = {step for step, _ in logged_rows(run_dir, run_id)}
    resumed = subprocess.run([sys.executable, "-c", _RESUME, str(run_dir)], env=_env(tmp_path), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert int(resumed.stdout.split()[-1]) == n - len(before)  # only what W&B did not hold
    counts = Counter(step for step, _ in _all_rows(run_dir, run_id))
    assert counts == Counter(range(1, n + 1)), (counts, before)  # every row once


def _all_rows(run_dir: Path, run_id: str) -> list[tuple[int, tuple[str, ...]]]:
    """Every history row of every local log (a list: duplicates count)."""
    from wandb.proto import wandb_internal_pb2 as pb

    from dapo_mcore.telemetry.wandb_sink import _log_records

    out = []
    for path in sorted(run_dir.glob(f"wandb/*run-*/run-{run_id}.wandb")):
        for data in _log_records(path.read_bytes()):
            rec = pb.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                if "step" not in row:  # W&B's own rows (e.g. its system metrics)
                    continue
                out.append((int(row["step"]), tuple(sorted(k for k in row if not k.startswith("_")))))
    return out


def test_a_torn_log_reads_up_to_its_last_whole_record(tmp_path):
    from dapo_mcore.telemetry.wandb_sink import _log_records

    header = b":W&B" + b"\0\0\0"
    chunk = lambda body: (0).to_bytes(4, "little") + len(body).to_bytes(2, "little") + b"\1" + body  # noqa: E731
    data = header + chunk(b"one") + chunk(b"two")
    assert list(_log_records(data)) == [b"one", b"two"]
    assert list(_log_records(data[:-2])) == [b"one"]  # the second was being written when the process died
