"""Your own verifier by import path (``reward.name=package.module:function``), the strict math verifier, and
``audit-reward`` on both (summary line, gates, user probes)."""

from __future__ import annotations

import pickle
import sys
import textwrap
from pathlib import Path

import pytest

from dapo_mcore.config import ConfigError, RewardConfig
from dapo_mcore.reward import audit
from dapo_mcore.reward.math_verifier import compute_score, compute_score_strict
from dapo_mcore.reward.pool import RewardPool
from dapo_mcore.reward.registry import get_reward
from dapo_mcore.reward.result import RewardResult

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_reward"
PLUGIN = '''
import time

def as_bool(response, gt):
    return response.strip().endswith(gt)

def as_float(response, gt):
    return 0.5 if gt in response else -0.25

def lenient(response, gt):  # a hackable verifier: pays if the ground truth appears anywhere
    text = response.decode("utf-8", "replace") if isinstance(response, bytes) else response
    return gt in text

def slow(response, gt):
    if response == "HANG":
        time.sleep(3600)
    return True

def bad_type(response, gt):
    return "yes"

not_callable = 3
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A module ``ux_plugin`` importable here and in spawned workers (they inherit sys.path)."""
    (tmp_path / "ux_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "ux_plugin"
    sys.modules.pop("ux_plugin", None)


def test_import_path_reward_adapts_bool_and_number(plugin):
    b = get_reward(f"{plugin}:as_bool")
    assert b.fn("Answer: 12", "12") == RewardResult(1.0, True, None)
    assert b.fn("Answer: 13", "12") == RewardResult(-1.0, False, None)
    f = get_reward(f"{plugin}:as_float").fn
    assert f("12", "12") == RewardResult(0.5, True, None) and f("1", "12") == RewardResult(-0.25, False, None)
    with pytest.raises(TypeError, match="return a RewardResult, a bool or a number"):
        get_reward(f"{plugin}:bad_type").fn("x", "1")
    # Pickled by path, so a spawned worker re-imports the function instead of needing the object.
    again = pickle.loads(pickle.dumps(b.fn))
    assert again.path == f"{plugin}:as_bool" and again("7", "7").acc


@pytest.mark.parametrize(("name", "fragment"), [
    ("no_such_module_xyz:score", "PYTHONPATH"),
    ("ux_plugin:missing", "has no function 'missing'; callables there: as_bool"),
    ("ux_plugin:not_callable", "has no function 'not_callable'"),
    ("ux_plugin:", "package.module:function"),
])
def test_bad_import_paths_are_config_errors(plugin, name, fragment):
    with pytest.raises(ConfigError, match="reward.name=") as err:
        RewardConfig(name=name).validate()
    assert fragment in str(err.value)
    with pytest.raises(ConfigError, match="registered: .*math_dapo_strict"):
        RewardConfig(name="math_dapo_stritc").validate()
    RewardConfig(name=f"{plugin}:as_bool", workers=2).validate()


def test_import_path_reward_in_the_pool_with_timeout(plugin):
    with RewardPool(f"{plugin}:slow", num_workers=1, timeout_s=1.0) as pool:
        out = pool.score(["ok", "HANG", "ok"], ["1", "1", "1"])
    assert [r.acc for r in out] == [True, False, True]
    assert "timed out" in out[1].reason


def test_trainer_scorer_uses_the_import_path(plugin):
    from dapo_mcore.run.runtime import make_scorer

    closers: list = []
    score = make_scorer(RewardConfig(name=f"{plugin}:as_bool", workers=1), closers)
    assert [r.acc for r in score(["a 5", "a 6"], ["5", "5"])] == [True, False]
    for close in closers:
        close()


@pytest.mark.parametrize("response", [
    "Answer: 7 = 12", "Answer: $12$ or $7$", "Answer: 1, 2", "Answer: 7\nAnswer: 12", "Answer: 3+9 = 12",
])
def test_strict_refuses_hedges_that_math_dapo_pays(response):
    gt = "12"
    assert compute_score(response, gt).acc
    r = compute_score_strict(response, gt)
    assert not r.acc and r.score == -1.0 and r.reason


@pytest.mark.parametrize(("response", "gt"), [
    ("Answer: 12", "12"), ("Answer: x = 12", "12"), ("Answer: f(2) = 12", "12"), ("Answer: $12$", "12"),
    ("Answer: 12,345", "12345"), ("Answer: (1,2)", "(1,2)"), ("Answer: \\frac{1}{2}", "\\frac{1}{2}"),
    ("Answer: 12\nAnswer: 12", "12"), ("Answer: 12 dollars", "12"),
])
def test_strict_keeps_math_dapo_verdicts_on_plain_answers(response, gt):
    assert compute_score_strict(response, gt) == compute_score(response, gt)


def test_audit_summary_and_gates(plugin, capsys):
    assert audit.main(["--num-gts", "20", "--reward", "math_dapo", "--fail-on-hedge"]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines()[-1].startswith("audit-reward summary: reward=math_dapo shortcuts=0 hedges_paid=")
    assert "HEDGE: math_dapo: hedge probe 'Answer: <wrong> = <gt>' is paid" in out.err
    assert audit.main(["--num-gts", "20", "--reward", "math_dapo_strict", "--fail-on-shortcut", "--fail-on-hedge"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("hedges_paid=0 honest_paid=100% verdict=ok")
    assert audit.main(["--num-gts", "20", "--reward", f"{plugin}:lenient", "--fail-on-shortcut"]) == 1
    out = capsys.readouterr()
    assert "verdict=shortcut" in out.out.splitlines()[-1] and "SHORTCUT" in out.err


def test_audit_side_by_side_and_user_probes(tmp_path, capsys):
    probes = tmp_path / "p.jsonl"
    probes.write_text('{"name": "mine: Answer: <gt> and <wrong>", "kind": "hedge", "response": "Answer: <gt> and <wrong>"}\n')
    assert audit.main(["--num-gts", "10", "--reward", "math_dapo", "--reward", "math_dapo_strict",
                       "--probes", str(probes), "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| probe | kind | `math_dapo` | `math_dapo_strict` |"
    assert any("`Answer: <wrong> = <gt>` | hedge | 100% / 100%" in row and row.endswith("| 0% / 0% (0) |") for row in lines)
    assert any(row.startswith("| `mine: Answer: <gt> and <wrong>` | hedge |") for row in lines)
    assert len([row for row in lines if row.startswith("audit-reward summary:")]) == 2


@pytest.mark.parametrize(("content", "fragment"), [
    ("not json\n", "not valid JSON"), ('{"name": "x", "kind": "odd", "response": "r"}\n', "kind 'odd'"),
    ('{"name": "x"}\n', "write {"), ("\n", "no probes"),
])
def test_bad_probe_files_exit_2(tmp_path, capsys, content, fragment):
    probes = tmp_path / "p.jsonl"
    probes.write_text(content)
    assert audit.main(["--num-gts", "5", "--probes", str(probes)]) == 2
    assert fragment in capsys.readouterr().err
    assert audit.main(["--num-gts", "5", "--reward", "nope_mod:f"]) == 2


def test_example_verifier_passes_both_gates_through_the_pool(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    assert audit.main(["--num-gts", "20", "--reward", "numeric_verifier:score", "--probes",
                       str(EXAMPLE / "probes.jsonl"), "--workers", "1", "--fail-on-shortcut", "--fail-on-hedge"]) == 0
    out = capsys.readouterr().out
    assert "fraction form: Answer: <gt>/1" in out and out.splitlines()[-1].endswith("verdict=ok")
    from numeric_verifier import score

    assert score("Answer: 0.5", "1/2") and not score("Answer: 0.5 or 1/2", "1/2") and not score("no answer", "1")
