"""benchmarks/recipe_speed.py: the shipped recipe and the paper-exact sync configuration priced by one step model."""

from __future__ import annotations

import pytest

from benchmarks.recipe_speed import PAPER_SYNC, load
from dapo_mcore.plan.step_model import variants_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("recipe", ["examples/qwen2.5-32b-fp8.yaml", "examples/qwen2.5-32b-fp8-async.yaml",
                                    "examples/qwen3-32b-fp8.yaml"])
def test_paper_overrides_give_the_published_sync_loop(recipe):
    # Whatever a recipe ships, the baseline is colocated batch-and-filter with every schedule switch off.
    cfg = load(recipe, "qwen2.5-32b", PAPER_SYNC)
    assert cfg.rollout.pipeline.mode == "sync"
    assert not cfg.rollout.schedule.enabled and not cfg.rollout.schedule.partial
    assert variants_of(cfg)[0] == "today"


@pytest.mark.parametrize("recipe,preset", [("examples/qwen2.5-32b-fp8.yaml", "qwen2.5-32b"),
                                           ("examples/qwen3-32b-fp8.yaml", "qwen3-32b")])
def test_shipped_dense_recipes_are_priced_as_completion_order_partial_rollouts(recipe, preset):
    assert variants_of(load(recipe, preset, []))[0] == "sync_partial_done"
    assert variants_of(load(recipe, preset, PAPER_SYNC))[0] == "today"


def test_streaming_partial_recipe_is_priced_as_its_own_variant():
    # (the recipe ships completion order: prompt order spelled out)
    shipped = load("examples/qwen2.5-32b-fp8.yaml", "qwen2.5-32b",
                   ["rollout.schedule.streaming=true", "rollout.schedule.partial=true", "algo.tis_cap=2.0",
                    "rollout.schedule.order=prompt"])
    assert variants_of(shipped)[0] == "sync_partial_rr"


def test_completion_order_recipe_is_priced_as_the_completion_variant():
    shipped = load("examples/qwen2.5-32b-fp8.yaml", "qwen2.5-32b",
                   ["rollout.schedule.streaming=true", "rollout.schedule.partial=true", "algo.tis_cap=2.0",
                    "rollout.schedule.order=completion"])
    assert variants_of(shipped) == ("sync_partial_done", "async_partial_done")


def test_format_ranking_marks_the_config_and_divides_by_the_paper_loop():
    from types import SimpleNamespace

    from dapo_mcore.plan.step_model import format_ranking

    split = SimpleNamespace(engine_gpus=96, trainer_gpus=32)
    rows = [("async_partial_done", split, 600.0), ("sync_partial_done", None, 900.0), ("today", None, 1200.0)]
    lines = format_ranking(rows, ("today", None))
    assert lines[1].split()[:4] == ["1", "async_partial_done", "async", "96+32"]
    assert lines[1].split()[4:6] == ["10.00", "2.00"]
    assert "order=completion" in lines[2] and "<- this config" in lines[3] and "<- this config" not in lines[2]


def test_rank_variants_orders_every_variant_fastest_first():
    from dapo_mcore.commands.plan import plan_input_from_config
    from dapo_mcore.plan import disagg as plan_disagg
    from dapo_mcore.plan.disagg import own_split
    from dapo_mcore.plan.rollout_model import Stage
    from dapo_mcore.plan.step_model import SimSettings, colocated_input, rank_variants

    # a small step (64 prompts, rounds of 128) keeps the simulation to seconds; the ranking logic is the same
    cfg = load("examples/qwen2.5-32b-fp8.yaml", "qwen2.5-32b", ["train.prompts_per_step=64",
                                                                 "rollout.gen_batch_prompts=128"])
    p = colocated_input(cfg, plan_input_from_config(cfg, 128))
    rates = plan_disagg.TransferRates()
    split = own_split(cfg, p, rates)
    short = (Stage("short", mean_len=150.0, all_correct=0.3, all_wrong=0.2),)
    rows = rank_variants(cfg, p, rates, SimSettings(steps=1, warmup=1), split, stages=short)
    names = [v for v, _, _ in rows]
    assert {"today", "sync_stream_done", "sync_partial_done", "async", "async_partial_done"} <= set(names)
    assert len(names) == len(set(names)) == 13
    times = [t for _, _, t in rows]
    assert times == sorted(times) and all(t > 0 for t in times)
    assert all((s is None) != v.startswith("async") for v, s, _ in rows)


def test_plan_rank_variants_needs_a_vllm_config(capsys):
    from dapo_mcore.commands.plan import main

    with pytest.raises(SystemExit) as err:
        main(["--model", "tiny", "--rank-variants"])
    assert err.value.code == 2
    assert "--rank-variants prices vLLM engines of a project config" in capsys.readouterr().err


def test_plan_rank_variants_refuses_the_moe_recipe_in_one_line(capsys):
    # 3B active parameters decode faster per sequence in a full engine than the step model's lone dense sequence:
    # the decode model cannot be built, and the user gets one line, not a traceback.
    from dapo_mcore.commands.plan import main
    from dapo_mcore.errors import UserError

    with pytest.raises(UserError, match="--rank-variants cannot price this recipe's engines: .* an MoE"):
        main(["examples/qwen3-30b-a3b.yaml", "model.hf_path=null", "model.preset=qwen3-30b-a3b", "--nodes", "16",
              "--rank-variants", "--rank-steps", "1"])
