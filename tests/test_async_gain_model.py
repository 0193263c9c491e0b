"""One model of async gains. ``dapo-mcore plan`` and ``benchmarks/rollout_sim.py`` price the 32B
async recipe against the sync one with the same step model (``dapo_mcore/plan/step_model.py``, generation tails included)
and must agree on whether it is faster; the recipe's header states the gain that model gives for its settings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import rollout_sim
from dapo_mcore.commands.plan import main as plan_main
from dapo_mcore.config import load_config

pytestmark = pytest.mark.e2e  # two simulations of 3 stages x 2 steps of 24k responses: ~1 min on 2 idle cores
ROOT = Path(__file__).resolve().parents[1]
ASYNC_32B = ROOT / "examples" / "qwen2.5-32b-fp8-async.yaml"
PRESET = ["model.hf_path=null", "model.preset=qwen2.5-32b"]


def test_plan_and_the_simulator_agree_on_the_32b_async_recipe(capsys):
    assert plan_main([str(ASYNC_32B), *PRESET, "--nodes", "16", "--json", "--tail-steps", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)["with_tails"]
    assert plan["engine_gpus"] == load_config(ASYNC_32B).rollout.pipeline.engine_ranks == 96
    assert plan["variants"] == ["today", "async"]  # the file's schedule: batch-and-filter, one version behind
    assert rollout_sim.main(["--config", str(ASYNC_32B), "--engine-gpus", "96", "--steps", "1",
                             "--variants", "config"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    sim = float(re.fullmatch(r"sim_async_over_sync_speedup: ([0-9.]+)", last).group(1))
    assert (sim > 1) == (plan["speedup"] > 1)  # the same sign...
    assert sim == pytest.approx(plan["speedup"], abs=0.005)  # ...because it is the same model
    header = ASYNC_32B.read_text().split("\nmodel:", 1)[0]
    claimed = re.search(r"async/sync speed-up ([0-9.]+)", header)
    assert claimed and float(claimed.group(1)) == pytest.approx(round(plan["speedup"], 2)), header
