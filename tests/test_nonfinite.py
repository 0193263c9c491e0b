"""NaN and infinity: refused in the config, never applied as an update, never checkpointed, never resumed or
exported."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dapo_mcore.actor.checkpoint import check_intact, find_latest
from dapo_mcore.actor.nonfinite import NonFiniteGuard
from dapo_mcore.config import ConfigError, load_config
from dapo_mcore.errors import NonFiniteError
from dapo_mcore.weights import checkpoint as wckpt
from dapo_mcore.weights.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
RANK_FILE = "model/mp_rank_00_000/model.safetensors"


@pytest.mark.unit
@pytest.mark.parametrize("override, needle", [
    ("optim.lr=1e309", "optim.lr=inf is not a finite number"),
    ("optim.lr=.nan", "optim.lr=nan is not a finite number"),
    ("algo.clip_high=1e309", "algo.clip_high=inf is not a finite number"),
    ("rollout.temperature=1e309", "rollout.temperature=inf is not a finite number"),
    ("algo.overlong_penalty_factor=1e309", "algo.overlong_penalty_factor=inf is not a finite number"),
    ("reward.timeout_s=.inf", "reward.timeout_s=inf is not a finite number"),
    ("optim.eps=0", "optim.eps=0.0 must be > 0"),
    ("optim.betas=[0.9,1.0]", "optim.betas[1]=1.0 must lie in [0, 1)"),
    ("optim.weight_decay=-1", "optim.weight_decay=-1.0 must be >= 0"),
    ("eval.temperature=0", "eval.temperature=0.0 must be > 0"),
    ("eval.top_p=1.5", "eval.top_p=1.5 must lie in (0, 1]"),
    ("eval.max_prompts=0", "eval.max_prompts=0 must be >= 1"),
    ("optim.skip_nonfinite_updates=-1", "optim.skip_nonfinite_updates=-1 must be >= 0"),
])
def test_config_numbers_must_be_finite_and_in_range(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(str(CONFIG), [override]).validate(1)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.unit
def test_the_guard_stops_at_once_by_default_and_skips_up_to_n_in_a_row_when_asked(caplog):
    stop = NonFiniteGuard(0, lr=1e6, grad_clip=0.0)
    assert stop.check(0.5, True, 1e6) is False
    with pytest.raises(NonFiniteError) as err:
        stop.check(float("nan"), False, 1e6)
    msg = str(err.value)
    assert "loss nan and non-finite gradients" in msg and "optim.lr (now 1e+06" in msg
    assert "optim.grad_clip=1.0" in msg and "optim.skip_nonfinite_updates=N" in msg
    skip = NonFiniteGuard(2, lr=1e-3, grad_clip=1.0)
    with caplog.at_level(logging.WARNING):
        assert skip.check(float("inf"), True, 1e-3) and skip.check(float("nan"), True, 1e-3)
    assert "skipped" in caplog.text
    assert skip.check(0.1, True, 1e-3) is False  # a finite update resets the count
    assert skip.check(float("nan"), True, 1e-3) and skip.check(float("nan"), True, 1e-3)
    with pytest.raises(NonFiniteError, match="3 non-finite updates in a row"):
        skip.check(float("nan"), True, 1e-3)


def _checkpoint(root: Path, step: int, value: float) -> Path:
    from safetensors.torch import save_file

    d = root / f"step_{step:06d}"
    (d / "model" / "mp_rank_00_000").mkdir(parents=True)
    (d / "model" / "dapo_mcore_checkpoint.json").write_text(json.dumps({"format": "x"}))
    w = torch.arange(64, dtype=torch.float32)
    w[7] = value
    save_file({"decoder.w": w, "ids": torch.arange(4)}, d / RANK_FILE)
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    wckpt.write_manifest(d, {n: wckpt.file_digest(d / n) for n in wckpt.list_files(d)}, world_size=1)
    (d / "COMPLETE").write_text(str(step))
    return d


@pytest.mark.unit
def test_resume_skips_a_nan_checkpoint_with_a_valid_manifest_like_a_bad_crc(tmp_path, caplog):
    _checkpoint(tmp_path, 1, 3.0)
    nan = _checkpoint(tmp_path, 2, float("nan"))
    (tmp_path / "latest").write_text(nan.name)
    with caplog.at_level(logging.WARNING):
        assert find_latest(tmp_path).name == "step_000001"
    assert f"{nan / RANK_FILE}: NaN or inf values in decoder.w" in caplog.text and "next: step_000001" in caplog.text
    assert check_intact(nan) and not check_intact(tmp_path / "step_000001")
    _checkpoint(tmp_path / "all_bad", 1, float("inf"))
    with pytest.raises(CheckpointError, match="NaN or inf values"):
        find_latest(tmp_path / "all_bad")


def _actor_worker(port: int, ckpt_root: str, queue) -> None:
    import torch.distributed as dist

    from dapo_mcore.actor.checkpoint import save_checkpoint
    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor, TrainSample
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig
    from dapo_mcore.model import cpu_compat
    from dapo_mcore.model.presets import preset_config

    cpu_compat.apply()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    init_model_parallel(1, 1, seed=5)
    out: dict = {}

    def weights(actor) -> dict:
        return {n: t.clone() for b in actor.export_hf_weights() for n, t in b}

    good = TrainSample([1, 5, 7], [9, 11, 3], advantage=1.0, old_logprobs=torch.full((3,), -2.0))
    bad = TrainSample([1, 5, 7], [9, 11, 3], advantage=float("nan"), old_logprobs=torch.full((3,), -2.0))
    actor = MegatronActor(ActorSettings(hf_config=preset_config("tiny"), algo=AlgoConfig(), layout="rows", lr=1e-3))
    before = weights(actor)
    try:
        actor.train_mini_batch([bad, good], lr=1e-3)
        out["stop"] = "no error"
    except NonFiniteError as exc:
        out["stop"] = str(exc)
    out["stop_unchanged"] = all(torch.equal(before[n], t) for n, t in weights(actor).items())
    actor.nonfinite = NonFiniteGuard(1, lr=1e-3, grad_clip=1.0)
    out["skip"] = actor.train_mini_batch([bad, good], lr=1e-3)
    out["skip_unchanged"] = all(torch.equal(before[n], t) for n, t in weights(actor).items())
    out["then"] = actor.train_mini_batch([good, good], lr=1e-3).get("update_ok")
    out["then_changed"] = any(not torch.equal(before[n], t) for n, t in weights(actor).items())
    with torch.no_grad():
        next(actor.chunks[0].parameters())[0].fill_(float("inf"))
    try:
        save_checkpoint(Path(ckpt_root), 1, actor, {"step": 1}, keep_last=1)
        out["save"] = "saved"
    except NonFiniteError as exc:
        out["save"] = str(exc)
    out["written"] = sorted(p.name for p in Path(ckpt_root).glob("*"))
    queue.put(out)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_a_nan_update_is_not_applied_and_nan_weights_are_not_checkpointed(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_actor_worker, args=(port, str(tmp_path / "ckpts"), queue))
    proc.start()
    res = queue.get(timeout=300)
    proc.join(timeout=60)
    assert "a non-finite update (loss nan" in res["stop"] and "stops the run" in res["stop"], res["stop"]
    assert res["stop_unchanged"] and res["skip"] == {"skipped": 1.0} and res["skip_unchanged"]
    assert res["then"] == 1.0 and res["then_changed"]
    assert "not saving the checkpoint of step 1" in res["save"] and "hold NaN or inf" in res["save"], res["save"]
    assert res["written"] == []


@pytest.mark.unit
def test_convert_refuses_a_nan_checkpoint_in_one_line_and_writes_nothing(tmp_path):
    src = tmp_path / "mcore"
    _tiny_mcore(src)
    path = src / "mp_rank_00_000" / "model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if tensors[k].is_floating_point())
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, path)
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "convert", "mcore-to-hf", "--mcore", str(src),
                           "--out", str(out), "--no-progress"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("dapo-mcore")]
    assert len(lines) == 1 and "holds NaN or inf values" in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".hf*"))


def _tiny_mcore(dst: Path) -> None:
    """A canonical tiny checkpoint: random tiny Qwen2 -> hf-to-mcore."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_mcore.model.presets import preset_config

    torch.manual_seed(0)
    hf = dst.parent / "hf_src"
    Qwen2ForCausalLM(Qwen2Config(**preset_config("tiny"))).save_pretrained(hf)
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "convert", "hf-to-mcore", "--hf", str(hf),
                           "--out", str(dst), "--no-progress"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
