"""The fast paths of the CLI: reading a config imports no torch, and ``train`` on a finished run says so without
building anything (it took 22-30 s: the model was built and the checkpoint loaded first)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dapo_mcore.algo.config import BUILTIN_LOSS_AGGS
from dapo_mcore.algo.loss import loss_agg_names
from dapo_mcore.config import load_config
from dapo_mcore.run.checkpoints import finished_step
from tests.conftest import TWO_STEPS, copy_run

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")


def _probe(code: str, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.unit
def test_the_config_side_imports_no_torch(cli_env):
    code = ("import sys; from dapo_mcore.commands.config import precheck; "
            f"precheck({TINY!r}, []); print('torch' in sys.modules)")
    assert _probe(code, cli_env) == "False"


@pytest.mark.unit
def test_builtin_loss_aggregations_are_the_registry():
    assert list(BUILTIN_LOSS_AGGS) == loss_agg_names()[:len(BUILTIN_LOSS_AGGS)]


@pytest.mark.e2e
def test_train_on_a_finished_run_answers_without_torch(finished_two_steps, cli_env, tmp_path):
    run = copy_run(finished_two_steps, tmp_path / "run")
    code = ("import sys; from dapo_mcore import cli; "
            f"rc = cli.main(['train', {TINY!r}, 'run.dir={run}', *{list(TWO_STEPS)!r}]); print(rc, 'torch' in sys.modules)")
    assert _probe(code, cli_env) == "0 False"
    cfg = load_config(TINY, [f"run.dir={run}", *TWO_STEPS])
    assert finished_step(cfg) == 2
    cfg.train.steps = 3  # more steps asked: the trainer resumes
    assert finished_step(cfg) is None
    cfg.train.steps, cfg.algo.clip_high = 2, 0.3  # another run's config: the trainer refuses it, not this path
    assert finished_step(cfg) is None
    cfg.algo.clip_high = load_config(TINY, []).algo.clip_high
    stored = yaml.safe_load((run / "config.yaml").read_text())
    del stored["telemetry"]  # a run from before the telemetry section existed: the same run at the defaults
    (run / "config.yaml").write_text(yaml.safe_dump(stored))
    assert finished_step(cfg) == 2


@pytest.mark.unit
def test_a_refused_config_is_reported_without_importing_torch(cli_env):
    code = ("import sys; from dapo_mcore import cli; "
            f"rc = cli.main(['train', {TINY!r}, 'parallel.tensor_parallel=3']); print(rc, 'torch' in sys.modules)")
    assert _probe(code, cli_env).splitlines()[-1] == "2 False"  # the error classes' imports pulled torch (5 s)
