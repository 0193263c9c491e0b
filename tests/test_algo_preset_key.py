"""``algo.preset`` is a config key like ``rollout.schedule.preset``: it sets the objective recipe's keys, a key given
beside it wins, the resolved keys are what a run records, and GSPO with a PPO-sized clip range warns."""

from __future__ import annotations

import logging

import pytest

from dapo_mcore.algo.config import PRESETS, AlgoConfig
from dapo_mcore.commands.config import precheck
from dapo_mcore.config import ConfigError, load_config
from dapo_mcore.config.tree import to_dict
from dapo_mcore.run.directory import identity_diff

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_preset_key_sets_what_from_preset_sets(name):
    cfg = load_config(None, ["model.tiny_base=true", f"algo.preset={name}"])
    cfg.algo.validate()
    want = AlgoConfig.from_preset(name)
    for key in PRESETS[name]:
        assert getattr(cfg.algo, key) == getattr(want, key), key


def test_a_key_beside_the_preset_wins_and_an_unknown_preset_is_refused():
    cfg = load_config(None, ["model.tiny_base=true", "algo.preset=gspo", "algo.clip_high=5e-4"])
    assert (cfg.algo.objective, cfg.algo.clip_low, cfg.algo.clip_high) == ("gspo", 3e-4, 5e-4)
    with pytest.raises(ConfigError, match="algo.preset='ppo' is unknown"):
        load_config(None, ["model.tiny_base=true", "algo.preset=ppo"]).validate()


def test_the_preset_name_is_no_change_of_run_when_the_keys_agree():
    spelled = load_config(None, ["model.tiny_base=true", "algo.objective=gspo", "algo.clip_low=3e-4",
                                 "algo.clip_high=4e-4", "algo.loss_agg=seq-mean-token-mean"])
    named = load_config(None, ["model.tiny_base=true", "algo.preset=gspo"])
    assert identity_diff(to_dict(spelled), to_dict(named)) == []


def test_gspo_with_a_ppo_clip_range_warns(caplog, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: {tiny_base: true}\nalgo: {objective: gspo}\n")
    with caplog.at_level(logging.WARNING):
        precheck(str(config), [], check_files=False)
    assert "algo.objective=gspo with clip_low=0.2 clip_high=0.28" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        precheck(str(config), ["algo.preset=gspo"], check_files=False)
    assert "gspo" not in caplog.text
