"""Shared by the worker scripts of this folder (run as scripts, under torchrun or plain python).

The pytest side (``harness.py``) writes a workspace: ``spec.json`` (actor settings, samples, temperatures)
and ``hf/`` (a tiny random Qwen2 saved by Hugging Face). Workers read it, build the Megatron actor from the same
HF weights at some TP/PP/DP layout, and write what they measured back as ``.pt`` files for pytest to assert on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def read_spec(ws: Path) -> dict:
    return json.loads((ws / "spec.json").read_text())


def start(port_env: str = "MASTER_PORT"):
    """Process group (gloo) from torchrun's environment, or a world of one."""
    from dapo_mcore.actor.parallel import init_distributed, read_launch_env

    env = read_launch_env()
    init_distributed(env, "gloo")
    return env


def make_actor(ws: Path, spec: dict, tp: int, pp: int, hf_config: dict | None = None, load: bool = True,
               params_dtype: torch.dtype = torch.float32, attention: str = "auto"):
    """Model parallel groups for (tp, pp) and a fresh actor with the workspace's HF weights."""
    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig

    init_model_parallel(tp, pp, seed=spec["seed"])
    hf = hf_config or json.loads((ws / "hf" / "config.json").read_text())
    settings = ActorSettings(
        hf_config=hf, tensor_parallel=tp, pipeline_parallel=pp, make_vocab_size_divisible_by=spec["vocab_div"],
        micro_batch_tokens=spec["micro_batch_tokens"], temperature=spec["temperature"], lr=spec["lr"],
        eps=spec["adam_eps"], weight_decay=spec["weight_decay"], grad_clip=spec["grad_clip"],
        algo=AlgoConfig(**spec["algo"]), layout="rows", params_dtype=params_dtype, attention=attention)
    actor = MegatronActor(settings)
    if load:
        actor.load_hf(str(ws / "hf"))
    return actor


def samples(spec: dict, key: str = "samples"):
    from dapo_mcore.actor.megatron_actor import TrainSample

    out = []
    for s in spec[key]:
        out.append(TrainSample(s["prompt"], s["response"], advantage=s["advantage"],
                               old_logprobs=torch.tensor(s["old_logprobs"]) if "old_logprobs" in s else None,
                               loss_mask=torch.tensor(s["loss_mask"]) if "loss_mask" in s else None))
    return out


def export(actor) -> dict[str, torch.Tensor]:
    """Full HF-named weights on every rank (a collective)."""
    return {name: t.detach().clone() for bucket in actor.export_hf_weights(bucket_bytes=1 << 16) for name, t in bucket}


def params_snapshot(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for c in actor.chunks for p in c.parameters()]


def same_params(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
