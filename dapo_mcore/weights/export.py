"""Streaming export of a LIVE Megatron model as full Hugging Face tensors, in size-bounded buckets.

`iter_hf_weights` is a collective: every rank of the job iterates it, and every rank receives every bucket.
For each Megatron tensor, the pipeline stage that owns it gathers the TP shards within its tensor-parallel group
into HF tensors (QKV split per group, gate/up split, vocab padding stripped; on gloo straight into their final
rows, see `export_plan`), then broadcasts them from that stage to the rest of its pipeline-parallel group.
Data-parallel replicas do the same independently. The rollout weight sync feeds these buckets to the inference engine's ``update_weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.collectives.device import collective_device
from dapo_mcore.model.lora.attach import adapted_layers
from dapo_mcore.weights.export_plan import CopyPlan, column_block, copy_plan, copy_runs
from dapo_mcore.weights.layout import ParallelLayout
from dapo_mcore.weights.live import live_ep_rank, live_layout, live_tensors, plain_tensor
from dapo_mcore.weights.mapping import ModelMapping, Placement
from dapo_mcore.weights.registry import get_mapping
from dapo_mcore.weights.transforms import Geometry, Split

log = logging.getLogger(__name__)

Bucket = list[tuple[str, torch.Tensor]]


def bucketed(tensors: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[Bucket]:
    """``(name, tensor)`` pairs in order, in buckets of at most ``limit`` bytes (one tensor may exceed it alone)."""
    bucket: Bucket = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def iter_hf_weights(model_chunks: list, hf_config: dict[str, Any], *, layer_spec: str = "local",
                    bucket_bytes: int = 256 << 20) -> Iterator[Bucket]:
    """Yield lists of (HF name, full tensor) in HF order; a bucket exceeds `bucket_bytes` only when one tensor does.

    Tensors have the model's (nominal) dtype and are fresh copies (safe to keep) on the collective device (the model's
    GPU under NCCL); FP8 parameters are dequantized first. The tied output layer is not
    yielded (HF ties ``lm_head`` to ``model.embed_tokens.weight``).
    """
    from megatron.core import parallel_state as ps

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive.")
    mapping = get_mapping(hf_config)
    layout, _, pp_rank = live_layout(model_chunks, layer_spec, make_vocab_size_divisible_by=1)
    mapping.check_layout(layout)
    params = live_tensors(model_chunks, layout)
    placements = [pl for pl in mapping.placements(layout) if pl.exported]
    ep_rank = live_ep_rank(layout) or 0

    def held_here(pl: Placement) -> bool:  # this stage's tensors; of experts, only this expert-parallel rank's
        return pl.pp_rank == pp_rank and pl.ep_rank in (None, ep_rank)

    missing = [layout.chunk_prefix(pl.vchunk) + pl.key for pl in placements
               if held_here(pl) and layout.chunk_prefix(pl.vchunk) + pl.key not in params]
    if missing:
        raise KeyError(f"the live model lacks {missing[:5]} ({len(missing)} missing); is layer_spec={layer_spec!r} "
                       "right and the model built from this hf_config?")
    dtype = next(iter(params.values())).dtype
    device = collective_device(ps.get_tensor_model_parallel_group())  # every group here is NCCL on a GPU, or none is
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if layout.pp > 1 else [dist.get_rank()]

    ep_group = ps.get_expert_model_parallel_group() if layout.ep > 1 else None
    ep_ranks = dist.get_process_group_ranks(ep_group) if ep_group is not None else []
    deltas = {layout.chunk_prefix(a.chunk) + a.weight_key: a.adapter for a in adapted_layers(model_chunks)}
    exporter = _Exporter(mapping, layout, params, tp_group, device, deltas)
    owned = iter([pl for pl in placements if held_here(pl)])
    # One placement ahead: its TP transfers are in flight while this one is finished and while the consumer
    # sends or loads the bucket just yielded (the generator is suspended at ``yield``, the collectives are not).
    inflight = exporter.start(next(owned, None))

    def in_order() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal inflight
        for pl in placements:
            if held_here(pl):
                current, inflight = inflight, exporter.start(next(owned, None))
                tensors = exporter.finish(current)
            else:
                tensors = [(n, device.empty(tuple(s), dtype)) for n, s in mapping.hf_output_shapes(pl)]
            for name, tensor in tensors:
                if ep_group is not None and pl.ep_rank is not None and pl.pp_rank == pp_rank:
                    dist.broadcast(tensor, src=ep_ranks[pl.ep_rank], group=ep_group)  # an expert: from its holder
                if layout.pp > 1:
                    dist.broadcast(tensor, src=pp_ranks[pl.pp_rank], group=pp_group)
                yield name, tensor

    try:
        yield from bucketed(in_order(), bucket_bytes)
    finally:
        if inflight is not None:  # a consumer that stopped early: complete the collectives this rank started
            for work in inflight.works:
                work.wait()


@dataclass
class InFlight:
    """One placement whose TP transfers were issued: wait for ``works``, then finish it."""

    pl: Placement
    outs: list[torch.Tensor]
    """The HF tensors (copy plan), or the gathered buffer (all-gather path)."""
    works: list
    columns: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(column block of the HF tensor, staging buffer received for it): ROW split, copied on finish."""


class _Exporter:
    """Starts and finishes the TP transfers of the placements of one export call.

    On gloo (and at TP=1) each HF tensor is built in its final buffer by the placement's copy plan
    (`export_plan`): this rank copies its own rows in, the other ranks' rows arrive by one broadcast per (rank,
    HF tensor) straight into their rows, so each byte is written once. Only ROW splits (column blocks) pass
    through a staging buffer, two of which are reused alternately (at most two placements are in flight).
    Broadcasts rather than gloo's all-gather, which stages the data through its own buffers and copies in and
    out; each root sends its slice to every other rank, so at large TP a ring all-gather would win again, but
    gloo runs on CPU, where TP stays small. NCCL: one ``all_gather_into_tensor`` per placement into a gathered
    buffer, merged by `merge_gathered` (a copy on the GPU is cheap next to the transfer).
    """

    def __init__(self, mapping: ModelMapping, layout: ParallelLayout, params: dict[str, torch.Tensor], tp_group,
                 device: Any, deltas: dict[str, Any] | None = None):
        self.mapping, self.layout, self.params, self.group = mapping, layout, params, tp_group
        self.deltas = deltas or {}
        """LoRA: the adapter of each adapted weight's key; its shard is merged before it is sent."""
        self.device = device
        """The collective device: the parameters are on it already on a GPU (``to`` is then no copy)."""
        self.geo = mapping.geometry(layout)
        self.by_plan = layout.tp == 1 or dist.get_backend(tp_group) == "gloo"
        self.ranks = dist.get_process_group_ranks(tp_group) if layout.tp > 1 else [dist.get_rank()]
        self.me = self.ranks.index(dist.get_rank())
        self._staging: list[torch.Tensor | None] = [None, None]
        self._slot = 0

    def start(self, pl: Placement | None) -> InFlight | None:
        """Issue ``pl``'s transfers without waiting for them (None when there is no placement)."""
        if pl is None:
            return None
        key = self.layout.chunk_prefix(pl.vchunk) + pl.key
        local = plain_tensor(self.params[key]).detach()
        adapter = self.deltas.get(key)
        if adapter is not None:  # LoRA: this rank's shard of W + scale * B @ A, merged here (no whole matrix)
            local = (local.float() + adapter.delta().to(local.device)).to(local.dtype)
        local = self.device.to(local.contiguous())
        if not self.by_plan:
            flat = self.device.empty((self.layout.tp * local.shape[0], *local.shape[1:]), local.dtype)
            return InFlight(pl, [flat], [dist.all_gather_into_tensor(flat, local, group=self.group, async_op=True)])
        shapes = tuple(s for _, s in self.mapping.hf_output_shapes(pl))
        geo = self.geo
        if pl.rule.split is Split.VOCAB:  # the live padding (the layout here says divisible by 1)
            geo = replace(geo, padded_vocab_size=local.shape[0] * self.layout.tp)
        plan = copy_plan(pl.rule.split, shapes, self.layout.tp, geo)
        outs = [self.device.empty(tuple(s), local.dtype) for s in plan.shapes]
        job = InFlight(pl, outs, [])
        if plan.columns:
            self._start_columns(plan, local, job)
        else:
            self._start_rows(plan, local, job)
        return job

    def _start_rows(self, plan: CopyPlan, local: torch.Tensor, job: InFlight) -> None:
        copied = False
        for send in plan.sends:
            if send.rank == self.me and send.src < 0 and not copied:  # rows not contiguous here: place them first
                copy_runs(plan, self.me, local, job.outs)
                copied = True
            if plan.tp == 1:
                continue
            if send.rank == self.me and send.src >= 0:
                data = local[send.src:send.src + send.rows]
            else:
                data = job.outs[send.out][send.dst:send.dst + send.rows]
            job.works.append(dist.broadcast(data, src=self.ranks[send.rank], group=self.group, async_op=True))
        if not copied:  # this rank's own rows, copied while its transfers run
            copy_runs(plan, self.me, local, job.outs)

    def _start_columns(self, plan: CopyPlan, local: torch.Tensor, job: InFlight) -> None:
        staging = self._stage(local, plan.tp - 1) if plan.tp > 1 else None
        others = iter(range(plan.tp - 1))
        for send in plan.sends:
            if send.rank == self.me:
                if plan.tp > 1:
                    job.works.append(dist.broadcast(local, src=self.ranks[send.rank], group=self.group,
                                                    async_op=True))
                continue
            buf = staging[next(others)]
            job.works.append(dist.broadcast(buf, src=self.ranks[send.rank], group=self.group, async_op=True))
            job.columns.append((column_block(job.outs[0], plan.tp, send.rank), buf))
        copy_runs(plan, self.me, local, job.outs)

    def _stage(self, like: torch.Tensor, count: int) -> torch.Tensor:
        """``count`` receive buffers shaped like ``like``, from the staging slot not used by the last call."""
        slot, self._slot = self._slot, 1 - self._slot
        need = count * like.numel()
        buf = self._staging[slot]
        if buf is None or buf.numel() < need or buf.dtype != like.dtype:
            buf = self._staging[slot] = self.device.empty(need, like.dtype)
        return buf[:need].view(count, *like.shape)

    def finish(self, job: InFlight) -> Bucket:
        """Wait for ``job``'s transfers and return its HF (name, tensor) pairs."""
        for work in job.works:
            work.wait()
        if not self.by_plan:
            merged = merge_gathered(job.pl.rule.split, job.outs[0], self.layout.tp, job.pl.hf_names, self.geo)
            return [(n, self.device.to(t.contiguous())) for n, t in merged]  # (on the device already: no copy)
        for block, buf in job.columns:
            block.copy_(buf)
        return list(zip(job.pl.hf_names, job.outs, strict=True))


def merge_gathered(split: Split, flat: torch.Tensor, tp: int, names: tuple[str, ...],
                   geo: Geometry) -> Bucket:
    """`transforms.merge` on all TP ranks' tensors stacked along dim 0 in one buffer, with the fewest copies.

    Same result as ``transforms.merge(split, list(flat.chunk(tp)), names, geo)``, but each HF tensor costs at
    most one copy (``cat`` after ``reshape`` costs two for q/k/v), and the vocabulary (the largest tensors) and
    the replicated norms none: they are contiguous row ranges of ``flat``, returned as views of it.
    """
    if split is Split.REPLICATED:
        return [(names[0], flat[: flat.shape[0] // tp])]
    if split is Split.VOCAB:
        return [(names[0], flat[: geo.vocab_size])]
    rest = tuple(flat.shape[1:])
    if split is Split.ROW:  # [tp * rows, cols / tp] -> [rows, cols]: rank r's columns are block r
        rows = flat.shape[0] // tp
        return [(names[0], flat.view(tp, rows, -1).transpose(0, 1).reshape(rows, -1))]
    if split is Split.GATE_UP:  # rank r holds [gate_r; up_r]
        halves = flat.view(tp, 2, -1, *rest)
        return [(names[0], halves[:, 0].reshape(-1, *rest)), (names[1], halves[:, 1].reshape(-1, *rest))]
    if split is Split.QKV:  # ranks hold whole query groups [q heads; k; v], in rank order = global group order
        q_rows, kv_rows = geo.heads_per_group * geo.head_dim, geo.head_dim
        groups = flat.view(-1, q_rows + 2 * kv_rows, *rest)
        q, k, v = groups.split([q_rows, kv_rows, kv_rows], dim=1)
        return [(n, t.reshape(-1, *rest)) for n, t in zip(names, (q, k, v), strict=True)]
    raise AssertionError(split)
