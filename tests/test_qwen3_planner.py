"""Qwen3 in the FLOPs formula and the planner: head_dim x heads != hidden counts in the attention
FLOPs and parameters, checked against torch's FLOP counter on Hugging Face's own Qwen3ForCausalLM and against the
parameter count of the real Qwen3-8B / Qwen3-32B shapes built on the meta device."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dapo_mcore.model.presets import preset_config
from dapo_mcore.plan.planner import PlanInput, estimate_memory
from dapo_mcore.telemetry.flops import ModelShape, sequence_forward_flops

pytestmark = pytest.mark.unit


def test_flops_match_torch_counter_on_hf_qwen3():
    import transformers

    cfg = preset_config("tiny-qwen3", num_hidden_layers=3, vocab_size=300, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg, attn_implementation="eager"))
    seq = 40
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 300, (1, seq)))
    shape = ModelShape.from_hf(cfg)
    assert shape.head_dim * shape.heads == 128 != shape.hidden
    assert counter.get_total_flops() == pytest.approx(sequence_forward_flops(shape, seq, causal=False), rel=1e-9)
    qwen2_style = ModelShape(shape.hidden, shape.ffn, shape.layers, shape.heads, shape.kv_heads, shape.vocab, False)
    assert sequence_forward_flops(qwen2_style, seq, causal=False) < 0.8 * counter.get_total_flops()


@pytest.mark.parametrize("name,billions", [("qwen3-8b", 8.19), ("qwen3-32b", 32.76), ("tiny-qwen3", None)])
def test_parameter_count_is_hf_qwen3s(name, billions):
    import transformers

    cfg = preset_config(name)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    hf_count = sum(p.numel() for p in model.parameters())  # a tied lm_head is the same Parameter: counted once
    assert ModelShape.from_hf(cfg).num_params() == hf_count
    if billions is not None:
        assert hf_count / 1e9 == pytest.approx(billions, abs=0.01)  # the model cards' 8.2B / 32.8B


def test_qwen3_32b_plan_at_the_recipe_layout():
    plan = PlanInput(model=preset_config("qwen3-32b"), tensor_parallel=8, pipeline_parallel=2, data_parallel=8,
                     precision="fp8", recompute="selective")
    qwen25 = PlanInput(model=preset_config("qwen2.5-32b"), tensor_parallel=8, pipeline_parallel=2, data_parallel=8,
                       precision="fp8", recompute="selective")
    est, ref = estimate_memory(plan), estimate_memory(qwen25)
    # Queries and attention outputs are 8192 wide, not 5120: more activations than Qwen2.5-32B at the same layout
    assert est.activations > ref.activations and est.train_peak < 80 * 1024**3
