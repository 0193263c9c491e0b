"""The CI entry point (.ci/run) and its tiers: the README's test line verbatim, every tier run and timed, one summary
with the skip reasons, a failing or skipping tier failing the run. The framework runs here on stand-in tiers."""

from __future__ import annotations

import os
import re
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


def test_an_at_once_tier_installs_nothing_and_needs_only_the_main_venv():
    """The at-once lane starts before the install-tiers step has built anything: a tier there with an install
    section would find it missing and install itself, beside the other lane's installs."""
    at_once = [t for t in sorted(TIERS.glob("*.sh")) if "\n# ci-beside-main-at-once:" in t.read_text()]
    assert {t.name for t in at_once} >= {"40-multinode.sh", "60-rehearse.sh", "61-rehearse-b.sh", "65-studies.sh"}
    for tier in at_once:
        text = tier.read_text()
        assert not re.search(r"^ci_install ", text, re.M) and "\n# ci-beside-main:" not in text, tier.name


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
    full = dict(os.environ, **{"CI_MAIN": "0", **env})
    full.pop("DAPO_MCORE_CI_NO_SKIPS", None)
    return subprocess.run([str(repo / ".ci" / "run")], cwd=repo, env=full, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def _summary(proc: subprocess.CompletedProcess) -> list[str]:
    lines = proc.stdout.splitlines()
    return lines[lines.index(next(ln for ln in lines if "CI summary" in ln)) + 1:]


def _status(summary: list[str]) -> dict[str, str]:
    """Each tier's and the total's pass/FAIL (the total's budget note, in parentheses, left out)."""
    return {ln.split()[0]: ln.split(None, 3)[3].split("  (")[0] for ln in summary
            if ln[:1].isdigit() or ln.startswith("total")}


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
    status = _status(summary)
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




def test_the_summary_puts_the_total_against_the_budget(tmp_path):
    spin = (f"{sys.executable} -c 'import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass'\n")
    repo = _fake_checkout(tmp_path, {"10-a.sh": "sleep 1\n", "20-spin.sh": spin})
    summary = _summary(_ci(repo, CI_TIERS="[12]0-*"))
    total = summary[-1]
    assert total.startswith("total") and re.search(r" s  pass  \(0\.\d min of 50; margin (50\.0|49\.\d) min\)", total), total
    cpu = {ln.split()[0]: int(ln.split("(cpu ")[1].split()[0]) for ln in summary if "(cpu " in ln}
    assert cpu["10-a"] <= 1 and 1 <= cpu["20-spin"] <= 4 and cpu["total"] >= cpu["20-spin"], summary
    assert total.endswith(" cores on average)"), total
    total = _summary(_ci(repo, CI_TIERS="10-*", CI_BUDGET_MIN="0"))[-1]
    assert "min of 0; OVER by 0.0 min)" in total, total


INSTALLS = ("install() {\n    ci_step 'install stand-in' bash -c 'echo \"$0\" >>installs.txt' \"$(basename \"$0\")\"\n}\n"
            "ci_install install\n")


def test_tier_installs_run_once_ahead_and_the_tier_then_finds_them_done(tmp_path):
    repo = _fake_checkout(tmp_path, {
        "10-venv.sh": INSTALLS + "[[ $(grep -c 10-venv.sh installs.txt) == 1 ]]\n",  # installed, and only once
        "20-none.sh": "true\n",  # a tier without installs: left out of install-tiers
        "30-venv.sh": INSTALLS + "grep -q 30-venv.sh installs.txt\n",
    })
    proc = _ci(repo, CI_EARLY_INSTALL="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (repo / "installs.txt").read_text().splitlines() == ["10-venv.sh", "30-venv.sh"]
    assert proc.stdout.count("installed earlier in this run by .ci/run's install-tiers step") == 2
    summary = _summary(proc)
    assert _status(summary) == {"10-venv": "pass", "20-none": "pass", "30-venv": "pass", "total": "pass"}
    text = "\n".join(summary)
    installs = summary[next(i for i, ln in enumerate(summary) if ln.startswith("install-tiers"))]
    assert installs.split()[3] == "pass", summary
    assert "  10-venv: all its installs" in text and "  30-venv: all its installs" in text
    assert "20-none: all" not in text
    assert text.index("install-tiers") < text.index("10-venv ")  # collected before the first tier runs

    # Run alone (no early install, or by hand outside .ci/run), a tier installs itself.
    (repo / "installs.txt").unlink()
    proc = _ci(repo, CI_TIERS="10-*")
    assert proc.returncode == 0 and "install-tiers" not in proc.stdout, proc.stdout + proc.stderr
    assert (repo / "installs.txt").read_text().splitlines() == ["10-venv.sh"]
    direct = subprocess.run([str(repo / ".ci" / "tiers" / "30-venv.sh")], cwd=repo, capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "CI_INSTALLED"}, timeout=60)
    assert direct.returncode == 0 and "installed earlier" not in direct.stdout, direct.stdout + direct.stderr


def test_a_failing_early_install_fails_the_run_and_the_tier_tries_again(tmp_path):
    flaky = ("install() {\n    ci_step 'install once' bash -c '[[ -f tried ]] || { touch tried; exit 4; }'\n}\n"
             "ci_install install\n")
    repo = _fake_checkout(tmp_path, {"10-flaky.sh": flaky})
    proc = _ci(repo, CI_EARLY_INSTALL="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = _summary(proc)
    status = _status(summary)
    assert status["10-flaky"] == "pass" and status["total"].startswith("FAIL"), summary  # the tier's own try passed
    line = next(ln for ln in summary if ln.startswith("install-tiers"))
    assert line.split(None, 3)[3] == "FAIL (exit 1)", summary
    assert any("10-flaky: all its installs" in ln and "FAIL (exit 4)" in ln for ln in summary), summary


# Stand-ins for the main step's `python3 -m venv .venv && .venv/bin/pip install ... && .venv/bin/python -m pytest -q`:
# the "suite" passes only if the file `beside-started` appears while it runs (within CI_FAKE_MAIN_WAIT seconds).
FAKE_PYTHON3 = """#!/usr/bin/env bash
mkdir -p .venv/bin
printf '#!/usr/bin/env bash\\necho "Successfully installed stand-in"\\n' >.venv/bin/pip
cat >.venv/bin/python <<'PY'
#!/usr/bin/env bash
for _ in $(seq 1 $(( ${CI_FAKE_MAIN_WAIT:-60} * 10 ))); do
    [[ -f beside-started ]] && { echo "1 passed in 0.01s"; exit 0; }
    sleep 0.1
done
echo "the beside-main tier did not start while the main suite ran"; exit 1
PY
chmod +x .venv/bin/pip .venv/bin/python
"""
BESIDE = "# ci-beside-main: a stand-in\n"


def _with_main(repo: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """.ci/run with its main steps (apt, install-main, main) on stand-ins."""
    (repo / "slurm" / "local").mkdir(parents=True)
    (repo / "slurm" / "local" / "install.sh").write_text("true\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON3)
    (bin_dir / "python3").chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    return _ci(repo, CI_MAIN="1", PATH=path, **env)


def test_a_beside_main_tier_runs_during_the_main_suite_after_the_installs(tmp_path):
    repo = _fake_checkout(tmp_path, {
        "10-after.sh": INSTALLS + "grep -q 40-beside.sh installs.txt && [[ -f beside-done ]]\n",
        "40-beside.sh": BESIDE + INSTALLS + "echo the beside tier ran; grep -q 40-beside.sh installs.txt\n"
                        "ci_step 'its own step' touch beside-started\nsleep 1; touch beside-done\n",
        "50-beside-fails.sh": BESIDE + "echo beside-fails ran; exit 3\n",
    })
    proc = _with_main(repo, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 50-beside-fails
    summary = _summary(proc)
    assert _status(summary) == {"10-after": "pass", "40-beside": "pass", "50-beside-fails": "FAIL (exit 3)",
                                "total": "FAIL"}, summary
    names = [ln.split()[0] for ln in summary if not ln.startswith(" ")]
    assert names == ["apt", "install-main", "main", "install-tiers", "40-beside", "50-beside-fails", "10-after",
                     "total"], summary
    main = next(ln for ln in summary if ln.startswith("main "))
    assert main.split()[3] == "pass", proc.stdout  # the stand-in suite saw the beside tier start while it ran
    beside = [ln for ln in summary if ln.startswith(("40-beside", "50-beside-fails"))]
    assert all(ln.endswith("  (beside the main suite)") for ln in beside), beside
    assert not next(ln for ln in summary if ln.startswith("10-after")).endswith("(beside the main suite)"), summary
    text = "\n".join(summary)
    assert "  its own step" in text and "  40-beside: all its installs" in text
    # each beside tier's whole output, once, after the main suite's, with its exit line
    out = proc.stdout
    assert out.count("the beside tier ran") == 1 and out.count("beside-fails ran") == 1, out
    assert out.index("::: main: exit 0") < out.index("the beside tier ran") < out.index("::: 10-after:"), out
    assert "::: 50-beside-fails: exit 3 after" in out and "(beside the main suite)" in out


# A tier in a background lane starts with SIGINT as a user's shell leaves it, not ignored as bash leaves what it runs
# with `&` (the lane's `timeout` catches SIGINT to forward it, so the tier it starts gets the default back).
SIGINT_AS_A_USER_HAS_IT = (f"{sys.executable} -c 'import signal, sys; "
                           "sys.exit(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)'\n")


def test_an_at_once_tier_runs_from_the_start_of_the_suite_beside_the_other_lane(tmp_path):
    """A "# ci-beside-main-at-once:" tier starts once the main step's pip is done, in a lane of its own: it runs
    while the other lane's installs are still going (it does not wait for them) and is collected like them."""
    slow_install = ("install() {\n    ci_step 'slow install' bash -c 'sleep 4; touch installs-done'\n}\n"
                    "ci_install install\n")
    repo = _fake_checkout(tmp_path, {
        "30-lane.sh": BESIDE + slow_install + SIGINT_AS_A_USER_HAS_IT,
        "40-waits.sh": "# ci-beside-main-at-once: a stand-in\n" + SIGINT_AS_A_USER_HAS_IT +
                       "[[ ! -f installs-done ]] && touch beside-started && echo at-once ran\n",
    })
    proc = _with_main(repo, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the suite saw it start, before the installs ended
    summary = _summary(proc)
    assert _status(summary) == {"30-lane": "pass", "40-waits": "pass", "total": "pass"}, summary
    assert next(ln for ln in summary if ln.startswith("40-waits")).endswith("  (beside the main suite)"), summary
    assert proc.stdout.count("at-once ran") == 1 and "40-waits: beside the main suite, from its start" in proc.stdout


def test_ci_beside_0_runs_a_beside_main_tier_in_order_after_the_main_suite(tmp_path):
    repo = _fake_checkout(tmp_path, {"40-beside.sh": BESIDE + "touch beside-started\n"})
    proc = _with_main(repo, tmp_path, CI_BESIDE="0", CI_FAKE_MAIN_WAIT="1")
    summary = _summary(proc)
    main = next(ln for ln in summary if ln.startswith("main "))
    assert main.split(None, 3)[3].split("  (")[0] == "FAIL (exit 1)", proc.stdout  # the tier did not run during the suite
    assert _status(summary)["40-beside"] == "pass", proc.stdout
    assert proc.stdout.index("::: main: exit 1") < proc.stdout.index("::: 40-beside:")
    assert "beside the main suite" not in proc.stdout
    # and run by hand (CI_MAIN=0) it is a tier like any other
    proc = _ci(repo, CI_TIERS="40-*")
    assert proc.returncode == 0 and "beside the main suite" not in proc.stdout, proc.stdout + proc.stderr


def test_a_recipe_the_rehearse_tier_leaves_out_is_rehearsed_in_effect_by_the_test_it_names():
    """60-rehearse.sh's RUN_WHOLE: each recipe it does not rehearse names a main-suite test that runs that recipe
    (by its file name) and kills a rank (SIGKILL) before a resume; the test exists and is not skipped by marker."""
    import ast
    import re

    text = (TIERS / "60-rehearse.sh").read_text()
    block = re.search(r"declare -A RUN_WHOLE=\((.*?)\n\)", text, re.S)
    assert block, "RUN_WHOLE not found in 60-rehearse.sh"
    entries = re.findall(r'\[(examples/[\w.-]+\.yaml)\]="(tests/[\w/.-]+\.py)::(\w+)"', block.group(1))
    assert len(entries) == len(re.findall(r"\[examples/", block.group(1))) >= 1
    for recipe, path, name in entries:
        assert (ROOT / recipe).is_file(), recipe
        tree = ast.parse((ROOT / path).read_text())
        funcs = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        assert name in funcs, f"{path}::{name} is gone: rehearse {recipe} in the tier again"
        source = (ROOT / path).read_text()
        assert Path(recipe).name in source, f"{path} does not run {recipe}"
        body = ast.get_source_segment(source, funcs[name])
        assert "kill" in body.lower() or "FAULT" in body, f"{path}::{name} kills no rank"
        assert "skip" not in " ".join(ast.unparse(d) for d in funcs[name].decorator_list), f"{path}::{name} skips"
