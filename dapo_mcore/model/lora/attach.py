"""Put LoRA adapters on a built Megatron model and freeze everything else.

``attach_lora`` walks this rank's model chunks, gives every targeted linear layer a child ``lora``
(`adapter.LoRAAdapter`, parameters ``<layer>.lora.a`` / ``<layer>.lora.b``) and a forward hook that adds the
adapter's output to the layer's, then sets ``requires_grad=False`` on every other parameter. It runs before
Megatron's DDP and optimizer are built, which then hold gradient buffers, fp32 main copies and Adam states for the
adapters alone. The base layers keep their parameter names, so loading, saving and exporting base weights is
unchanged; `adapted_layers` lists the adapters for the merged export (``weights.lora``).

Transformer Engine's ``TELayerNormColumnParallelLinear`` (``linear_qkv`` / ``linear_fc1`` of the TE spec) normalizes
its input itself: it is asked for the normalized input too (TE's ``return_layernorm_output``), and the adapter reads
that. TE's experts are hooked like the local spec's (``SequentialMLP`` of
``TEColumnParallelLinear`` / ``TERowParallelLinear``: the project builds MoE layers without grouped GEMM); grouped
experts (``TEGroupedMLP``: every expert's weight in one module) have no per-expert linear to hook and are refused.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from dapo_mcore.model.lora.adapter import LoRAAdapter
from dapo_mcore.model.lora.config import COLUMN_TARGETS, LoRAConfig

log = logging.getLogger(__name__)

CHILD = "lora"
_ADAPTER_PARAM = re.compile(rf"\.{CHILD}\.[ab]$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


class LoRAUnsupported(ValueError):
    """A model or layer spec the adapters cannot be put on (the message says what to change)."""


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (as ``named_parameters`` gives it) is an adapter's."""
    return bool(_ADAPTER_PARAM.search(name))


@dataclass(frozen=True)
class AdaptedLayer:
    """One adapted layer of one chunk: ``name`` in the chunk (``decoder.layers.0.self_attention.linear_qkv``)."""

    chunk: int
    name: str
    module: torch.nn.Module

    @property
    def adapter(self) -> LoRAAdapter:
        return getattr(self.module, CHILD)

    @property
    def weight_key(self) -> str:
        return f"{self.name}.weight"


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def adapted_layers(model_chunks: list) -> list[AdaptedLayer]:
    """Every adapted layer of this rank's chunks, chunk by chunk in module order."""
    out = []
    for v, chunk in enumerate(model_chunks):
        for name, module in _unwrap(chunk).named_modules():
            if isinstance(getattr(module, CHILD, None), LoRAAdapter):
                out.append(AdaptedLayer(v, name, module))
    return out


def global_layer_name(chunk: torch.nn.Module, name: str) -> str:
    """A layer's name with the global transformer-layer and expert numbers (the same at every TP/PP/EP layout)."""
    m = _LAYER.match(name)
    if m is None:
        return name
    layer = chunk.decoder.layers[int(m.group(1))]
    rest = m.group(2)
    e = _EXPERT.match(rest)
    if e is not None:
        experts = layer.mlp.local_expert_indices
        rest = f"{e.group(1)}{experts[int(e.group(2))]}{e.group(3)}"
    return f"layers.{layer.layer_number - 1}.{rest}"


def _expert_layout(module, name: str):
    """(TP group, explicit expert communication) of a layer. Megatron's local linears store both (``is_expert``,
    ``explicit_expert_comm``); Transformer Engine's (``TELinear``) store neither, so an expert is known by its place
    (``...experts.local_experts.N...``) and its communication by Megatron's own rule: an expert layer leaves its
    transfers to the token dispatcher when it is split over TP ranks or experts over EP ranks."""
    from megatron.core import parallel_state as ps

    expert = bool(getattr(module, "is_expert", False)) or ".experts." in f".{name}."
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    explicit = getattr(module, "explicit_expert_comm", None)
    if explicit is None:
        explicit = expert and (group.size() > 1 or ps.get_expert_model_parallel_world_size() > 1)
    return group, bool(explicit)


def _lora_hook(module, args, output):
    """Forward hook: the layer's ``(output, bias)`` with the adapter's output added."""
    adapter = getattr(module, CHILD)
    if getattr(module, "_lora_reads_norm", False):  # TE LayerNormLinear: (out, ln_out) inside the tuple
        if getattr(module, "te_return_bias", False):
            out, bias, x = output
        else:
            (out, x), bias = output
    else:
        (out, bias), x = output, args[0]
    return out + adapter(x).to(out.dtype), bias


def _attach_one(chunk, name: str, module, cfg: LoRAConfig, sequence_parallel: bool, seed: int) -> None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise LoRAUnsupported(f"model.lora cannot adapt {name} ({type(module).__name__}: no single 2-D weight; "
                              "Transformer Engine's grouped experts are not supported): use model.layer_spec=local "
                              "for an MoE model with LoRA, or leave linear_fc1/linear_fc2 out of "
                              "model.lora.target_modules.")
    group, explicit = _expert_layout(module, name)
    tp_size, tp_rank = group.size(), group.rank()
    leaf = name.rsplit(".", 1)[-1]
    parallel = "column" if leaf in COLUMN_TARGETS else "row"
    if hasattr(module, "layer_norm_weight") and hasattr(module, "return_layernorm_output"):
        module.return_layernorm_output = True  # TE: the normalized input comes back beside the output
        module._lora_reads_norm = True
    adapter = LoRAAdapter(
        parallel=parallel, in_features=weight.shape[1], out_features=weight.shape[0], rank=cfg.rank,
        scale=cfg.scale, dropout=cfg.dropout, tp_group=group, tp_size=tp_size, tp_rank=tp_rank,
        sequence_parallel=sequence_parallel, explicit_comm=explicit,
        allreduce=bool(getattr(weight, "allreduce", True)), dtype=weight.dtype, device=weight.device,
        init_key=global_layer_name(chunk, name), seed=seed)
    module.add_module(CHILD, adapter)
    module.register_forward_hook(_lora_hook)


def attach_lora(model_chunks: list, cfg: LoRAConfig, *, sequence_parallel: bool = False, seed: int = 0,
                inputs_require_grad: bool = False) -> int:
    """Adapters on every targeted layer of this rank's chunks; everything else frozen. Returns how many layers
    were adapted. ``inputs_require_grad``: make the embedding's output require grad (full activation
    recomputation: Megatron's checkpointed layers pass gradients only to inputs that require them)."""
    targets = set(cfg.target_modules)
    count = 0
    for chunk in model_chunks:
        chunk = _unwrap(chunk)
        for p in chunk.parameters():
            p.requires_grad_(False)
        layers = [(n, m) for n, m in chunk.named_modules() if n.rsplit(".", 1)[-1] in targets]
        for name, module in layers:
            _attach_one(chunk, name, module, cfg, sequence_parallel, seed)
            count += 1
        embedding = getattr(chunk, "embedding", None)
        if inputs_require_grad and embedding is not None:
            embedding.register_forward_hook(lambda _m, _a, out: out.requires_grad_(True)
                                            if torch.is_grad_enabled() else out)
    log.info("LoRA: rank %d, alpha %g on %d layers of this rank (%s); base frozen", cfg.rank, cfg.alpha, count,
             ", ".join(cfg.target_modules))
    return count


def trainable_parameters(model_chunks: list) -> int:
    """Trainable parameters on this rank."""
    return sum(p.numel() for c in model_chunks for p in _unwrap(c).parameters() if p.requires_grad)
