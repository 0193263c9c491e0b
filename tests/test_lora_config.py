"""``model.lora``: defaults, overrides and the one-line refusals, all before any process group exists."""

from __future__ import annotations

import pytest

from dapo_mcore.config import ConfigError, load_config

pytestmark = pytest.mark.unit


def _cfg(*overrides: str):
    return load_config(None, ["model.tiny_base=true", *overrides])


def test_off_by_default_with_every_projection_targeted():
    cfg = _cfg()
    cfg.model.validate()
    assert cfg.model.lora.rank == 0 and not cfg.model.lora.enabled
    assert cfg.model.lora.target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def test_overrides_reach_the_settings_and_the_scale():
    cfg = _cfg("model.lora.rank=16", "model.lora.alpha=32", "model.lora.dropout=0.05",
               "model.lora.target_modules=[linear_qkv, linear_proj]")
    cfg.model.validate()
    lora = cfg.model.lora
    assert (lora.rank, lora.scale, lora.dropout, lora.target_modules) == (16, 2.0, 0.05, ["linear_qkv", "linear_proj"])


@pytest.mark.parametrize("override, words", [
    ("model.lora.rank=-1", "model.lora.rank=-1"),
    ("model.lora.alpha=0", "model.lora.alpha=0"),
    ("model.lora.dropout=1.0", "model.lora.dropout=1.0"),
    ("model.lora.target_modules=[]", "target_modules is empty"),
    ("model.lora.target_modules=[q_proj]", "q_proj is linear_qkv"),
    ("model.lora.target_modules=[linear_qkv, linear_qkv]", "twice"),
])
def test_bad_values_are_refused_in_one_line(override, words):
    cfg = _cfg("model.lora.rank=8", override) if "rank=-1" not in override else _cfg(override)
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=1, check_files=False)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_distributed_optimizer_is_refused_with_lora():
    with pytest.raises(ConfigError, match="distributed_optimizer=false"):
        _cfg("model.lora.rank=8", "parallel.distributed_optimizer=true").validate(world_size=1, check_files=False)


def test_rank_zero_ignores_the_other_fields():
    _cfg("model.lora.alpha=0", "model.lora.target_modules=[]").model.validate()
