"""slurm/env.sh and launch.sh settings that a cluster would reject or misapply (no Slurm needed: plain bash)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
SLURM = Path(__file__).resolve().parents[1] / "slurm"


def _env_after_sourcing(**env: str) -> dict[str, str]:
    out = subprocess.run(["bash", "-c", f"source {SLURM / 'env.sh'} && env -0"], env={"PATH": "/usr/bin:/bin", **env},
                         capture_output=True, check=True).stdout.decode()
    return dict(line.split("=", 1) for line in out.split("\0") if "=" in line)


def test_ib_retry_count_fits_its_3_bit_field():
    assert 0 <= int(_env_after_sourcing()["NCCL_IB_RETRY_CNT"]) <= 7


def test_one_socket_interface_setting_reaches_nccl_and_gloo_and_each_can_be_overridden():
    env = _env_after_sourcing()
    assert "NCCL_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in env
    env = _env_after_sourcing(DAPO_SOCKET_IFNAME="ib0")
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["GLOO_SOCKET_IFNAME"] == "ib0"
    env = _env_after_sourcing(DAPO_SOCKET_IFNAME="ib0", GLOO_SOCKET_IFNAME="eth0")
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_srun_gets_the_batch_cpus_per_task():
    text = (SLURM / "launch.sh").read_text()
    export = text.index("export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}")
    assert export < text.index("srun --kill-on-bad-exit")


def test_caches_go_to_the_shared_cache_root_offline_by_default_and_each_can_be_overridden():
    env = _env_after_sourcing(SLURM_SUBMIT_DIR="/shared/dapo-mcore")
    root = "/shared/dapo-mcore/.cache/dapo-mcore"
    assert env["DAPO_CACHE_ROOT"] == root and env["HF_HUB_OFFLINE"] == "1"
    assert {env[k] for k in ("HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT")} == {
        f"{root}/huggingface", f"{root}/triton", f"{root}/torchinductor", f"{root}/vllm"}
    env = _env_after_sourcing(DAPO_CACHE_ROOT="/lustre/c", TRITON_CACHE_DIR="/tmp/t", HF_HUB_OFFLINE="0")
    assert env["HF_HOME"] == "/lustre/c/huggingface" and env["TRITON_CACHE_DIR"] == "/tmp/t"
    assert env["HF_HUB_OFFLINE"] == "0"
