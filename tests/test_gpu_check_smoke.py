"""benchmarks/gpu_check.py end to end in its CPU smoke mode: every section runs, the JSON and the table agree.

The GPU check is run once, by a session that has a lent GPU; this proves its plumbing (subprocess sections, time
budget, result files, the closing table) on any machine beforehand, plus the pure helpers it is built from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import SECTIONS, parse_pytest_counts, summary_lines
from benchmarks.gpu_measure import diff_stats, parity_verdict

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_check")
    out, work = root / "out", root / "work"
    env_cache = root / "cache"  # the smoke tiny base (4 pre-training steps) is built here, not in the user's cache
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(out),
                           "--workdir", str(work)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DAPO_MCORE_CACHE": str(env_cache)})
    return proc, out


def test_every_section_ran_and_passed(smoke):
    proc, out = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["smoke"] is True
    assert list(report["sections"]) == list(SECTIONS)
    for name, section in report["sections"].items():
        assert section["status"] == "ok", (name, section.get("error"))
        assert section["seconds"] > 0
    # at most 8 files come back from the device machine: everything the check writes must fit
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["gpu_check.json", "parity.log", "throughput.log", "pytest.log", "tiny_device.log", "tiny_cpu.log"])


def test_sections_hold_their_numbers(smoke):
    _, out = smoke
    s = json.loads((out / "gpu_check.json").read_text())["sections"]
    assert s["env"]["megatron-core"] and s["env"]["zarr"]
    lora = s["lora"]  # benchmarks/gpu_lora_merge.py in its CPU mode
    assert lora["device"] == "cpu" and lora["layers"] == 8 and lora["base_params_with_grad"] == 0
    assert lora["adapter_params_with_grad"] == lora["adapter_params"] == 16
    assert lora["merge_vs_naive_fp32_max_abs_diff"] < 1e-5 < lora["delta_max_abs"]
    assert lora["export_tensors_outside_one_rounding"] == 0 and lora["merge_ms"] > 0
    assert lora["export_tensors_changed_by_merge"] == lora["export_tensors_the_naive_merge_changes"] == 14
    stats = s["parity"]["stats"]
    assert stats["megatron_vs_hf_bf16"]["tokens"] == stats["hf_bf16_vs_hf_fp32"]["tokens"] > 0
    assert s["parity"]["ref_logp_std"] > 0.1
    rows = s["throughput"]["rows"]
    assert [(r["model"], r["budget"]) for r in rows] == [("tiny", 64), ("tiny", 128), ("tiny-wide", 64),
                                                         ("tiny-wide", 128)]
    for r in rows:
        assert r["status"] == "ok" and r["train_tok_s"] > 0 and r["logp_tok_s"] > 0 and r["loss_finite"]
        assert r["micro_batches"] == -(-256 // r["budget"])  # 8 sequences of 32 tokens per budget
    assert s["throughput"]["matmul"]["tflops"] > 0
    assert s["pytest"]["counts"].get("skipped", 0) >= 1 and s["pytest"]["exit_code"] == 0  # no CUDA here
    for run in ("device", "cpu"):
        assert s["tiny"][run]["exit_code"] == 0 and s["tiny"][run]["steps_done"] == 1
        assert s["tiny"][run]["backend"] == "gloo"


def test_the_table_comes_last(smoke):
    proc, _ = smoke
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == f"gpu_check_sections_ok: {len(SECTIONS)}/{len(SECTIONS)}"
    table = lines[lines.index("GPU check summary (SMOKE: CPU, tiny shapes; not GPU numbers)"):]
    for name in SECTIONS:
        assert any(line.startswith(f"{name} ") and " ok " in line for line in table), name


def test_a_failed_section_is_reported_as_failed():
    report = {"smoke": False, "sections": {
        "env": {"status": "ok", "seconds": 1.0, "torch": "x", "megatron-core": "y", "transformers": "z"},
        "parity": {"status": "FAILED", "seconds": 2.0, "error": "RuntimeError: boom"},
        "throughput": {"status": "SKIPPED", "error": "budget: 3 s left for it"}}}
    lines = summary_lines(report)
    assert any(line.startswith("parity") and "FAILED" in line and "boom" in line for line in lines)
    assert any(line.startswith("throughput") and "SKIPPED" in line for line in lines)
    assert lines[-1] == f"gpu_check_sections_ok: 1/{len(SECTIONS)}"


def test_parity_verdict_against_the_bf16_noise_floor():
    want = [torch.linspace(-12.0, -10.0, 50)]
    noise = [w + 0.01 * torch.sin(torch.arange(50.0)) for w in want]
    shifted = [w + 0.3 for w in want]  # e.g. a position or mask bug: far beyond bf16 rounding
    floor = diff_stats(noise, want)
    good = {"megatron_vs_hf_fp32": diff_stats(noise, want), "megatron_vs_hf_bf16": diff_stats(noise, noise),
            "hf_bf16_vs_hf_fp32": floor}
    bad = {"megatron_vs_hf_fp32": diff_stats(shifted, want), "megatron_vs_hf_bf16": diff_stats(shifted, noise),
           "hf_bf16_vs_hf_fp32": floor}
    assert parity_verdict(good)[0] and not parity_verdict(bad)[0]
    assert diff_stats(shifted, want)["max"] == pytest.approx(0.3, abs=1e-5)


def test_pytest_counts_parse_the_closing_line():
    text = "....\n=== 3 passed, 1 skipped, 700 deselected, 2 warnings in 9.10s ===\n"
    assert parse_pytest_counts(text) == {"passed": 3, "skipped": 1, "deselected": 700, "warnings": 2}
    assert parse_pytest_counts("1 failed, 1 error in 2s") == {"failed": 1, "error": 1}
    assert parse_pytest_counts("no summary") == {}
