"""A full disk under TensorBoard's writer thread or the zarr rollout store: the error names the path (one line in
the CLI), and TensorBoard's thread prints no traceback of its own."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def small_disk(tmp_path):
    point = tmp_path / "small"
    point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()[:80]})")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _fill(point: Path, leave: int) -> None:
    with open(point / "filler", "wb") as f:
        try:
            f.write(b"x" * (1024 * 1024 - leave))
        except OSError:
            pass


TB_SCRIPT = """
import sys
from pathlib import Path
from dapo_mcore.telemetry.metrics import MetricsWriter
from dapo_mcore.errors import describe_os_error
run = Path(sys.argv[1])
w = MetricsWriter(run)
(run / "filler").write_bytes(b"x" * 0)
try:
    for s in range(1, 5000):
        w.log(s, {"train/loss": 1.0, **{f"k{j}/{s}": 1.0 for j in range(20)}})
    print("no error")
except OSError as e:
    print("ERR", describe_os_error(e))
"""


def test_a_full_disk_under_tensorboard_names_the_path(small_disk):
    run = small_disk / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    _fill(small_disk, 24 * 1024)
    proc = subprocess.run([sys.executable, "-c", TB_SCRIPT, str(run)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    out = proc.stdout.strip().splitlines()[-1]
    assert out.startswith("ERR ") and "No space left on device" in out, proc.stdout + proc.stderr[-2000:]
    assert str(run / "metrics.jsonl") in out or str(run / "tensorboard") in out, out
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_full_disk_under_the_rollout_store_names_it(small_disk):
    from dapo_mcore.telemetry.rollout_store import Rollout, RolloutStore

    store = RolloutStore(small_disk / "rollouts.zarr", row_chunk=64, token_chunk=4096)
    _fill(small_disk, 0)
    rng = np.random.default_rng(0)
    with pytest.raises(OSError) as err:
        for step in range(1, 200):
            store.append_step(step, [Rollout(rng.integers(0, 50000, 64), rng.integers(0, 50000, 512), None, 1.0,
                                             True, "stop", True, i, 0) for i in range(8)])
    assert err.value.errno == errno.ENOSPC and str(small_disk / "rollouts.zarr") in str(err.value.filename)
