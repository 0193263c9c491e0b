"""NeMo-Run launcher: the SlurmExecutor dry run for the 32B recipe, LocalExecutor running real jobs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nemo_run", reason="needs nemo-run: pip install nemo-run==0.11.1 leptonai==0.27.3")

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "examples" / "nemo_run" / "launch.py"


def launch(tmp_path: Path, *args: str, timeout: int = 300, cache: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, NEMORUN_HOME=str(tmp_path / "nemorun_home"),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(REPO))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    if cache is not None:
        env["DAPO_MCORE_CACHE"] = cache
    return subprocess.run([sys.executable, str(LAUNCH), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.unit
def test_slurm_dry_run_prints_the_32b_sbatch(tmp_path):
    proc = launch(tmp_path, "slurm", "--account", "acct", "--partition", "batch", "--dry-run",
                  "--job-dir", str(tmp_path / "jobs"), "--remote-repo", "/shared/dapo-mcore", "algo.clip_high=0.28")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S*))?$", out, flags=re.M))
    assert flags["nodes"] == "16" and flags["ntasks-per-node"] == "8" and flags["gpus-per-node"] == "8"
    assert flags["time"] == "12:00:00" and flags["signal"] == "USR1@3600"
    assert flags["account"] == "acct" and flags["partition"] == "batch" and "exclusive" in flags
    assert "source /shared/dapo-mcore/slurm/env.sh" in out
    assert "export MASTER_ADDR=$head_node_ip" in out and "export TORCHX_MAX_RETRIES=20" in out
    srun = next(line for line in out.splitlines() if line.startswith("srun "))
    assert srun.rindex("--chdir /shared/dapo-mcore") > srun.index("--chdir")  # the last --chdir wins
    # The layout lives in the config (TP=8 PP=2 on 16 x 8 GPUs); only the run dir and the user's overrides follow.
    assert "python -m dapo_mcore.cli train examples/qwen2.5-32b-fp8.yaml run.dir=runs/dapo-32b-fp8 algo.clip_high=0.28" in srun
    assert "parallel." not in srun
    assert 'scontrol requeue "$SLURM_JOB_ID"' in out
    assert not list((tmp_path / "jobs").rglob("*_sbatch.sh")), "the dry run leaves no experiment behind"


@pytest.mark.distributed
def test_local_executor_runs_a_real_gloo_job(tmp_path):
    run_dir = tmp_path / "probe"
    proc = launch(tmp_path, "local", "--script", "slurm/probe.py", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "done.json").read_text()) == {"world": 2, "steps": 3, "restart": 0}


@pytest.mark.e2e
def test_local_executor_runs_the_tiny_trainer(tmp_path, tiny_cache):
    run_dir = tmp_path / "run"
    proc = launch(tmp_path, "local", "--run-dir", str(run_dir), "train.steps=3", "eval.every=0", "checkpoint.every=0",
                  timeout=900, cache=tiny_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SUCCEEDED" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
    # torchrun started 2 ranks and the trainer split the model over them (TP=2): one shard per rank.
    model = run_dir / "checkpoints" / "step_000003" / "model"
    assert sorted(p.name for p in model.iterdir() if p.is_dir()) == ["mp_rank_00_000", "mp_rank_01_000"]
