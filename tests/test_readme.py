"""The README's commands, parsed from README.md and run in order in fresh shells, as a new user pastes them.

The shells run in a scratch directory that looks like a fresh clone after the set-up line (``examples/`` and an
installed ``.venv``; the venv is NOT activated and not on PATH). Only the run length is shortened, through
``DAPO_MCORE_EXTRA_OVERRIDES`` (which the README does not need): 6 steps for the main run the later commands
inspect, 2 for the other training runs; every command is the README's own text.
The set-up line's venv creation and install are what this test already runs in, so only its train command runs;
the test command (which would run this test again) is checked verbatim but not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SETUP = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/dapo-mcore train examples/tiny_cpu.yaml"
TEST_LINE = 'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[dev]" && .venv/bin/python -m pytest -q -n 2 --dist loadfile'
INSTALL = re.compile(r"^(python3 -m venv \.venv|\.venv/bin/pip install .*)$")
SHORT = "train.steps=6 eval.every=3 checkpoint.every=3"
MAIN_RUN = ".venv/bin/dapo-mcore train examples/tiny_cpu.yaml"
# The other training runs (GRPO baseline, TP=2, async, custom verifier) only have to run and log: 2 steps, no checkpoint.
SHORT_OTHERS = "train.steps=2 eval.every=2 checkpoint.every=0"
SERVERS = (".venv/bin/tensorboard",)
"""Commands that serve until stopped: they pass when they print their address."""


def readme_commands(text: str) -> list[str]:
    """Every line of every ```bash block, in order."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return lines


def to_run(commands: list[str]) -> list[str]:
    """Drop the install steps this test already runs in, and the test command itself."""
    out = []
    for cmd in commands:
        if cmd == TEST_LINE:
            continue
        rest = [part for part in cmd.split(" && ") if not INSTALL.match(part.strip())]
        if rest:
            out.append(" && ".join(rest))
    return out


def test_readme_parsing_keeps_the_setup_lines_verbatim():
    commands = readme_commands((ROOT / "README.md").read_text())
    assert commands[0] == SETUP and commands[1] == TEST_LINE  # CI (.ci/run) calls the test line verbatim
    run = to_run(commands)
    assert run[0] == ".venv/bin/dapo-mcore train examples/tiny_cpu.yaml" and TEST_LINE not in run
    tp2 = [c for c in run if "--nproc-per-node 2" in c]
    assert tp2 and all("run.dir=" in c for c in tp2)  # never the main job's run directory
    assert all(c.split()[0].startswith((".venv/bin/", "PYTHONPATH=")) for c in run)  # no activation needed


def _fresh_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    bins = {str(venv / "bin"), str(Path(sys.executable).parent)}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p not in bins)
    env["DAPO_MCORE_EXTRA_OVERRIDES"] = SHORT
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _serve(cmd: str, cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if "http://" in line:
                return "".join(seen)
        raise AssertionError(f"{cmd!r} printed no address:\n{''.join(seen)[-3000:]}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_readme_commands_run_in_order(tmp_path):
    venv = Path(sys.prefix)
    if not (venv / "bin" / "dapo-mcore").exists():
        pytest.skip(f"{venv} has no dapo-mcore console script (run pytest from the README's .venv)")
    (tmp_path / ".venv").symlink_to(venv)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = _fresh_env(venv)
    outputs = {}
    for cmd in to_run(readme_commands((ROOT / "README.md").read_text())):
        if cmd.startswith(SERVERS):
            outputs[cmd] = _serve(cmd, tmp_path, env)
            continue
        trains_other = " train " in f" {cmd} " and cmd != MAIN_RUN
        cmd_env = dict(env, DAPO_MCORE_EXTRA_OVERRIDES=SHORT_OTHERS) if trains_other else env
        proc = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=cmd_env, capture_output=True, text=True,
                              timeout=1500)
        outputs[cmd] = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"README command failed ({proc.returncode}): {cmd}\n{outputs[cmd][-4000:]}"
    runs = tmp_path / "runs"
    assert "run finished: 6 steps" in outputs[MAIN_RUN]
    others = [c for c in outputs if " train " in f" {c} " and c != MAIN_RUN]
    assert len(others) == 4 and all("run finished: 2 steps" in outputs[c] for c in others), others
    assert "wait for rollouts (engines)" in outputs[".venv/bin/dapo-mcore profile runs/tiny_cpu_async"]
    assert (runs / "tiny_cpu" / "figures" / "compare.png").is_file()
    assert (runs / "tiny_cpu_tp2" / "metrics.jsonl").is_file() and (runs / "tiny_numeric_reward" / "metrics.jsonl").is_file()
    assert "diagnose runs/tiny_cpu: 6 training steps" in outputs[".venv/bin/dapo-mcore diagnose runs/tiny_cpu"]
