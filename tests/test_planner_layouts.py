"""Planner: layout validation, fix-it suggestions, accounting identities and the CLI main."""

from __future__ import annotations

import json

import pytest

from dapo_mcore.commands.plan import main
from dapo_mcore.model.presets import preset_config
from dapo_mcore.plan.fit import LayoutDoesNotFit, check
from dapo_mcore.plan.planner import GIB, PlanInput, estimate_flops, estimate_memory, stage_params
from dapo_mcore.telemetry.flops import ModelShape

pytestmark = pytest.mark.unit

QWEN32 = preset_config("qwen2.5-32b")
QWEN7 = preset_config("qwen2.5-7b")


def recipe_32b(**kw) -> PlanInput:
    base = dict(model=QWEN32, tensor_parallel=8, pipeline_parallel=2, data_parallel=8, precision="fp8",
                recompute="selective", distributed_optimizer=True, vllm_tensor_parallel=4)
    base.update(kw)
    return PlanInput(**base)


def test_paper_recipe_layout_fits_on_h100():
    est = check(recipe_32b())
    assert est.train_peak < 80 * GIB and est.rollout_peak < 80 * GIB
    assert est.vllm_kv_tokens > 2048 + 20480


def test_stage_params_sum_to_model_params():
    for cfg in (QWEN32, QWEN7, preset_config("qwen2.5-0.5b")):
        shape = ModelShape.from_hf(cfg)
        for pp in (1, 2, 4):
            total = sum(stage_params(shape, pp, s)[0] for s in range(pp))
            extra = shape.vocab * shape.hidden if (shape.tied_embeddings and pp > 1) else 0
            assert total == shape.num_params() + extra


def test_distributed_optimizer_shards_the_12_bytes():
    a = estimate_memory(recipe_32b(distributed_optimizer=False))
    b = estimate_memory(recipe_32b(distributed_optimizer=True))
    assert a.optimizer == pytest.approx(8 * b.optimizer)
    assert a.weights == b.weights and a.grads == pytest.approx(2 * a.weights)


def test_first_stage_activations_independent_of_pp_under_1f1b():
    # 1F1B keeps PP micro-batches of L/PP layers in flight: L layers' worth regardless of PP.
    acts = [estimate_memory(recipe_32b(pipeline_parallel=pp, data_parallel=1)).activations for pp in (1, 2, 4)]
    assert acts[0] == pytest.approx(acts[1]) == pytest.approx(acts[2])
    full = estimate_memory(recipe_32b(recompute="full", pipeline_parallel=1)).activations
    none = estimate_memory(recipe_32b(recompute="none", pipeline_parallel=1)).activations
    from dapo_mcore.plan.activations import layer_activations

    shape = ModelShape.from_hf(QWEN32)
    tp = recipe_32b().tensor_parallel
    per_layer = layer_activations(shape, "none", 2, tp).total  # checked against measurement (test_activation_model)
    kept = layer_activations(shape, "full", 2, tp).total
    assert kept == shape.hidden * 2 / tp  # full keeps each layer's input (split by sequence parallelism)
    # full keeps each layer's input plus one layer's full set while that layer is recomputed
    assert none / full == pytest.approx(shape.layers * per_layer / (shape.layers * kept + per_layer))


def test_refuses_layout_and_names_fixes():
    plan = recipe_32b(tensor_parallel=4, data_parallel=16, distributed_optimizer=False, recompute="none",
                      precision="bf16")
    with pytest.raises(LayoutDoesNotFit) as err:
        check(plan)
    msg = str(err.value)
    assert "training phase" in msg and "tensor_parallel=8" in msg
    assert "micro_batch_tokens=" not in msg  # a budget below one max-length sequence is no fix
    assert "rollout phase" in msg and "offload_train_state_in_rollout=true" in msg


def test_refuses_vllm_fraction_that_crowds_the_trainer():
    with pytest.raises(LayoutDoesNotFit, match=r"vllm_gpu_memory_utilization<=0\.\d\d"):
        check(recipe_32b(distributed_optimizer=False, vllm_gpu_memory_utilization=0.7))


def test_micro_batch_budget_suggestion_is_the_largest_that_fits():
    plan = recipe_32b(tensor_parallel=8, pipeline_parallel=1, data_parallel=16, recompute="none",
                      micro_batch_tokens=65536, max_response_len=8192)
    with pytest.raises(LayoutDoesNotFit) as err:
        check(plan)
    budget = int(str(err.value).split("micro_batch_tokens=")[1].split()[0])
    assert estimate_memory(PlanInput(**{**plan.__dict__, "micro_batch_tokens": budget})).train_peak <= 80 * GIB
    assert estimate_memory(PlanInput(**{**plan.__dict__, "micro_batch_tokens": budget + 1024})).train_peak > 80 * GIB


@pytest.mark.parametrize("kw, match", [
    (dict(model=QWEN7, tensor_parallel=8), "num_key_value_heads=4"),
    (dict(model=QWEN32, pipeline_parallel=3), "num_hidden_layers=64"),
    (dict(model=QWEN32, recompute="partial"), "recompute"),
    (dict(model=QWEN32, vllm_gpu_memory_utilization=1.2), "vllm_gpu_memory_utilization"),
])
def test_validate_messages(kw, match):
    with pytest.raises(ValueError, match=match):
        PlanInput(**kw).validate()


def test_flops_per_step_structure():
    fl = estimate_flops(recipe_32b(recompute="none"))
    assert fl.train == pytest.approx(3 * fl.old_logprobs) and fl.train_model == pytest.approx(fl.train)
    assert fl.train_tokens == 512 * 16 * (256 + 8192)


def test_main_exit_codes_and_json(capsys):
    assert main(["--model", "qwen2.5-32b", "--tensor-parallel", "8", "--pipeline-parallel", "2",
                 "--data-parallel", "8", "--precision", "fp8", "--recompute", "selective"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["--model", "qwen2.5-32b", "--tensor-parallel", "2", "--distributed-optimizer", "false"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert main(["--model", "qwen2.5-7b", "--tensor-parallel", "4", "--data-parallel", "2", "--json"]) == 0
    out = capsys.readouterr().out
    payload = json.loads(out[: out.rindex("}") + 1])
    assert payload["memory_gib"]["train_peak"] < 80
