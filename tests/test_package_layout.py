"""The package's shape: a short top level, imports that only point down a floor, and no modules importing each
other in a circle (lazy and TYPE_CHECKING imports count: they are arrows a reader follows too)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dapo_mcore"

# Lowest first; docs/architecture.md shows the same table.
FLOORS = [
    {"errors", "signals", "collectives"},
    {"model", "algo", "reward", "tools"},
    {"data", "telemetry", "weights"},
    {"actor"},
    {"rollout", "config"},
    {"plan", "run"},
    {"trainer"},
    {"commands"},
    {"cli"},
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
TOP_LEVEL_MODULES = {"__init__.py", "cli.py", "trainer.py", "errors.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its text (a parent package it lives in excluded)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges[name] |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return edges


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.mark.unit
def test_no_module_imports_another_in_a_circle():
    assert _cycles(_imports(_modules())) == []


@pytest.mark.unit
def test_every_import_points_down_a_floor():
    modules = _modules()
    rooms = {_room(m) for m in modules if m != "dapo_mcore"}
    assert rooms <= set(FLOOR), f"rooms without a floor: {sorted(rooms - set(FLOOR))}; add them to FLOORS"
    upward = sorted(f"{a} -> {b}" for a, targets in _imports(modules).items() for b in targets
                    if a != "dapo_mcore" and b != "dapo_mcore" and _room(a) != _room(b)
                    and FLOOR[_room(b)] >= FLOOR[_room(a)])
    assert upward == []


@pytest.mark.unit
def test_the_top_level_is_the_entry_point_the_loop_and_the_errors():
    loose = {p.name for p in PKG.glob("*.py")}
    assert loose == TOP_LEVEL_MODULES


@pytest.mark.unit
def test_the_checker_sees_a_circle_and_an_upward_import():
    """The two checks above would pass vacuously if the parsing found no edges: show they catch what they exist for."""
    edges = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": set()}
    assert _cycles(edges) == [["a.x", "a.y", "a.z"]]
    real = _imports(_modules())
    assert "dapo_mcore.run.runtime" in real["dapo_mcore.trainer"]  # a lazy or top-level import is seen
    assert FLOOR[_room("dapo_mcore.trainer")] > FLOOR[_room("dapo_mcore.run.runtime")]
