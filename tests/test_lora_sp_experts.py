"""LoRA on Megatron's parallel linears at TP=2 with sequence parallelism and as experts (explicit expert
communication): output, input gradient and adapter gradients equal a dense reference on whole matrices.

The full model's sequence parallelism needs Transformer Engine's norms (the local spec's torch RMSNorm has none) and
its experts' transfers a token dispatcher; here the layers run alone (tests/dist_scripts/lora_sp_experts.py) and the
test reassembles what the neighbours would: sequence chunks, row/column blocks, and the dispatcher's sums.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.dist_scripts import harness

pytestmark = pytest.mark.distributed
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks():
    out = Path(tempfile.mkdtemp(prefix="dapo_lora_sp_"))
    try:
        harness._wait(harness._launch([str(harness.HERE / "lora_sp_experts.py"), str(out)], nproc=2), "LoRA SP/experts")
        yield [torch.load(out / f"sp_experts_rank{r}.pt", weights_only=False) for r in range(2)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _d(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_the_cases_take_the_paths_they_name(ranks):
    for r in ranks:
        assert r["column_sp"]["sp"] and r["row_sp"]["sp"] and not r["column_sp"]["explicit"]
        assert r["column_expert"]["explicit"] and r["row_expert"]["explicit"] and not r["row_expert"]["sp"]
        assert all(r[k]["base_grad"] is None for k in r if k != "ref")  # the base is frozen


def test_column_parallel_with_sequence_parallelism(ranks):
    ref, parts = ranks[0]["ref"], [r["column_sp"] for r in ranks]
    assert _d(torch.cat([p["y"] for p in parts], -1), ref["y"]) < TOL        # output rows split over TP
    assert _d(torch.cat([p["dx"] for p in parts], 0), ref["dx"]) < TOL       # input split along the sequence
    assert max(_d(p["da"], ref["da"]) for p in parts) < TOL                   # A whole on every rank
    assert _d(torch.cat([p["db"] for p in parts], 0), ref["db"]) < TOL


def test_row_parallel_with_sequence_parallelism(ranks):
    ref, parts = ranks[0]["ref"], [r["row_sp"] for r in ranks]
    assert _d(torch.cat([p["y"] for p in parts], 0), ref["y"]) < TOL         # output reduce-scattered: sequence
    assert _d(torch.cat([p["dx"] for p in parts], -1), ref["dx"]) < TOL
    assert _d(torch.cat([p["da"] for p in parts], -1), ref["da"]) < TOL
    assert max(_d(p["db"], ref["db"]) for p in parts) < TOL


def test_column_parallel_expert(ranks):
    ref, parts = ranks[0]["ref"], [r["column_expert"] for r in ranks]
    assert _d(torch.cat([p["y"] for p in parts], -1), ref["y"]) < TOL
    assert _d(sum(p["dx"] for p in parts), ref["dx"]) < TOL                   # the dispatcher sums input grads
    assert max(_d(p["da"], ref["da"]) for p in parts) < TOL
    assert _d(torch.cat([p["db"] for p in parts], 0), ref["db"]) < TOL


def test_row_parallel_expert(ranks):
    ref, parts = ranks[0]["ref"], [r["row_expert"] for r in ranks]
    assert _d(sum(p["y"] for p in parts), ref["y"]) < TOL                     # the dispatcher sums the outputs
    assert _d(torch.cat([p["dx"] for p in parts], -1), ref["dx"]) < TOL
    assert _d(torch.cat([p["da"] for p in parts], -1), ref["da"]) < TOL
    assert max(_d(p["db"], ref["db"]) for p in parts) < TOL
