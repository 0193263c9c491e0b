"""A correction setting means what it says: fields beside a preset win even at their plain default, equivalent
spellings are one run on resume, a cap below 1 is refused in every spelling, and dropping W&B on resume is said."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from dapo_mcore.actor.parallel import LaunchEnv
from dapo_mcore.algo.rollout_correction_config import PRESETS
from dapo_mcore.config import ConfigError, load_config, write_resolved
from dapo_mcore.run.directory import prepare_run_dir

pytestmark = pytest.mark.unit

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
RANK0 = LaunchEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=29500, source="test")
RC = "algo.rollout_correction"


@pytest.mark.parametrize("preset, field, value, expected", [
    ("bypass_ppo_clip", "bypass", "false", False),
    ("geo_rs_token_tis", "rs", "[]", []),
    ("token_tis", "is_level", "null", None),
])
def test_a_field_at_its_default_beside_a_preset_is_applied(tmp_path, preset, field, value, expected):
    overrides = [f"run.dir={tmp_path}", f"{RC}.preset={preset}", f"{RC}.{field}={value}"]
    if field == "rs":
        overrides.append(f"{RC}.rs_thresholds=[]")
    cfg = load_config(TINY, overrides)
    cfg.validate(2)
    assert getattr(cfg.algo.correction, field) == expected
    assert getattr(PRESETS[preset], field) != expected  # the preset alone says otherwise
    # what config.yaml records is what runs, and reads back to the same correction
    write_resolved(cfg, tmp_path)
    stored = yaml.safe_load((tmp_path / "config.yaml").read_text())["algo"]["rollout_correction"]
    assert stored[field] == expected and stored["preset"] == preset
    assert load_config(tmp_path / "config.yaml").algo.correction == cfg.algo.correction


@pytest.mark.parametrize("first, then", [
    (["algo.tis_cap=2"], [f"{RC}.preset=token_tis"]),
    ([f"{RC}.preset=token_tis"], ["algo.tis_cap=2.0"]),
    ([f"{RC}.preset=geo_rs"], [f"{RC}.rs=[seq_mean_k1]", f"{RC}.rs_thresholds=[[0.999, 1.001]]"]),
])
def test_equivalent_spellings_resume_as_one_run(tmp_path, first, then):
    run_dir = tmp_path / "run"
    write_resolved(load_config(TINY, [f"run.dir={run_dir}", *first]), run_dir)
    prepare_run_dir(load_config(TINY, [f"run.dir={run_dir}", *then]), RANK0)  # the same run: no error
    with pytest.raises(ConfigError, match=r"algo.correction.is_threshold: .* -> 3.0"):
        prepare_run_dir(load_config(TINY, [f"run.dir={run_dir}", f"{RC}.preset=token_tis",
                                           f"{RC}.is_threshold=3.0"]), RANK0)


def test_a_run_directory_written_before_presets_resolved_on_load_resumes(tmp_path):
    """Older versions wrote ``preset: icepop`` beside the fields at their plain defaults."""
    run_dir = tmp_path / "run"
    write_resolved(load_config(TINY, [f"run.dir={run_dir}", f"{RC}.preset=icepop"]), run_dir)
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    written["algo"]["rollout_correction"].update(is_level=None, is_threshold=None)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(written))
    prepare_run_dir(load_config(TINY, [f"run.dir={run_dir}", f"{RC}.preset=icepop"]), RANK0)


@pytest.mark.parametrize("overrides, key", [
    (["algo.tis_cap=0.5"], "algo.tis_cap"),
    ([f"{RC}.is_level=token", f"{RC}.is_threshold=0.5"], f"{RC}.is_threshold"),
    ([f"{RC}.preset=token_tis", f"{RC}.is_threshold=0.5"], f"{RC}.is_threshold"),
])
def test_a_cap_below_one_is_refused_in_every_spelling(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides).validate(2)
    assert str(err.value).startswith(key) and ">= 1" in str(err.value) and "\n" not in str(err.value)
    load_config(TINY, [f"{RC}.is_level=token", f"{RC}.is_threshold=[0.5, 5.0]"]).validate(2)  # a band may start < 1


def test_dropping_wandb_on_resume_is_said(tmp_path, caplog):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    write_resolved(load_config(TINY, [f"run.dir={run_dir}", "telemetry.wandb.project=demo"]), run_dir)
    with caplog.at_level(logging.WARNING, logger="dapo_mcore.run.directory"):
        prepare_run_dir(load_config(TINY, [f"run.dir={run_dir}", "telemetry.wandb.project=demo"]), RANK0)
        assert not caplog.records
        prepare_run_dir(load_config(TINY, [f"run.dir={run_dir}"]), RANK0)
    [record] = caplog.records
    assert "'demo'" in record.getMessage() and "telemetry.wandb.project=demo" in record.getMessage()
