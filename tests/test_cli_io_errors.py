"""I/O failures are user errors: one line on stderr naming the path and the fix, exit 2, no traceback.

In-process tests cover every command's error path (a missing path, a path through a file, a full disk simulated
by a failing write); the subprocess tests use real file systems: a read-only and a 64 KB tmpfs where this process
may mount one (root), skipped elsewhere.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore import cli
from dapo_mcore.errors import describe_os_error

# each test carries its own tier marker: a module-level unit mark would put the
# distributed/e2e tests below into the quick unit subset too (pytest adds it to every test of the module)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"


def _one_line(err: str) -> str:
    """The error line: exactly one, the last thing on stderr (log lines may come before it), no traceback."""
    # "dapo-mcore: ..." from the CLI's guard, "dapo-mcore convert: ..." from conversion's own (standalone) guard
    lines = [line for line in err.strip().splitlines() if re.match(r"dapo-mcore( convert)?: ", line)]
    assert len(lines) == 1 and err.strip().endswith(lines[0]), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.unit
@pytest.mark.parametrize("code, needle", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "read-only"),
                                          (errno.ENOENT, "create its parent directory"),
                                          (errno.EACCES, "fix the permissions")])
def test_os_errors_name_the_path_and_the_fix(code, needle):
    line = describe_os_error(OSError(code, os.strerror(code), "/runs/x/metrics.jsonl"))
    assert line.startswith(f"/runs/x/metrics.jsonl: {os.strerror(code)}; ") and needle in line


@pytest.mark.unit
def test_guard_shows_the_traceback_only_with_debug(capsys, monkeypatch):
    def fail() -> int:
        raise OSError(errno.ENOSPC, "No space left on device", "/full/ckpt.pt")

    assert cli._guard(fail) == 2
    err = capsys.readouterr().err
    assert _one_line(err) == ("dapo-mcore: I/O error: /full/ckpt.pt: No space left on device; the disk is full: "
                              "free space on it (df -h) or use a path on another disk.")
    assert cli._guard(fail, debug=True) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("DAPO_MCORE_DEBUG", "1")
    assert cli.main(["profile", "/nonexistent/run"]) == 2
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.unit
def test_guard_keeps_tracebacks_of_bugs():
    def bug() -> int:
        raise KeyError("internal")

    with pytest.raises(KeyError):
        cli._guard(bug)


@pytest.mark.unit
@pytest.mark.parametrize("argv, needle", [
    (["profile", "/nonexistent/run"], "/nonexistent/run/metrics.jsonl does not exist"),
    (["report", "/nonexistent/run"], "/nonexistent/run/metrics.jsonl does not exist"),
    (["rollouts", "/nonexistent/run"], "no rollout store at /nonexistent/run/rollouts.zarr"),
])
def test_read_commands_report_a_missing_run_on_stderr_with_exit_2(capsys, argv, needle):
    assert cli.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and needle in _one_line(out.err)


@pytest.mark.unit
def test_convert_goes_through_the_same_guard(tmp_path, capsys):
    assert cli.main(["convert", "mcore-to-hf", "--mcore", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert str(tmp_path / "none") in _one_line(capsys.readouterr().err)


def _fake_run(run: Path) -> Path:
    from tests.test_telemetry_report import _fake_run as make

    return make(run, seed=1, n_steps=4)


@pytest.mark.unit
def test_report_into_a_path_through_a_file_names_it(tmp_path, capsys):
    run = _fake_run(tmp_path / "run")
    (tmp_path / "afile").write_text("x")
    assert cli.main(["report", str(run), "--out", str(tmp_path / "afile" / "figs")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(tmp_path / "afile") in line and "fix the path" in line


@pytest.mark.unit
def test_report_on_a_full_disk_names_the_file(tmp_path, capsys, monkeypatch):
    import matplotlib.figure

    def full(self, path, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    run = _fake_run(tmp_path / "run")
    assert cli.main(["report", str(run)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(run / "figures") in line and "the disk is full" in line


@pytest.mark.unit
def test_train_refuses_a_run_dir_below_a_file_before_writing(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert cli.main(["train", str(CONFIG), f"run.dir={tmp_path / 'afile' / 'run'}"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "is a file, not a directory" in line and "run.dir" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.unit
def test_eval_of_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert cli.main(["eval", str(CONFIG), f"run.dir={tmp_path}", "--checkpoint", str(tmp_path / "nope")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(tmp_path / "nope") in line and "no such directory" in line and "'base'" in line


@pytest.mark.unit
def test_checkpoint_save_on_a_full_disk_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    """safetensors and torch.save hide the errno of a failed write; the checkpoint writers restore it."""
    import builtins

    import safetensors.torch
    import torch

    from dapo_mcore.weights import checkpoint as wckpt

    def full_save_file(tensors, path, metadata=None):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_save_file)
    with pytest.raises(OSError) as err:
        wckpt.save_safetensors({"w": torch.zeros(2)}, tmp_path / "m.safetensors")
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "m.safetensors")

    real_open = builtins.open

    def full_open(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".pt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_open)
    with pytest.raises(OSError) as err:
        wckpt.torch_save({"rng": torch.get_rng_state()}, tmp_path / "rank_00000.pt")
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "rank_00000.pt")


# ---- real file systems (root only) --------------------------------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, read_only) -> a fresh tmpfs mount point; skipped where this process cannot mount."""
    mounts: list[Path] = []

    def mount(size: str = "64k", read_only: bool = False) -> Path:
        point = tmp_path / f"mnt{len(mounts)}"
        point.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()[:80]})")
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("DAPO_MCORE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "dapo_mcore.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.e2e
def test_train_in_a_read_only_run_dir_exits_2_before_writing(tmpfs):
    ro = tmpfs(read_only=True)
    done = _cli("train", str(CONFIG), f"run.dir={ro / 'run'}")
    assert done.returncode == 2, done.stderr[-2000:]
    line = _one_line(done.stderr)
    assert f"{ro}" in line and "read-only file system" in line and "writable run.dir" in line


@pytest.mark.e2e
def test_report_on_a_real_full_disk(tmpfs, tmp_path):
    full = tmpfs(size="16k")
    run = _fake_run(tmp_path / "run")
    done = _cli("report", str(run), "--out", str(full / "figs"))
    assert done.returncode == 2, done.stderr[-2000:]
    line = _one_line(done.stderr)
    assert str(full / "figs") in line and "No space left on device" in line and "the disk is full" in line
