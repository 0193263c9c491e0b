"""Routing replay with activation recompute: at PP=2 (1F1B: stage 0 runs micro-batch 1's forward before micro-batch
0's backward) a tiny Qwen3-MoE replaying given routes trains to the same loss and gradient norm with
``model.recompute`` none, selective and full, and its log-prob pass routes every token as given. Before, a full
recompute replayed the routes of the last forward in every recomputed layer (and ``config`` refused the combination).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.dist_scripts.moe_workspace import REPO, free_port, write_moe_workspace

SCRIPT = REPO / "tests" / "dist_scripts" / "replay_recompute.py"


@pytest.mark.distributed
def test_replay_under_selective_and_full_recompute_trains_as_without(tmp_path):
    write_moe_workspace(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(SCRIPT), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        out = torch.load(tmp_path / f"out_rank{rank}.pt", weights_only=False)
        assert out["none"]["micro_batches"] >= 2  # 1F1B interleaves forwards and backwards
        for mode in ("none", "selective", "full"):
            assert out[mode]["mismatch"] == 0.0, (mode, out[mode]["mismatch"])
            for got, want in zip(out[mode]["metrics"], out["none"]["metrics"], strict=True):
                for key in ("loss", "grad_norm"):
                    assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (mode, key, got, want)
        assert out["none"]["metrics"][0]["grad_norm"] > 0
