"""The planner's MoE terms: expert weights and activations follow expert-TP, and the decode model's step time is the
bytes it reads and moves at the assumed rates (checked against the sum written out by hand for Qwen3-30B-A3B)."""

from __future__ import annotations

import pytest

from dapo_mcore.model.presets import preset_config
from dapo_mcore.plan.moe_decode import DecodeAssumptions, decode_step, generation_seconds
from dapo_mcore.plan.planner import GIB, PlanInput, estimate_memory
from dapo_mcore.telemetry.flops import ModelShape

pytestmark = pytest.mark.unit
A3B = preset_config("qwen3-30b-a3b")


def _plan(**kw) -> PlanInput:
    base = dict(model=A3B, tensor_parallel=4, data_parallel=32, expert_parallel=8, recompute="none")
    return PlanInput(**{**base, **kw})


def test_expert_weights_per_gpu_divide_by_ep_times_expert_tp():
    shape = ModelShape.from_hf(A3B)
    whole, split = estimate_memory(_plan(expert_tensor_parallel=1)), estimate_memory(_plan(expert_tensor_parallel=4))
    # bf16 weights: experts / (EP x ETP) per GPU, the rest / TP
    assert whole.weights - split.weights == pytest.approx(2 * shape.expert_params() * (1 / 8 - 1 / 32), rel=1e-9)
    dense = shape.num_params() - shape.expert_params()
    assert whole.weights == pytest.approx(2 * (dense / 4 + shape.expert_params() / 8), rel=1e-9)
    # below TP the routed tokens are not all-gathered over TP: their activations divide by TP
    assert whole.activations < 0.6 * split.activations
    assert split.train_peak / GIB == pytest.approx(77.7, abs=0.1)  # the recipe's former layout, as before


def test_an_expert_layout_megatron_cannot_place_is_refused():
    with pytest.raises(ValueError, match="expert_parallel=8 x expert_tensor_parallel=3"):
        _plan(expert_tensor_parallel=3).validate()
    _plan(expert_parallel=32, expert_tensor_parallel=1).validate()  # EP may span the TP ranks at expert-TP 1


def test_decode_step_is_the_bytes_it_reads_and_moves():
    """Qwen3-30B-A3B on one engine of 4 GPUs, 100 sequences at 4,096 tokens of context, by hand."""
    a = DecodeAssumptions()
    shape = ModelShape.from_hf(A3B)
    h, layers, kv_heads, d = 2048, 48, 4, 128
    experts = 48 * 128 * 3 * 2048 * 768
    assert shape.expert_params() == experts and (shape.hidden, shape.layers, shape.kv_heads, shape.head_dim) == \
        (h, layers, kv_heads, d)
    weights = (shape.num_params() - experts) * 2 / 4 + experts * 2 / 4 * (1 - (120 / 128) ** 100)
    kv = 100 * 4096 * layers * 2 * 1 * d * 2  # 4 KV heads over 4 GPUs: one per GPU
    memory = (weights + kv) / (3350e9 * 0.6)
    dispatch = 2 * layers * (2 * 3 / 4 * 100 * h * 2 / 450e9 + 15e-6)
    step = decode_step(shape, gpus=4, batch=100, context=4096, peak_tflops=989.4, a=a)
    assert step.memory_s == pytest.approx(memory, rel=1e-9)
    assert step.dispatch_s == pytest.approx(dispatch, rel=1e-9)
    assert step.seconds == pytest.approx(max(memory, step.compute_s) + dispatch + 1e-3, rel=1e-9)
    # the same engine as one of 32 in a data-parallel group across nodes: every token of every engine crosses
    lockstep = decode_step(shape, gpus=4, batch=100, context=4096, peak_tflops=989.4, lockstep_engines=32,
                           engines_per_node=2, a=a)
    moe = 2 * 100 * 32 * h * 2 / 45e9 + 2 * 40e-6
    attn = 2 * 3 / 4 * 100 * h * 2 / 450e9 + 15e-6
    assert lockstep.dispatch_s == pytest.approx(48 * moe + 48 * attn, rel=1e-9)
    assert lockstep.dispatch_s > 10 * step.dispatch_s


def test_a_generation_batch_takes_its_steps_or_its_longest_response():
    shape = ModelShape.from_hf(A3B)
    kw = dict(gpus=4, engines=32, prompt=256, kv_tokens=1_000_000, peak_tflops=989.4, lockstep=False)
    many = generation_seconds(shape, responses=24576, mean_response=8192, max_response=20480, **kw)
    assert many.batch == int(1_000_000 / (256 + 8192))
    assert many.seconds == pytest.approx(24576 / 32 * 8192 / many.batch * many.step.seconds)
    few = generation_seconds(shape, responses=32, mean_response=100, max_response=20480, **kw)
    assert few.seconds == pytest.approx(20480 * few.tail_step.seconds)  # one long response sets the time
