"""Streaming export of a LIVE Megatron model as full Hugging Face tensors, in size-bounded buckets.

`iter_hf_weights` is a collective: every rank of the job iterates it, and every rank receives every bucket.
For each Megatron tensor, the pipeline stage that owns it all-gathers the TP shards within its tensor-parallel
group, merges them into HF tensors (QKV split per group, gate/up split, vocab padding stripped), then broadcasts
them from that stage to the rest of its pipeline-parallel group. Data-parallel replicas do the same
independently. The rollout weight sync feeds these buckets to the inference engine's ``update_weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.weights.live import live_layout, live_tensors, plain_tensor
from dapo_mcore.weights.mapping import Placement
from dapo_mcore.weights.registry import get_mapping
from dapo_mcore.weights.transforms import Geometry, Split

log = logging.getLogger(__name__)

Bucket = list[tuple[str, torch.Tensor]]


def iter_hf_weights(model_chunks: list, hf_config: dict[str, Any], *, layer_spec: str = "local",
                    bucket_bytes: int = 256 << 20) -> Iterator[Bucket]:
    """Yield lists of (HF name, full tensor) in HF order; a bucket exceeds `bucket_bytes` only when one tensor does.

    Tensors have the model's (nominal) dtype and device and are fresh copies (safe to keep); FP8 parameters are
    dequantized first. The tied output layer is not
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
    missing = [layout.chunk_prefix(pl.vchunk) + pl.key for pl in placements
               if pl.pp_rank == pp_rank and layout.chunk_prefix(pl.vchunk) + pl.key not in params]
    if missing:
        raise KeyError(f"the live model lacks {missing[:5]} ({len(missing)} missing); is layer_spec={layer_spec!r} "
                       "right and the model built from this hf_config?")
    first = next(iter(params.values()))
    dtype, device = first.dtype, first.device
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if layout.pp > 1 else [dist.get_rank()]

    owned = iter([pl for pl in placements if pl.pp_rank == pp_rank])
    # One placement ahead: its TP gather is in flight while this one is merged and while the consumer sends or
    # loads the bucket just yielded (the generator is suspended at ``yield``, the collective is not).
    inflight = _start_gather(next(owned, None), params, layout, tp_group)
    bucket: Bucket = []
    size = 0
    try:
        for pl in placements:
            if pl.pp_rank == pp_rank:
                current, inflight = inflight, _start_gather(next(owned, None), params, layout, tp_group)
                tensors = _finish_and_merge(mapping, current, layout)
            else:
                tensors = [(n, torch.empty(s, dtype=dtype, device=device)) for n, s in mapping.hf_output_shapes(pl)]
            for name, tensor in tensors:
                if layout.pp > 1:
                    dist.broadcast(tensor, src=pp_ranks[pl.pp_rank], group=pp_group)
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((name, tensor))
                size += nbytes
        if bucket:
            yield bucket
    finally:
        if inflight is not None:  # a consumer that stopped early: complete the collective this rank started
            for work in inflight[2]:
                work.wait()


_InFlight = tuple  # (placement, local or gathered buffer, pending collective works)


def _start_gather(pl: Placement | None, params: dict[str, torch.Tensor], layout, tp_group) -> _InFlight | None:
    """Issue the TP all-gather of ``pl``'s parameter without waiting for it (None when there is no placement)."""
    if pl is None:
        return None
    local = plain_tensor(params[layout.chunk_prefix(pl.vchunk) + pl.key]).detach().contiguous()
    if layout.tp == 1:  # FP8 params (model.fp8.fp8_params) leave as bf16, dequantized above
        return pl, local, []
    flat, works = _gather_rows(local, layout.tp, tp_group)
    return pl, flat, works


def _finish_and_merge(mapping, inflight: _InFlight, layout) -> Bucket:
    pl, data, works = inflight
    for work in works:
        work.wait()
    if layout.tp == 1:
        merged = mapping.merge(pl, [data], layout)
        if pl.rule.split is Split.REPLICATED:
            merged = [(n, t.clone()) for n, t in merged]  # do not hand out the live parameter itself
        return [(n, t.contiguous()) for n, t in merged]
    merged = merge_gathered(pl.rule.split, data, layout.tp, pl.hf_names, mapping.geometry(layout))
    return [(n, t.contiguous()) for n, t in merged]


def _gather_rows(local: torch.Tensor, tp: int, group) -> tuple[torch.Tensor, list]:
    """All TP ranks' ``local`` tensors stacked on dim 0 (in rank order) in one fresh buffer, issued asynchronously:
    returns the buffer and the works to wait on before reading it.

    NCCL: ``all_gather_into_tensor``. gloo: one broadcast per rank into its slice of the buffer, because gloo's
    all-gather stages the data through its own buffers and copies in and out; at TP=2 on CPU the broadcasts move
    the same bytes about twice as fast (benchmarks/weight_sync.py). Each root sends its slice to every other
    rank, so at large TP an all-gather's ring would win again; gloo runs on CPU, where TP stays small.
    """
    rows = local.shape[0]
    flat = torch.empty((tp * rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
    if dist.get_backend(group) != "gloo":
        return flat, [dist.all_gather_into_tensor(flat, local, group=group, async_op=True)]
    me = dist.get_rank()
    works = []
    for r, src in enumerate(dist.get_process_group_ranks(group)):
        part = flat[r * rows:(r + 1) * rows]
        if src == me:
            part.copy_(local)
        works.append(dist.broadcast(part, src=src, group=group, async_op=True))
    return flat, works


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
