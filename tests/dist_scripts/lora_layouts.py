"""The LoRA actor at several layouts from the same HF weights and the same adapters; results for pytest.

usage: torchrun --nproc_per_node 2 lora_layouts.py WS TPxPP[,TPxPP...]

The workspace (tests/test_lora_actor.py) holds the tiny HF model (``hf/``), the samples (``spec.json``) and a
peft adapter (``adapter/``: adapter_config.json + adapter_model.safetensors, fused layers sharing one A). Per layout,
on every rank:
  logits         full-vocab logits with the adapter loaded (to compare with peft's own model)
  metrics        one DAPO update (loss, grad norm)
  grads          the adapters' gradients of that update, by peft name (gathered over TP and pipeline stages)
  adapters       the adapters after it, by peft name
  merged         the HF weights the weight sync sends after it (export_hf_weights: merged shard-locally)
  frozen         base weights bit-identical to the HF checkpoint after the update; no main grad / no optimizer
                 state for them; the optimizer holds exactly the adapters
  ckpt           adapters + optimizer state saved and reloaded into a fresh actor at this layout: equal
written to WS/out/lora_rank<R>.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

RANK, ALPHA = 4, 8.0


def make_lora_actor(ws: Path, spec: dict, tp: int, pp: int):
    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig
    from dapo_mcore.model.lora.config import LoRAConfig

    init_model_parallel(tp, pp, seed=spec["seed"])
    hf = json.loads((ws / "hf" / "config.json").read_text())
    settings = ActorSettings(
        hf_config=hf, tensor_parallel=tp, pipeline_parallel=pp, make_vocab_size_divisible_by=spec["vocab_div"],
        micro_batch_tokens=spec["micro_batch_tokens"], temperature=spec["temperature"], lr=spec["lr"],
        eps=spec["adam_eps"], weight_decay=spec["weight_decay"], grad_clip=spec["grad_clip"],
        algo=AlgoConfig(**spec["algo"]), layout="rows", lora=LoRAConfig(rank=RANK, alpha=ALPHA))
    actor = MegatronActor(settings)
    actor.load_hf(str(ws / "hf"))
    return actor


def everywhere(part: dict) -> dict:
    """Union of every rank's dict (pipeline stages hold different layers)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    out: dict = {}
    for p in parts:
        out.update(p)
    return out


def gathered(actor, attr: str | None = None) -> dict:
    from dapo_mcore.weights.lora import gather_adapters

    return everywhere(gather_adapters(actor.chunks, actor.s.hf_config, grads=attr == "grad"))


def frozen_report(actor, ws: Path) -> dict:
    from safetensors.torch import load_file

    from dapo_mcore.weights.live import live_layout, live_tensors

    base = [p for ch in actor.chunks for n, p in ch.named_parameters() if ".lora." not in n]
    adapters = [p for ch in actor.chunks for n, p in ch.named_parameters() if ".lora." in n]
    in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    exported = c.export(actor)  # merged: equals the HF base only where no adapter is
    hf = load_file(str(ws / "hf" / "model.safetensors"))
    layout = live_layout(actor.chunks, "local", 1)[0]
    return {"base_requires_grad": sum(p.requires_grad for p in base),
            "base_main_grad": sum(hasattr(p, "main_grad") for p in base),
            "adapters": len(adapters), "optimizer_params": len(in_optimizer),
            "optimizer_is_adapters": in_optimizer == {id(p) for p in adapters},
            "base_live": len(live_tensors(actor.chunks, layout)),
            "unadapted_equal_hf": all(torch.equal(exported[n], hf[n]) for n in hf
                                      if not any(k in n for k in ("proj",)))}


def check_layout(ws: Path, spec: dict, tp: int, pp: int) -> dict:
    from safetensors.torch import load_file

    from conversion.verify import megatron_logits
    from dapo_mcore.weights.lora import load_adapters

    actor = make_lora_actor(ws, spec, tp, pp)
    load_adapters(actor.chunks, actor.s.hf_config, load_file(str(ws / "adapter" / "adapter_model.safetensors")))
    res: dict = {"logits": megatron_logits(actor.chunks, torch.tensor(spec["ids"]), spec["vocab_size"])}
    grads: dict = {}
    step = actor.optimizer.step

    def step_recording_grads():
        grads.update(gathered(actor, "grad"))
        return step()

    actor.optimizer.step = step_recording_grads
    res["metrics"] = actor.train_mini_batch(c.samples(spec, "update1"), lr=spec["lr"])
    res["grads"] = grads
    res["adapters"] = gathered(actor)
    res["merged"] = c.export(actor)
    res["frozen"] = frozen_report(actor, ws)
    return res


def main() -> None:
    ws, layouts = Path(sys.argv[1]), sys.argv[2]
    spec = c.read_spec(ws)
    env = c.start()
    results = {}
    for layout in layouts.split(","):
        tp, pp = (int(x) for x in layout.split("x"))
        results[f"tp{tp}_pp{pp}_dp{env.world_size // (tp * pp)}"] = check_layout(ws, spec, tp, pp)
    c.save(results, ws / "out" / f"lora_rank{env.rank}.pt")
    from dapo_mcore.actor.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main()
