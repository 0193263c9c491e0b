"""run.overwrite deletes only a run, never a directory that holds none; an empty run.dir and a seed that train
cannot take are refused by config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore.actor.parallel import LaunchEnv
from dapo_mcore.config import ConfigError, load_config
from dapo_mcore.run.directory import claim_run_dir, prepare_run_dir

pytestmark = pytest.mark.unit

RANK0 = LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0, source="test")


def test_an_empty_run_dir_is_refused_by_validate():
    cfg = load_config(None, ["model.tiny_base=true", "run.dir="])
    with pytest.raises(ConfigError, match="run.dir is empty"):
        cfg.validate()


def test_overwrite_refuses_a_directory_that_holds_no_run(tmp_path):
    (tmp_path / "README.md").write_text("my checkout\n")
    (tmp_path / "src").mkdir()
    cfg = load_config(None, ["model.tiny_base=true", f"run.dir={tmp_path}", "run.overwrite=true"])
    with pytest.raises(ConfigError, match="holds no run .*README.md, src.*nothing is deleted"):
        prepare_run_dir(cfg, RANK0)
    assert (tmp_path / "README.md").is_file() and (tmp_path / "src").is_dir()


def test_overwrite_deletes_what_a_run_wrote_and_keeps_the_rest(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "config.yaml").write_text("run: {}\n")
    (run_dir / "notes.txt").write_text("mine\n")
    cfg = load_config(None, ["model.tiny_base=true", f"run.dir={run_dir}", "run.overwrite=true"])
    prepare_run_dir(cfg, RANK0)
    lock = claim_run_dir(cfg, RANK0)
    try:
        assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")) == ["notes.txt"]
    finally:
        lock.release()


def test_config_command_refuses_an_empty_run_dir_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "config", "examples/tiny_cpu.yaml", "run.dir=",
                          "run.overwrite=true"], capture_output=True, text=True, env=env, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 2, out.stderr
    assert "run.dir is empty" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("seed", [2**63, 2**31, -1])
def test_a_seed_train_cannot_take_is_refused_by_config(seed):
    cfg = load_config(None, ["model.tiny_base=true", f"train.seed={seed}"])
    with pytest.raises(ConfigError, match="train.seed"):
        cfg.validate()
