"""The exporter's one-buffer merge (`export.merge_gathered`) against the reference `transforms.merge`, per split."""

from __future__ import annotations

import pytest
import torch

from dapo_mcore.weights.export import merge_gathered
from dapo_mcore.weights.transforms import Geometry, Split, merge

pytestmark = pytest.mark.unit

# 8 heads in 4 query groups (GQA), head_dim 3; vocab 37 padded to 48.
GEO = Geometry(num_heads=8, num_kv_heads=4, head_dim=3, vocab_size=37, padded_vocab_size=48)
HIDDEN, FFN = 10, 12
QKV_ROWS = (GEO.num_heads + 2 * GEO.num_kv_heads) * GEO.head_dim


def _local_shape(split: Split, tp: int, bias: bool) -> tuple[int, ...]:
    """One TP rank's Megatron tensor shape for each kind of split."""
    return {
        Split.REPLICATED: (HIDDEN,),
        Split.ROW: (HIDDEN, FFN // tp),
        Split.VOCAB: (GEO.padded_vocab_size // tp, HIDDEN),
        Split.GATE_UP: (2 * FFN // tp, HIDDEN),
        Split.QKV: (QKV_ROWS // tp,) if bias else (QKV_ROWS // tp, HIDDEN),
    }[split]


NAMES = {Split.REPLICATED: ("n",), Split.ROW: ("w",), Split.VOCAB: ("e",), Split.GATE_UP: ("g", "u"),
         Split.QKV: ("q", "k", "v")}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("split,bias", [(Split.REPLICATED, False), (Split.ROW, False), (Split.VOCAB, False),
                                        (Split.GATE_UP, False), (Split.QKV, False), (Split.QKV, True)])
def test_merge_gathered_equals_reference_merge(split, bias, tp):
    gen = torch.Generator().manual_seed(tp)
    shape = _local_shape(split, tp, bias)
    parts = [torch.randn(shape, generator=gen) for _ in range(tp)]
    if split is Split.REPLICATED:
        parts = [parts[0].clone() for _ in range(tp)]
    flat = torch.cat(parts)  # what all_gather_into_tensor leaves in the buffer: ranks stacked on dim 0
    want = merge(split, [p.clone() for p in parts], NAMES[split], GEO)
    got = merge_gathered(split, flat, tp, NAMES[split], GEO)
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, g), (_, w) in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.equal(g, w), name
        assert g.untyped_storage().data_ptr() != parts[0].untyped_storage().data_ptr()


def test_vocab_merge_is_a_view_without_padding():
    parts = [torch.randn(GEO.padded_vocab_size // 2, HIDDEN) for _ in range(2)]
    flat = torch.cat(parts)
    (_, out), = merge_gathered(Split.VOCAB, flat, 2, ("e",), GEO)
    assert out.shape == (GEO.vocab_size, HIDDEN) and out.is_contiguous()
    assert out.data_ptr() == flat.data_ptr()  # no copy of the largest tensors
