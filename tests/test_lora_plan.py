"""The planner with LoRA: a frozen base keeps only its weights; the adapters get grads, fp32 main copies and Adam."""

from __future__ import annotations

import pytest

from dapo_mcore.model.presets import preset_config
from dapo_mcore.plan.lora import adapter_params_per_gpu
from dapo_mcore.plan.planner import PlanInput, estimate_memory
from dapo_mcore.telemetry.flops import ModelShape

pytestmark = pytest.mark.unit

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _naive_adapters(hf: dict, rank: int, tp: int) -> int:
    """Loop over the layers and projections of the HF shape: column layers split B's rows, row layers A's columns."""
    h, f, n = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    hd = h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    total = 0
    for _ in range(n):
        total += rank * h + rank * (q + 2 * kv) // tp       # linear_qkv: A [r, h] whole, B [(q+2kv)/tp, r]
        total += rank * q // tp + rank * h                  # linear_proj: A [r, q/tp], B [h, r] whole
        total += rank * h + rank * 2 * f // tp              # linear_fc1: A whole, B [2f/tp, r]
        total += rank * f // tp + rank * h                  # linear_fc2
    return total


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_adapter_count_matches_a_loop_over_the_layers(tp):
    hf = preset_config("qwen2.5-7b")
    got = adapter_params_per_gpu(ModelShape.from_hf(hf), 16, TARGETS, tensor_parallel=tp, pipeline_parallel=1)
    assert got == _naive_adapters(hf, 16, tp)


def test_lora_keeps_the_weights_and_drops_the_base_grads_and_optimizer():
    hf = preset_config("qwen2.5-32b")
    kw = dict(model=hf, tensor_parallel=8, distributed_optimizer=False, colocate_vllm=False)
    full = estimate_memory(PlanInput(**kw))
    lora = estimate_memory(PlanInput(**kw, lora_rank=64))
    adapters = adapter_params_per_gpu(ModelShape.from_hf(hf), 64, TARGETS, tensor_parallel=8, pipeline_parallel=1)
    assert lora.weights == pytest.approx(full.weights + 2 * adapters)
    assert lora.grads == pytest.approx(4 * adapters) and lora.optimizer == pytest.approx(12 * adapters)
    assert lora.activations == full.activations
    assert lora.train_peak < 0.5 * full.train_peak  # 32B at TP 8 without ZeRO: 18 B/param -> ~2 B/param


def test_config_describes_the_adapters_and_their_cost_per_gpu():
    from dapo_mcore.commands.config import describe_layout
    from dapo_mcore.config import load_config

    cfg = load_config(None, ["model.tiny_base=false", "model.preset=qwen2.5-32b", "model.params_dtype=bfloat16",
                             "parallel.tensor_parallel=8", "model.lora.rank=64", "model.lora.alpha=128"])
    (line,) = [x for x in describe_layout(cfg, 8) if x.startswith("LoRA:")]
    n = adapter_params_per_gpu(ModelShape.from_hf(preset_config("qwen2.5-32b")), 64, TARGETS, tensor_parallel=8,
                               pipeline_parallel=1)
    assert f"{n / 1e6:.1f}M adapter parameters per GPU" in line and "scale 2" in line
    assert f"{18 * n / 2**30:.2f} GiB" in line  # bf16 copy 2 + fp32 grad 4 + fp32 main 4 + Adam 8 bytes
    plain = load_config(None, ["model.tiny_base=false", "model.preset=qwen2.5-32b", "parallel.tensor_parallel=8"])
    assert not [x for x in describe_layout(plain, 8) if x.startswith("LoRA:")]
