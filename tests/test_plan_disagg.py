"""``dapo-mcore plan --disaggregated`` (dapo_mcore/plan/disagg.py) on the 32B recipe at 128 GPUs.

Memory and seconds are checked against hand formulas from the model's shape, not against the module's own output.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dapo_mcore.commands.plan import main, plan_input_from_config
from dapo_mcore.config import load_config
from dapo_mcore.model.presets import preset_config
from dapo_mcore.plan.disagg import (
    TransferRates,
    colocated_step_seconds,
    engine_memory,
    price_split,
    propose,
    scan_splits,
    weight_sync_seconds,
)
from dapo_mcore.plan.planner import GIB, estimate_flops, estimate_memory, estimate_step_seconds
from dapo_mcore.telemetry.flops import ModelShape

CFG_32B = str(Path(__file__).resolve().parent.parent / "examples" / "qwen2.5-32b-fp8.yaml")
PRESET_32B = ["model.hf_path=null", "model.preset=qwen2.5-32b"]


def plan_32b(*overrides: str):
    return plan_input_from_config(load_config(CFG_32B, [*PRESET_32B, *overrides]), 128)


def test_engine_side_holds_only_vllm_at_its_own_memory_fraction():
    p = plan_32b()
    shape = ModelShape.from_hf(preset_config("qwen2.5-32b"))
    mem = engine_memory(p, 0.9)
    weights = 2.0 * shape.num_params() / 4  # bf16 at vLLM TP=4
    kv = 0.9 * 80 * GIB - weights - 2 * GIB  # minus the workspace
    per_token = 2 * 64 * (8 // 4) * 128 * 2  # K and V, 64 layers, 2 of 8 KV heads per GPU, head dim 128, bf16
    assert mem.weights == pytest.approx(weights)
    assert mem.kv_tokens == int(kv // per_token)
    assert mem.peak == pytest.approx(0.9 * 80 * GIB + 3 * GIB)  # + CUDA context / NCCL buffers, no trainer state
    assert mem.kv_tokens > 2 * estimate_memory(p).vllm_kv_tokens  # the colocated engine gets half of the GPU
    assert price_split(p, 96, 0.9).fits
    too_much = price_split(p, 96, 0.97)  # 77.6 + 3 GiB > 80
    assert not too_much.fits and "engine GPU needs 80.6 GiB" in too_much.problems[0]


def test_trainer_side_drops_the_colocated_engine():
    p = plan_32b()
    split = price_split(p, 64)  # 64 trainer GPUs: TP 8 x PP 2 x DP 4
    colocated_same_dp = estimate_memory(replace(p, data_parallel=4))
    assert split.trainer.data_parallel == 4 and not split.trainer.colocate_vllm
    assert split.trainer_peak == pytest.approx(colocated_same_dp.train_peak - 1.0 * GIB)  # no vLLM sleep residue
    assert split.fits


def test_trainer_side_that_does_not_fit_names_the_fix():
    p = plan_32b("parallel.pipeline_parallel=1")  # TP=8 only: 32B's optimizer state over 2 replicas does not fit
    split = price_split(p, 112)
    assert not split.fits
    assert "trainer side layout does not fit: training phase needs" in split.problems[0]
    assert split.trainer_peak > 80 * GIB


def test_only_power_of_two_trainer_sizes_are_layouts_at_128_gpus():
    splits = scan_splits(plan_32b())
    assert [s.engine_gpus for s in splits] == list(range(8, 128, 8))  # whole nodes of engines
    assert [s.engine_gpus for s in splits if s.fits] == [64, 96]  # DP = 4, 2 divide the 512 responses
    reasons = {s.engine_gpus: s.problems[0] for s in splits if not s.fits}
    # DP = 1 divides them too, but one replica holds the whole optimizer state: 81.9 GiB on stage 0
    assert "training phase needs 81.9 GiB" in reasons[112]
    assert "not a multiple of TP x PP = 16" in reasons[8]
    assert "data_parallel=6" in reasons[32]


def test_sides_scale_with_their_gpus_and_the_proposal_balances_them():
    p = plan_32b()
    train_all, gen_all = estimate_step_seconds(p, estimate_flops(p))
    fitting = [s for s in scan_splits(p) if s.fits]
    for s in fitting:
        assert s.generation_s == pytest.approx(gen_all * 128 / s.engine_gpus)
        assert s.trainer_s == pytest.approx(train_all * 128 / s.trainer_gpus)  # same MFU on fewer GPUs
        assert s.step_s == pytest.approx(max(s.generation_s, s.trainer_s) + s.transfer_s)
    best = propose(fitting)
    assert best.step_s == min(s.step_s for s in fitting)
    assert best.engine_gpus == 96
    # The balance point lies within one step of the scan: generation is the longer side on one neighbour and
    # the shorter on the other (here: the trainer is the longer side at 96, generation at 64).
    i = fitting.index(best)
    sides = [s.generation_s > s.trainer_s for s in fitting[max(0, i - 1):i + 2]]
    assert True in sides and False in sides


def test_weight_transfer_seconds_by_hand():
    p = plan_32b()
    model_bytes = 2.0 * ModelShape.from_hf(p.model).num_params()
    rates = TransferRates(export_gbs=40.0, network_gbs=25.0)
    assert weight_sync_seconds(p, rates, disaggregated=False) == pytest.approx(model_bytes / 40e9)
    assert weight_sync_seconds(p, rates, disaggregated=True) == pytest.approx(model_bytes / 40e9 + model_bytes / 4 / 25e9)
    gen, train, sync = colocated_step_seconds(p, rates)
    assert (train, gen) == estimate_step_seconds(p, estimate_flops(p)) and sync == pytest.approx(model_bytes / 40e9)
    with pytest.raises(ValueError, match="must be > 0"):
        TransferRates(export_gbs=0.0)


def test_plan_cli_never_proposes_a_split_slower_than_the_colocated_run(capsys):
    """At 128 GPUs the throughput model's fastest split (96 + 32, 29.6 min) is slower than the
    colocated run (26.4 min): it is named, not proposed."""
    assert main([CFG_32B, *PRESET_32B, "--nodes", "16", "--disaggregated", "--tail-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "proposed split" not in out
    assert "no split is faster than the colocated run in this throughput model: the fastest, 96 engine GPUs" in out
    assert "run one with rollout.pipeline.mode=async rollout.pipeline.engine_ranks=N" in out
    assert main([CFG_32B, *PRESET_32B, "--nodes", "16", "--engine-gpus", "64", "--json", "--tail-steps", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["proposed_engine_gpus"] is None and [s["trainer_gpus"] for s in doc["splits"]] == [64]
    colocated = sum(colocated_step_seconds(plan_32b(), TransferRates()))
    assert doc["splits"][0]["step_s"] > colocated
    # A split that beats the colocated run is proposed; one that only ties it is not.
    fitting = [s for s in scan_splits(plan_32b()) if s.fits]
    fastest = min(fitting, key=lambda s: s.step_s)
    assert propose(fitting, colocated_s=fastest.step_s + 1.0) is fastest
    assert propose(fitting, colocated_s=fastest.step_s) is None
    assert main([CFG_32B, *PRESET_32B, "--nodes", "16", "--engine-gpus", "80"]) == 1  # DP=3 does not split 512
    assert "data_parallel=3" in capsys.readouterr().out


def test_plan_cli_bad_split_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as err:
        main([CFG_32B, *PRESET_32B, "--nodes", "16", "--engine-gpus", "90", "--tail-steps", "0"])
    assert err.value.code == 2
    assert "engine_gpus=90 is not a multiple of vllm_tensor_parallel=4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([CFG_32B, *PRESET_32B, "rollout.engine=hf", "--nodes", "16", "--disaggregated"])
    assert "rollout.engine=vllm" in capsys.readouterr().err


def test_plan_prices_an_async_config_at_its_own_split(capsys):
    """examples/qwen2.5-32b-fp8-async.yaml: plan prices its rollout.pipeline.engine_ranks=96 split, not the colocated
    layout (whose vLLM at 0.9 of memory beside the trainer would not fit)."""
    cfg = str(Path(CFG_32B).with_name("qwen2.5-32b-fp8-async.yaml"))
    assert main([cfg, *PRESET_32B, "--nodes", "16", "--tail-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "96      32   2" in out and "the fastest, 96 engine GPUs + 32 trainer GPUs" in out
    assert "ROLLOUT PEAK" not in out
