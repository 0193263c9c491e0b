"""Qwen3-MoE with expert parallelism on 2 gloo ranks: logits against Hugging Face's own
``Qwen3MoeForCausalLM`` at EP=2, a short DAPO run at EP=2 with router metrics, and its resume at EP=1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


@pytest.mark.distributed
def test_verify_at_ep2_matches_transformers(tmp_path, cli_env):
    """`conversion.verify --ep 2`: every rank holds half the experts, tokens cross by all-to-all; the logits equal
    HF's within fp32 rounding (the near-tied router pairs would show a swapped expert or a different top-k)."""
    from conversion.synthetic_moe import save_tiny_moe_model

    save_tiny_moe_model(tmp_path / "hf")
    proc = subprocess.run([*TORCHRUN, "-m", "conversion.verify", "--hf", str(tmp_path / "hf"), "--ep", "2",
                           "--json", str(tmp_path / "v.json")], cwd=REPO, env=cli_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads((tmp_path / "v.json").read_text())
    assert stats["max_abs_diff"] < 1e-5 and stats["top1_agreement"] == 1.0


def _train(cli_env, run_dir: Path, base: Path, *extra: str, nproc: int) -> subprocess.CompletedProcess:
    launch = TORCHRUN[:-1] + [str(nproc)] if nproc > 1 else [sys.executable]
    return subprocess.run([*launch, "-m", "dapo_mcore.cli", "train", "examples/tiny_cpu.yaml", "model.tiny_base=false",
                           f"model.hf_path={base}", "eval.every=0", "eval.at_start=false", "eval.max_prompts=8", "checkpoint.every=1",
                           f"run.dir={run_dir}", *extra], cwd=REPO, env=cli_env, capture_output=True, text=True,
                          timeout=1200)


@pytest.mark.e2e
def test_dapo_at_ep2_then_resume_at_ep1(tmp_path, cli_env):
    """Two DAPO steps at EP=2 (experts and their Adam moments split over the ranks, rank files per EP rank), router
    metrics logged each step; the run then resumes at EP=1 in one process for a third step."""
    from conversion.synthetic_moe import save_tiny_moe_base

    base = save_tiny_moe_base(tmp_path / "base", steps=120)
    run = tmp_path / "run"
    proc = _train(cli_env, run, base, "parallel.expert_parallel=2", "train.steps=2", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = run / "checkpoints" / "step_000002" / "model"
    assert sorted(p.name for p in model.glob("mp_rank_*")) == ["mp_rank_00_000_000", "mp_rank_00_000_001"]
    assert sorted(p.name for p in (model.parent / "optim" / "exp_avg").glob("mp_rank_*")) == \
        ["mp_rank_00_000_000", "mp_rank_00_000_001"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "moe/load_max_over_mean" in r]
    assert len(steps) == 2
    for r in steps:  # 4 experts: max/mean lies in [1, 4]; the aux loss (num_experts * sum f_i P_i) is >= 1
        assert 1.0 <= r["moe/load_max_over_mean"] <= 4.0 and r["moe/aux_loss"] >= 0.99
        assert r["mismatch/logp_abs_diff_max"] < 1e-4  # engine (HF, fused experts) and trainer (EP=2) agree
    proc = _train(cli_env, run, base, "parallel.expert_parallel=1", "train.steps=3", nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed step_000002" in proc.stderr
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["mismatch/logp_abs_diff_max"] < 1e-4
