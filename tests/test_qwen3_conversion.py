"""Qwen3 dense through the conversion: the name table against Hugging Face's own
``Qwen3ForCausalLM`` (head_dim 32 != hidden 64 / 4 heads, q/k norm weights away from 1, no QKV bias), file
round trips bit-exact at TP/PP/VPP and both layer specs, and ``verify``'s logit parity in fp32 (one process and
``torchrun`` TP=2 x PP=2) and bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conversion_helpers import assert_round_trip, assert_verify_fp32_tp2_pp2_and_bf16, load_dir

from conversion.synthetic import build_tiny_hf_model, save_tiny_hf_model, tiny_hf_config
from dapo_mcore.weights import ParallelLayout, get_mapping
from dapo_mcore.weights.checkpoint import read_megatron_rank

pytestmark = pytest.mark.unit



@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3_dir(request, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen3") / "model"
    save_tiny_hf_model(d, seed=7, preset="tiny-qwen3", tie_word_embeddings=request.param, num_hidden_layers=4,
                       max_shard_size="60KB")
    return d


@pytest.mark.parametrize("tied", [False, True])
def test_name_table_is_hf_qwen3s_state_dict(tied):
    cfg = tiny_hf_config("tiny-qwen3", tie_word_embeddings=tied)
    model = build_tiny_hf_model(cfg, seed=1)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    attn = model.model.layers[0].self_attn
    assert attn.head_dim == 32 and attn.q_proj.out_features == 128 != cfg["hidden_size"] and attn.q_proj.bias is None
    assert not torch.allclose(attn.q_norm.weight, torch.ones(32))  # randomised: a dropped q/k norm would show
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert get_mapping(cfg).hf_shapes() == want


def test_megatron_names_and_shapes_match_the_table():
    """The live Megatron model (qk_layernorm, kv_channels=head_dim, no QKV bias) holds exactly the tensors the table
    places, with the table's shapes: the same check as load_hf_into_model's strict load, without HF files."""
    from dapo_mcore.actor.parallel import init_distributed, init_model_parallel, read_launch_env, shutdown
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config

    cfg = tiny_hf_config("tiny-qwen3", tie_word_embeddings=False)
    init_distributed(read_launch_env(), "gloo")
    try:
        init_model_parallel(1, 1, None, seed=1)
        tc = transformer_config(cfg)
        assert tc.qk_layernorm and tc.kv_channels == 32 and not tc.add_qkv_bias
        (chunk,) = build_gpt_model(cfg, tc, make_vocab_size_divisible_by=16)
        got = {k: tuple(v.shape) for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
    finally:
        shutdown()
    mapping = get_mapping(cfg)
    layout = ParallelLayout(make_vocab_size_divisible_by=16)
    want = {pl.key: mapping.rank_shape(pl, layout) for pl in mapping.placements(layout)}
    assert got == want
    assert got["decoder.layers.0.self_attention.q_layernorm.weight"] == (32,)
    assert got["decoder.layers.0.self_attention.linear_qkv.weight"] == (128 + 2 * 64, 64)


@pytest.mark.parametrize("tp,pp,vpp,spec", [(2, 1, 1, "local"), (2, 2, 2, "local"), (1, 2, 1, "transformer_engine")])
def test_round_trip_is_bit_identical(qwen3_dir, tmp_path, tp, pp, vpp, spec):
    mcore = assert_round_trip(qwen3_dir, tmp_path, ParallelLayout(tp=tp, pp=pp, vpp=vpp, layer_spec=spec), 50_000)
    if (tp, pp, spec) == (2, 1, "local"):  # the q/k norms are replicated, whole, on every TP rank
        k_norm = load_dir(qwen3_dir)["model.layers.1.self_attn.k_norm.weight"]
        for tp_rank in range(2):
            sd = read_megatron_rank(mcore, tp_rank, 0)
            assert torch.equal(sd["decoder.layers.1.self_attention.k_layernorm.weight"], k_norm)



def test_verify_against_hf_qwen3_fp32_tp2_pp2_and_bf16(tmp_path):
    hf = tmp_path / "hf"
    model = save_tiny_hf_model(hf, seed=11, preset="tiny-qwen3", tie_word_embeddings=False, num_hidden_layers=4)
    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        for layer in model.model.layers:  # what a Megatron model without the q/k norms would compute
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
        no_norm = model(ids).logits
    assert (ref - no_norm).abs().max() > 1e-2  # so fp32's 1e-4 below cannot pass with the norms dropped

    assert_verify_fp32_tp2_pp2_and_bf16(tmp_path, hf)


def test_torch_dist_round_trip_carries_qk_layernorm(qwen3_dir, tmp_path):
    """Megatron-LM's own format: its args say qk_layernorm (and no QKV bias), and the checkpoint reads back bit-exactly."""
    from conversion.hf_to_mcore import main as hf_to_mcore_main
    from conversion.mcore_to_hf import main as mcore_to_hf_main

    assert hf_to_mcore_main(["--hf", str(qwen3_dir), "--out", str(tmp_path / "td"), "--format", "torch_dist",
                             "--no-progress"]) == 0
    args = torch.load(tmp_path / "td" / "release" / "common.pt", weights_only=False)["args"]
    assert args.qk_layernorm and not args.add_qkv_bias and args.kv_channels == 32
    assert mcore_to_hf_main(["--format", "torch_dist", "--mcore", str(tmp_path / "td"), "--hf-config", str(qwen3_dir),
                             "--out", str(tmp_path / "back"), "--no-progress"]) == 0
    ref, got = load_dir(qwen3_dir), load_dir(tmp_path / "back")
    assert sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref)
