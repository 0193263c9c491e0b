"""Routing replay under recompute: a tiny Qwen3-MoE at PP=2 on 2 gloo ranks, the engine's routes replayed, trained
with model.recompute none, selective and full from the same weights on the same batch.

usage: torchrun --nproc_per_node 2 replay_recompute.py WS

The routes are drawn at random (not the router's own choice), so a forward that routes any other way, or a recomputed
forward that replays another micro-batch's routes (1F1B runs micro-batch 1's forward before micro-batch 0's backward
on stage 0), changes the loss and the gradients. Records per mode: the routing mismatch of the log-prob pass, and two
updates' metrics. Writes WS/out_rank<R>.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402


def samples(spec: dict, key: str, hf: dict):
    from dapo_mcore.actor.megatron_actor import TrainSample
    from dapo_mcore.model.moe import MoEShape

    shape = MoEShape.from_hf(hf)
    gen = torch.Generator().manual_seed(spec["route_seed"] + len(key))
    layers = len(shape.moe_layers)
    out = []
    for s in spec[key]:
        tokens = len(s["prompt"]) + len(s["response"]) - 1
        routes = torch.stack([torch.randperm(shape.num_experts, generator=gen)[: shape.topk]
                              for _ in range(tokens * layers)]).view(tokens, layers, -1)
        out.append(TrainSample(s["prompt"], s["response"], advantage=s["advantage"],
                               old_logprobs=torch.tensor(s["old_logprobs"]), extra={"routed_experts": routes}))
    return out


def run(ws: Path, spec: dict, recompute: str) -> dict:
    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig

    init_model_parallel(1, 2, seed=spec["seed"])
    hf = json.loads((ws / "hf" / "config.json").read_text())
    actor = MegatronActor(ActorSettings(
        hf_config=hf, pipeline_parallel=2, router_replay=True, recompute=recompute,
        make_vocab_size_divisible_by=spec["vocab_div"], micro_batch_tokens=spec["micro_batch_tokens"],
        temperature=spec["temperature"], lr=spec["lr"], eps=spec["adam_eps"], weight_decay=spec["weight_decay"],
        grad_clip=spec["grad_clip"], algo=AlgoConfig(**spec["algo"]), layout="rows"))
    actor.load_hf(str(ws / "hf"))
    batch = samples(spec, "update1", hf)
    actor.compute_logprobs(batch)
    out = {"mismatch": actor.routing_mismatch, "micro_batches": len(actor._my_micro_batches(batch))}
    out["metrics"] = [actor.train_mini_batch(samples(spec, key, hf), lr=spec["lr"]) for key in ("update1", "update2")]
    return out


def main() -> None:
    from dapo_mcore.actor.parallel import shutdown

    ws = Path(sys.argv[1])
    spec = c.read_spec(ws)
    env = c.start()
    out = {mode: run(ws, spec, mode) for mode in ("none", "selective", "full")}
    c.save(out, ws / f"out_rank{env.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
