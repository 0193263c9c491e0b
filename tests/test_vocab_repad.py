"""A checkpoint of one vocabulary padding loads into a model of the other (model.mcore_path, resume at another
rule): the padding rows are stripped and re-added, the real rows move bit for bit, and the logits of the real
vocabulary do not change. Checkpoints written by older versions name no rule: they read as Megatron-LM's."""

from __future__ import annotations

import json

import pytest
import torch

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.synthetic import save_tiny_hf_model
from dapo_mcore.weights.checkpoint import METADATA_FILE, read_meta
from dapo_mcore.weights.layout import ParallelLayout
from dapo_mcore.weights.reshard import read_rank_resharded

pytestmark = pytest.mark.unit

EMBED, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


def _hf(tmp_path, vocab: int):
    model = save_tiny_hf_model(tmp_path / "hf", seed=5, vocab_size=vocab, tie_word_embeddings=False)
    sd = model.state_dict()
    return model, sd["model.embed_tokens.weight"], sd["lm_head.weight"]


def _as_pre_38(directory) -> None:
    """Rewrite the metadata as dapo-mcore wrote it before the padding rule was recorded (no vocab_padding key)."""
    path = directory / METADATA_FILE
    data = json.loads(path.read_text())
    assert data.pop("vocab_padding") == "megatron"
    path.write_text(json.dumps(data))


def _rows(directory, layout: ParallelLayout, key: str) -> list[torch.Tensor]:
    return [read_rank_resharded(directory, layout, t, 0)[key] for t in range(layout.tp)]


@pytest.mark.parametrize("vocab", [32, 37])  # 37: odd, the tp rule pads it by one row at TP 2
def test_old_megatron_checkpoint_reshards_into_tp_padding_and_back(tmp_path, vocab):
    _, embed, head = _hf(tmp_path, vocab)
    old = ParallelLayout(tp=2, make_vocab_size_divisible_by=64, vocab_padding="megatron")
    convert_hf_to_mcore(tmp_path / "hf", tmp_path / "old", old)
    _as_pre_38(tmp_path / "old")
    meta = read_meta(tmp_path / "old")
    assert meta.layout == old and meta.padded_vocab_size == 128

    new = ParallelLayout(tp=2, make_vocab_size_divisible_by=64, vocab_padding="tp")
    want_rows = vocab if vocab % 2 == 0 else vocab + 1
    for key, ref in ((EMBED, embed), (OUTPUT, head)):
        parts = _rows(tmp_path / "old", new, key)
        assert [p.shape[0] for p in parts] == [want_rows // 2] * 2
        full = torch.cat(parts)
        assert torch.equal(full[:vocab], ref)  # real rows bit for bit
        assert not full[vocab:].any()  # the one padding row of an odd vocabulary is zero

    # and a tp-padded checkpoint into a Megatron-LM-padded model: the real rows, then zeros up to 128
    convert_hf_to_mcore(tmp_path / "hf", tmp_path / "tp", new)
    assert read_meta(tmp_path / "tp").padded_vocab_size == want_rows
    for key, ref in ((EMBED, embed), (OUTPUT, head)):
        full = torch.cat(_rows(tmp_path / "tp", old, key))
        assert full.shape[0] == 128 and torch.equal(full[:vocab], ref) and not full[vocab:].any()


def test_old_padding_mcore_path_loads_into_a_tp_model_with_equal_logits(tmp_path):
    """What the actor does with model.mcore_path (load_megatron_checkpoint_into_model, reshard=True, the config's
    padding): an older version's checkpoint of 64 rows loads into a model of 32, whose logits equal the 64-row model's on
    the real vocabulary (and Hugging Face's)."""
    from conversion.verify import megatron_logits
    from dapo_mcore.actor.parallel import init_distributed, init_model_parallel, read_launch_env, shutdown
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config
    from dapo_mcore.weights.live import live_tensors, load_megatron_checkpoint_into_model

    model, embed, _ = _hf(tmp_path, 32)
    convert_hf_to_mcore(tmp_path / "hf", tmp_path / "old",
                        ParallelLayout(make_vocab_size_divisible_by=64, vocab_padding="megatron"))
    _as_pre_38(tmp_path / "old")
    hf_config = read_meta(tmp_path / "old").hf_config
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))
    init_distributed(read_launch_env(), "gloo")
    try:
        init_model_parallel(1, 1, None, seed=1)
        tconfig = transformer_config(hf_config)
        old_model = build_gpt_model(hf_config, tconfig, make_vocab_size_divisible_by=64, vocab_padding="megatron")
        load_megatron_checkpoint_into_model(old_model, tmp_path / "old")  # its own layout, no reshard
        tp_model = build_gpt_model(hf_config, tconfig, make_vocab_size_divisible_by=64, vocab_padding="tp")
        meta = load_megatron_checkpoint_into_model(tp_model, tmp_path / "old", reshard=True,
                                                   make_vocab_size_divisible_by=64, vocab_padding="tp")
        assert meta.layout.vocab_padding == "megatron"
        params = live_tensors(tp_model, ParallelLayout())
        assert params[EMBED].shape[0] == 32 and torch.equal(params[EMBED].detach(), embed)
        assert live_tensors(old_model, ParallelLayout())[EMBED].shape[0] == 64
        with torch.no_grad():
            got, want = megatron_logits(tp_model, ids, 32), megatron_logits(old_model, ids, 32)
            ref = model(ids).logits
    finally:
        shutdown()
    assert got.shape == want.shape == (2, 12, 32)
    assert torch.equal(got, want)
    assert (got - ref).abs().max() < 1e-5


@pytest.mark.parametrize("flags, rows", [((), 38), (("--vocab-padding", "megatron"), 256),
                                         (("--vocab-padding", "megatron", "--vocab-divisible-by", "16"), 64)])
def test_cli_vocab_padding_and_mcore_to_hf_reads_both(tmp_path, flags, rows):
    """`convert hf-to-mcore` pads by --vocab-padding (default tp) and records it; mcore-to-hf gives HF back bit for
    bit whichever rule (it reads the padded size from the metadata). Vocabulary 37 at TP 2: tp pads to 38."""
    from safetensors.torch import load_file

    from conversion.hf_to_mcore import main as hf_to_mcore_main
    from conversion.mcore_to_hf import main as mcore_to_hf_main

    model, _, _ = _hf(tmp_path, 37)
    assert hf_to_mcore_main(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m"), "--tp", "2",
                             "--no-progress", *flags]) == 0
    meta = read_meta(tmp_path / "m")
    assert meta.layout.vocab_padding == ("tp" if not flags else "megatron") and meta.padded_vocab_size == rows
    assert mcore_to_hf_main(["--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "back"), "--no-progress"]) == 0
    got = {k: v for f in sorted((tmp_path / "back").glob("*.safetensors")) for k, v in load_file(f).items()}
    ref = model.state_dict()
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
