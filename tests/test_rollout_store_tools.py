"""The rollout store's multi-turn columns: ``loss_mask`` per response token and ``tool_calls``/``tool_errors`` per
row round-trip; stores written before them read as all-model / no calls, verify, and take appends; a damaged mask is
caught by the step checksum; ``rollouts`` prints the turns with the tool's output set apart."""

from __future__ import annotations

import numpy as np
import pytest

from dapo_mcore.telemetry import rollout_store
from dapo_mcore.telemetry.rollout_store import ROLLOUTS_DIR, Rollout, RolloutReader, RolloutStore, step_crc32
from tests.test_telemetry_rollout_store import _save_tokenizer, expected

pytestmark = pytest.mark.unit


def multiturn(step: int) -> list[Rollout]:
    rng = np.random.default_rng(100 + step)
    out = []
    for i in range(5):
        n = int(rng.integers(3, 12))
        mask = np.ones(n, dtype=bool)
        calls = i % 3
        for _ in range(calls):
            a = int(rng.integers(0, n - 1))
            mask[a:a + 2] = False
        lp = np.where(mask, -rng.random(n), np.nan).astype(np.float32)
        out.append(Rollout(prompt_ids=rng.integers(0, 100, 4), response_ids=rng.integers(0, 100, n), logprobs=lp,
                           reward=1.0, acc=True, finish_reason="stop", kept=True, group_id=i, gen_batch=0,
                           loss_mask=mask, tool_calls=calls, tool_errors=int(calls == 2)))
    return out


def test_round_trip(tmp_path):
    store = RolloutStore(tmp_path / ROLLOUTS_DIR, row_chunk=3, token_chunk=8)
    store.append_step(0, expected(0))
    store.append_step(1, multiturn(1))
    reader = RolloutReader(tmp_path / ROLLOUTS_DIR)
    for got, want in zip(reader.read_step(1), multiturn(1), strict=True):
        assert np.array_equal(got.response_ids, want.response_ids)
        assert got.loss_mask.tolist() == want.loss_mask.tolist()
        assert np.array_equal(got.logprobs, want.logprobs, equal_nan=True)
        assert (got.tool_calls, got.tool_errors) == (want.tool_calls, want.tool_errors)
    assert all(r.loss_mask.all() and r.tool_calls == 0 for r in reader.read_step(0))
    assert reader.column("tool_calls").tolist() == [0] * len(expected(0)) + [r.tool_calls for r in multiturn(1)]


def test_store_written_before_the_columns(tmp_path):
    import zarr

    path = tmp_path / ROLLOUTS_DIR
    store = RolloutStore(path, row_chunk=5, token_chunk=16)
    store.append_step(0, expected(0))
    old = zarr.open_group(str(path), mode="r+")
    for name in ("loss_mask", "tool_calls", "tool_errors"):
        del old[name]  # as written before them: the step's checksum did not cover them
    reader = RolloutReader(path)
    assert all(r.loss_mask.all() and r.tool_calls == 0 for r in reader.read_step(0))  # verifies the checksum
    RolloutStore(path, resume_step=1).append_step(1, multiturn(1))
    assert [r.loss_mask.tolist() for r in reader.read_step(1)] == [r.loss_mask.tolist() for r in multiturn(1)]
    assert all(r.loss_mask.all() for r in reader.read_step(0))


def test_single_turn_checksum_unchanged_and_a_damaged_mask_is_caught(tmp_path):
    cols = rollout_store._columns(0, expected(0))
    without = {k: v for k, v in cols.items() if k not in ("loss_mask", "tool_calls", "tool_errors")}
    names = [n for n in (*rollout_store.ROW_COLUMNS, *rollout_store.TOKEN_COLUMNS) if n in without]
    import zlib

    crc = 0
    for name in names:
        dtype = rollout_store.ROW_COLUMNS.get(name) or rollout_store.TOKEN_COLUMNS[name][0]
        crc = zlib.crc32(np.ascontiguousarray(without[name], dtype=dtype).tobytes(), crc)
    assert step_crc32(cols) == crc
    import zarr

    path = tmp_path / ROLLOUTS_DIR
    RolloutStore(path).append_step(3, multiturn(3))
    group = zarr.open_group(str(path), mode="r+")
    mask = group["loss_mask"][:]
    group["loss_mask"][:] = ~mask
    with pytest.raises(rollout_store.StoreDamagedError, match="step 3"):
        RolloutReader(path).read_step(3)


def test_cli_sets_the_tool_output_apart(tmp_path, capsys):
    vocab = _save_tokenizer(tmp_path / "tokenizer")
    ids = {w: i for i, w in enumerate(vocab)}
    resp = [ids["what"], ids["2+2"], ids["4"], ids["Answer:"], ids["4"]]
    store = RolloutStore(tmp_path / ROLLOUTS_DIR)
    store.append_step(0, [Rollout([ids["what"]], resp, None, 1.0, True, "stop", True, 0, 0,
                                  loss_mask=np.array([1, 1, 0, 1, 1], dtype=bool), tool_calls=1)])
    assert rollout_store.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 tool call(s), 0 errored" in out
    lines = [ln.strip() for ln in out.splitlines() if "|" in ln]
    assert lines == ["model | 'what 2+2'", "TOOL  | '4'", "model | 'Answer: 4'"]
