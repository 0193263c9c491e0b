"""Qwen3-MoE: per-expert Hugging Face tensors <-> Megatron's expert layout, on top of the Qwen3 attention rows.

Hugging Face saves one tensor per expert (``model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``)
and the router as ``mlp.gate.weight`` [num_experts, hidden]; dense layers (``mlp_only_layers``,
``decoder_sparse_step``) keep the Qwen MLP rows. Megatron's MoE layer holds ``mlp.router.weight`` and, on
expert-parallel rank ``r`` of ``ep``, the experts ``r * E/ep ...`` numbered from 0: with the local spec
(``SequentialMLP``) as ``mlp.experts.local_experts.{j}.linear_fc1.weight`` ([gate; up], column-parallel) and
``linear_fc2.weight`` (row-parallel); with Transformer Engine's grouped GEMM (``TEGroupedMLP``, whose
``GroupedLinear`` registers one ``weight{j}`` per local expert) as ``mlp.experts.linear_fc1.weight{j}`` and
``mlp.experts.linear_fc2.weight{j}``. Each expert is split over the expert-tensor-parallel ranks
(``ParallelLayout.etp``, Megatron's default = tensor_parallel) with the TP transforms of the dense MLP. A rank file
of an EP > 1 checkpoint holds the dense tensors of its TP rank and the experts of its expert-parallel rank at its
expert-TP rank (``mp_rank_TT_PPP_EEE``, Megatron's naming; with etp < tp only the (TP, EP) pairs that a process
holds exist: ``ParallelLayout.rank_files``).
"""

from __future__ import annotations

from typing import Any

from dapo_mcore.model.moe import MoEShape
from dapo_mcore.model.qwen import QwenShape, padded_vocab_size
from dapo_mcore.weights.layout import LayoutError, ParallelLayout
from dapo_mcore.weights.mapping import ModelMapping, Placement, Scope, TensorRule
from dapo_mcore.weights.transforms import Split

_L = "decoder.layers.{i}."
_H = "model.layers.{i}."
_X = "mlp.experts.local_experts.{e}."
_G = "mlp.experts."  # TEGroupedMLP: one GroupedLinear per projection, weight{e} per local expert

ROUTER = TensorRule(_L + "mlp.router.weight", _L + "mlp.router.weight", (_H + "mlp.gate.weight",), ("router",),
                    Split.REPLICATED, Scope.LAYER)
# The MoE layer's norm stays a separate module with either spec (Megatron does not fuse it into the experts).
MOE_NORM = TensorRule(_L + "pre_mlp_layernorm.weight", _L + "pre_mlp_layernorm.weight",
                      (_H + "post_attention_layernorm.weight",), ("norm",), Split.REPLICATED, Scope.LAYER)
EXPERT_IN = TensorRule(_L + _X + "linear_fc1.weight", _L + _G + "linear_fc1.weight{e}",
                       (_H + "mlp.experts.{e}.gate_proj.weight", _H + "mlp.experts.{e}.up_proj.weight"),
                       ("expert_gate_up", "expert_gate_up"), Split.GATE_UP, Scope.LAYER)
EXPERT_OUT = TensorRule(_L + _X + "linear_fc2.weight", _L + _G + "linear_fc2.weight{e}",
                        (_H + "mlp.experts.{e}.down_proj.weight",), ("expert_down",), Split.ROW, Scope.LAYER)
EXPERT_RULES = (EXPERT_IN, EXPERT_OUT)
MLP_SUFFIXES = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
                "mlp.linear_fc2.weight")


def _is_mlp_rule(rule: TensorRule) -> bool:
    return rule.local.endswith(MLP_SUFFIXES) or rule.te.endswith(MLP_SUFFIXES)


class MoEMapping(ModelMapping):
    """A Qwen mapping whose MoE layers hold a router and per-expert MLPs in place of the dense MLP."""

    def __init__(self, hf_config: dict[str, Any], rules: tuple[TensorRule, ...], moe: MoEShape, **shape: Any):
        super().__init__(hf_config, rules, **shape)
        self.moe = moe

    def _hf_tensor_shapes(self, rule: TensorRule) -> list[tuple[int, ...]]:
        h, f = self.hidden_size, self.moe.moe_ffn_hidden_size
        own = {"router": (self.moe.num_experts, h), "expert_gate_up": (f, h), "expert_down": (h, f)}
        if all(k in own for k in rule.kinds):
            return [own[k] for k in rule.kinds]
        return super()._hf_tensor_shapes(rule)

    def check_layout(self, layout: ParallelLayout) -> None:
        super().check_layout(layout)
        if self.moe.num_experts % layout.ep:
            raise LayoutError(f"expert_parallel={layout.ep} does not divide num_experts={self.moe.num_experts}; "
                              f"use one of {', '.join(str(d) for d in range(1, self.moe.num_experts + 1) if self.moe.num_experts % d == 0)}.")
        if self.moe.moe_ffn_hidden_size % layout.expert_tp:
            raise LayoutError(f"expert tensor parallel {layout.expert_tp} does not divide moe_intermediate_size="
                              f"{self.moe.moe_ffn_hidden_size}.")

    def layer_placements(self, layer: int, pp_rank: int, vchunk: int, layout: ParallelLayout,
                         local: int) -> list[Placement]:
        if layer not in self.moe.moe_layers:
            return super().layer_placements(layer, pp_rank, vchunk, layout, local)
        out = [self._place(rule, layer, pp_rank, vchunk, layout, local)
               for rule in self.rules if rule.scope is Scope.LAYER and not _is_mlp_rule(rule)]
        out.append(self._place(MOE_NORM, layer, pp_rank, vchunk, layout, local))
        out.append(self._place(ROUTER, layer, pp_rank, vchunk, layout, local))
        per_rank = self.moe.num_experts // layout.ep
        for expert in range(self.moe.num_experts):
            ep_rank, local_expert = divmod(expert, per_rank)
            for rule in EXPERT_RULES:
                key = rule.mcore_name(layout.layer_spec).format(i=local, e=local_expert)
                hf_names = tuple(n.format(i=layer, e=expert) for n in rule.hf)
                out.append(Placement(rule, layer, pp_rank, vchunk, key, hf_names, exported=True, ep_rank=ep_rank))
        return out


def qwen3_moe_mapping(hf_config: dict[str, Any]) -> ModelMapping:
    from dapo_mcore.weights.qwen3 import QWEN3_RULES

    shape = QwenShape.from_hf(hf_config)
    moe = MoEShape.from_hf(hf_config)
    assert moe is not None
    return MoEMapping(
        hf_config, QWEN3_RULES, moe, num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size, vocab_size=shape.vocab_size, tie_embeddings=shape.tie_embeddings,
        padded_vocab_fn=padded_vocab_size,
    )


def per_expert_views(params: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint-named per-expert views of transformers' fused expert parameters (transformers >= 5 holds a
    layer's experts as ``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first, and ``mlp.experts.down_proj``
    [E, H, I], but saves and loads them one tensor per expert): ``{name: view}`` for every fused parameter in
    `params`, so a weight sync in checkpoint names copies straight into the fused storage. Other names: none."""
    views: dict[str, Any] = {}
    for name, param in params.items():
        prefix = name.removesuffix("gate_up_proj")
        if name.endswith(".mlp.experts.gate_up_proj") and param.dim() == 3:
            half = param.shape[1] // 2
            for e in range(param.shape[0]):
                views[f"{prefix}{e}.gate_proj.weight"] = param[e, :half]
                views[f"{prefix}{e}.up_proj.weight"] = param[e, half:]
        elif name.endswith(".mlp.experts.down_proj") and param.dim() == 3:
            prefix = name.removesuffix("down_proj")
            for e in range(param.shape[0]):
                views[f"{prefix}{e}.down_proj.weight"] = param[e]
    return views
