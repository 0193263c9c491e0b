"""The MoE facts of a Qwen3-MoE config and the expert-parallel sizes it can take, without torch: what ``config``,
``plan`` and the FLOP model read (``model/moe.py`` builds Megatron's MoE layers from them and re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dapo_mcore.model.hf_config import expert_count

MOE_MODEL_TYPES = ("qwen3_moe",)
GPUS_PER_NODE = 8
"""The cluster's GPUs per node (H100 HGX) for where an expert-parallel group lies."""


class MoEConfigError(ValueError):
    """An MoE config this project cannot build faithfully (message names the field and the fix)."""


@dataclass(frozen=True)
class MoEShape:
    """The MoE facts of a Qwen3-MoE config."""

    num_experts: int
    topk: int
    moe_ffn_hidden_size: int
    norm_topk_prob: bool
    aux_loss_coeff: float
    moe_layers: tuple[int, ...]
    """Global indices of the sparse (MoE) layers; every other layer is a dense MLP."""
    num_layers: int

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoEShape | None:
        """None for a dense model; raise MoEConfigError for an MoE feature Megatron would compute differently."""
        if hf.get("model_type") not in MOE_MODEL_TYPES:
            return None
        experts = expert_count(hf)
        if not experts:
            raise MoEConfigError("qwen3_moe config has no num_experts (or num_local_experts); it is not a "
                                 "Qwen3-MoE checkpoint's config.json.")
        topk = int(hf["num_experts_per_tok"])
        if not 1 <= topk <= int(experts):
            raise MoEConfigError(f"num_experts_per_tok={topk} must be in 1..num_experts={experts}.")
        if topk == 1 and hf.get("norm_topk_prob", False):
            raise MoEConfigError("num_experts_per_tok=1 with norm_topk_prob=true (gate = 1) is not supported: "
                                 "Megatron routes top-1 only with pre-softmax gates (supported: top-1 with "
                                 "norm_topk_prob=false, or num_experts_per_tok >= 2).")
        if hf.get("shared_expert_intermediate_size"):
            raise MoEConfigError("shared_expert_intermediate_size is set: shared experts (Qwen2-MoE style) are not "
                                 "supported for qwen3_moe; remove it from config.json.")
        layers = int(hf["num_hidden_layers"])
        dense_only = {int(i) for i in hf.get("mlp_only_layers") or []}
        step = int(hf.get("decoder_sparse_step", 1))
        if step < 1:
            raise MoEConfigError(f"decoder_sparse_step={step} must be >= 1.")
        moe_layers = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        if not moe_layers:
            raise MoEConfigError("mlp_only_layers / decoder_sparse_step leave no MoE layer; this is a dense model "
                                 "(use a qwen3 config).")
        return cls(num_experts=int(experts), topk=topk, moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)), moe_layers=moe_layers,
                   num_layers=layers)

    @property
    def layer_pattern(self) -> list[int]:
        """Megatron's ``moe_layer_freq`` list: 1 = MoE layer, 0 = dense."""
        return [1 if i in self.moe_layers else 0 for i in range(self.num_layers)]

    def active_experts_fraction(self) -> float:
        return self.topk / self.num_experts


def check_expert_parallel(shape: MoEShape | None, expert_parallel: int) -> None:
    """One-line errors for an expert-parallel size the model cannot take."""
    if expert_parallel < 1:
        raise MoEConfigError(f"parallel.expert_parallel={expert_parallel} must be >= 1.")
    if shape is None:
        if expert_parallel > 1:
            raise MoEConfigError(f"parallel.expert_parallel={expert_parallel} needs an MoE model (qwen3_moe); "
                                 "this model is dense: set parallel.expert_parallel=1.")
        return
    if shape.num_experts % expert_parallel:
        ok = [d for d in range(1, shape.num_experts + 1) if shape.num_experts % d == 0]
        raise MoEConfigError(f"parallel.expert_parallel={expert_parallel} does not divide num_experts="
                             f"{shape.num_experts}; use one of {', '.join(map(str, ok))}.")


def describe_experts(hf: dict[str, Any], tensor_parallel: int, expert_parallel: int, router_replay: str | None = None,
                     vllm: tuple[int, int] | None = None, expert_tensor_parallel: int | None = None,
                     vllm_engines: int | None = None) -> str | None:
    """One line on the expert layout of an MoE model (None for a dense one): experts and top-k, EP, expert-TP (None:
    = TP, Megatron's default, over which the dispatcher all-gathers the routed tokens), experts per rank, routing
    replay and, for vLLM, how its engines split the experts (``vllm`` = (tensor parallel, data parallel);
    ``vllm_engines``: how many engines run, when more than one data-parallel group: independent instances)."""
    shape = MoEShape.from_hf(hf)
    if shape is None:
        return None
    etp = tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel
    how = ("= TP: routed tokens all-gathered over it" if etp == tensor_parallel and etp > 1 else
           "every expert whole" if etp == 1 else f"each expert split {etp} ways")
    line = (f"experts: {shape.num_experts} per MoE layer ({len(shape.moe_layers)} of {hf['num_hidden_layers']} "
            f"layers), top-{shape.topk}; EP={expert_parallel}, expert-TP={etp} ({how}), "
            f"{shape.num_experts // expert_parallel} experts per rank")
    if expert_parallel > 1:  # Megatron's expert grid: an EP group's ranks lie etp apart
        span = etp * expert_parallel
        line += (f" (EP group within {span} consecutive ranks: "
                 f"{'one node' if span <= GPUS_PER_NODE else 'crosses nodes'})")
    if router_replay is not None:
        line += f"; router replay: {router_replay}"
    if vllm is not None:
        ranks = vllm[0] * vllm[1]
        where = ("within one node" if ranks <= GPUS_PER_NODE else
                 f"{-(-ranks // GPUS_PER_NODE)} nodes of {GPUS_PER_NODE} GPUs: every MoE layer's exchange crosses nodes")
        count = vllm_engines or vllm[1]
        engines = (f"{vllm[1]} engines of TP={vllm[0]} in one data-parallel group" if vllm[1] > 1 else
                   f"{count} independent engines of TP={vllm[0]}" if count > 1 else "one engine")
        line += (f"; vLLM: {engines}, {max(1, shape.num_experts // ranks)} experts per GPU, expert parallel over "
                 f"{ranks} GPUs ({where})" if ranks > 1 else "; vLLM: all experts on one GPU")
    return line
