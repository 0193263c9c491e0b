"""Fixtures shared by the end-to-end tests: tiny runs through the CLI, the Slurm and the nemo-run launches."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# NCCL on CPU for the whole suite: every collective our code issues on a group that is NCCL on a GPU refuses a tensor
# that did not come through the collective device (dapo_mcore.collectives.strict). Set before anything imports
# dapo_mcore, and inherited by every subprocess the tests launch (torchrun, multiprocessing, the CLI).
os.environ["DAPO_MCORE_STRICT_DEVICE"] = "1"


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Each test starts with the handlers the session had and leaves them so: code run in-process may set handlers
    meant for a process about to exit (``convert`` ignores SIGTERM once its output is written, ``cli.entry`` after
    main), and a later test that signals itself would then see its signal ignored."""
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    saved = {sig: signal.getsignal(sig) for sig in sigs}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


# tests/bridge_live needs Megatron-Bridge's own virtualenv: the main suite (`pytest` over tests/) does not collect it;
# .ci/tiers/50-bridge.sh names the file, which pytest collects whatever this says. (A conftest.py of its own would
# shadow this one for the test modules that `from conftest import ...`.)
collect_ignore_glob = ["bridge_live/*"]


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    """One tiny-base-model cache per test session, shared by every e2e module (never ~/.cache): each tiny base is
    pre-trained once per session, also across pytest-xdist's workers (their common base directory; the base
    builder's lock makes a worker wait for the other's build). ``DAPO_MCORE_TEST_CACHE`` points it elsewhere (e.g. a
    cache kept between runs)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # popen-gw0/, popen-gw1/ -> the session's directory
    path = os.environ.get("DAPO_MCORE_TEST_CACHE") or str(base / "dapo-mcore-cache")
    Path(path).mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def cli_env(tiny_cache) -> dict[str, str]:
    """The environment of a ``python -m dapo_mcore.cli`` subprocess: the session cache, one intra-op thread, this
    checkout first on the import path, and no torchrun rank variables inherited from the caller."""
    e = dict(os.environ)
    e["DAPO_MCORE_CACHE"] = tiny_cache
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


# The overrides of the finished 2-step run below: no evaluation, a checkpoint after each step (keep_last 2, the
# default), so step_000001 and step_000002 are both there.
TWO_STEPS = ("train.steps=2", "eval.every=0", "eval.at_start=false", "eval.max_prompts=8", "checkpoint.every=1")


@pytest.fixture(scope="session")
def finished_two_steps(cli_env, tmp_path_factory) -> Path:
    """One finished tiny run of 2 steps (examples/tiny_cpu.yaml + TWO_STEPS), made once per session for the tests
    that damage a finished run and resume it. Read only: a test copies it (``copy_run``) before it changes anything."""
    run_dir = tmp_path_factory.mktemp("two_steps") / "run"
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "train", str(ROOT / "examples" / "tiny_cpu.yaml"),
                           f"run.dir={run_dir}", *TWO_STEPS], env=cli_env, cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]
    return run_dir


def copy_run(run_dir: Path, to: Path) -> Path:
    """A copy of a finished run directory at ``to`` (a run's files name no absolute path of it: it resumes there)."""
    shutil.copytree(run_dir, to, symlinks=True)
    return to


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory) -> dict[str, str]:
    """A private single-node Slurm (slurm/local/start.sh) for one module, stopped by pid afterwards: the environment
    its clients need (SLURM_CONF). Skipped without the packages (slurm/local/install.sh) or root."""
    missing = [exe for exe in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(exe) is None]
    if missing:
        pytest.skip(f"slurm packages not installed ({', '.join(missing)}): run slurm/local/install.sh")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm runs slurmd as root; run the e2e tests as root")
    state = tmp_path_factory.mktemp("slurm")
    subprocess.run([str(ROOT / "slurm/local/start.sh"), str(state)], check=True, capture_output=True, text=True)
    try:
        yield dict(os.environ, SLURM_CONF=str(state / "slurm.conf"))
    finally:
        subprocess.run([str(ROOT / "slurm/local/stop.sh"), str(state)], check=True)


def pytest_sessionfinish(session, exitstatus):
    """``DAPO_MCORE_CI_NO_SKIPS=1`` (a CI tier's switch, see .ci/run) fails a session that skipped anything: a tier
    selects exactly the tests it exists to run, so a skip there means the tier did not test what it claims to."""
    if os.environ.get("DAPO_MCORE_CI_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped and session.exitstatus == pytest.ExitCode.OK:
        reporter.ensure_newline()
        reporter.write_line(f"DAPO_MCORE_CI_NO_SKIPS=1: {len(skipped)} skip(s) fail this session (reasons below)",
                            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
