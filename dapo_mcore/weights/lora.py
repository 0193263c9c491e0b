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

from collections.abc import Callable
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
Getter = Callable[[torch.nn.Parameter], torch.Tensor]
Putter = Callable[[torch.nn.Parameter, torch.Tensor], None]


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


def layer_pieces(layer: AdaptedLayer, pl: Placement, geo, get: Getter | None = None) -> dict[str, torch.Tensor]:
    """One adapted layer's ``peft`` tensors (a collective over the layer's TP group), fp32. ``get`` picks what of
    each adapter parameter: its value by default; its gradient, or an optimizer state of its shape, in the same form."""
    ad = layer.adapter
    get = get or (lambda p: p)
    a, b = get(ad.a).detach().float(), get(ad.b).detach().float()
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
                    get: Getter | None = None) -> dict[str, torch.Tensor]:
    """This rank's adapters (its pipeline stage's and expert-parallel rank's layers) by ``peft`` name, whole along
    TP, fp32 (``get``: see `layer_pieces`). A collective over each TP group."""
    mapping, layout, placed = _placements(model_chunks, hf_config, layer_spec)
    geo = mapping.geometry(layout)
    out: dict[str, torch.Tensor] = {}
    for layer in adapted_layers(model_chunks):
        out.update(layer_pieces(layer, placed[_key(layout, layer)], geo, get))
    return out


@torch.no_grad()
def load_adapters(model_chunks: list, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                  layer_spec: str = "local", put: Putter | None = None) -> int:
    """Set this rank's adapters from ``peft``-named whole tensors (any layout wrote them); returns how many layers
    were set. ``put(param, shard)`` stores a shard (default: into the parameter; an optimizer state instead). Every
    shape is checked before anything is stored: KeyError naming the first missing tensor, ValueError on a rank or
    shape mismatch."""
    mapping, layout, placed = _placements(model_chunks, hf_config, layer_spec)
    geo = mapping.geometry(layout)
    todo = []
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
            todo.append((live, new))
    put = put or (lambda param, value: param.copy_(value.to(param.dtype)))
    for live, new in todo:
        put(live, new)
    return len(todo) // 2


def hf_target_modules(target_modules: list[str]) -> list[str]:
    """peft's ``target_modules`` (Hugging Face module names) of Megatron targets."""
    from dapo_mcore.model.lora.config import HF_TARGETS

    return [hf for t in target_modules for hf in HF_TARGETS[t]]


def adapter_config(lora, base_path: str | None, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The ``adapter_config.json`` peft reads (``LoraConfig`` fields; ``PeftModel.from_pretrained`` loads it)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
            "target_modules": hf_target_modules(list(lora.target_modules)), "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True, "modules_to_save": None}
