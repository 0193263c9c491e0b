"""Issue 35 items 4: the async mode as a user reads it (config's split, refusals, warnings), without a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_mcore.config_cli import main

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
ASYNC_32B = str(ROOT / "examples" / "qwen2.5-32b-fp8-async.yaml")


def _stand_ins(tmp_path: Path) -> list[str]:
    """The 32B example on a laptop: the preset for the absent checkpoint, empty stand-ins for the datasets."""
    for f in ("train.parquet", "eval.parquet"):
        (tmp_path / f).touch()
    return ["model.hf_path=null", "model.preset=qwen2.5-32b", f"data.train={tmp_path / 'train.parquet'}",
            f"data.eval={tmp_path / 'eval.parquet'}", f"run.dir={tmp_path / 'run'}"]


def test_config_prints_the_async_split_of_the_32b_recipe(tmp_path, capsys):
    assert main([ASYNC_32B, "--world-size", "128", *_stand_ins(tmp_path)]) == 0
    derived = capsys.readouterr().out.split("# derived\n", 1)[1]
    assert "# processes: 128 = 32 trainer ranks (0-31) + 96 engine ranks (32-127)" in derived
    assert "# trainer: 32 = data parallel 2 x tensor parallel 8 x pipeline parallel 2" in derived
    assert "# engines: 96 = 24 vllm engine(s) (data parallel) x tensor parallel 4" in derived
    assert "data parallel 8" not in derived and "32 engine group" not in derived  # not the sync layout


def test_config_of_a_sync_run_says_the_engines_are_colocated(tmp_path, capsys):
    assert main([str(ROOT / "examples" / "tiny_cpu.yaml"), "--world-size", "2", f"run.dir={tmp_path / 'r'}"]) == 0
    derived = capsys.readouterr().out.split("# derived\n", 1)[1]
    assert "# processes: 2 = data parallel 2 x tensor parallel 1 x pipeline parallel 1" in derived
    assert "2 engine group(s) of 1 process(es), colocated" in derived and "trainer ranks" not in derived
