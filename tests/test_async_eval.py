"""Evaluation off the trainer's path in async mode, at the real shape: trainer DP=2 beside two engine
ranks (4 gloo processes, the weights group refusing tensors off its device).

The engines evaluate an eval step's version while the trainer trains the next step: the eval step's line records no
trainer time on evaluation, the result lands in the next step's line labelled with the version it evaluated, and it
equals the colocated ``dapo-mcore eval`` of that step's checkpoint (the same seeds). A run killed after that
checkpoint, before the evaluation arrived, resumes with the engines evaluating the version again: the same line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_async import EXACT, ROOT, TIMEOUT, _rows, _same, _train

pytestmark = pytest.mark.e2e

SHAPE = ("rollout.pipeline.engine_ranks=2", "eval.every=2", "checkpoint.keep_last=4")
EVAL = ("eval/avg_at_k", "eval/pass_at_k", "eval/maj_at_k", "eval/policy_version")


@pytest.fixture(scope="module")
def behind(cli_env, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("async_eval") / "run"
    proc = _train(run, cli_env, 4, 4, *SHAPE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_the_trainer_does_not_wait_on_an_eval_step_and_the_result_lands_labelled(behind):
    rows = _rows(behind)
    assert sorted(rows) == [1, 2, 3, 4]
    # Step 2 is an eval step: the trainer spent no time evaluating and its line holds no evaluation ...
    assert not any(k.startswith("eval/") for k in rows[2]), rows[2]
    assert rows[2].get("time/eval", 0.0) == 0.0 and rows[3].get("time/eval", 0.0) == 0.0
    # ... which the engines ran while the trainer trained step 3: it arrives with step 3, labelled with version 2.
    assert rows[3]["eval/policy_version"] == 2.0 and rows[3]["eval/k"] == 4.0
    assert rows[3]["async/engine_eval_s"] > 0 and rows[3]["async/trainer_wait_eval_s"] >= 0
    # The last version is evaluated after the last step, on the trainer's path (nothing trains beside it).
    assert rows[4]["eval/policy_version"] == 4.0 and rows[4]["time/eval"] > 0


def test_the_evaluation_equals_the_colocated_eval_of_the_same_checkpoint(behind, cli_env):
    """Colocated on two processes: two engine groups, as the two engine ranks (each group draws its own samples)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                           "dapo_mcore.cli", "eval", str(behind / "config.yaml"), "--checkpoint",
                           str(behind / "checkpoints" / "step_000002"), "--json"], env=cli_env, cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    colocated = json.loads(proc.stdout.strip().splitlines()[-1])
    late = _rows(behind)[3]
    for key in ("eval/avg_at_k", "eval/pass_at_k", "eval/maj_at_k", "eval/problems"):
        assert late[key] == colocated[key], (key, late[key], colocated[key])


def test_a_run_killed_before_the_evaluation_arrived_resumes_with_it(behind, cli_env, tmp_path):
    """Kill -9 of trainer rank 0 while it publishes version 3: the last checkpoint is step 2's, taken before the
    evaluation of version 2 reached the trainer; the resumed run's step 3 line holds it, as the reference's."""
    run = tmp_path / "run"
    killed = _train(run, cli_env, 4, 4, *SHAPE, fault="publish:3:1")
    assert killed.returncode != 0 and "killing this process (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    resumed = _train(run, cli_env, 4, 4, *SHAPE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint" in resumed.stderr
    _same(behind, run, (*EXACT, *EVAL))
