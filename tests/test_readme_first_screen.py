"""The README's first screen says plainly what has run on a GPU (nothing) and what the prepared GPU check covers,
and names the paper recipe beside the fast one."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_the_first_screen_says_nothing_has_run_on_a_gpu():
    first = " ".join(ROOT.joinpath("README.md").read_text().splitlines()[:25])
    assert "Nothing in this project has run on a GPU yet" in first
    assert "docs/gpu-check.md" in first and "neither Transformer Engine nor vLLM" in first


def test_the_paper_recipe_ships_beside_the_fast_one():
    import yaml

    paper = yaml.safe_load(ROOT.joinpath("examples/qwen2.5-32b-paper.yaml").read_text())
    assert paper["model"]["fp8"]["enabled"] is False and paper["model"]["params_dtype"] == "bfloat16"
    assert paper["rollout"]["schedule"]["preset"] == "paper" and paper["algo"]["tis_cap"] is None
    fast = ROOT.joinpath("examples/qwen2.5-32b-fp8.yaml").read_text().splitlines()[0]
    assert "FAST recipe, not the paper's" in fast
