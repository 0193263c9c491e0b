"""The LoRA actor on a tiny Qwen3-MoE (experts targeted) at TP=2 (sequence parallel) x EP=2 x expert-TP=2 and at
TP=1 x EP=1, on the same 4 gloo ranks, from the same HF weights and the same adapters; results for pytest.

usage: torchrun --nproc_per_node 4 lora_expert_tp.py WS

Every adapter's B starts random (drawn from its peft name, the same at every layout; A is the run's own
layout-independent draw), so every delta is non-zero from the first forward. Per layout, on every rank:
  metrics   one DAPO update (loss, grad norm)
  grads     the adapters' gradients of that update, by peft name, whole (gathered over TP / expert-TP and EP)
  adapters  the adapters after it, by peft name
  merged    the HF weights the weight sync sends after it (merged shard-locally, experts on their expert-TP shards)
Then a fresh TP=1 x EP=1 actor resumes the TP=2 x EP=2 x expert-TP=2 checkpoint taken after the update:
  resumed   its adapters and merged export
written to WS/lora_etp_rank<R>.pt.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
from lora_layouts import everywhere, gathered, update_recording_grads  # noqa: E402

RANK, ALPHA = 4, 8.0


def make_actor(ws: Path, spec: dict, tp: int, ep: int):
    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig
    from dapo_mcore.model.lora.config import LoRAConfig

    init_model_parallel(tp, 1, seed=spec["seed"], expert_parallel=ep, expert_tensor_parallel=tp)
    hf = json.loads((ws / "hf" / "config.json").read_text())
    settings = ActorSettings(
        hf_config=hf, tensor_parallel=tp, sequence_parallel=tp > 1, expert_parallel=ep, expert_tensor_parallel=tp,
        make_vocab_size_divisible_by=spec["vocab_div"], micro_batch_tokens=spec["micro_batch_tokens"],
        temperature=spec["temperature"], lr=spec["lr"], eps=spec["adam_eps"], weight_decay=spec["weight_decay"],
        grad_clip=spec["grad_clip"], algo=AlgoConfig(**spec["algo"]), layout="rows",
        lora=LoRAConfig(rank=RANK, alpha=ALPHA))
    actor = MegatronActor(settings)
    actor.load_hf(str(ws / "hf"))
    return actor


def random_b(actor) -> dict[str, torch.Tensor]:
    """Every adapter (whole, peft names) with B drawn from its name; A as the actor drew it."""
    whole = gathered(actor)
    for name, t in whole.items():
        if name.endswith(".lora_B.weight"):
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            whole[name] = 0.1 * torch.randn(t.shape, generator=gen)
    return whole


def run_layout(ws: Path, spec: dict, tp: int, ep: int, adapters: dict | None) -> tuple[dict, object]:
    from dapo_mcore.weights.lora import load_adapters

    actor = make_actor(ws, spec, tp, ep)
    start = adapters if adapters is not None else random_b(actor)
    load_adapters(actor.chunks, actor.s.hf_config, start)
    res: dict = {"start": start, "start_merged": c.export(actor)}
    res["metrics"], grads = update_recording_grads(actor, spec)
    res["grads"], res["adapters"], res["merged"] = grads, gathered(actor), c.export(actor)
    return res, actor


def main() -> None:
    from dapo_mcore.actor import checkpoint as ckpt
    from dapo_mcore.actor.parallel import shutdown

    ws = Path(sys.argv[1])
    spec = c.read_spec(ws)
    env = c.start()
    out: dict = {}
    out["tp2_ep2_etp2"], actor = run_layout(ws, spec, 2, 2, None)
    out["expert_adapters"] = everywhere({str(env.rank): [n for n, _ in actor.chunks[0].named_parameters() if ".lora." in n
                                               and ".experts." in n]})
    ckpt.save_checkpoint(ws / "ckpt", 1, actor, {"step": 1}, keep_last=1)
    out["tp1_ep1"], _ = run_layout(ws, spec, 1, 1, out["tp2_ep2_etp2"]["start"])
    fresh = make_actor(ws, spec, 1, 1)
    ckpt.load_checkpoint(ws / "ckpt" / "step_000001", fresh)
    out["resumed"] = {"adapters": gathered(fresh), "merged": c.export(fresh)}
    c.save(out, ws / f"lora_etp_rank{env.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
