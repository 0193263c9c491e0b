"""HF -> Megatron -> HF file conversion: bit-identical at any TP/PP/VPP, sharded inputs, trainer dirs."""

from __future__ import annotations

import json

import pytest
import torch
from conversion_helpers import load_dir

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.hf_to_mcore import main as hf_to_mcore_main
from conversion.mcore_to_hf import convert_mcore_to_hf
from conversion.mcore_to_hf import main as mcore_to_hf_main
from conversion.synthetic import save_tiny_hf_model
from dapo_mcore.weights import ParallelLayout
from dapo_mcore.weights.checkpoint import read_megatron_rank, read_meta

pytestmark = pytest.mark.unit



@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "model"
    # sharded input (several files + index json) to exercise the index reader
    save_tiny_hf_model(d, seed=5, tie_word_embeddings=request.param, num_hidden_layers=4, max_shard_size="60KB")
    assert (d / "model.safetensors.index.json").exists()
    return d


@pytest.mark.parametrize("tp,pp,vpp,spec", [(1, 1, 1, "local"), (2, 1, 1, "local"), (1, 2, 1, "local"),
                                            (2, 2, 2, "local"), (1, 4, 1, "transformer_engine"),
                                            (2, 1, 2, "local")])
def test_round_trip_is_bit_identical(hf_dir, tmp_path, tp, pp, vpp, spec):
    ref = load_dir(hf_dir)
    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, layer_spec=spec)
    meta = convert_hf_to_mcore(hf_dir, tmp_path / "mcore", layout)
    assert read_meta(tmp_path / "mcore").layout == layout and meta.padded_vocab_size == 128 * tp
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", max_shard_bytes=50_000)
    got = load_dir(tmp_path / "back")
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ref)
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name]


def test_rank_files_hold_megatron_state_dicts(hf_dir, tmp_path):
    convert_hf_to_mcore(hf_dir, tmp_path / "m", ParallelLayout(tp=2, pp=2, vpp=2))
    sd = read_megatron_rank(tmp_path / "m", 1, 0)
    assert set(k.split(".")[0] for k in sd) == {"chunk0", "chunk1"}
    assert sd["chunk0.embedding.word_embeddings.weight"].shape == (128, 64)
    assert torch.count_nonzero(sd["chunk0.embedding.word_embeddings.weight"]) == 0  # rank 1 = padding only
    assert sd["chunk1.decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64, 64)
    assert "chunk0.decoder.final_layernorm.weight" not in sd


def test_cli_bf16_cast_trainer_dir_and_hf_loadable(hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = tmp_path / "step_10"
    trainer.mkdir()
    assert hf_to_mcore_main(["--hf", str(hf_dir), "--out", str(trainer / "model"), "--tp", "2", "--pp", "2",
                             "--dtype", "bfloat16", "--no-progress"]) == 0
    assert read_meta(trainer).dtype == "bfloat16"
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    assert mcore_to_hf_main(["--mcore", str(trainer), "--out", str(tmp_path / "hf"), "--tokenizer", str(tok),
                             "--no-progress"]) == 0
    assert (tmp_path / "hf" / "tokenizer_config.json").exists()
    got = load_dir(tmp_path / "hf")
    ref = load_dir(hf_dir)
    assert all(torch.equal(got[k], ref[k].to(torch.bfloat16)) for k in ref)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.dtype == torch.bfloat16
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], got[k]) for k in got)
