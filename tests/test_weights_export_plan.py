"""The export's copy plan (`weights.export_plan`) against the reference `transforms.merge`, per split and layout.

Every rank of the export ends up with what `assemble` builds on one process (each rank copies its own rows into
place, the others' rows arrive by the plan's sends), so `assemble` equal to `merge` is the export's result; the
sends must cover every HF row exactly once and carry exactly the sender's rows. Plans are cached on (split,
shapes, TP, geometry): the cache must hand back the same plan for the same layout and never another layout's.
"""

from __future__ import annotations

import pytest
import torch

from dapo_mcore.weights.export_plan import assemble, copy_plan
from dapo_mcore.weights.transforms import Geometry, Split, merge

pytestmark = pytest.mark.unit

HIDDEN, FFN = 10, 12


def _geo(num_kv_heads: int, tp: int) -> Geometry:
    # 8 heads, head_dim 3; vocab 37 padded to a multiple of 8 * tp (so TP 4 has a rank of padding only).
    padded = -(-37 // (8 * tp)) * 8 * tp
    return Geometry(num_heads=8, num_kv_heads=num_kv_heads, head_dim=3, vocab_size=37, padded_vocab_size=padded)


def _hf_shapes(split: Split, geo: Geometry, bias: bool) -> tuple[tuple[int, ...], ...]:
    q, kv = geo.num_heads * geo.head_dim, geo.num_kv_heads * geo.head_dim
    return {
        Split.REPLICATED: ((HIDDEN,),),
        Split.ROW: ((HIDDEN, FFN),),
        Split.VOCAB: ((geo.vocab_size, HIDDEN),),
        Split.GATE_UP: ((FFN, HIDDEN), (FFN, HIDDEN)),
        Split.QKV: ((q,), (kv,), (kv,)) if bias else ((q, HIDDEN), (kv, HIDDEN), (kv, HIDDEN)),
    }[split]


def _parts(split: Split, geo: Geometry, tp: int, bias: bool, seed: int) -> list[torch.Tensor]:
    """Each TP rank's Megatron tensor (random; replicated: equal on every rank, as Megatron keeps them)."""
    gen = torch.Generator().manual_seed(seed)
    qkv_rows = (geo.num_heads + 2 * geo.num_kv_heads) * geo.head_dim
    shape = {
        Split.REPLICATED: (HIDDEN,), Split.ROW: (HIDDEN, FFN // tp), Split.VOCAB: (geo.padded_vocab_size // tp, HIDDEN),
        Split.GATE_UP: (2 * FFN // tp, HIDDEN), Split.QKV: (qkv_rows // tp,) if bias else (qkv_rows // tp, HIDDEN),
    }[split]
    parts = [torch.randn(shape, generator=gen) for _ in range(tp)]
    return [parts[0].clone() for _ in range(tp)] if split is Split.REPLICATED else parts


CASES = [(Split.REPLICATED, False), (Split.ROW, False), (Split.VOCAB, False), (Split.GATE_UP, False),
         (Split.QKV, False), (Split.QKV, True)]
NAMES = {Split.REPLICATED: ("n",), Split.ROW: ("w",), Split.VOCAB: ("e",), Split.GATE_UP: ("g", "u"),
         Split.QKV: ("q", "k", "v")}


# KV heads 4: TP 1/2 hold 4/2 whole groups per rank, TP 4 one; KV heads 2 at TP 4: half a group per rank.
@pytest.mark.parametrize("kv,tp", [(4, 1), (4, 2), (4, 4), (2, 4)])
@pytest.mark.parametrize("split,bias", CASES)
def test_assembled_plan_equals_reference_merge(split, bias, kv, tp):
    geo = _geo(kv, tp)
    parts = _parts(split, geo, tp, bias, seed=tp + kv)
    plan = copy_plan(split, _hf_shapes(split, geo, bias), tp, geo)
    want = merge(split, [p.clone() for p in parts], NAMES[split], geo)
    got = assemble(plan, parts)
    assert len(got) == len(want)
    for g, (name, w) in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.equal(g, w), name


@pytest.mark.parametrize("kv,tp", [(4, 2), (4, 4), (2, 4)])
@pytest.mark.parametrize("split,bias", [c for c in CASES if c[0] is not Split.ROW])
def test_sends_cover_every_row_once_with_the_senders_rows(split, bias, kv, tp):
    geo = _geo(kv, tp)
    parts = _parts(split, geo, tp, bias, seed=3)
    plan = copy_plan(split, _hf_shapes(split, geo, bias), tp, geo)
    outs = assemble(plan, parts)
    cover = [torch.zeros(s[0], dtype=torch.int64) for s in plan.shapes]
    for send in plan.sends:
        cover[send.out][send.dst:send.dst + send.rows] += 1
        rows = sum(r.rows for r in plan.runs[send.rank] if r.out == send.out)
        assert rows == send.rows  # the sender's own copy fills exactly the rows it sends
        if send.src >= 0:  # sent straight from the Megatron tensor: must be the same rows
            assert torch.equal(parts[send.rank][send.src:send.src + send.rows],
                               outs[send.out][send.dst:send.dst + send.rows])
    assert all(bool((c == 1).all()) for c in cover)
    assert len({(s.rank, s.out) for s in plan.sends}) == len(plan.sends)


def test_plan_cache_is_keyed_on_the_layout():
    shapes = _hf_shapes(Split.QKV, _geo(4, 2), bias=False)
    assert copy_plan(Split.QKV, shapes, 2, _geo(4, 2)) is copy_plan(Split.QKV, shapes, 2, _geo(4, 2))
    tp2, tp4 = copy_plan(Split.QKV, shapes, 2, _geo(4, 2)), copy_plan(Split.QKV, shapes, 4, _geo(4, 4))
    assert tp2.tp == 2 and tp4.tp == 4 and tp2.sends != tp4.sends
    # Same TP, other geometry (vocab padding follows make_vocab_size_divisible_by): a plan of its own.
    vshape = _hf_shapes(Split.VOCAB, _geo(4, 2), bias=False)
    wide = Geometry(8, 4, 3, 37, 64)
    a, b = copy_plan(Split.VOCAB, vshape, 2, _geo(4, 2)), copy_plan(Split.VOCAB, vshape, 2, wide)
    assert [(s.dst, s.rows) for s in a.sends] == [(0, 24), (24, 13)]  # padded to 48
    assert [(s.dst, s.rows) for s in b.sends] == [(0, 32), (32, 5)]  # padded to 64
    parts = _parts(Split.VOCAB, wide, 2, False, seed=5)
    assert torch.equal(assemble(b, parts)[0], merge(Split.VOCAB, parts, ("e",), wide)[0][1])


def test_padding_only_rank_sends_nothing():
    geo = _geo(4, 4)  # vocab 37 padded to 64: rank 3 holds rows 48..63, all padding
    plan = copy_plan(Split.VOCAB, _hf_shapes(Split.VOCAB, geo, False), 4, geo)
    assert [(s.rank, s.dst, s.rows) for s in plan.sends] == [(0, 0, 16), (1, 16, 16), (2, 32, 5)]
    assert plan.runs[3] == ()
