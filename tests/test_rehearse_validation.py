"""``rehearse`` checks the recipe as written before it shrinks it: an impossible layout or value is exit 2 up front,
not a rehearsal of another layout; a YAML alias bomb is refused before it is expanded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore.commands.rehearse import validate_as_written
from dapo_mcore.config import ConfigError, load_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_passes_as_written(recipe):
    validate_as_written(load_config(str(ROOT / "examples" / recipe)))


@pytest.mark.parametrize("override, needle", [
    ("parallel.tensor_parallel=3", "does not divide num_attention_heads=28"),
    ("parallel.tensor_parallel=0", "must be >= 1"),
    ("parallel.tensor_parallel=1048576", "does not divide num_attention_heads=28"),
    ("parallel.pipeline_parallel=5", "does not divide num_hidden_layers=28"),
])
def test_an_impossible_layout_is_refused_before_shrinking(override, needle):
    with pytest.raises(ConfigError, match=needle):
        validate_as_written(load_config(str(ROOT / "examples" / "qwen2.5-7b.yaml"), [override]))


def _bomb(tmp_path: Path) -> Path:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10^9 leaves
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_yaml_alias_bomb_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="expands to more than 100,000 YAML nodes"):
        load_config(str(_bomb(tmp_path)))


def test_rehearse_of_an_impossible_layout_exits_2_in_one_line():
    done = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "rehearse", "examples/qwen2.5-7b.yaml",
                           "parallel.tensor_parallel=3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "tensor_parallel=3 does not divide" in done.stderr and "Traceback" not in done.stderr
