"""Rollout store: zarr round trip, appends across steps, resume, crash recovery, a concurrent reader, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dapo_mcore.telemetry import rollout_store
from dapo_mcore.telemetry.rollout_store import ROLLOUTS_DIR, Rollout, RolloutReader, RolloutStore

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

# Deterministic rollouts per step, shared (as source) with the reader subprocess.
GEN_SRC = '''
import numpy as np
from dapo_mcore.telemetry.rollout_store import Rollout

def expected(step):
    rng = np.random.default_rng(step)
    out = []
    for i in range(int(rng.integers(1, 12))):
        resp = rng.integers(0, 50000, int(rng.integers(0, 15)))
        lp = None if i == 1 else -rng.random(len(resp)).astype(np.float32)
        out.append(Rollout(
            prompt_ids=rng.integers(0, 50000, int(rng.integers(1, 9))), response_ids=resp, logprobs=lp,
            reward=float(np.float32(rng.normal())), acc=i % 3 == 0, finish_reason="length" if i % 4 == 0 else "stop",
            kept=i % 2 == 1, group_id=i // 2, gen_batch=int(rng.integers(0, 3)),
            stale_tokens=len(resp) // 2 if i % 5 == 2 else 0))
    return out

def same(got, want, step):
    assert len(got) == len(want), (step, len(got), len(want))
    for g, w in zip(got, want):
        assert g.step == step
        assert np.array_equal(g.prompt_ids, w.prompt_ids) and np.array_equal(g.response_ids, w.response_ids)
        want_lp = np.full(len(w.response_ids), np.nan, np.float32) if w.logprobs is None else w.logprobs
        assert np.array_equal(g.logprobs, want_lp, equal_nan=True)
        assert (g.reward, g.acc, g.finish_reason, g.kept, g.group_id, g.gen_batch, g.stale_tokens) == (
            w.reward, w.acc, w.finish_reason, w.kept, w.group_id, w.gen_batch, w.stale_tokens)
'''
_ns: dict = {}
exec(GEN_SRC, _ns)
expected, same = _ns["expected"], _ns["same"]


def test_round_trip_and_append_across_steps(tmp_path):
    store = RolloutStore(tmp_path / ROLLOUTS_DIR, row_chunk=5, token_chunk=16)
    for step in (0, 1, 2, 5):
        store.append_step(step, expected(step))
    reader = RolloutReader(tmp_path / ROLLOUTS_DIR)
    assert reader.steps() == [0, 1, 2, 5]
    for step in (0, 1, 2, 5):
        same(reader.read_step(step), expected(step), step)
    want_rewards = np.concatenate([[r.reward for r in expected(s)] for s in (0, 1, 2, 5)])
    assert np.array_equal(reader.column("reward"), want_rewards.astype(np.float32))
    cols = reader.read_step_columns(2)
    want = expected(2)
    assert cols["response_ids"].tolist() == np.concatenate([r.response_ids for r in want]).tolist()
    i = len(want) - 1
    s0 = cols["response_start"][i]
    assert cols["response_ids"][s0:s0 + cols["response_len"][i]].tolist() == want[i].response_ids.tolist()
    with pytest.raises(KeyError, match="not in the store"):
        reader.read_step(3)


def test_store_written_before_stale_tokens_reads_zeros_and_takes_appends(tmp_path):
    """A run started before the stale_tokens column (partial rollouts) existed: its store reads as 0 stale tokens,
    and a resumed run appends to it with the column created (zeros for the old rows)."""
    import zarr

    path = tmp_path / ROLLOUTS_DIR
    store = RolloutStore(path, row_chunk=5, token_chunk=16)
    for step in (0, 1):
        store.append_step(step, expected(step))
    old = zarr.open_group(str(path), mode="r+")
    del old["stale_tokens"]  # as the first stores were written (without step checksums either)
    committed = dict(old.attrs["committed"])
    del committed["crc32"]
    old.update_attributes({"committed": committed})
    assert "stale_tokens" not in zarr.open_group(str(path), mode="r")
    reader = RolloutReader(path)
    assert [r.stale_tokens for r in reader.read_step(1)] == [0] * len(expected(1))
    assert reader.column("stale_tokens").tolist() == [0] * (len(expected(0)) + len(expected(1)))
    RolloutStore(path, resume_step=2).append_step(2, expected(2))
    same(reader.read_step(2), expected(2), 2)
    assert any(r.stale_tokens for r in expected(2))
    assert reader.column("stale_tokens").tolist()[: len(expected(0))] == [0] * len(expected(0))


def test_reopen_appends_and_resume_rewrites(tmp_path):
    path = tmp_path / ROLLOUTS_DIR
    store = RolloutStore(path, row_chunk=4, token_chunk=8)
    for step in range(5):
        store.append_step(step, expected(step))
    with pytest.raises(ValueError, match="resume_step=4"):
        RolloutStore(path).append_step(4, expected(4))
    resumed = RolloutStore(path, resume_step=3)
    assert resumed.steps == [0, 1, 2]
    resumed.append_step(3, expected(103))  # the resumed run generates different rollouts
    resumed.append_step(4, expected(104))
    reader = RolloutReader(path)
    assert reader.steps() == [0, 1, 2, 3, 4]
    same(reader.read_step(2), expected(2), 2)
    same(reader.read_step(3), expected(103), 3)
    same(reader.read_step(4), expected(104), 4)
    n_rows = sum(len(expected(s)) for s in (0, 1, 2, 103, 104))
    assert len(reader.column("step")) == n_rows
    assert reader.column("step").tolist() == sorted(reader.column("step").tolist())


def test_crash_mid_step_leaves_only_committed_steps(tmp_path, monkeypatch):
    path = tmp_path / ROLLOUTS_DIR
    store = RolloutStore(path, row_chunk=4, token_chunk=8)
    store.append_step(0, expected(0))
    original = RolloutStore._write

    def dying_write(self, name, start, data):
        if name == "prompt_ids":
            raise RuntimeError("killed")
        original(self, name, start, data)

    monkeypatch.setattr(RolloutStore, "_write", dying_write)
    with pytest.raises(RuntimeError, match="killed"):
        store.append_step(1, expected(1))
    monkeypatch.setattr(RolloutStore, "_write", original)
    assert RolloutReader(path).steps() == [0]  # the half-written step is invisible
    reopened = RolloutStore(path)
    reopened.append_step(1, expected(1))
    same(RolloutReader(path).read_step(1), expected(1), 1)
    assert len(RolloutReader(path).column("step")) == len(expected(0)) + len(expected(1))


def test_validation(tmp_path):
    store = RolloutStore(tmp_path / ROLLOUTS_DIR)
    bad = expected(0)[0]
    with pytest.raises(ValueError, match="finish_reason"):
        store.append_step(0, [Rollout(**{**bad.__dict__, "finish_reason": "abort"})])
    with pytest.raises(ValueError, match="one per token"):
        store.append_step(0, [Rollout(**{**bad.__dict__, "logprobs": np.zeros(len(bad.response_ids) + 1)})])
    store.append_step(0, [])  # a step may hold no rollouts
    assert RolloutReader(tmp_path / ROLLOUTS_DIR).read_step(0) == []
    (tmp_path / "other").mkdir()
    import zarr
    zarr.open_group(str(tmp_path / "other"), mode="w")
    with pytest.raises(ValueError, match="not a dapo-mcore-rollouts"):
        RolloutReader(tmp_path / "other").steps()


READER_SCRIPT = GEN_SRC + '''
import json, sys, time
from dapo_mcore.telemetry.rollout_store import RolloutReader
path, last = sys.argv[1], int(sys.argv[2])
print("ready", flush=True)
checked, snapshots, deadline = set(), set(), time.time() + 600  # generous: a loaded machine
while time.time() < deadline:
    try:
        reader = RolloutReader(path)
    except FileNotFoundError:
        continue
    steps = reader.steps()
    if len(steps) not in snapshots:
        print(f"seen {len(steps)}", flush=True)
    snapshots.add(len(steps))
    for step in steps:
        if step not in checked:
            same(reader.read_step(step), expected(step), step)
            checked.add(step)
    if last in checked:
        break
    time.sleep(0.005)
print(json.dumps({"checked": sorted(checked), "snapshots": len(snapshots)}), flush=True)
'''


def _wait_seen(proc: subprocess.Popen, n: int) -> None:
    """Block until the reader reports a snapshot of at least ``n`` committed steps."""
    while True:
        line = proc.stdout.readline()
        assert line, f"the reader ended early: {proc.stderr.read()[-2000:]}"
        if line.startswith("seen ") and int(line.split()[1]) >= n:
            return


def test_reader_in_another_process_sees_only_complete_steps(tmp_path):
    path = tmp_path / ROLLOUTS_DIR
    n_steps = 30
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", READER_SCRIPT, str(path), str(n_steps - 1)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        # Tiny chunks: every append rewrites chunks that hold already-committed data.
        store = RolloutStore(path, row_chunk=3, token_chunk=7)
        for step in range(n_steps):
            store.append_step(step, expected(step))
            time.sleep(0.01)
            if step in (9, 19):  # let the reader catch up mid-run, however loaded the machine is
                _wait_seen(proc, step + 1)
        out, err = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["checked"] == list(range(n_steps))
    assert result["snapshots"] > 2, "the reader never observed the store mid-run"


def _save_tokenizer(directory: Path) -> list[str]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "<eos>", "<unk>", "what", "is", "2+2", "?", "Answer:", "4", "5"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(directory)
    return vocab


def test_rollouts_cli_prints_decoded_samples(tmp_path, capsys):
    vocab = _save_tokenizer(tmp_path / "tokenizer")
    ids = {w: i for i, w in enumerate(vocab)}
    prompt = [ids["what"], ids["is"], ids["2+2"], ids["?"]]
    store = RolloutStore(tmp_path / ROLLOUTS_DIR)
    right, wrong = [ids["Answer:"], ids["4"], ids["<eos>"]], [ids["Answer:"], ids["5"]]
    store.append_step(7, [
        Rollout(prompt, right, None, 1.0, True, "stop", True, 0, 0),  # group 0: kept
        Rollout(prompt, wrong, None, -1.0, False, "length", True, 0, 0),
        Rollout(prompt, wrong, None, -1.0, False, "length", False, 1, 1),  # group 1: all wrong, rejected
        Rollout(prompt, wrong, None, -1.0, False, "length", False, 1, 1),
        Rollout(prompt, right, None, 1.0, True, "stop", False, 2, 1),  # group 2: usable, not needed
        Rollout(prompt, wrong, None, -1.0, False, "length", False, 2, 1),
    ])
    assert rollout_store.main([str(tmp_path), "--step", "7"]) == 0
    out = capsys.readouterr().out
    assert "6 rollouts, 2 kept, 2 rejected by dynamic sampling (no mixed outcome), 2 surplus" in out
    assert "Answer: 4" in out and "Answer: 5" in out and "what is 2+2 ?" in out
    assert "finish length" in out and "reward -1.000" in out
    assert rollout_store.main([str(tmp_path), "--which", "surplus", "--raw"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- [") == 2 and out.count("group 2 ") == 2 and "surplus" in out
    (tmp_path / "config.yaml").write_text("algo:\n  dynamic_sampling: false\n")  # GRPO refuses no group
    assert rollout_store.main([str(tmp_path), "--step", "7"]) == 0
    assert "2 kept, 0 rejected by dynamic sampling (no mixed outcome), 4 surplus" in capsys.readouterr().out
    (tmp_path / "config.yaml").unlink()
    assert rollout_store.main([str(tmp_path), "--which", "rejected", "--raw"]) == 0  # default: last step
    out = capsys.readouterr().out
    assert f"{ids['Answer:']} {ids['5']}" in out and "reward +1.000" not in out and out.count("group 1 ") == 2
    from dapo_mcore import cli

    assert cli.main(["rollouts", str(tmp_path), "--step", "8"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "not stored" in out.err and out.err.count("\n") == 1
