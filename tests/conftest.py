"""Fixtures shared by the end-to-end tests: tiny runs through the CLI, the Slurm and the nemo-run launches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    """One tiny-base-model cache per test session, shared by every e2e module (never ~/.cache): each tiny base is
    pre-trained once per session. ``DAPO_MCORE_TEST_CACHE`` points it elsewhere (e.g. a cache kept between runs)."""
    path = os.environ.get("DAPO_MCORE_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "dapo-mcore-cache")
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
