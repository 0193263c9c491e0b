"""Read one rank's tensors of a canonical checkpoint at ANOTHER layout (elastic resume).

A canonical checkpoint (``weights.checkpoint``) saved at TP/PP/VPP = (a, b, c) is read by a rank of a model laid
out at (x, y, z): every tensor that rank owns is rebuilt through Hugging Face names, exactly as a round trip
through ``convert mcore-to-hf`` and ``hf-to-mcore`` would, but in memory and one Megatron tensor at a time:
the source TP shards are merged (``mapping.merge``) into full HF tensors, and the target shard is cut from them
(``mapping.shard``). Both steps only move elements (concatenate, slice, regroup QKV, strip and re-add vocabulary
padding), so the result is bit-identical to the source values.

The same path serves any per-parameter tensor stored in the canonical format: Adam's ``exp_avg`` and
``exp_avg_sq`` and fp32 main parameters have the parameter's shape and split, so they reshard the same way.
Padded vocabulary rows come back as zeros (the value they hold at the start and keep: no token reaches them).
"""

from __future__ import annotations

import torch

from dapo_mcore.weights import checkpoint as ckpt
from dapo_mcore.weights.layout import ParallelLayout
from dapo_mcore.weights.mapping import ModelMapping, Placement


class CanonicalSource:
    """A `transforms.TensorSource` of full HF tensors, merged on demand from a canonical checkpoint's rank files.

    Keeps the HF tensors of the last merged Megatron tensor only (q, k and v of one fused QKV are read in a row),
    so memory stays bounded by one full tensor.
    """

    def __init__(self, directory, meta: ckpt.CheckpointMeta, mapping: ModelMapping):
        self.dir, self.layout, self.mapping = directory, meta.layout, mapping
        self._owner: dict[str, Placement] = {}
        for pl in mapping.placements(meta.layout):
            if pl.exported:  # the tied output layer is a copy of the embedding: read the embedding
                for name in pl.hf_names:
                    self._owner[name] = pl
        self._cached: tuple[Placement | None, dict[str, torch.Tensor]] = (None, {})

    def _full(self, name: str) -> torch.Tensor:
        pl = self._owner[name]
        if self._cached[0] is not pl:
            key = self.layout.chunk_prefix(pl.vchunk) + pl.key
            files = [self._file(pl, shard) for shard in range(self.mapping.split_size(pl, self.layout))]
            parts = [ckpt.read_rank_tensor(self.dir, t, pl.pp_rank, key, ep) for t, ep in files]
            self._cached = (pl, dict(self.mapping.merge(pl, parts, self.layout)))
        return self._cached[1][name]

    def _file(self, pl: Placement, shard: int) -> tuple[int, int | None]:
        """(TP rank, EP rank or None) of a rank file holding shard `shard` of `pl`: with EP, a dense tensor is in
        every file of its TP rank and an expert's shard in the files of its EP rank (``ParallelLayout.rank_files``)."""
        layout = self.layout
        if layout.ep == 1:
            return shard, None
        if pl.ep_rank is None:
            return shard, layout.file_with_tp(shard)
        return layout.file_with_expert_shard(pl.ep_rank, shard), pl.ep_rank

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._full(name).shape)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self._full(name)
        if dim is None:
            return t.clone()
        return t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start).clone()


def read_rank_resharded(directory, target: ParallelLayout, tp_rank: int, pp_rank: int,
                        ep_rank: int | None = None) -> dict[str, torch.Tensor]:
    """Rank (tp_rank, pp_rank[, ep_rank])'s state dict at layout `target`, from a canonical checkpoint of any
    layout (an MoE checkpoint's experts move between expert-parallel ranks the same way).

    Keys are those of the target rank file (chunk prefix when target.vpp > 1, names of target.layer_spec).
    """
    directory = ckpt.resolve_checkpoint_dir(directory)
    meta = ckpt.read_meta(directory)
    from dapo_mcore.weights.registry import get_mapping

    mapping = get_mapping(meta.hf_config)
    mapping.check_layout(target)
    if _same_files(meta.layout, target):
        return ckpt.read_megatron_rank(directory, tp_rank, pp_rank, ep_rank)
    source = CanonicalSource(directory, meta, mapping)
    return {key: mapping.shard(pl, source, target, tp_rank).contiguous()
            for key, pl in mapping.rank_placements(target, pp_rank, ep_rank or 0)}


def _same_files(a: ParallelLayout, b: ParallelLayout) -> bool:
    return a.as_dict() == b.as_dict()
