"""A run directory is one run: layout changes resume it, other config changes are refused naming each key."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_mcore.actor.parallel import LaunchEnv
from dapo_mcore.config import ConfigError, load_config, write_resolved
from dapo_mcore.run.directory import identity_diff, prepare_run_dir

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
RANK0 = LaunchEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=29500, source="test")


def _existing_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    write_resolved(load_config(str(CONFIG), [f"run.dir={run_dir}"]), str(run_dir))
    return run_dir


@pytest.mark.parametrize("overrides", [
    ["parallel.tensor_parallel=2"], ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=null"],
    ["train.steps=500", "train.micro_batch_tokens=512", "model.layer_spec=local", "model.recompute=full",
     "model.make_vocab_size_divisible_by=64", "rollout.vllm.tensor_parallel=2", "eval.every=5", "checkpoint.every=3"],
    ["rollout.pipeline.engine_ranks=2", "rollout.pipeline.bucket_mb=64"],  # the async split and transfer: layout
])
def test_layout_and_length_changes_resume_the_run(tmp_path, overrides):
    run_dir = _existing_run(tmp_path)
    cfg = load_config(str(CONFIG), [f"run.dir={run_dir}", *overrides])
    prepare_run_dir(cfg, RANK0)  # no error: the same run, continued


def test_another_run_is_refused_naming_every_changed_key(tmp_path):
    run_dir = _existing_run(tmp_path)
    cfg = load_config(str(CONFIG), [f"run.dir={run_dir}", "algo.clip_high=0.3", "optim.lr=0.001",
                                    "parallel.tensor_parallel=2"])
    with pytest.raises(ConfigError) as err:
        prepare_run_dir(cfg, RANK0)
    msg = str(err.value)
    assert "holds another run (algo.clip_high: 0.28 -> 0.3; optim.lr: 0.0005 -> 0.001)" in msg
    assert "tensor_parallel" not in msg and "run.overwrite=true" in msg


def test_a_schedule_preset_is_its_switches_not_its_name(tmp_path):
    # A run started with every switch off resumes under rollout.schedule.preset=paper (the same loop, named); a
    # preset that turns switches on is another run, named by the switches that changed.
    run_dir = _existing_run(tmp_path)
    prepare_run_dir(load_config(str(CONFIG), [f"run.dir={run_dir}", "rollout.schedule.preset=paper"]), RANK0)
    cfg = load_config(str(CONFIG), [f"run.dir={run_dir}", "rollout.schedule.preset=partial_completion",
                                    "algo.tis_cap=2.0"])
    with pytest.raises(ConfigError) as err:
        prepare_run_dir(cfg, RANK0)
    msg = str(err.value)
    assert "rollout.schedule.order: 'prompt' -> 'completion'" in msg and "rollout.schedule.partial: False -> True" in msg
    assert "rollout.schedule.preset" not in msg


def test_identity_diff_against_a_naive_walk():
    old = {"algo": {"clip_high": 0.28, "nested": {"a": [1, 2]}}, "train": {"steps": 5, "seed": 1}, "parallel": {"tp": 1}}
    new = {"algo": {"clip_high": 0.28, "nested": {"a": [1, 3], "b": True}}, "train": {"steps": 9, "seed": 2},
           "parallel": {"tp": 2}}
    assert identity_diff(old, new) == ["algo.nested.a: [1, 2] -> [1, 3]", "algo.nested.b: (unset) -> True",
                                       "train.seed: 1 -> 2"]


def test_a_setting_added_after_the_run_started_is_no_change_at_its_default(tmp_path):
    """A run directory written by an older version lacks newer keys: at their defaults the run resumes; set to
    anything else it is another run."""
    import yaml

    run_dir = _existing_run(tmp_path)
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    del written["rollout"]["schedule"]["exchange_every"]
    del written["rollout"]["stop_token_ids"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(written))
    prepare_run_dir(load_config(str(CONFIG), [f"run.dir={run_dir}"]), RANK0)  # resumes
    cfg = load_config(str(CONFIG), [f"run.dir={run_dir}", "rollout.schedule.exchange_every=2"])
    with pytest.raises(ConfigError, match=r"rollout.schedule.exchange_every: \(unset\) -> 2"):
        prepare_run_dir(cfg, RANK0)


def test_switching_between_sync_and_async_is_another_run(tmp_path):
    """Async trains on tokens one policy version old: not the same run as the sync one it would continue."""
    run_dir = _existing_run(tmp_path)
    cfg = load_config(str(CONFIG), [f"run.dir={run_dir}", "rollout.pipeline.mode=async", "algo.tis_cap=2.0"])
    with pytest.raises(ConfigError, match=r"rollout.pipeline.mode: 'sync' -> 'async'"):
        prepare_run_dir(cfg, RANK0)


def test_raising_max_gen_batches_continues_the_run(tmp_path):
    # the fix dynamic sampling's exhaustion names first: it must not be refused as another run
    run_dir = _existing_run(tmp_path)
    prepare_run_dir(load_config(str(CONFIG), [f"run.dir={run_dir}", "algo.max_gen_batches=0"]), RANK0)
