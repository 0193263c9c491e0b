"""The GPU stack pins (pyproject gpu extra, slurm/constraints-gpu.txt) agree with the start-up check, and the
check refuses an unsupported version in one line."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from dapo_mcore.model.fp8 import MissingGPUExtra
from dapo_mcore.model.gpu_stack import SUPPORTED, check_gpu_stack, release
from dapo_mcore.rollout.engines.vllm_engine import SUPPORTED_VLLM

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def _loads(name: str) -> None:
    return None


def _fake(versions: dict[str, str]):
    return lambda names: next((versions[n] for n in names if n in versions), None)


@pytest.mark.parametrize(("versions", "bad"), [
    ({"megatron-core": "0.16.1", "transformer-engine": "2.11.0", "vllm": "0.33.0"}, None),
    ({"megatron-core": "0.16.1", "transformer_engine": "2.9.0+a1b2c3", "vllm": "0.20.1"}, None),
    ({"megatron-core": "0.17.1", "transformer-engine": "2.11.0", "vllm": "0.33.0"}, None),  # clusters on Python 3.12
    ({"megatron-core": "0.19.2", "transformer-engine": "2.11.0", "vllm": "0.33.0"}, None),  # CI's newest tier
    ({"megatron-core": "0.20.0", "transformer-engine": "2.11.0", "vllm": "0.33.0"}, "megatron-core 0.20.0"),
    ({"megatron-core": "0.16.1", "transformer-engine": "2.11.0", "vllm": "0.20.0"}, "vllm 0.20.0"),
    ({"megatron-core": "0.16.1", "transformer-engine": "2.2.0", "vllm": "0.33.0"}, "transformer-engine 2.2.0"),
    ({"megatron-core": "0.16.1", "transformer-engine": "2.20.2", "vllm": "0.33.0"}, "transformer-engine 2.20.2"),
    ({"megatron-core": "0.16.1", "transformer-engine": "2.11.0", "vllm": "0.10.1"}, "vllm 0.10.1"),
    ({"megatron-core": "0.15.0", "transformer-engine": "2.11.0", "vllm": "0.33.0"}, "megatron-core 0.15.0"),
])
def test_check_refuses_unsupported_versions_in_one_line(versions, bad):
    if bad is None:
        check_gpu_stack(transformer_engine=True, vllm=True, installed=_fake(versions), import_module=_loads)
        return
    with pytest.raises(MissingGPUExtra) as err:
        check_gpu_stack(transformer_engine=True, vllm=True, installed=_fake(versions), import_module=_loads)
    assert str(err.value).startswith(bad) and "\n" not in str(err.value)
    assert "constraints-gpu.txt" in str(err.value)


def test_packages_the_run_does_not_use_are_not_checked():
    check_gpu_stack(transformer_engine=False, vllm=False,
                    installed=_fake({"megatron-core": "0.16.1", "transformer-engine": "1.0", "vllm": "0.1"}))


def test_this_machine_passes_the_cpu_check():
    check_gpu_stack(transformer_engine=False, vllm=False)


def test_constraints_file_pins_lie_inside_the_checked_ranges():
    pins = {}
    for line in (ROOT / "slurm" / "constraints-gpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name] = version
    assert set(pins) == set(SUPPORTED)
    for name, version in pins.items():
        lo, hi, _ = SUPPORTED[name]
        assert lo <= release(version) < hi, name


def test_pyproject_gpu_extra_and_vllm_engine_use_the_same_ranges():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert "transformer-engine[pytorch]>=2.9,<2.12" in extra and "vllm>=0.20.1,<0.34" in extra
    lo, hi, _ = SUPPORTED["vllm"]
    assert (lo, hi) == SUPPORTED_VLLM
    assert SUPPORTED["transformer-engine"][:2] == ((2, 9), (2, 12))


# vLLM's CuMemAllocator (sleep mode) asserted that expandable segments and its memory pool are incompatible until
# PR #40812 ("Auto-disable expandable_segments around cumem memory pool"), released in vLLM 0.20.1.
EXPANDABLE_SEGMENTS_WITH_SLEEP_MODE = (0, 20, 1)


def _pyproject_vllm_lower_bound() -> tuple[int, ...]:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    spec = next(e for e in extra if e.startswith("vllm"))
    return release(spec.split(">=")[1].split(",")[0])


def test_every_accepted_vllm_tolerates_the_allocator_setting_env_sh_exports():
    env = (ROOT / "slurm" / "env.sh").read_text()
    exported = [line for line in env.splitlines() if line.startswith("export PYTORCH_CUDA_ALLOC_CONF=")]
    assert exported, "env.sh no longer sets the allocator: this test has nothing to guard"
    if "expandable_segments:True" in exported[0]:
        pins = dict(line.split("#")[0].strip().split("==") for line in
                    (ROOT / "slurm" / "constraints-gpu.txt").read_text().splitlines() if "==" in line.split("#")[0])
        for where, lower in [("gpu_stack.SUPPORTED", SUPPORTED["vllm"][0]), ("SUPPORTED_VLLM", SUPPORTED_VLLM[0]),
                             ("pyproject gpu extra", _pyproject_vllm_lower_bound()),
                             ("constraints-gpu.txt", release(pins["vllm"]))]:
            assert lower >= EXPANDABLE_SEGMENTS_WITH_SLEEP_MODE, where


def test_a_transformer_engine_built_against_another_torch_is_named_in_one_line():
    def abi_mismatch(name: str):
        assert name == "transformer_engine.pytorch"
        raise ImportError("/venv/lib/python3.12/site-packages/transformer_engine_torch.cpython-312-x86_64-linux-gnu.so: "
                          "undefined symbol: _ZN3c104cuda9SetDeviceEi\nmore detail")

    versions = {"megatron-core": "0.17.1", "transformer-engine": "2.11.0"}
    with pytest.raises(MissingGPUExtra) as err:
        check_gpu_stack(transformer_engine=True, vllm=False, installed=_fake(versions), import_module=abi_mismatch)
    msg = str(err.value)
    assert "\n" not in msg and "undefined symbol" in msg and "--no-build-isolation" in msg and "NGC" in msg
    # a run without TE never imports it
    check_gpu_stack(transformer_engine=False, vllm=False, installed=_fake(versions), import_module=abi_mismatch)


def test_the_gpu_checks_parity_and_throughput_workers_meet_the_same_gate(monkeypatch):
    """benchmarks/gpu_measure.start_single_process_world (parity, throughput) refuses what dapo-mcore's start-up does,
    and accepts megatron-core 0.17.1 as it does."""
    import importlib.metadata

    from benchmarks import gpu_measure

    real = importlib.metadata.version
    for version in ("0.15.0", "0.20.0"):
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda name, v=version: v if name.startswith("megatron") else real(name))
        with pytest.raises(MissingGPUExtra, match=f"megatron-core {version} is not supported"):
            gpu_measure.start_single_process_world()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.17.1" if name.startswith("megatron") else real(name))
    check_gpu_stack(transformer_engine=False, vllm=False)


def test_the_gpu_checks_wheel_choice_follows_the_python_and_passes_the_gate():
    """benchmarks/gpu_check.sh picks megatron-core by the Python the wheels are for (0.17+ require 3.12)."""
    import subprocess

    func = subprocess.run(["sed", "-n", "/^mcore_for()/,/^}/p", str(ROOT / "benchmarks" / "gpu_check.sh")],
                          capture_output=True, text=True, check=True).stdout
    out = subprocess.run(["bash", "-c", func + "\nfor v in 3.11 3.12 3.13; do mcore_for $v; done"],
                         capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == ["0.16.1", "0.17.1", "0.17.1"]
    lo, hi, _ = SUPPORTED["megatron-core"]
    assert all(lo <= release(v) < hi for v in out)
