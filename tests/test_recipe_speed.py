"""benchmarks/recipe_speed.py: the shipped recipe and the paper-exact sync configuration priced by one step model."""

from __future__ import annotations

import pytest

from benchmarks.recipe_speed import PAPER_SYNC, load
from dapo_mcore.step_model import variants_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("recipe", ["examples/qwen2.5-32b-fp8.yaml", "examples/qwen2.5-32b-fp8-async.yaml",
                                    "examples/qwen3-32b-fp8.yaml"])
def test_paper_overrides_give_the_published_sync_loop(recipe):
    # Whatever a recipe ships, the baseline is colocated batch-and-filter with every schedule switch off.
    cfg = load(recipe, "qwen2.5-32b", PAPER_SYNC)
    assert cfg.rollout.pipeline.mode == "sync"
    assert not cfg.rollout.schedule.enabled and not cfg.rollout.schedule.partial
    assert variants_of(cfg)[0] == "today"


def test_streaming_partial_recipe_is_priced_as_its_own_variant():
    shipped = load("examples/qwen2.5-32b-fp8.yaml", "qwen2.5-32b",
                   ["rollout.schedule.streaming=true", "rollout.schedule.partial=true", "algo.tis_cap=2.0"])
    assert variants_of(shipped)[0] == "sync_partial_rr"


def test_completion_order_recipe_is_priced_as_the_completion_variant():
    shipped = load("examples/qwen2.5-32b-fp8.yaml", "qwen2.5-32b",
                   ["rollout.schedule.streaming=true", "rollout.schedule.partial=true", "algo.tis_cap=2.0",
                    "rollout.schedule.order=completion"])
    assert variants_of(shipped) == ("sync_partial_done", "async_partial_done")
