"""The vocabulary padding rules (model.vocab) against a naive reference: count rows up one at a time."""

from __future__ import annotations

import json

import pytest

from dapo_mcore.config import Config, ConfigError, load_config
from dapo_mcore.model.qwen import VOCAB_PADDINGS, padded_vocab_size
from dapo_mcore.weights.checkpoint import CheckpointMeta
from dapo_mcore.weights.layout import LayoutError, ParallelLayout

pytestmark = pytest.mark.unit


def naive_padded(vocab: int, divisible_by: int, tp: int, padding: str) -> int:
    """Megatron-LM: first size >= vocab that divisible_by * tp divides. tp: the vocabulary itself if tp divides it,
    else the first size >= vocab that d * tp divides, d the largest power of two <= divisible_by dividing vocab."""
    if padding == "tp":
        if vocab % tp == 0:
            return vocab
        d = max(2 ** k for k in range(0, 20) if 2 ** k <= divisible_by and vocab % 2 ** k == 0)
        multiple = d * tp
    else:
        multiple = divisible_by * tp
    rows = vocab
    while rows % multiple:
        rows += 1
    return rows


def test_rules_match_the_naive_reference():
    for padding in VOCAB_PADDINGS:
        for vocab in (*range(1, 300), 151_936, 151_643, 152_064, 32_000, 50_257, 128_256):
            for tp in (1, 2, 3, 4, 6, 8):
                for div in (1, 16, 48, 128):
                    got = padded_vocab_size(vocab, div, tp, padding)
                    assert got == naive_padded(vocab, div, tp, padding), (vocab, div, tp, padding)
                    assert got >= vocab and got % tp == 0


def test_qwen25_vocabulary():
    # 151,936 = 2^7 x 1187: every TP up to 8 divides it, so the tp rule never pads (what Megatron-Bridge builds)
    assert [padded_vocab_size(151_936, 128, tp, "tp") for tp in (1, 2, 4, 8)] == [151_936] * 4
    # Megatron-LM's rule pads to a multiple of 128 x tp from TP 2 on
    assert [padded_vocab_size(151_936, 128, tp, "megatron") for tp in (1, 2, 4, 8)] == [151_936, 152_064, 152_064, 152_576]


def test_odd_vocabulary_at_tp2():
    # 50,257 is odd: the largest power-of-two divisor is 1, so the tp rule pads by one row to be split in two
    assert padded_vocab_size(50_257, 128, 2, "tp") == 50_258
    assert padded_vocab_size(50_257, 128, 2, "megatron") == 50_432
    # 2 x odd at TP 4: divisor 2, next multiple of 8
    assert padded_vocab_size(1_000_002, 128, 4, "tp") == 1_000_008


def test_default_keeps_megatron_rule_and_unknown_rule_is_refused():
    assert padded_vocab_size(151_936, 128, 2) == 152_064  # existing callers keep their meaning
    with pytest.raises(ValueError, match="choose one of tp, megatron"):
        padded_vocab_size(32, 16, 1, "bridge")


def test_config_default_is_tp_and_validation_names_the_fix():
    assert Config().model.vocab_padding == "tp"
    assert load_config(None, ["model.vocab_padding=megatron"]).model.vocab_padding == "megatron"
    with pytest.raises(ConfigError, match="model.vocab_padding"):  # the YAML / override path: the type check
        load_config(None, ["model.vocab_padding=bridge"])
    cfg = Config()
    cfg.model.tiny_base = True
    cfg.model.vocab_padding = "bridge"  # built in Python: validate() names the fix
    with pytest.raises(ConfigError, match=r"model.vocab_padding='bridge' is unknown; use tp .* or megatron"):
        cfg.model.validate()


def test_layout_records_the_rule_and_old_metadata_reads_as_megatron():
    layout = ParallelLayout(tp=2, make_vocab_size_divisible_by=128, vocab_padding="tp")
    assert layout.as_dict()["vocab_padding"] == "tp"
    meta = CheckpointMeta({"vocab_size": 151_936}, layout, 151_936, "bfloat16")
    assert CheckpointMeta.from_json(json.loads(json.dumps(meta.to_json()))).layout == layout
    old = meta.to_json()
    del old["vocab_padding"]  # metadata written by older versions
    assert CheckpointMeta.from_json(old).layout.vocab_padding == "megatron"
    with pytest.raises(LayoutError, match="unknown vocab_padding 'x'; choose one of tp, megatron"):
        ParallelLayout(vocab_padding="x").validate()
