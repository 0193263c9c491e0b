"""What the conversion tests of every model family share: reading a safetensors directory, a bit-exact file round
trip at a layout, and ``conversion.verify`` run as a user runs it (one process or ``torchrun``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.mcore_to_hf import convert_mcore_to_hf
from dapo_mcore.weights import ParallelLayout

REPO = Path(__file__).resolve().parents[1]


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``path``."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(os.fspath(f)))
    return out


def assert_round_trip(hf_dir: Path, tmp_path: Path, layout: ParallelLayout, max_shard_bytes: int) -> Path:
    """HF -> Megatron at ``layout`` -> HF gives back every tensor bit for bit, with its dtype; the Megatron dir."""
    ref = load_dir(hf_dir)
    convert_hf_to_mcore(hf_dir, tmp_path / "mcore", layout)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", max_shard_bytes=max_shard_bytes)
    got = load_dir(tmp_path / "back")
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    return tmp_path / "mcore"


def run_verify(tmp_path: Path, *args: str, nproc: int = 1, timeout: int = 600) -> tuple[int, dict, str]:
    """``python -m conversion.verify ARGS --json FILE`` (under ``torchrun`` for ``nproc`` > 1): exit code, the JSON
    it wrote, the tail of its stderr."""
    out = tmp_path / f"verify{len(list(tmp_path.glob('verify*.json')))}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 \
        else [sys.executable]
    proc = subprocess.run([*launcher, "-m", "conversion.verify", *args, "--json", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    stats = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, stats, proc.stderr[-3000:]


def assert_verify_fp32_tp2_pp2_and_bf16(tmp_path: Path, hf: Path, seq_len: int = 24) -> None:
    """fp32 at TP=2 x PP=2 (4 processes) within 1e-5 of HF with every top-1 token the same; bf16 in one process
    within verify's own tolerance, not bit-equal (a bf16 run that matched exactly would not be bf16)."""
    rc, stats, err = run_verify(tmp_path, "--hf", str(hf), "--tp", "2", "--pp", "2", "--seq-len", str(seq_len), nproc=4)
    assert rc == 0, err
    assert stats["max_abs_diff"] < 1e-5 and stats["top1_agreement"] == 1.0, stats
    rc, stats, err = run_verify(tmp_path, "--hf", str(hf), "--dtype", "bfloat16", "--seq-len", str(seq_len))
    assert rc == 0, err
    assert stats["top1_agreement"] >= 0.95 and 0 < stats["max_abs_diff"] <= stats["atol"], stats
