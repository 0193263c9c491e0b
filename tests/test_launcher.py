"""``dapo-mcore train --nproc-per-node N``: a refusal is one line and exit 2, the ranks' exit code comes back, a
Ctrl-C (SIGINT to the launcher, as a terminal or ``kill -INT`` sends it) checkpoints and exits 130, and a user
error several ranks report is printed once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dapo_mcore.commands import launcher
from dapo_mcore.telemetry import progress

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")


def _launch(args: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dapo_mcore.cli", "train", "--nproc-per-node", "2", TINY, *args],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)


@pytest.mark.unit
def test_a_refusal_is_one_line_and_exit_2_before_any_rank_starts(cli_env, tmp_path):
    proc = _launch(["parallel.tensor_parallel=3", f"run.dir={tmp_path / 'run'}"], cli_env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "parallel.tensor_parallel=3" in lines[0], out
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.unit
def test_distinct_rank_errors_are_printed_once_naming_the_ranks(tmp_path, capsys):
    for rank, line in ((0, "dapo-mcore: bad checkpoint"), (1, "dapo-mcore: bad checkpoint")):
        (tmp_path / f"rank{rank}").write_text(line + "\n")
    launcher._print_rank_errors(tmp_path)
    assert capsys.readouterr().err == "dapo-mcore: bad checkpoint\n"
    (tmp_path / "rank1").write_text("dapo-mcore: disk full\n")
    launcher._print_rank_errors(tmp_path)
    assert capsys.readouterr().err.splitlines() == ["dapo-mcore: bad checkpoint (rank 0)",
                                                     "dapo-mcore: disk full (rank 1)"]


@pytest.mark.unit
def test_a_rank_hands_its_error_line_to_the_launcher(tmp_path, monkeypatch, capsys):
    from dapo_mcore import cli

    monkeypatch.setenv(launcher.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert cli._guard(lambda: (_ for _ in ()).throw(cli.UserError("no such step"))) == 2
    assert capsys.readouterr().err == "" and (tmp_path / "rank1").read_text() == "dapo-mcore: no such step\n"


@pytest.mark.unit
def test_signal_deaths_read_as_a_shell_reports_them():
    assert [launcher.exit_code_of(c) for c in (0, 2, 75, 130, -2, -9)] == [0, 2, 75, 130, 130, 137]


@pytest.mark.unit
def test_next_line_names_the_venv_script_under_torchrun(monkeypatch, tmp_path):
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "dapo-mcore").write_text("#!/bin/sh\n")
    monkeypatch.delenv(launcher.COMMAND_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "dapo_mcore" / "cli.py")])  # torchrun -m dapo_mcore.cli
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    assert progress._command_name() == ".venv/bin/dapo-mcore"
    monkeypatch.setenv(launcher.COMMAND_ENV, "/opt/venv/bin/dapo-mcore")  # the launcher passes the user's
    assert progress._command_name() == "/opt/venv/bin/dapo-mcore"


@pytest.mark.distributed
@pytest.mark.parametrize(("sig", "code", "name"), [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 75, "SIGTERM")])
def test_a_signal_through_the_launcher_checkpoints_and_returns_the_ranks_code(cli_env, tmp_path, sig, code, name):
    """Ctrl-C: 130; SIGTERM (scancel, a pre-emption): the ranks' requeue code 75, not torchrun's 1."""
    run_dir = tmp_path / "run"
    proc = _launch(["parallel.tensor_parallel=2", f"run.dir={run_dir}", "train.steps=40", "eval.every=0",
                    "eval.at_start=false", "checkpoint.every=0", "telemetry.progress_every_s=0.001"], cli_env)
    seen: list[str] = []
    deadline = time.monotonic() + 600
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if "step 1/40" in line:
            proc.send_signal(sig)  # the launcher only, as a terminal's Ctrl-C reaches it
            break
        assert time.monotonic() < deadline, "".join(seen)
    out = "".join(seen) + proc.communicate(timeout=600)[0]
    assert proc.returncode == code, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out and "SignalException" not in out, out[-3000:]
    assert (run_dir / "checkpoints" / "latest").is_file(), out[-3000:]
    assert out.count(f"{name} received") == 2, out[-3000:]  # forwarded once: each rank's warning, no "abandon"
    assert "exitcode" not in out, out[-3000:]  # torch's own failure notice
    inside = [ln for ln in out.splitlines() if "step 1: " in ln and "usable groups" in ln]
    assert any(" generate, batch 1/" in ln and "tokens generated" in ln for ln in inside), out[-3000:]
    assert len({ln.split(" INFO ")[0] for ln in inside}) <= len(inside)  # a log line, not a bar (not a tty)


@pytest.mark.unit
def test_eval_flags_reach_the_ranks_not_the_overrides(monkeypatch, tmp_path):
    from dapo_mcore import cli

    seen = {}
    monkeypatch.setattr(launcher, "launch", lambda *a: seen.setdefault("args", a) and 0)
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["eval", "--nproc-per-node", "2", TINY, "eval.k=2", "--checkpoint", str(tmp_path), "--json"]) == 0
    assert seen["args"][:4] == ("eval", 2, TINY, ["eval.k=2"])
    assert seen["args"][5] == ["--checkpoint", str(tmp_path), "--json"]


@pytest.mark.unit
def test_a_refusal_on_one_rank_is_not_contradicted_by_the_stop_torch_sent_the_others(tmp_path, capsys):
    from dapo_mcore.signals.startup import STOP_LINE

    refusal = "dapo-mcore: configuration error: run directory runs/x holds another run (algo.clip_high: 0.28 -> 0.3)."
    (tmp_path / "rank0").write_text(refusal + "\n")
    (tmp_path / "rank1").write_text(STOP_LINE.format(name="SIGTERM", sender=" (sent by pid 7: torchrun)") + "\n")
    launcher._print_rank_errors(tmp_path, signalled=False)  # torch stopped rank 1 after rank 0 failed
    assert capsys.readouterr().err == refusal + "\n"
    launcher._print_rank_errors(tmp_path, signalled=True)  # a scancel reached both: both lines stay
    assert len(capsys.readouterr().err.splitlines()) == 2
