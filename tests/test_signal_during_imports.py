"""A stop signal while ``dapo-mcore train`` is still importing its modules (seconds: pyarrow, torch) is start-up:
one line and the requeue code (75; Ctrl-C 130), not a silent 143 or a traceback through an import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# Runs the CLI module as `python -m dapo_mcore.cli train ...` does, with pyarrow's import held for 60 s: the signal
# lands in the middle of the imports that follow the arming.
_SLOW_IMPORTS = """import importlib.abc, runpy, sys, time
class Hold(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "pyarrow":
            print("importing", flush=True)
            time.sleep(60)
        return None
sys.meta_path.insert(0, Hold())
sys.argv = [sys.argv[0], "train", "examples/tiny_cpu.yaml"]
runpy.run_module("dapo_mcore.cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 75), (signal.SIGHUP, 75), (signal.SIGINT, 130)])
def test_a_stop_signal_during_the_imports_is_one_line_and_its_code(sig, code):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "DAPO_MCORE_ERROR_DIR")}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_IMPORTS], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "importing\n"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "during start-up" in lines[0] and "Traceback" not in err, lines
