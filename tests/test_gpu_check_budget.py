"""The prepared GPU check fits one device call of at most 300 s, and its table says what it cannot test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.gpu_check import SECTIONS, gpu_plan, headline

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]


def test_check_and_wrapper_stay_under_300_seconds():
    plan = gpu_plan()
    limit = int(re.search(r"LIMIT_S=\$\{GPU_CHECK_LIMIT_S:-(\d+)\}", (REPO / "benchmarks/gpu_check.sh").read_text())[1])
    assert plan.budget_s < limit <= 285  # the wrapper's hard stop, with ~15 s for the wheel install and copy-back
    assert sum(plan.floors[s] for s in SECTIONS) <= plan.budget_s  # every section can start


def test_env_headline_names_the_untested_stack():
    row = {"status": "ok", "device_name": "H200", "torch": "2.9", "megatron-core": "0.16.1", "transformers": "4.57",
           "transformer-engine": None, "vllm": None}
    assert "NOT TESTED (absent here): Transformer Engine, vLLM" in headline("env", row)
