"""A bf16 actor that loads its weights after Megatron built the optimizer must train from THOSE weights: the
optimizer's fp32 main copies are refreshed, so an update with lr=0 leaves the loaded weights as they are
(before the fix the first update wrote the random initial weights back)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp


def _worker(port: int, hf_dir: str, queue) -> None:
    import json

    import torch.distributed as dist

    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor, TrainSample
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig
    from dapo_mcore.model import cpu_compat

    cpu_compat.apply()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    init_model_parallel(1, 1, seed=5)
    hf = json.loads(open(f"{hf_dir}/config.json").read())
    actor = MegatronActor(ActorSettings(hf_config=hf, params_dtype=torch.bfloat16, algo=AlgoConfig(), layout="rows"))
    actor.load_hf(hf_dir)
    loaded = {n: t.clone() for b in actor.export_hf_weights() for n, t in b}
    sample = TrainSample([1, 5, 7], [9, 11, 3], advantage=1.0, old_logprobs=torch.full((3,), -2.0))
    metrics = actor.train_mini_batch([sample, sample], lr=0.0)
    after = {n: t for b in actor.export_hf_weights() for n, t in b}
    changed = sorted(n for n in loaded if not torch.equal(loaded[n], after[n]))
    # run.resume_weights_only: a fresh actor (other random weights) resumes the weights of a checkpoint and starts
    # its optimizer fresh; its fp32 main copies must hold the resumed weights too.
    from pathlib import Path

    from dapo_mcore.actor.checkpoint import load_checkpoint, save_checkpoint

    ckpt = save_checkpoint(Path(hf_dir).parent / "ckpts", 1, actor, {"step": 1}, keep_last=1)
    torch.manual_seed(123)
    fresh = MegatronActor(ActorSettings(hf_config=hf, params_dtype=torch.bfloat16, algo=AlgoConfig(), layout="rows"))
    load_checkpoint(ckpt, fresh, weights_only=True)
    fresh.train_mini_batch([sample, sample], lr=0.0)
    resumed = {n: t for b in fresh.export_hf_weights() for n, t in b}
    changed_resume = sorted(n for n in after if not torch.equal(after[n], resumed[n]))
    queue.put(dict(changed=changed, changed_resume=changed_resume, update_ok=metrics.get("update_ok"), n=len(loaded)))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_an_lr0_update_keeps_the_loaded_bf16_weights(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_mcore.model.presets import preset_config

    torch.manual_seed(1)
    Qwen2ForCausalLM(Qwen2Config(**preset_config("tiny"))).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(port, str(tmp_path / "hf"), queue))
    proc.start()
    res = queue.get(timeout=240)
    proc.join(timeout=60)
    assert res["n"] > 0 and res["update_ok"] == 1.0
    assert res["changed"] == []
    assert res["changed_resume"] == []
