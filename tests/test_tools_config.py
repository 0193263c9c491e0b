"""rollout.tools: each field's range and the schedules a multi-turn rollout refuses, in one line naming the fix."""

from __future__ import annotations

import pytest

from dapo_mcore.config import ConfigError, load_config

pytestmark = pytest.mark.unit

BASE = ["rollout.tools.enabled=true", "rollout.max_new_tokens=64", "rollout.tools.max_output_tokens=16"]


def test_tools_off_by_default_and_on_validates():
    assert load_config("examples/tiny_cpu.yaml").rollout.tools.enabled is False
    load_config("examples/tiny_cpu.yaml", BASE).validate_layout(1)


@pytest.mark.parametrize(("override", "needle"), [
    ("rollout.tools.max_calls=0", "rollout.tools.max_calls=0"),
    ("rollout.tools.timeout_s=0", "rollout.tools.timeout_s=0"),
    ("rollout.tools.memory_mb=8", "rollout.tools.memory_mb=8"),
    ("rollout.tools.pool_size=-1", "rollout.tools.pool_size=-1"),
    ("rollout.tools.max_output_tokens=64", "leaves no room"),
])
def test_refusals_name_the_setting(override, needle):
    cfg = load_config("examples/tiny_cpu.yaml", BASE + [override])
    with pytest.raises(ConfigError) as err:
        cfg.validate_layout(1)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_streaming_and_partial_rollouts_run_with_tools():
    load_config("examples/tiny_cpu.yaml", BASE + ["rollout.schedule.streaming=true", "rollout.schedule.partial=true",
                                                  "algo.tis_cap=2.0"]).validate_layout(1)


def test_tools_run_in_the_async_pipeline():
    """The engine ranks wrap their engine in the multi-turn engine (run/async_runtime.py); the batch's loss mask and
    tool counts travel to the trainer (rollout/pipeline/wire.py)."""
    load_config("examples/tiny_cpu.yaml", BASE + ["rollout.pipeline.mode=async", "rollout.pipeline.engine_ranks=1",
                                                 "algo.tis_cap=2.0"]
                ).validate_layout(2)


def test_bad_sandbox_name_is_refused_at_load():
    with pytest.raises(ConfigError, match="sandbox"):
        load_config("examples/tiny_cpu.yaml", BASE + ["rollout.tools.sandbox=docker"])


def test_a_tool_recipe_is_rehearsed_on_the_tool_task():
    """The 32B ReTool recipe's rehearsal: the shrunk model gets the tool vocabulary and the tiny tool task, so the
    rehearsal makes real tool calls; the other recipes keep the tiny vocabulary."""
    from dapo_mcore.commands.rehearse import recipe_model, shrink

    cfg = load_config("examples/retool-qwen2.5-32b.yaml")
    plan = shrink(cfg, recipe_model(cfg)[0], vllm_installed=False)
    assert plan.tools and plan.hf["vocab_size"] == 48
    assert "data.train=task:mul2tool" in plan.overrides and "rollout.engine=hf" in plan.overrides
    assert any(k.startswith("tool use (python") for k in plan.kept)
    plain = load_config("examples/qwen2.5-32b-fp8.yaml")
    other = shrink(plain, recipe_model(plain)[0], vllm_installed=False)
    assert not other.tools and other.hf["vocab_size"] == 32 and "data.train=task:max4" in other.overrides
