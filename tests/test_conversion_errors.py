"""Bad inputs raise the right error before anything is written."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.mcore_to_hf import convert_mcore_to_hf
from conversion.synthetic import save_tiny_hf_model
from dapo_mcore.weights import ParallelLayout
from dapo_mcore.weights.checkpoint import CheckpointError, rank_file
from dapo_mcore.weights.errors import OutputPathError
from dapo_mcore.weights.hf_checkpoint import HFCheckpointError
from dapo_mcore.weights.layout import LayoutError
from dapo_mcore.weights.registry import UnsupportedModelError

pytestmark = pytest.mark.unit


@pytest.fixture()
def hf(tmp_path):
    d = tmp_path / "hf"
    save_tiny_hf_model(d, seed=1, tie_word_embeddings=False)
    return d


def _edit(hf, fn):
    path = os.fspath(hf / "model.safetensors")
    sd = load_file(path)
    fn(sd)
    save_file(sd, path, {"format": "pt"})


def _expect(hf, tmp_path, error, match, **kw):
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        convert_hf_to_mcore(hf, out, kw.pop("layout", ParallelLayout()), **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] + (["out"] if out.exists() else [])
    assert not out.exists()


def test_missing_tensor(hf, tmp_path):
    _edit(hf, lambda sd: sd.pop("model.layers.1.self_attn.k_proj.bias"))
    _expect(hf, tmp_path, HFCheckpointError, r"missing \['model.layers.1.self_attn.k_proj.bias'\]")


def test_unexpected_tensor(hf, tmp_path):
    _edit(hf, lambda sd: sd.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    _expect(hf, tmp_path, HFCheckpointError, r"unexpected \['model.layers.0.self_attn.rotary_emb.inv_freq'\]")


def test_shape_mismatch(hf, tmp_path):
    _edit(hf, lambda sd: sd.update({"model.norm.weight": torch.ones(63)}))
    _expect(hf, tmp_path, HFCheckpointError, r"model.norm.weight: \(63,\) \(config implies \(64,\)\)")


def test_mixed_dtype_needs_explicit_cast(hf, tmp_path):
    _edit(hf, lambda sd: sd.update({"model.norm.weight": sd["model.norm.weight"].half()}))
    _expect(hf, tmp_path, HFCheckpointError, "mixed dtypes")
    convert_hf_to_mcore(hf, tmp_path / "ok", ParallelLayout(), dtype=torch.float32)  # explicit cast works


def test_unsupported_model_type(hf, tmp_path):
    cfg = json.loads((hf / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (hf / "config.json").write_text(json.dumps(cfg))
    _expect(hf, tmp_path, UnsupportedModelError, "supported: llama, qwen2")


def test_tp_must_divide_heads(hf, tmp_path):
    _expect(hf, tmp_path, LayoutError, "num_attention_heads=4", layout=ParallelLayout(tp=8))


def test_fewer_kv_heads_than_tp_round_trips(hf, tmp_path):
    """2 KV heads at TP=4: megatron-core 0.16.1 splits query groups across ranks (all-gathered at run time)."""
    convert_hf_to_mcore(hf, tmp_path / "m", ParallelLayout(tp=4))
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "back")
    ref, back = load_file(os.fspath(hf / "model.safetensors")), load_file(os.fspath(tmp_path / "back" / "model.safetensors"))
    assert sorted(ref) == sorted(back) and all(torch.equal(ref[k], back[k]) for k in ref)


def test_existing_target_is_refused(hf, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        convert_hf_to_mcore(hf, tmp_path / "out", ParallelLayout())
    assert list((tmp_path / "out").iterdir()) == []
    convert_hf_to_mcore(hf, tmp_path / "m", ParallelLayout(tp=2))
    (tmp_path / "back").mkdir()
    with pytest.raises(FileExistsError):
        convert_mcore_to_hf(tmp_path / "m", tmp_path / "back")


def test_damaged_megatron_checkpoint_is_refused(hf, tmp_path):
    convert_hf_to_mcore(hf, tmp_path / "m", ParallelLayout(tp=2))
    path = os.fspath(rank_file(tmp_path / "m", 1, 0))
    sd = load_file(path)
    sd.pop("decoder.layers.0.mlp.linear_fc2.weight")
    save_file(sd, path)
    with pytest.raises(CheckpointError, match="linear_fc2"):
        convert_mcore_to_hf(tmp_path / "m", tmp_path / "back")
    assert not (tmp_path / "back").exists()
    with pytest.raises(CheckpointError, match="no dapo_mcore_checkpoint.json"):
        convert_mcore_to_hf(tmp_path / "hf", tmp_path / "back2")


def test_failure_midway_leaves_no_target(hf, tmp_path, monkeypatch):
    from dapo_mcore.weights import mapping as mapping_mod

    calls = {"n": 0}
    real = mapping_mod.ModelMapping.shard_extents  # the no-cast path plans byte ranges instead of tensors

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 10:
            raise RuntimeError("disk on fire")
        return real(self, *a, **k)

    monkeypatch.setattr(mapping_mod.ModelMapping, "shard_extents", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_hf_to_mcore(hf, tmp_path / "out", ParallelLayout(tp=2))
    assert calls["n"] == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_background_write_failure_raises_and_leaves_no_target(hf, tmp_path, monkeypatch):
    from dapo_mcore.weights import staged_io

    def broken(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staged_io.os, "pwrite", broken)
    with pytest.raises(OutputPathError, match="No space left on device.*free space"):
        convert_hf_to_mcore(hf, tmp_path / "out", ParallelLayout(tp=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
