"""The package's shape: a short top level, imports that only point down a floor (between packages, and between the
sub-packages of a package), and no modules importing each other in a circle (lazy and TYPE_CHECKING imports count:
they are arrows a reader follows too)."""

from __future__ import annotations

import ast
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dapo_mcore"

# Lowest first; docs/architecture.md shows the same table.
FLOORS = [
    {"errors", "signals", "collectives", "plugins"},
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

OWN = "(own modules)"
"""In a sub-package table: the package's own modules (those not in a sub-package of it), as one room."""

# Inside a package that holds sub-packages, its rooms (the sub-packages, and its own modules by name or as OWN) are
# stacked in floors too, lowest first; an import points down or sideways within its room, never up, and never into
# the package's front door (its ``__init__``) from inside. docs/architecture.md shows the same tables. A room that
# does not exist yet is a place reserved for it.
SUB_FLOORS = {
    "rollout": [{"protocol"}, {"correction", "scheduling"}, {"engines"}, {"multiturn"}, {"pipeline"}],
    "model": [{OWN}, {"lora"}],
}
ROLLOUT_TOP_LEVEL = {"__init__.py", "protocol.py"}


def _modules(pkg: Path = PKG) -> dict[str, Path]:
    out = {}
    for path in pkg.rglob("*.py"):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
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


def _front_door_imports(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(module, package it lives in) where the module imports a name of that package's ``__init__`` (not a
    submodule): an arrow to the front door, which ``_imports`` leaves out with the parent packages."""
    found = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and name.startswith(node.module + ".")
                    and any(f"{node.module}.{a.name}" not in modules for a in node.names)):
                found.add((name, node.module))
    return found


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _sub_room(package: str, module: str, modules: dict[str, Path]) -> str:
    """``module``'s room in ``package`` (dotted, below ``dapo_mcore``): the sub-package or module it is in, or OWN."""
    head = module[len(package) + 1:].split(".")[0]
    is_module = modules[f"{package}.{head}"].name != "__init__.py"
    return OWN if is_module and any(OWN in floor for floor in SUB_FLOORS[package.split(".", 1)[1]]) else head


def _packages_with_sub_packages(modules: dict[str, Path]) -> set[str]:
    """Packages below the top level that hold a package of their own (dotted, ``dapo_mcore.x``)."""
    return {m.rsplit(".", 1)[0] for m, p in modules.items() if p.name == "__init__.py" and m.count(".") >= 2}


def _upward_imports(modules: dict[str, Path]) -> list[str]:
    """Every import that points up or sideways between rooms: between the top-level packages (FLOORS), and between
    the rooms of a package that has sub-packages (SUB_FLOORS), front door included."""
    upward = []
    for a, targets in _imports(modules).items():
        for b in targets:
            if "dapo_mcore" in (a, b):
                continue
            if _room(a) != _room(b):
                if FLOOR[_room(b)] >= FLOOR[_room(a)]:
                    upward.append(f"{a} -> {b}")
                continue
            common = []
            for x, y in zip(a.split("."), b.split("."), strict=False):
                if x != y:
                    break
                common.append(x)
            package = ".".join(common)
            floors = SUB_FLOORS.get(package.split(".", 1)[1]) if "." in package else None
            if floors is None or package == a:
                continue  # sideways within a package without sub-packages, or a front door importing its inside
            floor = {room: i for i, rooms in enumerate(floors) for room in rooms}
            ra, rb = _sub_room(package, a, modules), _sub_room(package, b, modules)
            if ra != rb and floor[rb] >= floor[ra]:
                upward.append(f"{a} -> {b}")
    upward += [f"{a} -> {p} (the front door of the package it lives in)" for a, p in _front_door_imports(modules)
               if p.split(".", 1)[-1] in SUB_FLOORS]
    return sorted(upward)


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
    for package in _packages_with_sub_packages(modules):
        key = package.split(".", 1)[1]
        assert key in SUB_FLOORS, f"{package} holds sub-packages: stack them in SUB_FLOORS"
        tabled = set().union(*SUB_FLOORS[key])
        inside = {_sub_room(package, m, modules) for m in modules if m.startswith(package + ".")}
        assert inside <= tabled, f"rooms of {package} without a floor: {sorted(inside - tabled)}; add to SUB_FLOORS"
    assert _upward_imports(modules) == []


@pytest.mark.unit
def test_the_rollout_top_level_is_the_package_and_the_engine_protocol():
    assert {p.name for p in (PKG / "rollout").glob("*.py")} == ROLLOUT_TOP_LEVEL


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


@pytest.mark.unit
def test_the_checker_sees_an_upward_import_inside_a_package(tmp_path):
    """A copy of the tree with upward imports planted, at each level the rule covers: between sub-packages, into a
    package's front door, and in the reserved places (model/lora, tools) before they exist here."""
    pkg = tmp_path / "dapo_mcore"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert _upward_imports(_modules(pkg)) == []  # the copy is as clean as the tree

    def plant(rel: str, line: str) -> None:
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((path.read_text() if path.is_file() else "") + "\n" + line + "\n")

    plant("rollout/engines/hf_engine.py", "from dapo_mcore.rollout.pipeline import wire")  # engines -> pipeline: up
    plant("rollout/scheduling/gather.py", "from dapo_mcore.rollout.correction import mismatch")  # same floor
    plant("rollout/pipeline/colocated.py", "from dapo_mcore.rollout import HFEngine")  # the front door
    plant("rollout/pipeline/wire.py", "from dapo_mcore.rollout.engines import hf_engine")  # down: allowed
    plant("model/lora/__init__.py", "")
    plant("model/lora/adapter.py", "from dapo_mcore.model import hf_config")  # lora -> the model's modules: down
    plant("model/qwen.py", "from dapo_mcore.model.lora import adapter")  # the model's modules -> lora: up
    plant("tools/__init__.py", "")
    plant("tools/registry.py", "from dapo_mcore.rollout import protocol")  # tools (floor 1) -> rollout: up
    # ``from p import m`` is an arrow to the package p and to its module m: both are reported
    assert _upward_imports(_modules(pkg)) == sorted([
        "dapo_mcore.model.qwen -> dapo_mcore.model.lora", "dapo_mcore.model.qwen -> dapo_mcore.model.lora.adapter",
        "dapo_mcore.rollout.engines.hf_engine -> dapo_mcore.rollout.pipeline",
        "dapo_mcore.rollout.engines.hf_engine -> dapo_mcore.rollout.pipeline.wire",
        "dapo_mcore.rollout.pipeline.colocated -> dapo_mcore.rollout (the front door of the package it lives in)",
        "dapo_mcore.rollout.scheduling.gather -> dapo_mcore.rollout.correction",
        "dapo_mcore.rollout.scheduling.gather -> dapo_mcore.rollout.correction.mismatch",
        "dapo_mcore.tools.registry -> dapo_mcore.rollout", "dapo_mcore.tools.registry -> dapo_mcore.rollout.protocol",
    ])
