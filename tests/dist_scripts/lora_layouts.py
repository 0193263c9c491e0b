"""The LoRA actor at several layouts from the same HF weights and the same adapters; results for pytest.

usage: torchrun --nproc_per_node 2 lora_layouts.py WS TPxPP[vV][f][,...]   (vV: V virtual pipeline stages per
       pipeline stage; f: full activation recomputation; the resume checks run for the first three layouts only)

The workspace (tests/test_lora_actor.py) holds the tiny HF model (``hf/``), the samples (``spec.json``) and a
peft adapter (``adapter/``: adapter_config.json + adapter_model.safetensors, fused layers sharing one A). Per layout,
on every rank:
  logits         full-vocab logits with the adapter loaded (to compare with peft's own model)
  metrics        one DAPO update (loss, grad norm)
  grads          the adapters' gradients of that update, by peft name (gathered over TP and pipeline stages)
  adapters       the adapters after it, by peft name
  merged         the HF weights the weight sync sends after it (export_hf_weights: merged shard-locally)
  engine         the transformers engine's weights after a weight sync (HFEngine.update_weights of those buckets)
  frozen         base weights bit-identical to the HF checkpoint after the update; no main grad / no optimizer
                 state for them; the optimizer holds exactly the adapters
  moments / update2                 Adam's exp_avg of the adapters, and a second update, after the first
  resumed_*      a fresh actor at this layout resumes the FIRST layout's checkpoint (taken after the first update):
                 adapters, exp_avg and the second update as the uninterrupted run has them
  other_base     the refusal when the resuming run's base is another model (None if it was not refused)
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


def make_lora_actor(ws: Path, spec: dict, tp: int, pp: int, recompute: str = "none", vpp: int | None = None):
    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig
    from dapo_mcore.model.lora.config import LoRAConfig

    init_model_parallel(tp, pp, vpp, seed=spec["seed"])
    hf = json.loads((ws / "hf" / "config.json").read_text())
    settings = ActorSettings(
        hf_config=hf, tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline=vpp, make_vocab_size_divisible_by=spec["vocab_div"],
        micro_batch_tokens=spec["micro_batch_tokens"], temperature=spec["temperature"], lr=spec["lr"],
        eps=spec["adam_eps"], weight_decay=spec["weight_decay"], grad_clip=spec["grad_clip"],
        algo=AlgoConfig(**spec["algo"]), layout="rows", lora=LoRAConfig(rank=RANK, alpha=ALPHA), recompute=recompute)
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

    get = (lambda p: p.main_grad) if attr == "grad" else None
    return everywhere(gather_adapters(actor.chunks, actor.s.hf_config, get=get))


def synced_engine(ws: Path, actor) -> dict:
    """The transformers engine's weights after a weight sync from the actor (small buckets: several per sync)."""
    from dapo_mcore.rollout.engines.hf_engine import HFEngine

    engine = HFEngine.from_pretrained(ws / "hf")
    engine.update_weights(actor.export_hf_weights(bucket_bytes=1 << 14))
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


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
            "adapters": len(adapters), "optimizer_params": len(in_optimizer), "chunks": len(actor.chunks),
            "optimizer_is_adapters": in_optimizer == {id(p) for p in adapters},
            "base_live": len(live_tensors(actor.chunks, layout)),
            "trainable_here": sum(p.numel() for p in adapters),
            "unadapted_equal_hf": all(torch.equal(exported[n], hf[n]) for n in hf
                                      if not any(k in n for k in ("proj",)))}


def moments(actor) -> dict:
    from dapo_mcore.actor.lora_state import _getter
    from dapo_mcore.weights.lora import gather_adapters

    return everywhere(gather_adapters(actor.chunks, actor.s.hf_config, get=_getter(actor, "exp_avg")))


def resume_checks(ws: Path, spec: dict, tp: int, pp: int, actor, name: str, first: str, vpp: int | None) -> dict:
    """Save a checkpoint; update on; a fresh actor resumes the FIRST layout's checkpoint and updates the same."""
    from dapo_mcore.actor import checkpoint as ckpt
    from dapo_mcore.weights.checkpoint import CheckpointError

    out: dict = {"moments": moments(actor)}
    ckpt.save_checkpoint(ws / "ckpt" / name, 1, actor, {"step": 1}, keep_last=1)
    dist.barrier()
    out["update2"] = actor.train_mini_batch(c.samples(spec, "update2"), lr=spec["lr"])
    fresh = make_lora_actor(ws, spec, tp, pp, vpp=vpp)
    source = ws / "ckpt" / first / "step_000001"
    ckpt.load_checkpoint(source, fresh)
    out["resumed_adapters"], out["resumed_moments"] = gathered(fresh), moments(fresh)
    out["resumed_update2"] = fresh.train_mini_batch(c.samples(spec, "update2"), lr=spec["lr"])
    weights_only = make_lora_actor(ws, spec, tp, pp, vpp=vpp)  # run.resume_weights_only: the adapters, a fresh optimizer
    ckpt.load_checkpoint(source, weights_only, weights_only=True)
    out["weights_only_adapters"], out["weights_only_moments"] = gathered(weights_only), moments(weights_only)
    other = make_lora_actor(ws, spec, tp, pp, vpp=vpp)
    other.base_source, other._base_identity = str(ws / "hf_other"), None
    try:
        ckpt.load_checkpoint(source, other)
        out["other_base"] = None
    except CheckpointError as err:
        out["other_base"] = str(err)
    out["damaged_adapter"] = damaged_adapter_check(ws, spec, tp, pp, source, name, vpp)
    return out


def damaged_adapter_check(ws: Path, spec: dict, tp: int, pp: int, source: Path, name: str,
                          vpp: int | None) -> str | None:
    """A copy of the checkpoint with one byte of one adapter file flipped: the resume must find the damage (and so
    fall back to an older checkpoint), not load the flipped adapter. Returns the error text (None: loaded)."""
    import shutil

    from dapo_mcore.actor import checkpoint as ckpt
    from dapo_mcore.weights.checkpoint import DamagedFileError

    damaged = ws / "damaged" / name / source.name
    if dist.get_rank() == 0:
        shutil.copytree(source, damaged)
        victim = sorted(f for f in (damaged / "lora").rglob("*.safetensors"))[0]
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x10  # in the tensor bytes, past the header
        victim.write_bytes(bytes(data))
    dist.barrier()
    try:
        ckpt.load_checkpoint(damaged, make_lora_actor(ws, spec, tp, pp, vpp=vpp))
        return None
    except DamagedFileError as err:
        return str(err)


def update_recording_grads(actor, spec: dict) -> tuple[dict, dict]:
    """One update on the "update1" samples: its metrics and the adapters' gradients gathered just before the
    optimizer step (of this update only: a later one does not record)."""
    grads: dict = {}
    step = actor.optimizer.step

    def step_recording_grads():
        grads.update(gathered(actor, "grad"))
        return step()

    actor.optimizer.step = step_recording_grads
    try:
        metrics = actor.train_mini_batch(c.samples(spec, "update1"), lr=spec["lr"])
    finally:
        actor.optimizer.step = step
    return metrics, grads


def check_layout(ws: Path, spec: dict, tp: int, pp: int, name: str, first: str, recompute: str = "none",
                 vpp: int | None = None) -> dict:
    from safetensors.torch import load_file

    from conversion.verify import megatron_logits
    from dapo_mcore.weights.lora import load_adapters

    actor = make_lora_actor(ws, spec, tp, pp, recompute, vpp)
    load_adapters(actor.chunks, actor.s.hf_config, load_file(str(ws / "adapter" / "adapter_model.safetensors")))
    res: dict = {"logits": megatron_logits(actor.chunks, torch.tensor(spec["ids"]), spec["vocab_size"])}
    res["metrics"], res["grads"] = update_recording_grads(actor, spec)
    res["adapters"] = gathered(actor)
    res["merged"] = c.export(actor)
    res["engine"] = synced_engine(ws, actor)
    res["frozen"] = frozen_report(actor, ws)
    if recompute == "none":
        res.update(resume_checks(ws, spec, tp, pp, actor, name, first, vpp))
    return res


def main() -> None:
    ws, layouts = Path(sys.argv[1]), sys.argv[2]
    spec = c.read_spec(ws)
    env = c.start()
    results: dict = {}
    for layout in layouts.split(","):
        recompute = "full" if layout.endswith("f") else "none"  # TPxPPf: full activation recomputation
        shape, _, v = layout.rstrip("f").partition("v")  # TPxPPvV: V virtual pipeline stages
        tp, pp = (int(x) for x in shape.split("x"))
        vpp = int(v) if v else None
        name = (f"tp{tp}_pp{pp}" + (f"_vpp{vpp}" if vpp else "") + f"_dp{env.world_size // (tp * pp)}"
                + ("_recompute" if recompute == "full" else ""))
        results[name] = check_layout(ws, spec, tp, pp, name, first=next(iter(results), name), recompute=recompute,
                                     vpp=vpp)
    c.save(results, ws / "out" / f"lora_rank{env.rank}.pt")
    from dapo_mcore.actor.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main()
