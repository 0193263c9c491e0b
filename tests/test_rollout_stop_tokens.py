"""The run's stop set (rollout.engines.stop_tokens): generation_config.json's eos_token_id (int or list), the
tokenizer's EOS and rollout.stop_token_ids, each id with its sources; bad sources refused in one line; the store keeps
the stop id."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dapo_mcore.config import ConfigError, load_config
from dapo_mcore.rollout.engines.stop_tokens import StopTokenError, resolve_stop_tokens
from dapo_mcore.telemetry.rollout_store import Rollout, RolloutReader, RolloutStore

pytestmark = pytest.mark.unit


def write_gen(tmp_path, eos):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return tmp_path


def test_union_of_generation_config_tokenizer_and_setting(tmp_path):
    s = resolve_stop_tokens(write_gen(tmp_path, [151645, 151643]), 151645, [7], 151936)
    assert s.ids == (7, 151643, 151645)
    assert s.sources[151645] == ("generation_config", "tokenizer") and s.sources[7] == ("rollout.stop_token_ids",)
    assert resolve_stop_tokens(write_gen(tmp_path, 5), 2, [], 32).ids == (2, 5)
    assert resolve_stop_tokens(tmp_path / "nowhere", 2, [], 32).ids == (2,)  # no generation config: the tokenizer's


def test_bad_sources_are_refused_naming_them(tmp_path):
    with pytest.raises(StopTokenError, match="generation_config.json: stop token id 99 lies outside"):
        resolve_stop_tokens(write_gen(tmp_path, [99]), 2, [], 32)
    with pytest.raises(StopTokenError, match="must be an int or a list of ints"):
        resolve_stop_tokens(write_gen(tmp_path, "eos"), 2, [], 32)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(StopTokenError, match="is not valid JSON"):
        resolve_stop_tokens(tmp_path, 2, [], 32)
    with pytest.raises(StopTokenError, match="set rollout.stop_token_ids"):
        resolve_stop_tokens(None, None, [], 32)


def test_config_refuses_stop_ids_outside_the_vocabulary():
    cfg = load_config(None, ["model.tiny_base=true", "rollout.stop_token_ids=[3, 40]"])
    with pytest.raises(ConfigError, match=r"rollout.stop_token_ids=\[3, 40\]: \[40\] lie outside the vocabulary"):
        cfg.validate_layout(1)


def test_store_records_the_stop_id_and_old_stores_read_minus_one(tmp_path):
    store = RolloutStore(tmp_path / "r.zarr")
    rows = [Rollout(np.array([1, 2]), np.array([5, 9]), None, 1.0, True, "stop", True, 0, 0, stop_token=9),
            Rollout(np.array([1, 2]), np.array([5, 6]), None, -1.0, False, "length", True, 0, 0)]
    store.append_step(1, rows)
    got = RolloutReader(tmp_path / "r.zarr").read_step(1)
    assert [r.stop_token for r in got] == [9, -1]
    import zarr

    group = zarr.open_group(str(tmp_path / "r.zarr"), mode="r+")
    del group["stop_token"]  # a store written before the column existed (and so before step checksums)
    committed = dict(group.attrs["committed"])
    committed.pop("crc32", None)
    group.update_attributes({"committed": committed})
    assert [r.stop_token for r in RolloutReader(tmp_path / "r.zarr").read_step(1)] == [-1, -1]
    RolloutStore(tmp_path / "r.zarr").append_step(2, rows)
    assert [r.stop_token for r in RolloutReader(tmp_path / "r.zarr").read_step(2)] == [9, -1]
    assert [r.stop_token for r in RolloutReader(tmp_path / "r.zarr").read_step(1)] == [-1, -1]
