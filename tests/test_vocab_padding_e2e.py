"""Runs and checkpoints written by older versions (Megatron-LM's vocabulary padding, no rule recorded) keep working
under the new default model.vocab_padding=tp, through the real CLI on the tiny default.

The tiny vocabulary (32 rows) pads to 64 under Megatron-LM's rule with make_vocab_size_divisible_by=64 and stays
32 under the tp rule, so the two rules build different models here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dapo_mcore.weights import checkpoint as wckpt
from tests.conftest import copy_run

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
RUN = ("train.steps=4", "eval.every=0", "eval.at_start=false", "checkpoint.every=2",
       "model.make_vocab_size_divisible_by=64")
TRACE_KEYS = ("train/loss", "train/grad_norm", "train/entropy", "rollout/reward_mean", "rollout/acc_mean",
              "rollout/usable_group_frac")


def _train(run_dir: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "train", str(CONFIG), f"run.dir={run_dir}",
                           *overrides], env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _trace(run_dir: Path) -> dict[str, dict[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {k: {r["step"]: r[k] for r in rows if k in r} for k in TRACE_KEYS}


def _as_pre_38(ckpt: Path) -> None:
    """Rewrite a checkpoint's metadata as dapo-mcore wrote it before the padding rule was recorded (no
    vocab_padding key), with its manifest updated so that it stays intact."""
    manifest = wckpt.read_manifest(ckpt)
    for meta in ckpt.rglob(wckpt.METADATA_FILE):
        data = json.loads(meta.read_text())
        assert data.pop("vocab_padding") == "megatron"
        meta.write_text(json.dumps(data))
        manifest["files"][meta.relative_to(ckpt).as_posix()] = wckpt.file_digest(meta)
    files = manifest.pop("files")
    wckpt.write_manifest(ckpt, files, **manifest)


@pytest.fixture(scope="module")
def megatron_run(cli_env, tmp_path_factory) -> Path:
    """4 uninterrupted steps with model.vocab_padding=megatron (the reference trajectory)."""
    run_dir = tmp_path_factory.mktemp("megatron") / "run"
    _train(run_dir, cli_env, *RUN, "model.vocab_padding=megatron")
    meta = wckpt.read_meta(run_dir / "checkpoints" / "step_000004" / "model")
    assert (meta.layout.vocab_padding, meta.padded_vocab_size) == ("megatron", 64)
    return run_dir


def test_old_run_resumed_without_the_key_continues_identically(cli_env, megatron_run, tmp_path):
    """An older version's run stopped after step 2 (its step-4 checkpoint gone, no rule in its config or metadata), resumed
    with a config that says nothing about padding: the checkpoint's rule wins, and steps 3-4 equal the
    uninterrupted run's."""
    run_dir = copy_run(megatron_run, tmp_path / "run")
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "step_000004")
    (ckpts / "latest").write_text("step_000002")
    _as_pre_38(ckpts / "step_000002")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    del config["model"]["vocab_padding"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    proc = _train(run_dir, cli_env, *RUN)
    assert "loaded checkpoint" in proc.stderr
    assert "pads the vocabulary by the 'megatron' rule: model.vocab_padding=megatron is used instead of tp" \
        in proc.stderr
    assert _trace(run_dir) == _trace(megatron_run)
    meta = wckpt.read_meta(ckpts / "step_000004" / "model")
    assert (meta.layout.vocab_padding, meta.padded_vocab_size) == ("megatron", 64)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["vocab_padding"] == "megatron"


def test_old_padding_mcore_path_starts_a_tp_run(cli_env, megatron_run, tmp_path):
    """model.mcore_path at an older version's checkpoint (64 rows) under the default tp rule: re-padded to 32 rows on load
    (the real rows as they are: test_vocab_repad checks the values and logits), and the run saves tp checkpoints."""
    start = tmp_path / "start"
    shutil.copytree(megatron_run / "checkpoints" / "step_000002", start)
    _as_pre_38(start)
    run_dir = tmp_path / "run"
    proc = _train(run_dir, cli_env, "train.steps=1", "eval.every=0", "eval.at_start=false", "checkpoint.every=1",
                  "model.make_vocab_size_divisible_by=64", f"model.mcore_path={start}")
    assert "vocabulary re-padded: 64 rows, megatron padding -> 32 rows, tp padding" in proc.stderr
    meta = wckpt.read_meta(run_dir / "checkpoints" / "step_000001" / "model")
    assert (meta.layout.vocab_padding, meta.padded_vocab_size) == ("tp", 32)
