"""Issue 35 items 4: the async mode as a user reads it (config's split, refusals, warnings), without a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_mcore.commands.config import main

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


def _tiny(*overrides: str):
    from dapo_mcore.config import load_config

    return load_config(ROOT / "examples" / "tiny_cpu.yaml", list(overrides))


ASYNC = ("rollout.pipeline.mode=async", "algo.tis_cap=2")


@pytest.mark.parametrize(("overrides", "world", "says", "not_says"), [
    # engine_ranks=0 is no "leaves no rank to train" case: it gives the engines nothing.
    (("rollout.pipeline.engine_ranks=0",), 2, "rollout.pipeline.engine_ranks=0 must be >= 1: the async mode runs the "
                                              "engines on ranks of their own", "leaves no"),
    (("rollout.pipeline.engine_ranks=2",), 2, "leaves no trainer rank of the 2 launched: launch 3 processes", None),
    # A TP refusal speaks of the trainer ranks and says which count to launch (the user launched 2: not "2").
    (("parallel.tensor_parallel=2",), 2, "1 trainer ranks (2 launched - rollout.pipeline.engine_ranks=1) is not a "
                                         "multiple of tensor_parallel x pipeline_parallel = 2; launch 3 processes",
     "world size"),
    (("parallel.tensor_parallel=2", "rollout.pipeline.engine_ranks=2"), 5, "launch 4 or 6 processes", None),
])
def test_async_refusals_speak_of_trainer_ranks(overrides, world, says, not_says):
    from dapo_mcore.config.tree import ConfigError

    with pytest.raises(ConfigError) as info:
        _tiny(*ASYNC, *overrides).validate(world)
    assert says in str(info.value)
    assert not_says is None or not_says not in str(info.value)


def test_the_launch_counts_a_refusal_suggests_are_accepted():
    """The counts the TP refusal proposes validate (the hint is computed, so check it against validate itself)."""
    for world in (4, 6):
        _tiny(*ASYNC, "parallel.tensor_parallel=2", "rollout.pipeline.engine_ranks=2").validate_layout(world)


def test_async_only_keys_in_sync_mode_warn_once_in_one_line(tmp_path, caplog, monkeypatch):
    from dapo_mcore.commands.config import precheck

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    tiny = str(ROOT / "examples" / "tiny_cpu.yaml")
    with caplog.at_level("WARNING", logger="dapo_mcore.commands.config"):
        precheck(tiny, ["rollout.pipeline.engine_ranks=4", "rollout.pipeline.bucket_mb=64"], 1)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "rollout.pipeline.engine_ranks=4, rollout.pipeline.bucket_mb=64" in lines[0] and "ignored" in lines[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="dapo_mcore.commands.config"):
        precheck(tiny, [], 1)  # defaults: nothing to say
        precheck(tiny, [*ASYNC, "rollout.pipeline.engine_ranks=1", "rollout.pipeline.bucket_mb=64"], 2)  # async
        precheck(tiny, ["rollout.pipeline.bucket_mb=64"], 1, warn=False)  # eval of an async run's config
    assert not caplog.records, [r.getMessage() for r in caplog.records]
