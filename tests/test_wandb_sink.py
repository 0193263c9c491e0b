"""``telemetry.wandb`` in W&B's offline mode (nothing is sent): the local run files hold every metric of
metrics.jsonl with its step and the resolved config, and a resumed run continues the same W&B run."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore.config import Config, ConfigError
from dapo_mcore.telemetry.metrics import read_metrics

pytest.importorskip("wandb")
ROOT = Path(__file__).resolve().parents[1]


def _records(path: Path):
    """The protobuf records of a W&B ``.wandb`` file (a LevelDB-style log: 7-byte header, 32 KiB blocks of
    ``crc32 u32 | length u16 | type u8 | data`` chunks, type 1 full, 2-4 first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def _offline_runs(run_dir: Path) -> list[tuple[str, dict, list[dict]]]:
    """(run id, config, history rows without W&B's own ``_`` keys) of each offline run under RUN_DIR/wandb."""
    out = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run_id, config, rows = "", {}, []
        for rec in _records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_id = rec.run.run_id
                config = {u.key: json.loads(u.value_json) for u in rec.run.config.update if u.key != "_wandb"}
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                rows.append({k: v for k, v in row.items() if not k.startswith("_")})
        out.append((run_id, config, rows))
    return out


@pytest.mark.unit
def test_a_missing_wandb_package_is_one_config_error(monkeypatch):
    import importlib.util

    cfg = Config()
    cfg.telemetry.wandb.project = "dapo"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        cfg.telemetry.wandb.validate()


@pytest.mark.e2e
def test_offline_run_holds_the_jsonl_metrics_and_a_resume_continues_it(cli_env, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(cli_env, WANDB_MODE="offline", WANDB_CONFIG_DIR=str(tmp_path / "wbconfig"),
               WANDB_CACHE_DIR=str(tmp_path / "wbcache"))
    base = [sys.executable, "-m", "dapo_mcore.cli", "train", str(ROOT / "examples" / "tiny_cpu.yaml"),
            f"run.dir={run_dir}", "eval.every=2", "eval.at_start=false", "checkpoint.every=1",
            "telemetry.wandb.project=dapo-test", "telemetry.wandb.tags=[ci,tiny]"]
    for steps in (1, 2):  # the second command resumes the first run from its step-1 checkpoint
        proc = subprocess.run([*base, f"train.steps={steps}"], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = _offline_runs(run_dir)
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert len(runs) == 2 and {r[0] for r in runs} == {run_id}  # one W&B run, continued
    assert runs[0][1]["run"]["dir"] == str(run_dir) and runs[0][1]["telemetry"]["wandb"]["tags"] == ["ci", "tiny"]
    logged = [row for _, _, rows in runs for row in rows if row]  # W&B's own rows (only `_` keys) dropped
    jsonl = read_metrics(run_dir)
    assert [r.get("step") for r in logged] == [1, 2] == [r["step"] for r in jsonl], [sorted(r)[:4] for r in logged]
    for row, record in zip(logged, jsonl, strict=True):
        assert row == pytest.approx(record), record["step"]
