"""The load's log line says "resharded" only when the split moved (a same-layout load whose vocabulary rule's
divisor differs, with the same rows, is a plain load)."""

from __future__ import annotations

import pytest

from dapo_mcore.weights.layout import ParallelLayout
from dapo_mcore.weights.live import describe_load

pytestmark = pytest.mark.unit


def test_a_same_layout_load_is_not_called_resharded():
    saved = ParallelLayout(tp=2, pp=1, make_vocab_size_divisible_by=128)
    live = ParallelLayout(tp=2, pp=1, make_vocab_size_divisible_by=64)  # another divisor, the same padded rows
    assert describe_load(saved, live, 256, 256) == ""


def test_a_moved_split_a_renamed_spec_and_a_repadded_vocabulary_are_named():
    saved = ParallelLayout(tp=1, pp=2, layer_spec="local")
    live = ParallelLayout(tp=2, pp=1, layer_spec="transformer_engine")
    text = describe_load(saved, live, 256, 384)
    assert "(resharded from tp=1 pp=2 vpp=1)" in text and "local layer spec mapped to transformer_engine" in text
    assert "256 rows" in text and "384 rows" in text
