"""Llama 3.x dense through the conversion: the name table against Hugging Face's own ``LlamaForCausalLM`` (no QKV
bias, tied and untied), the ``llama3`` RoPE frequencies against transformers' ``_compute_llama3_parameters``, file
round trips bit-exact at TP/PP/VPP and both layer specs, ``verify``'s logit parity in fp32 (``torchrun`` TP=2 x PP=2,
tied embeddings, positions past the original context) and bf16, the refusals, and the presets' parameter counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conversion_helpers import assert_round_trip, assert_verify_fp32_tp2_pp2_and_bf16, load_dir

from conversion.synthetic import build_tiny_hf_model, save_tiny_hf_model, tiny_hf_config
from dapo_mcore.model.hf_config import HFConfigError, QwenShape
from dapo_mcore.model.presets import preset_config
from dapo_mcore.weights import ParallelLayout, get_mapping

pytestmark = pytest.mark.unit



@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def llama_dir(request, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llama") / "model"
    save_tiny_hf_model(d, seed=7, preset="tiny-llama", tie_word_embeddings=request.param, num_hidden_layers=4,
                       max_shard_size="150KB")
    return d


@pytest.mark.parametrize("tied", [False, True])
def test_name_table_is_hf_llamas_state_dict(tied):
    cfg = tiny_hf_config("tiny-llama", tie_word_embeddings=tied)
    model = build_tiny_hf_model(cfg, seed=1)
    assert type(model).__name__ == "LlamaForCausalLM"
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is None and attn.o_proj.bias is None and model.model.layers[0].mlp.up_proj.bias is None
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert get_mapping(cfg).hf_shapes() == want


def _hf_llama3_inv_freq(cfg: dict) -> torch.Tensor:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**cfg), "cpu")
    assert scale == 1.0
    return inv_freq


@pytest.mark.parametrize("preset", ["tiny-llama", "llama3.1-8b", "llama3.2-1b"])
def test_megatron_rope_frequencies_are_hfs_llama3(preset):
    """The frequencies Megatron's RotaryEmbedding holds after build_gpt_model's fix equal transformers' for the
    config; megatron-core's own ``rope_scaling=True`` (factor only, original context fixed at 8192) matches only the
    released configs, not a config with another original context, such as the tiny one."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from dapo_mcore.model.qwen import set_llama3_inv_freq

    cfg = preset_config(preset)
    shape = QwenShape.from_hf(cfg)
    want = _hf_llama3_inv_freq(cfg)
    def rotary(scaled: bool) -> RotaryEmbedding:
        return RotaryEmbedding(shape.head_dim, 1.0, rotary_base=shape.rope_theta, rope_scaling=scaled,
                               rope_scaling_factor=shape.rope_scaling[0], use_cpu_initialization=True)

    fixed, megatron_own = rotary(True), rotary(True)
    set_llama3_inv_freq(fixed, shape)
    torch.testing.assert_close(fixed.inv_freq, want, rtol=1e-6, atol=0)
    assert (want != rotary(False).inv_freq).any()  # the scaling changes some bands
    if preset == "tiny-llama":  # original context 16, not 8192
        assert (megatron_own.inv_freq - want).abs().max() > 1e-3
    else:
        torch.testing.assert_close(megatron_own.inv_freq, want, rtol=1e-6, atol=0)


def test_megatron_names_and_shapes_match_the_table():
    from dapo_mcore.actor.parallel import init_distributed, init_model_parallel, read_launch_env, shutdown
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config

    cfg = tiny_hf_config("tiny-llama", tie_word_embeddings=False)
    init_distributed(read_launch_env(), "gloo")
    try:
        init_model_parallel(1, 1, None, seed=1)
        tc = transformer_config(cfg)
        assert not tc.qk_layernorm and tc.kv_channels == 32 and not tc.add_qkv_bias and not tc.add_bias_linear
        (chunk,) = build_gpt_model(cfg, tc, make_vocab_size_divisible_by=16)
        got = {k: tuple(v.shape) for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
        inv_freq = chunk.rotary_pos_emb.inv_freq
    finally:
        shutdown()
    torch.testing.assert_close(inv_freq, _hf_llama3_inv_freq(cfg), rtol=1e-6, atol=0)
    mapping = get_mapping(cfg)
    layout = ParallelLayout(make_vocab_size_divisible_by=16)
    assert got == {pl.key: mapping.rank_shape(pl, layout) for pl in mapping.placements(layout)}
    assert got["decoder.layers.0.self_attention.linear_qkv.weight"] == (128 + 2 * 64, 128)


@pytest.mark.parametrize("tp,pp,vpp,spec", [(2, 1, 1, "local"), (2, 2, 2, "local"), (1, 2, 1, "transformer_engine")])
def test_round_trip_is_bit_identical(llama_dir, tmp_path, tp, pp, vpp, spec):
    assert_round_trip(llama_dir, tmp_path, ParallelLayout(tp=tp, pp=pp, vpp=vpp, layer_spec=spec), 100_000)
    back_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert QwenShape.from_hf(back_cfg).rope_scaling == (4.0, 1.0, 4.0, 16)  # the scaling survives the trip



def test_verify_against_hf_llama_fp32_tp2_pp2_tied_and_bf16(tmp_path):
    """Tied embeddings at PP=2 (the output layer is the embedding's copy on the last stage) and 24 positions, past
    the 16-token original context: a Megatron model with plain RoPE, or with megatron-core's own llama3 scaling
    (original context 8192), would miss fp32's tolerance by two orders of magnitude or more."""
    import transformers

    hf = tmp_path / "hf"
    model = save_tiny_hf_model(hf, seed=11, preset="tiny-llama", num_hidden_layers=4)
    assert model.config.tie_word_embeddings
    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        for rope in ({"rope_type": "default"}, dict(model.config.rope_parameters, original_max_position_embeddings=8192)):
            cfg = json.loads((hf / "config.json").read_text())
            cfg.pop("rope_scaling", None)
            cfg["rope_parameters"] = {**rope, "rope_theta": 10000.0}
            other = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
            other.load_state_dict(model.state_dict())
            assert (other(ids).logits - ref).abs().max() > 1e-3, rope  # 100x the tolerance below

    assert_verify_fp32_tp2_pp2_and_bf16(tmp_path, hf)


REFUSED = [
    ({"mlp_bias": True}, "mlp_bias=true is not supported for model_type='llama'"),
    ({"attention_bias": True}, "attention_bias=true is not supported for model_type='llama'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
     "rope_scaling='yarn' (RoPE scaling) is not supported for Llama 3.x dense (supported: 'default', 'llama3')"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_type='llama3' without low_freq_factor, high_freq_factor, original_max_position_embeddings"),
]


@pytest.mark.parametrize("overrides,message", REFUSED, ids=[r[1].split()[0] for r in REFUSED])
def test_refusals_name_the_field(overrides, message):
    with pytest.raises(HFConfigError, match=None) as info:
        QwenShape.from_hf(preset_config("tiny-llama", **overrides))
    assert message in str(info.value)


def test_plain_rope_llama_and_qwen_refuse_llama3():
    """Llama 3.0 (no rope_scaling) builds with plain RoPE; llama3 scaling stays refused for the Qwen families."""
    assert QwenShape.from_hf(preset_config("tiny-llama", rope_scaling=None)).rope_scaling is None
    with pytest.raises(HFConfigError, match="not supported for Qwen3 dense"):
        QwenShape.from_hf(preset_config("tiny-qwen3", rope_scaling=preset_config("tiny-llama")["rope_scaling"]))


@pytest.mark.parametrize("name,billions", [("llama3.1-8b", 8.03), ("llama3.2-1b", 1.24), ("tiny-llama", None)])
def test_parameter_count_is_hf_llamas(name, billions):
    import transformers

    from dapo_mcore.telemetry.flops import ModelShape

    cfg = preset_config(name)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    hf_count = sum(p.numel() for p in model.parameters())  # a tied lm_head is the same Parameter: counted once
    assert ModelShape.from_hf(cfg).num_params() == hf_count
    if billions is not None:
        assert hf_count / 1e9 == pytest.approx(billions, abs=0.01)
    if name == "llama3.1-8b":  # 128256 rows split evenly at TP 8; Megatron-LM's rule pads to 128 x 8
        assert get_mapping(cfg).padded_vocab_size(ParallelLayout(tp=8, vocab_padding="tp")) == 128256
        assert get_mapping(cfg).padded_vocab_size(ParallelLayout(tp=8, vocab_padding="megatron")) == 129024


def test_torch_dist_carries_the_llama3_factor_and_refuses_what_megatron_lm_cannot_build(tmp_path, capsys):
    """Megatron-LM's args say ``--use-rope-scaling`` with the factor, and the checkpoint reads back bit-exactly; a
    llama3 RoPE with another original context (which Megatron-LM fixes at 8192) is refused in one line."""
    from conversion.hf_to_mcore import main as hf_to_mcore_main
    from conversion.mcore_to_hf import main as mcore_to_hf_main

    rope = dict(preset_config("tiny-llama")["rope_scaling"], original_max_position_embeddings=8192)
    save_tiny_hf_model(tmp_path / "hf", seed=3, preset="tiny-llama", rope_scaling=rope)
    assert hf_to_mcore_main(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "td"), "--format", "torch_dist",
                             "--no-progress"]) == 0
    args = torch.load(tmp_path / "td" / "release" / "common.pt", weights_only=False)["args"]
    assert args.use_rope_scaling and args.rope_scaling_factor == 4.0 and not args.add_qkv_bias
    assert not args.untie_embeddings_and_output_weights
    assert mcore_to_hf_main(["--format", "torch_dist", "--mcore", str(tmp_path / "td"), "--hf-config",
                             str(tmp_path / "hf"), "--out", str(tmp_path / "back"), "--no-progress"]) == 0
    ref, got = load_dir(tmp_path / "hf"), load_dir(tmp_path / "back")
    assert sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref)

    save_tiny_hf_model(tmp_path / "hf16", seed=3, preset="tiny-llama")  # original context 16
    capsys.readouterr()
    assert hf_to_mcore_main(["--hf", str(tmp_path / "hf16"), "--out", str(tmp_path / "td16"), "--format",
                             "torch_dist", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "original_max_position_embeddings=16 cannot be written as a Megatron-LM" in err[0], err
    assert not (tmp_path / "td16").exists()


def test_bridge_run_config_of_llama_reads_back_as_the_hf_config():
    from conversion.bridge_config import bridge_run_config
    from dapo_mcore.weights.dist_checkpoint import hf_config_from_run_config

    hf = preset_config("llama3.2-1b")
    config = bridge_run_config(hf, tp=1, pp=1, dtype=torch.bfloat16, padded_rows=hf["vocab_size"], vocab_padding="tp",
                               divisible_by=128, tokenizer_model=None)
    assert config["model"]["rope_scaling"] is True and config["model"]["rope_scaling_factor"] == 32.0
    back = hf_config_from_run_config(config, Path("."))
    assert back["model_type"] == "llama" and back["architectures"] == ["LlamaForCausalLM"]
    assert QwenShape.from_hf(back) == QwenShape.from_hf(hf)
    with pytest.raises(HFConfigError, match="cannot be written as a Megatron-Bridge checkpoint"):
        bridge_run_config(preset_config("tiny-llama"), tp=1, pp=1, dtype=torch.float32, padded_rows=32,
                          vocab_padding="tp", divisible_by=128, tokenizer_model=None)
