"""The GPU stack pins (pyproject gpu extra, slurm/constraints-gpu.txt) agree with the start-up check, and the
check refuses an unsupported version in one line."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from dapo_mcore.gpu_stack import SUPPORTED, check_gpu_stack, release
from dapo_mcore.model.fp8 import MissingGPUExtra
from dapo_mcore.rollout.vllm_engine import SUPPORTED_VLLM

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def _fake(versions: dict[str, str]):
    return lambda names: next((versions[n] for n in names if n in versions), None)


@pytest.mark.parametrize(("versions", "bad"), [
    ({"megatron-core": "0.16.1", "transformer-engine": "2.11.0", "vllm": "0.33.0"}, None),
    ({"megatron-core": "0.16.1", "transformer_engine": "2.9.0+a1b2c3", "vllm": "0.11.2"}, None),
    ({"megatron-core": "0.16.1", "transformer-engine": "2.2.0", "vllm": "0.33.0"}, "transformer-engine 2.2.0"),
    ({"megatron-core": "0.16.1", "transformer-engine": "2.20.2", "vllm": "0.33.0"}, "transformer-engine 2.20.2"),
    ({"megatron-core": "0.16.1", "transformer-engine": "2.11.0", "vllm": "0.10.1"}, "vllm 0.10.1"),
    ({"megatron-core": "0.15.0", "transformer-engine": "2.11.0", "vllm": "0.33.0"}, "megatron-core 0.15.0"),
])
def test_check_refuses_unsupported_versions_in_one_line(versions, bad):
    if bad is None:
        check_gpu_stack(transformer_engine=True, vllm=True, installed=_fake(versions))
        return
    with pytest.raises(MissingGPUExtra) as err:
        check_gpu_stack(transformer_engine=True, vllm=True, installed=_fake(versions))
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
    assert "transformer-engine[pytorch]>=2.9,<2.12" in extra and "vllm>=0.11,<0.34" in extra
    lo, hi, _ = SUPPORTED["vllm"]
    assert (lo, hi) == SUPPORTED_VLLM
    assert SUPPORTED["transformer-engine"][:2] == ((2, 9), (2, 12))
