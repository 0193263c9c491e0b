"""The CI entry point (.ci/run) and its tiers: the README's test line verbatim, every tier run and timed, one summary
with the skip reasons, a failing or skipping tier failing the run. The framework runs here on stand-in tiers."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import TEST_LINE

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TIERS = ROOT / ".ci" / "tiers"


def test_ci_runs_the_readme_test_line_verbatim():
    assert f"step main bash -c '{TEST_LINE}'" in (ROOT / ".ci" / "run").read_text()


def test_every_tier_is_an_executable_bash_script_that_stops_on_errors():
    tiers = sorted(TIERS.glob("*.sh"))
    assert tiers, "no tiers"
    for tier in tiers:
        assert tier.stat().st_mode & stat.S_IXUSR, f"{tier.name} is not executable"
        text = tier.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text, tier.name
        assert "DAPO_MCORE_CI_NO_SKIPS=1" in text, f"{tier.name}: a tier fails when it skips what it exists to run"


def _fake_checkout(tmp_path: Path, tiers: dict[str, str]) -> Path:
    repo = tmp_path / "repo"
    (repo / ".ci" / "tiers").mkdir(parents=True)
    for name in ("run", "lib.sh"):
        shutil.copy2(ROOT / ".ci" / name, repo / ".ci" / name)
    for name, body in tiers.items():
        path = repo / ".ci" / "tiers" / name
        path.write_text("#!/usr/bin/env bash\nset -euo pipefail\nsource .ci/lib.sh\n" + body)
        path.chmod(0o755)
    (repo / "tests").mkdir()
    shutil.copy2(ROOT / "tests" / "conftest.py", repo / "tests" / "conftest.py")
    (repo / "tests" / "test_fake.py").write_text(
        "import pytest\n\n"
        "def test_ok():\n    pass\n\n"
        "@pytest.mark.skip(reason='needs the moon')\ndef test_moon():\n    pass\n")
    return repo


def _ci(repo: Path, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, CI_MAIN="0", **env)
    full.pop("DAPO_MCORE_CI_NO_SKIPS", None)
    return subprocess.run([str(repo / ".ci" / "run")], cwd=repo, env=full, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def _summary(proc: subprocess.CompletedProcess) -> list[str]:
    lines = proc.stdout.splitlines()
    return lines[lines.index(next(ln for ln in lines if "CI summary" in ln)) + 1:]


def test_tiers_run_in_order_and_the_summary_names_times_failures_and_skip_reasons(tmp_path):
    py = sys.executable
    repo = _fake_checkout(tmp_path, {
        "20-fails.sh": "echo tier20 ran; exit 3\n",
        "10-installs.sh": "ci_step 'install stand-in' true\n"
                          f"{py} -m pytest -q -p no:cacheprovider -ra tests/test_fake.py\n",
        "30-forbids-skips.sh": f"DAPO_MCORE_CI_NO_SKIPS=1 {py} -m pytest -q -p no:cacheprovider -ra tests/test_fake.py\n",
        "40-no-tests.sh": f"{py} -m pytest -q -p no:cacheprovider tests/test_fake.py -k nothing_matches\n",
        "50-passes.sh": "[[ $CI == true ]] && [[ ! -t 0 ]] && [[ -f .ci/run ]]\n",
    })
    proc = _ci(repo)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.index("tier20 ran") > proc.stdout.index("10-installs")  # lexical order
    summary = _summary(proc)
    status = {ln.split()[0]: ln.split(None, 3)[3] for ln in summary if ln[:1].isdigit() or ln.startswith("total")}
    assert status == {"10-installs": "pass", "20-fails": "FAIL (exit 3)", "30-forbids-skips": "FAIL (exit 1)",
                      "40-no-tests": "FAIL (exit 5)", "50-passes": "pass", "total": "FAIL"}
    text = "\n".join(summary)
    assert "  install stand-in" in text  # a tier's own timed step, under the tier
    assert text.count("SKIPPED [1] tests/test_fake.py:6: needs the moon") == 2
    assert "pytest: 1 passed, 1 skipped in" in text


def test_all_tiers_passing_exit_zero_and_ci_tiers_selects(tmp_path):
    repo = _fake_checkout(tmp_path, {"10-a.sh": "true\n", "20-b.sh": "exit 1\n"})
    proc = _ci(repo, CI_TIERS="10-*")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "20-b" not in proc.stdout
    assert _ci(repo, CI_TIERS="nope").returncode == 1  # a selection that matches nothing is not a pass


def _module_level_skips(source: str) -> list[int]:
    """Line numbers of ``pytest.skip(...)`` / ``pytest.importorskip(...)`` run at import time (module level)."""
    import ast

    lines = []
    for node in ast.parse(source).body:
        for call in ast.walk(node) if isinstance(node, (ast.Expr, ast.Assign, ast.If)) else ():
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in ("skip", "importorskip")
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "pytest"):
                lines.append(call.lineno)
    return lines


def test_module_level_skip_detector_sees_both_forms():
    assert _module_level_skips("import pytest\npytest.importorskip('x')\n") == [2]
    assert _module_level_skips("import pytest\nif True:\n    pytest.skip('no', allow_module_level=True)\n") == [3]
    assert _module_level_skips("import pytest\ndef test_a():\n    pytest.importorskip('x')\n") == []


def test_no_test_module_skips_at_import_time():
    """A module-level skip is reported even when a tier's ``-m`` deselects every test in that module, so a tier that
    fails on skips (DAPO_MCORE_CI_NO_SKIPS=1) fails on another tier's package check: the vLLM tier did, on the nemo-run
    module's ``importorskip``. Use ``pytestmark = pytest.mark.skipif(...)`` instead."""
    found = {path.name: lines for path in sorted((ROOT / "tests").rglob("test_*.py"))
             if (lines := _module_level_skips(path.read_text()))}
    assert not found, found
