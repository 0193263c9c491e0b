"""Qwen3-MoE on Megatron-Core: the MoE half of a Hugging Face config -> TransformerConfig and layer specs.

Qwen3-MoE's router (``Qwen3MoeTopKRouter``) takes the softmax of the router logits, keeps the top-k experts and,
with ``norm_topk_prob``, renormalises the kept probabilities to sum to 1. Megatron's ``TopKRouter`` with
``score_function="softmax"`` computes the same thing two ways:

* ``moe_router_pre_softmax=False``: top-k of the logits, then softmax over the k kept logits. Softmax is monotone,
  so the same experts are kept, and ``softmax(kept logits) == kept probs / sum(kept probs)``: ``norm_topk_prob=true``.
* ``moe_router_pre_softmax=True``: softmax over all experts, then top-k, not renormalised: ``norm_topk_prob=false``.

Which layers are sparse: HF's rule (``layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0``)
becomes Megatron's ``moe_layer_freq`` as an explicit 0/1 list; dense layers keep ``intermediate_size``, experts use
``moe_intermediate_size``. Experts are Megatron's ``SequentialMLP`` (no grouped GEMM: it runs on a CPU; the
transformer_engine spec uses ``TEGroupedMLP`` on GPU), dispatched by the all-to-all token dispatcher.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dapo_mcore.model.moe_shape import (  # noqa: F401  (re-exported: the shape facts need no torch)
    GPUS_PER_NODE,
    MOE_MODEL_TYPES,
    MoEConfigError,
    MoEShape,
    check_expert_parallel,
    describe_experts,
)


def moe_transformer_kwargs(hf: dict[str, Any], *, expert_parallel: int = 1, routing_replay: bool = False,
                           expert_tensor_parallel: int | None = None, layer_spec: str = "local") -> dict[str, Any]:
    """TransformerConfig keyword arguments for the MoE part of `hf` (empty for a dense model).

    ``expert_tensor_parallel`` None leaves Megatron's default (= TP). With the Transformer Engine spec the experts
    are one ``TEGroupedMLP`` per layer (``moe_grouped_gemm``: one grouped GEMM over the local experts instead of a
    GEMM per expert); the local spec keeps ``SequentialMLP`` (grouped GEMM is a GPU kernel)."""
    shape = MoEShape.from_hf(hf)
    check_expert_parallel(shape, expert_parallel)
    if shape is None:
        return {}
    return dict(
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_layer_freq=shape.layer_pattern,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not shape.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if shape.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=shape.aux_loss_coeff,
        moe_router_dtype="fp32",  # HF takes the router softmax in float32
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=layer_spec == "transformer_engine",
        moe_enable_routing_replay=routing_replay,
        expert_model_parallel_size=expert_parallel,
        **({} if expert_tensor_parallel is None else {"expert_tensor_parallel_size": expert_tensor_parallel}),
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def moe_layer_specs(tconfig, kind: str, core_attention=None) -> list:
    """One layer spec per global layer (MoE or dense as `tconfig.moe_layer_freq` says), with the local spec's
    ``core_attention`` swapped for `core_attention` when given (the project's SDPA attention)."""
    from megatron.core.models.gpt import gpt_layer_specs

    specs = gpt_layer_specs.get_gpt_decoder_layer_specs(
        tconfig, use_transformer_engine=kind == "transformer_engine", normalization="RMSNorm")
    if core_attention is None:
        return specs
    from dapo_mcore.model.attention import with_core_attention

    swapped: dict[int, Any] = {}
    return [swapped.setdefault(id(s), with_core_attention(s, core_attention)) for s in specs]


def define_missing_te_names() -> None:
    """megatron-core 0.16.1's router gating (``moe_utils.RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None`` but only defines the name when Transformer Engine imports, so without TE the
    router ends in a NameError. Define it as None there (what the test means), as the module does for the rest."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _split_sizes_as_lists()
    _uneven_sequence_collectives()


class _AllToAll(torch.autograd.Function):
    """Megatron's ``_AllToAll`` (variable splits, the reverse exchange in backward) with the output on the input's
    device and split sizes as int lists."""

    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
        if group.size() == 1:
            return input_
        from dapo_mcore.collectives.device import collective_device

        device = collective_device(group)  # the tokens' own device on a GPU (a no-op); marked under NCCL-on-CPU
        input_ = device.to(input_.contiguous())
        rows = input_.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        output = device.to(input_.new_empty((rows, *input_.shape[1:])))
        dist.all_to_all_single(output, input_, output_split_sizes=output_split_sizes,
                               input_split_sizes=input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, grad):
        return (None, _AllToAll.apply(ctx.group, grad, ctx.input_split_sizes, ctx.output_split_sizes), None, None)


def _dispatcher_all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    def as_list(sizes):
        return None if sizes is None else [int(n) for n in sizes]
    return _AllToAll.apply(group, input_, as_list(output_split_sizes_), as_list(input_split_sizes))


def _uneven_gather(input_, group, output_split_sizes=None, use_global_buffer=False, *, _even=None):
    """Megatron's ``_gather_along_first_dim`` with uneven ``output_split_sizes`` as one all-to-all (gloo has no
    uneven all-gather): every rank sends its rows to every rank."""
    if output_split_sizes is None or group.size() == 1:
        return _even(input_, group, output_split_sizes, use_global_buffer)
    from dapo_mcore.collectives.device import collective_device

    device = collective_device(group)
    rows = int(input_.shape[0])
    source = device.to(input_.contiguous().repeat(group.size(), *([1] * (input_.dim() - 1))))
    output = device.to(input_.new_empty((sum(output_split_sizes), *input_.shape[1:])))
    dist.all_to_all_single(output, source, output_split_sizes=[int(n) for n in output_split_sizes],
                           input_split_sizes=[rows] * group.size(), group=group)
    return output


def _uneven_reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False, *, _even=None):
    """Megatron's ``_reduce_scatter_along_first_dim`` with uneven ``input_split_sizes`` as one all-to-all and a sum
    (gloo has no uneven reduce-scatter): rank r receives every rank's block r and adds them up."""
    if input_split_sizes is None or group.size() == 1:
        return _even(input_, group, input_split_sizes, use_global_buffer)
    from dapo_mcore.collectives.device import collective_device

    device = collective_device(group)
    mine = int(input_split_sizes[group.rank()])
    received = device.to(input_.new_empty((group.size() * mine, *input_.shape[1:])))
    dist.all_to_all_single(received, device.to(input_.contiguous()), output_split_sizes=[mine] * group.size(),
                           input_split_sizes=[int(n) for n in input_split_sizes], group=group)
    return received.view(group.size(), mine, *input_.shape[1:]).sum(dim=0)


def _uneven_sequence_collectives() -> None:
    """The expert-TP all-gather of routed tokens (and its reduce-scatter in backward), made to run on gloo:
    Megatron passes uneven split sizes to ``torch.distributed.all_gather`` / ``reduce_scatter``, which gloo refuses
    ("invalid tensor size"). Same values, same gradients (the autograd functions around them are Megatron's)."""
    from functools import partial

    from megatron.core.tensor_parallel import mappings

    if torch.cuda.is_available() or getattr(mappings, "_dapo_uneven", False):
        return
    mappings._gather_along_first_dim = partial(_uneven_gather, _even=mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = partial(_uneven_reduce_scatter,
                                                       _even=mappings._reduce_scatter_along_first_dim)
    mappings._dapo_uneven = True


def _split_sizes_as_lists() -> None:
    """The all-to-all token dispatcher's exchange, made to run on CPU/gloo: megatron-core 0.16.1 passes its split
    sizes to ``all_to_all_single`` as numpy arrays (``maybe_move_tensor_to_cpu(as_numpy=True)``), which torch 2.13's
    binding refuses (TypeError), and allocates the output with ``device=torch.cuda.current_device()``, which fails in
    the autograd thread where the CPU compatibility mode is not active. Same exchange, same gradients."""
    from megatron.core.transformer.moe import token_dispatcher

    if torch.cuda.is_available():
        return  # NCCL: Megatron's own function
    token_dispatcher.all_to_all = _dispatcher_all_to_all


def moe_block_spec(tconfig, kind: str, core_attention=None, vp_stage: int | None = None):
    """This pipeline stage's ``TransformerBlockSubmodules`` (its slice of `moe_layer_specs`)."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    define_missing_te_names()
    specs = moe_layer_specs(tconfig, kind, core_attention)
    offset = get_transformer_layer_offset(tconfig, vp_stage=vp_stage)
    count = get_num_layers_to_build(tconfig, vp_stage=vp_stage)
    if kind == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm as norm
    else:
        norm = LNImpl
    block = TransformerBlockSubmodules(layer_specs=specs[offset: offset + count], layer_norm=norm)
    if kind == "local" and tconfig.sequence_parallel:
        from dapo_mcore.model.norm import with_sequence_parallel_norms

        block = with_sequence_parallel_norms(block)
    return block


def in_recompute() -> bool:
    """Whether a forward runs inside autograd's backward: activation recompute (Megatron's full recompute and its
    ``recompute_modules``, torch's checkpoint, reentrant or not) re-runs a layer's forward there, so a forward hook
    fires twice per micro-batch; a hook that counts skips the second call."""
    return torch._C._current_graph_task_id() != -1


def routing_copies(tensor_parallel: int, sequence_parallel: bool) -> int:
    """How many ranks of one model replica route the same token: every TP rank without sequence parallelism (each
    holds the whole sequence), one with it (the MoE layer's input is split along the sequence over the TP ranks, so
    each routes its 1/TP of the tokens). ``RouterStats.metrics`` divides the job's token counts by this."""
    return 1 if sequence_parallel else tensor_parallel


class RouterStats:
    """Load balance and aux loss of the MoE routers of this rank's model chunks, per optimizer update.

    A forward hook on each Megatron ``TopKRouter`` adds its routing map's tokens per expert (this rank's tokens; with
    TP every TP rank routes the same tokens), once per forward: the second run of a recomputed layer inside backward
    is not counted (`in_recompute`). `metrics` (a collective over the default group) sums them over the
    job, giving per-layer ``max / mean`` tokens per expert (1 = perfectly balanced), and reads Megatron's aux-loss
    tracker (the unscaled load-balancing loss, averaged over layers and router calls). The counts stay on the
    routers' device between updates; `metrics` reduces them on the default group's collective device (NCCL on a GPU
    refuses a CPU tensor) and reads them back with one host sync."""

    def __init__(self, chunks: list, num_layers: int, num_experts: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.calls = torch.zeros(num_layers, dtype=torch.float64)
        self._on_device = False
        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            router.register_forward_hook(self._record)

    def _record(self, router, _inputs, output) -> None:
        if in_recompute():  # full / MoE recompute runs the router's forward again inside backward: count it once
            return
        layer = router.layer_number - 1  # Megatron numbers layers from 1 (global, across pipeline stages)
        routed = output[1].detach().sum(dim=0)
        if not self._on_device:  # the routers' device, found at the first call: no host sync per layer and call
            self.counts, self.calls, self._on_device = self.counts.to(routed.device), self.calls.to(routed.device), True
        self.counts[layer] += routed.to(torch.float64)
        self.calls[layer] += 1

    def reset(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        self.calls.zero_()
        clear_aux_losses_tracker()

    def metrics(self, tensor_parallel: int) -> dict[str, float]:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        aux = torch.zeros_like(self.calls)
        tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        if tracked is not None:
            values = tracked["values"].detach()[: aux.numel()]
            aux[: values.numel()] += values.to(aux.device, torch.float64)
        packed = _summed_over_job(torch.cat([self.counts.flatten(), self.calls, aux]))
        n_layers, n_experts = self.counts.shape
        counts = packed[: n_layers * n_experts].view(n_layers, n_experts) / tensor_parallel
        calls = packed[n_layers * n_experts: n_layers * (n_experts + 1)]
        aux = packed[n_layers * (n_experts + 1):]
        routed = counts.sum(dim=1) > 0
        if not routed.any():
            return {}
        ratio = counts[routed].max(dim=1).values / counts[routed].mean(dim=1)
        out = {"moe/load_max_over_mean": float(ratio.mean()), "moe/load_max_over_mean_worst": float(ratio.max()),
               "moe/tokens_per_expert_mean": float(counts[routed].mean())}
        if bool((aux != 0).any()):
            out["moe/aux_loss"] = float((aux[routed] / calls[routed].clamp(min=1)).mean())
        return out


class RouterReplay:
    """Rollout routing replay (R3) in the actor's forward passes, and the routing-mismatch count.

    ``begin(routes, known)`` before a micro-batch's forward: with replay on, each MoE layer's router is told
    (Megatron's ``RouterReplay``, ``REPLAY_FORWARD``) to use the engine's experts for every token; it still computes
    its logits and takes the gates from them on those experts (softmax over the replayed logits with
    ``norm_topk_prob``), so the router keeps its gradient. Either way a forward hook compares the experts each
    router used with the engine's on the tokens the engine recorded (``known``): `mismatch` is the fraction of
    (token, layer) pairs whose top-k sets differ (0 with replay on, by construction; what replay removes, off).
    Token order is Megatron's: the router sees ``[seq, batch]`` flattened sequence-major.

    Recompute (``model.recompute`` selective or full): a recomputed forward runs in the backward pass, after later
    micro-batches' forwards under a pipeline schedule. Each router keeps the routes of every micro-batch of the call
    in forward order (Megatron's ``replay_backward_list``), and a pre-hook switches it to ``REPLAY_BACKWARD`` while
    autograd runs a backward, which takes them in the same order (1F1B runs backwards in forward order, per model
    chunk), so the recomputed forward routes each micro-batch as its forward did. `end` drops them after the call.
    """

    def __init__(self, chunks: list, moe_layers: tuple[int, ...], replay: bool, sequence_parallel: bool = False):
        from megatron.core.transformer.moe.router import TopKRouter

        self.replay = replay
        self.sequence_parallel = sequence_parallel
        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self.ordinal = {id(r): moe_layers.index(r.layer_number - 1) for r in self.routers}
        if replay and any(r.router_replay is None for r in self.routers):
            raise RuntimeError("router replay needs the model built with moe_enable_routing_replay=True.")
        self.current: tuple[Tensor, Tensor] | None = None
        self.differ = self.counted = 0.0
        for router in self.routers:
            router.register_forward_pre_hook(self._direction)
            router.register_forward_hook(self._compare)

    def _tokens_major(self, t: Tensor) -> Tensor:
        """[B, S, ...] -> Megatron's router order [S * B, ...] (this TP rank's sequence shard under SP)."""
        t = t.transpose(0, 1)
        if self.sequence_parallel:
            from megatron.core import parallel_state as ps

            size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            t = t.chunk(size, dim=0)[rank]
        return t.reshape(-1, *t.shape[2:])

    def begin(self, routes: Tensor | None, known: Tensor | None) -> None:
        """Before a micro-batch's forward: its routes (appended to each router's list for a recompute)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.current = None if routes is None else (self._tokens_major(routes), self._tokens_major(known))
        for router in self.routers:
            rr = router.router_replay
            if rr is None:
                continue
            if self.replay and self.current is not None:
                rr.set_target_indices(self.current[0][:, self.ordinal[id(router)]].contiguous())
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                rr.clear_router_replay_action()

    def end(self) -> None:
        """After a forward-backward call: no routes left for the next one."""
        self.current = None
        for router in self.routers:
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def _direction(self, router, _inputs) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        rr = router.router_replay
        if rr is None or rr.router_replay_action is None:
            return
        rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD if in_recompute()
                                    else RouterReplayAction.REPLAY_FORWARD)

    def _compare(self, router, _inputs, output) -> None:
        if self.current is None or in_recompute():
            return
        routes, known = self.current
        used = output[1].detach().cpu()
        engine = torch.zeros_like(used).scatter(1, routes[:, self.ordinal[id(router)]].cpu(), True)
        differ = (used != engine).any(dim=1) & known.cpu()
        self.differ += float(differ.sum())
        self.counted += float(known.sum())

    def reset(self) -> None:
        self.differ = self.counted = 0.0

    def mismatch(self) -> float | None:
        """Fraction of recorded (token, MoE layer) pairs routed to another top-k set than the engine's, over the
        job (a collective); None when nothing was recorded."""
        packed = _summed_over_job(torch.tensor([self.differ, self.counted], dtype=torch.float64))
        return None if packed[1] == 0 else float(packed[0] / packed[1])


def _summed_over_job(packed: Tensor) -> Tensor:
    """``packed`` summed over the default group, on the host: moved onto the group's collective device (CUDA under
    NCCL), all-reduced there and read back once (one host sync); itself on one process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return packed.cpu()
    from dapo_mcore.collectives.device import collective_device

    device = collective_device()
    on_device = device.to(packed)
    dist.all_reduce(on_device)
    return device.host(on_device)
