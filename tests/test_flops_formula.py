"""FLOPs formula vs a naive per-matmul count and vs torch's FLOP counter on Hugging Face Qwen2."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dapo_mcore.model.presets import preset_config
from dapo_mcore.telemetry.flops import (
    ModelShape,
    attention_score_flops,
    forward_flops_per_token,
    mfu,
    mfu_from_tokens_per_second,
    sequence_forward_flops,
    sequence_train_flops,
    tokens_per_second_at_mfu,
)

pytestmark = pytest.mark.unit


def naive_forward_flops(cfg: dict, seq_len: int, causal: bool) -> float:
    """Sum 2*m*n*k over every matmul of a Qwen2 forward, attention one query position at a time."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // nh
    matmuls = []  # (m, n, k)
    for _ in range(cfg["num_hidden_layers"]):
        matmuls += [(seq_len, nh * d, h), (seq_len, nkv * d, h), (seq_len, nkv * d, h)]  # q, k, v
        for head in range(nh):
            for pos in range(seq_len):
                keys = pos + 1 if causal else seq_len
                matmuls += [(1, keys, d), (1, d, keys)]  # scores row, weighted values
            del head
        matmuls += [(seq_len, h, nh * d)]  # o_proj
        matmuls += [(seq_len, f, h), (seq_len, f, h), (seq_len, h, f)]  # gate, up, down
    matmuls += [(seq_len, v, h)]  # lm_head
    return float(sum(2 * m * n * k for m, n, k in matmuls))


SHAPES = [
    preset_config("tiny"),
    preset_config("tiny", hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=200,
                  num_hidden_layers=3, vocab_size=300, tie_word_embeddings=False),
    preset_config("qwen2.5-7b", num_hidden_layers=1, vocab_size=1000),
]


@pytest.mark.parametrize("cfg", SHAPES, ids=["tiny", "gqa-2to1", "7b-1layer"])
@pytest.mark.parametrize("causal", [True, False])
def test_sequence_flops_match_naive_matmul_sum(cfg, causal):
    seq = 17
    shape = ModelShape.from_hf(cfg)
    assert sequence_forward_flops(shape, seq, causal) == pytest.approx(naive_forward_flops(cfg, seq, causal), rel=1e-12)


def test_per_token_flops_sum_to_sequence_flops():
    shape = ModelShape.from_hf(SHAPES[1])
    seq = 33
    total = sum(forward_flops_per_token(shape, context_len=i + 1) for i in range(seq))
    assert total == pytest.approx(sequence_forward_flops(shape, seq, causal=True), rel=1e-12)


def test_matches_torch_flop_counter_on_hf_qwen2_forward_and_backward():
    transformers = pytest.importorskip("transformers")
    cfg = SHAPES[1]
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg, attn_implementation="eager"))
    seq = 40
    ids = torch.randint(0, cfg["vocab_size"], (1, seq))
    with FlopCounterMode(display=False) as fwd_counter:
        logits = model(ids).logits
    with FlopCounterMode(display=False) as bwd_counter:
        logits.float().square().mean().backward()
    shape = ModelShape.from_hf(cfg)
    # Eager attention computes the full S x S square and masks afterwards.
    expected_fwd = sequence_forward_flops(shape, seq, causal=False)
    assert fwd_counter.get_total_flops() == pytest.approx(expected_fwd, rel=1e-9)
    train = fwd_counter.get_total_flops() + bwd_counter.get_total_flops()
    assert train == pytest.approx(sequence_train_flops(shape, seq, "none", causal=False), rel=1e-9)


def test_recompute_modes_and_param_count():
    shape = ModelShape.from_hf(SHAPES[2])
    fwd = sequence_forward_flops(shape, 64)
    assert sequence_train_flops(shape, 64, "full") == pytest.approx(4 * fwd)
    assert sequence_train_flops(shape, 64, "selective") == pytest.approx(3 * fwd + attention_score_flops(shape, 64))
    with pytest.raises(ValueError, match="recompute"):
        sequence_train_flops(shape, 64, "some")
    transformers = pytest.importorskip("transformers")
    cfg = SHAPES[1]
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg))
    assert ModelShape.from_hf(cfg).num_params() == sum(p.numel() for p in model.parameters())


def test_qwen_32b_parameter_count_and_6n_rule():
    shape = ModelShape.from_hf(preset_config("qwen2.5-32b"))
    assert 32.5e9 < shape.num_params() < 32.9e9  # published: 32.8B (32.5B non-embedding + embeddings)
    # At short context the training FLOPs per token approach 6 * (non-embedding params + lm head).
    per_token_train = sequence_train_flops(shape, 1) / 1
    non_emb = shape.layers * shape.layer_params() + shape.vocab * shape.hidden
    assert per_token_train == pytest.approx(6 * non_emb, rel=1e-3)


def test_mfu_helpers_invert_each_other():
    shape = ModelShape.from_hf(preset_config("qwen2.5-7b"))
    tps = tokens_per_second_at_mfu(shape, 0.4, seq_len=4096, num_gpus=8, peak_flops_per_gpu=989e12)
    assert mfu_from_tokens_per_second(shape, tps, 4096, 8, 989e12) == pytest.approx(0.4)
    assert mfu(1e15, 2.0, 1, 1e15) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mfu(1.0, 0.0, 1, 1.0)
