"""What vLLM needs for an MoE policy, checked on CPU (vLLM itself is not imported): routed-expert capture needs Model
Runner V2, which the engine groups' lockstep (vLLM data-parallel > 1) cannot use, so that layout is refused before
launch; experts are split by expert parallelism, not cut over every rank; the capture's /dev/shm buffer is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore.rollout.engines.vllm_engine import (
    VLLMEngineOptions,
    check_moe_weight_layout,
    check_routed_experts_shm,
    kv_tokens_bound,
    pin_model_runner,
    routed_experts_shm_bytes,
)
from dapo_mcore.rollout.protocol import EngineError

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]
V2 = "VLLM_USE_V2_MODEL_RUNNER"


def test_routed_expert_capture_pins_model_runner_v2_and_refuses_data_parallel():
    """The old engine pinned V1 (=0) first with data-parallel > 1, so its later setdefault(V2, "1") did nothing and
    vLLM refused ("requires Model Runner V2"); with data-parallel 1 it relied on vLLM's default."""
    assert pin_model_runner({}, 1, routed_experts=True) == {V2: "1"}
    assert pin_model_runner({V2: "1"}, 1, routed_experts=True) == {}
    with pytest.raises(EngineError, match="data-parallel 2.*Model Runner V2"):
        pin_model_runner({}, 2, routed_experts=True)
    with pytest.raises(EngineError, match=f"{V2}=0 with routed-expert capture"):
        pin_model_runner({V2: "0"}, 1, routed_experts=True)
    assert pin_model_runner({}, 2) == {V2: "0"}  # without capture, data-parallel engines keep the V1 runner


def _config(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "config", "examples/qwen3-30b-a3b.yaml",
                           "model.hf_path=null", "model.preset=qwen3-30b-a3b", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("extra", [(), ("rollout.pipeline.mode=async", "rollout.pipeline.engine_ranks=32")])
def test_config_refuses_replay_with_vllm_data_parallel_in_one_line(extra):
    proc = _config("--world-size", "128", "algo.router_replay=rollout", "model.recompute=none", *extra)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "vLLM data-parallel" in line and "algo.router_replay=none" in line and "Traceback" not in proc.stderr


def test_an_moe_engine_over_several_gpus_uses_expert_parallelism():
    moe = VLLMEngineOptions(model_path="m", tensor_parallel=4, expert_parallel=True)
    assert moe.llm_kwargs(128)["enable_expert_parallel"] is True
    assert "enable_expert_parallel" not in VLLMEngineOptions(model_path="m", tensor_parallel=4).llm_kwargs(128)
    assert "enable_expert_parallel" not in VLLMEngineOptions(model_path="m", expert_parallel=True).llm_kwargs(1)


def test_the_capture_buffer_is_sized_and_a_small_dev_shm_is_refused():
    from dapo_mcore.model.presets import preset_config

    cfg = preset_config("qwen3-30b-a3b")
    bound = kv_tokens_bound(cfg, 80 * 2**30, 0.5, 4)
    # 40 GiB less 1/4 of 30.5B bf16 weights over 48 layers x 1 KV head x 128 x 2 (K, V) x 2 bytes = 24 KiB a token
    assert 1.0e6 < bound < 1.2e6
    need = routed_experts_shm_bytes(bound, cfg)
    assert need == bound * 48 * 8 * 4
    check_routed_experts_shm(need, need)
    with pytest.raises(EngineError, match="/dev/shm has 0.06 GiB free"):
        check_routed_experts_shm(64 << 20, need)  # a container's default 64 MiB
    with pytest.raises(EngineError, match="/dev/shm is missing"):
        check_routed_experts_shm(None, need)


def test_a_vllm_moe_kernel_that_relays_out_the_experts_is_refused():
    """FlashInfer's CUTLASS MoE swaps each expert's gate/up halves after loading; the in-place sync would not."""
    check_moe_weight_layout({}, moe=True)
    check_moe_weight_layout({"VLLM_USE_FLASHINFER_MOE_FP16": "1"}, moe=False)  # a dense model has no w13
    check_moe_weight_layout({"VLLM_USE_FLASHINFER_MOE_FP16": "0"}, moe=True)
    for key in ("VLLM_USE_FLASHINFER_MOE_FP16", "VLLM_ROCM_USE_AITER_MOE"):
        with pytest.raises(EngineError, match=f"unset {key}"):
            check_moe_weight_layout({key: "1"}, moe=True)
