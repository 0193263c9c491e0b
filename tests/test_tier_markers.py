"""A test that starts ranks or a run is never in the quick unit subset: pytest adds a module-level
``pytestmark = pytest.mark.unit`` to every test of the module, so one marked distributed/e2e/vllm there carries both
marks and ``-m unit`` runs it (a kill test under load made the quick subset flaky that way)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

HEAVY = ("distributed", "e2e", "vllm")


def _mixed(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    module_unit = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and "unit" in ast.unparse(n.value) for n in tree.body)
    if not module_unit:
        return []
    return [f"{path.name}::{n.name}" for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and n.name.startswith("test") and any(f"mark.{m}" in ast.unparse(d) for d in n.decorator_list
                                                  for m in HEAVY)]


def test_no_test_is_both_unit_and_heavier():
    mixed = [t for f in sorted(Path(__file__).parent.glob("test_*.py")) for t in _mixed(f)]
    assert mixed == [], f"marked unit by their module and heavier by themselves: {mixed}"


def test_the_check_sees_a_mixed_module(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("import pytest\npytestmark = pytest.mark.unit\n\n@pytest.mark.distributed\ndef test_a():\n    pass\n")
    assert _mixed(f) == ["test_x.py::test_a"]
