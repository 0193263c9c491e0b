"""One accessor for "this model is MoE" and its expert count (``model.hf_config.expert_count``): Qwen3-MoE configs
spell the count ``num_experts``, transformers 5 saves ``num_local_experts``; every question "is this MoE?" reads
either, so a transformers-5 config still builds vLLM with expert parallelism and keeps the MoE guards."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

QWEN3_MOE = dict(model_type="qwen3_moe", num_hidden_layers=2, num_experts_per_tok=2, moe_intermediate_size=16,
                 hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=96)


@pytest.mark.parametrize("spelling", ["num_experts", "num_local_experts"])
def test_either_spelling_is_moe_with_its_count(spelling):
    from dapo_mcore.model.hf_config import expert_count, is_moe
    from dapo_mcore.model.moe import MoEShape

    hf = {**QWEN3_MOE, spelling: 8}
    assert expert_count(hf) == 8 and is_moe(hf)
    assert MoEShape.from_hf(hf).num_experts == 8
    dense = {"model_type": "qwen2", "num_experts": None}
    assert expert_count(dense) == 0 and not is_moe(dense) and not is_moe({"model_type": "qwen3"})


@pytest.mark.parametrize("spelling", ["num_experts", "num_local_experts"])
def test_vllm_engine_is_built_with_expert_parallelism_for_either_spelling(spelling, monkeypatch, tmp_path: Path):
    """``runtime._build_engine`` read ``num_experts`` only: a transformers-5 config built vLLM without expert
    parallelism (every expert split over all its ranks)."""
    from dapo_mcore.config import load_config
    from dapo_mcore.rollout.engines import vllm_engine as ve
    from dapo_mcore.rollout.engines.stop_tokens import StopTokens
    from dapo_mcore.run import runtime

    built = {}

    class Recorder:
        def __init__(self, options, hf_config):
            built["options"] = options

    monkeypatch.setattr(ve, "VLLMEngine", Recorder)
    cfg = load_config(None, [])
    cfg.rollout.engine = "vllm"
    runtime._build_engine(cfg, tmp_path, {**QWEN3_MOE, spelling: 8}, None, StopTokens(ids=(2,), sources={}))
    assert built["options"].expert_parallel is True
    runtime._build_engine(cfg, tmp_path, {"model_type": "qwen2"}, None, StopTokens(ids=(2,), sources={}))
    assert built["options"].expert_parallel is False
