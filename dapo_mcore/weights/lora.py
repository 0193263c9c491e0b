"""LoRA adapters by their Hugging Face ``peft`` names: gathered from and scattered to a live model at any layout.

A Megatron adapter on a fused layer is several ``peft`` adapters sharing one A: ``linear_qkv``'s ``B`` holds the
rows of q, k and v interleaved per query group (and per TP rank) exactly like the base weight, so the weight
table's own transforms (`transforms.merge` / `transforms.shard` with the base tensor's split) turn the TP shards of
``B`` into ``q_proj`` / ``k_proj`` / ``v_proj``'s ``lora_B`` and back; the shared ``A`` is each one's ``lora_A``.
``linear_fc1`` likewise gives ``gate_proj`` and ``up_proj``. Row-parallel layers' ``A`` is split by columns like
the base weight (`Split.ROW`), their ``B`` replicated. ``B_q @ A`` is then exactly q's rows of the fused update.

The global (``peft``) form is what checkpoints hold and what ``convert mcore-to-hf --adapter-only`` writes, so an
adapter saved at one TP/PP/EP layout loads at any other. Adapters are small (rank x width), so gathering them
whole is cheap; the merged base weights are never gathered here (the weight sync merges shard-locally,
``export.iter_hf_weights``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.collectives.device import collective_device
from dapo_mcore.model.lora.attach import AdaptedLayer, adapted_layers
from dapo_mcore.weights.live import live_layout
from dapo_mcore.weights.mapping import Placement
from dapo_mcore.weights.registry import get_mapping
from dapo_mcore.weights.transforms import DictSource, Split, merge, shard

PEFT_PREFIX = "base_model.model."


def peft_name(hf_weight: str, which: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    assert hf_weight.endswith(".weight") and which in ("A", "B"), (hf_weight, which)
    return f"{PEFT_PREFIX}{hf_weight[:-len('.weight')]}.lora_{which}.weight"


def hf_module_name(hf_weight: str) -> str:
    """The module's last name (``q_proj``), what peft's ``target_modules`` lists."""
    return hf_weight.rsplit(".", 2)[-2]


def _placements(model_chunks: list, hf_config: dict[str, Any], layer_spec: str):
    """(layout, {chunk-prefixed Megatron key: placement}) of this rank's tensors."""
    from megatron.core import parallel_state as ps

    mapping = get_mapping(hf_config)
    layout, _, pp_rank = live_layout(model_chunks, layer_spec, make_vocab_size_divisible_by=1)
    ep = ps.get_expert_model_parallel_rank() if layout.ep > 1 else 0
    return mapping, layout, dict(mapping.rank_placements(layout, pp_rank, ep))


def _key(layout, layer: AdaptedLayer) -> str:
    return layout.chunk_prefix(layer.chunk) + layer.weight_key


def _gather_tp(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``t`` of one TP group, in rank order (on the host)."""
    if group.size() == 1:
        return [t.detach().clone()]
    dev = collective_device(group)
    local = dev.to(t.detach().contiguous())
    parts = [dev.empty(tuple(local.shape), local.dtype) for _ in range(group.size())]
    dist.all_gather(parts, local, group=group)
    return [dev.host(p) for p in parts]


def layer_pieces(layer: AdaptedLayer, pl: Placement, geo, grads: bool = False) -> dict[str, torch.Tensor]:
    """One adapted layer's ``peft`` tensors (a collective over the layer's TP group), fp32; with ``grads``, their
    gradients (Megatron's ``main_grad``) in the same form."""
    ad = layer.adapter
    a, b = (ad.a.main_grad, ad.b.main_grad) if grads else (ad.a, ad.b)
    a, b = a.detach().float(), b.detach().float()
    out: dict[str, torch.Tensor] = {}
    if ad.parallel == "column":
        bs = merge(pl.rule.split, _gather_tp(b, ad.group), pl.hf_names, geo)
        for name, piece in bs:
            out[peft_name(name, "A")] = a.clone()
            out[peft_name(name, "B")] = piece.contiguous()
    else:
        (name,) = pl.hf_names
        out[peft_name(name, "A")] = merge(Split.ROW, _gather_tp(a, ad.group), pl.hf_names, geo)[0][1].contiguous()
        out[peft_name(name, "B")] = b.clone()
    return out


def gather_adapters(model_chunks: list, hf_config: dict[str, Any], layer_spec: str = "local",
                    grads: bool = False) -> dict[str, torch.Tensor]:
    """This rank's adapters (its pipeline stage's and expert-parallel rank's layers) by ``peft`` name, whole along
    TP, fp32 (with ``grads``: their gradients). A collective over each TP group."""
    mapping, layout, placed = _placements(model_chunks, hf_config, layer_spec)
    geo = mapping.geometry(layout)
    out: dict[str, torch.Tensor] = {}
    for layer in adapted_layers(model_chunks):
        out.update(layer_pieces(layer, placed[_key(layout, layer)], geo, grads))
    return out


@torch.no_grad()
def load_adapters(model_chunks: list, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                  layer_spec: str = "local") -> int:
    """Set this rank's adapters from ``peft``-named whole tensors (any layout wrote them); returns how many layers
    were set. KeyError naming the first missing tensor; ValueError on a rank or shape mismatch."""
    mapping, layout, placed = _placements(model_chunks, hf_config, layer_spec)
    geo = mapping.geometry(layout)
    count = 0
    for layer in adapted_layers(model_chunks):
        pl, ad = placed[_key(layout, layer)], layer.adapter
        tp, rank = ad.group.size(), ad.group.rank()
        names = pl.hf_names
        missing = [n for nm in names for n in (peft_name(nm, "A"), peft_name(nm, "B")) if n not in tensors]
        if missing:
            raise KeyError(f"the adapter has no {missing[0]} ({len(missing)} tensors missing for {layer.name})")
        if ad.parallel == "column":
            a = tensors[peft_name(names[0], "A")]
            b = shard(pl.rule.split, DictSource({n: tensors[peft_name(n, "B")] for n in names}), names, tp, rank, geo)
        else:
            a = shard(Split.ROW, DictSource({names[0]: tensors[peft_name(names[0], "A")]}), names, tp, rank, geo)
            b = tensors[peft_name(names[0], "B")]
        for live, new, what in ((ad.a, a, "A"), (ad.b, b, "B")):
            if tuple(live.shape) != tuple(new.shape):
                raise ValueError(f"adapter {what} of {layer.name}: shape {tuple(new.shape)} does not fit the live "
                                 f"{tuple(live.shape)} (another model.lora.rank or model?)")
            live.copy_(new.to(live.dtype))
        count += 1
    return count
