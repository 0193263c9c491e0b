"""Ctrl-C during an async run's start-up: SIGINT to the job's process group while the ranks import,
while the trainer joins the start-up barrier (the engine ranks wait at the start meeting), and while it builds its
model (the engine ranks wait at the first version's meeting): every rank exits 130 at once, with at most one line and no traceback
(``dapo_mcore.signals.startup``). The ranks are started directly (RANK/WORLD_SIZE/MASTER_*), one process group, so each
one's exit code is seen, not torchrun's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dapo_mcore.signals.startup import LINE

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
WORLD = 3  # 1 trainer rank + 2 engine ranks
ASYNC = ("rollout.pipeline.mode=async", "rollout.pipeline.engine_ranks=2", "algo.tis_cap=2.0", "eval.every=0",
         "eval.at_start=false", "train.steps=2")
MOMENTS = {"imports": None, "start-up barrier": "process group ready", "model build": "built GPTModel"}
"""When the group gets SIGINT: 1.5 s after launch, or once rank 0 logged this."""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cli_env: dict[str, str], run_dir: Path) -> list[subprocess.Popen]:
    port, procs = _port(), []
    for rank in range(WORLD):
        env = dict(cli_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dapo_mcore.cli", "train", str(ROOT / "examples" / "tiny_cpu.yaml"),
             f"run.dir={run_dir}", *ASYNC], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, process_group=0 if rank == 0 else procs[0].pid))
    return procs


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_during_start_up_exits_130_on_every_rank_in_at_most_one_line(cli_env, tmp_path, moment):
    procs = _launch(cli_env, tmp_path / "run")
    errs: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, e=e: e.extend(p.stderr), daemon=True) for p, e in zip(procs, errs, strict=True)]
    for r in readers:
        r.start()
    marker, deadline = MOMENTS[moment], time.monotonic() + 300
    if marker is None:
        time.sleep(1.5)
    else:
        while not any(marker in line for line in errs[0]) and time.monotonic() < deadline:
            assert procs[0].poll() is None, "".join(errs[0])[-3000:]
            time.sleep(0.02)
    os.killpg(procs[0].pid, signal.SIGINT)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=20))  # at once: not torchrun's 30 s kill, nor a collective's timeout
        except subprocess.TimeoutExpired:
            codes.append("still running 20 s after SIGINT")
    for r in readers:
        r.join(timeout=5)
    for p in procs:
        if p.poll() is None:
            p.kill()
    text = ["".join(e) for e in errs]
    assert codes == [130] * WORLD, (codes, [t[-2000:] for t in text])
    for t in text:
        assert "Traceback" not in t and "KeyboardInterrupt" not in t, t[-3000:]
        assert t.count(LINE) <= 1, t[-3000:]
