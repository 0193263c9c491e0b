"""Unit tests of the mapping table, placement (against Megatron's own layer offsets) and TP transforms."""

from __future__ import annotations

import pytest
import torch

from dapo_mcore.model.presets import preset_config
from dapo_mcore.weights import ParallelLayout, get_mapping, register_mapping, supported_model_types
from dapo_mcore.weights.layout import LayoutError
from dapo_mcore.weights.registry import UnsupportedModelError
from dapo_mcore.weights.transforms import DictSource

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (4, 1), (2, 2), (2, 4), (4, 2)])
def test_layer_placement_matches_megatron_offsets(pp, vpp):
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from dapo_mcore.model.qwen import transformer_config

    hf = preset_config("tiny", num_hidden_layers=16)
    tc = transformer_config(hf, pipeline_parallel=pp, virtual_pipeline=vpp if vpp > 1 else None)
    layout = ParallelLayout(pp=pp, vpp=vpp)
    per_chunk = 16 // (pp * vpp)
    seen = set()
    for p in range(pp):
        for v in range(vpp):
            offset = get_transformer_layer_offset(tc, vp_stage=v if vpp > 1 else None, pp_rank=p)
            assert layout.chunk_first_layer(16, p, v) == offset
            for local in range(per_chunk):
                assert layout.locate_layer(16, offset + local) == (p, v, local)
                seen.add(offset + local)
    assert seen == set(range(16))


def _naive_qkv(q, k, v, heads, kv_heads, hd):
    """Megatron's fused QKV: for each query group g, [its q heads, k_g, v_g]."""
    rows = []
    per = heads // kv_heads
    for g in range(kv_heads):
        for h in range(g * per, (g + 1) * per):
            rows.append(q[h * hd:(h + 1) * hd])
        rows.append(k[g * hd:(g + 1) * hd])
        rows.append(v[g * hd:(g + 1) * hd])
    return torch.cat(rows)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])  # 8 > 4 KV heads: megatron-core splits query groups across ranks
def test_qkv_gate_up_vocab_shards_against_naive_reference(tp):
    hf = preset_config("tiny", num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                       vocab_size=100)
    mapping = get_mapping(hf)
    layout = ParallelLayout(tp=tp, make_vocab_size_divisible_by=16)
    shapes = mapping.hf_shapes()
    state = {n: torch.randn(s) for n, s in shapes.items()}
    src = DictSource(state)
    pls = {pl.key: pl for pl in mapping.placements(layout)}
    hd, p = 8, "model.layers.1."
    full_qkv = _naive_qkv(state[p + "self_attn.q_proj.weight"], state[p + "self_attn.k_proj.weight"],
                          state[p + "self_attn.v_proj.weight"], 8, 4, hd)
    full_bias = _naive_qkv(state[p + "self_attn.q_proj.bias"], state[p + "self_attn.k_proj.bias"],
                           state[p + "self_attn.v_proj.bias"], 8, 4, hd)
    gate, up = state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]
    padded = mapping.padded_vocab_size(layout)
    emb = torch.cat([state["model.embed_tokens.weight"], torch.zeros(padded - 100, 64)])
    for r in range(tp):
        qkv = mapping.shard(pls["decoder.layers.1.self_attention.linear_qkv.weight"], src, layout, r)
        assert torch.equal(qkv, full_qkv.chunk(tp)[r])  # rank r: the r-th row block of the interleaved groups
        bias = mapping.shard(pls["decoder.layers.1.self_attention.linear_qkv.bias"], src, layout, r)
        assert torch.equal(bias, full_bias.chunk(tp)[r])
        fc1 = mapping.shard(pls["decoder.layers.1.mlp.linear_fc1.weight"], src, layout, r)
        assert torch.equal(fc1, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
        proj = mapping.shard(pls["decoder.layers.1.self_attention.linear_proj.weight"], src, layout, r)
        assert torch.equal(proj, state[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[r])
        out = mapping.shard(pls["output_layer.weight"], src, layout, r)
        assert torch.equal(out, torch.cat([state["lm_head.weight"], torch.zeros(padded - 100, 64)]).chunk(tp)[r])
        assert torch.equal(mapping.shard(pls["embedding.word_embeddings.weight"], src, layout, r), emb.chunk(tp)[r])
    # merge inverts shard for every tensor
    for pl in mapping.placements(layout):
        parts = [mapping.shard(pl, src, layout, r) for r in range(tp)]
        for name, t in mapping.merge(pl, parts, layout):
            assert torch.equal(t, state[name]), name


def test_te_spec_names_fuse_norms():
    mapping = get_mapping(preset_config("tiny"))
    keys = [k for k, _ in mapping.rank_placements(ParallelLayout(layer_spec="transformer_engine"), 0)]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)


def test_tied_output_layer_only_on_a_separate_last_stage():
    mapping = get_mapping(preset_config("tiny", num_hidden_layers=4))
    one = [k for k, _ in mapping.rank_placements(ParallelLayout(), 0)]
    assert "output_layer.weight" not in one
    last = dict(mapping.rank_placements(ParallelLayout(pp=2, vpp=2), 1))
    assert "chunk1.output_layer.weight" in last and not last["chunk1.output_layer.weight"].exported
    assert "lm_head.weight" not in mapping.hf_shapes()


def test_layout_errors_name_the_fix():
    mapping = get_mapping(preset_config("qwen2.5-32b"))
    with pytest.raises(LayoutError, match="num_key_value_heads=8 or be a multiple of it .*use one of 1, 2, 4, 8, 40"):
        mapping.check_layout(ParallelLayout(tp=5))
    get_mapping(preset_config("qwen2.5-1.5b")).check_layout(ParallelLayout(tp=4))  # 2 KV heads < TP 4: allowed
    with pytest.raises(LayoutError, match="num_attention_heads=40"):
        mapping.check_layout(ParallelLayout(tp=3))
    with pytest.raises(LayoutError, match="num_hidden_layers=64"):
        mapping.check_layout(ParallelLayout(pp=3))


def test_registry_dispatch_and_guards():
    assert "qwen2" in supported_model_types()
    with pytest.raises(UnsupportedModelError, match="supported: llama, qwen2"):
        get_mapping({"model_type": "mistral"})
    with pytest.raises(ValueError, match="already registered"):
        register_mapping("qwen2", lambda cfg: None)
