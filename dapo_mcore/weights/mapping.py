"""Generic HF <-> Megatron mapping engine: a declarative table of `TensorRule`s, placed on a `ParallelLayout`.

A model family (e.g. `qwen2.py`) supplies the table and its geometry; this module turns it into
`Placement`s: every Megatron tensor of the whole model, with the pipeline rank / virtual chunk that owns it,
its key in that chunk's state dict, the HF tensors it is made from, and the transform between them.
Everything downstream (file conversion, loading HF into a live model, streaming export) walks placements.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from dapo_mcore.weights import transforms
from dapo_mcore.weights.layout import ParallelLayout
from dapo_mcore.weights.transforms import Geometry, Split, TensorSource


class Scope(StrEnum):
    LAYER = "layer"   # once per transformer layer; names use {i} (HF: global index, Megatron: local index)
    FIRST = "first"   # in the chunk with pre_process (embedding)
    LAST = "last"     # in the chunk with post_process (final norm, output layer)


@dataclass(frozen=True)
class TensorRule:
    """One Megatron tensor and the HF tensor(s) it is made of."""

    local: str
    """Megatron state-dict name with the `local` layer spec."""
    te: str
    """Megatron state-dict name with the `transformer_engine` layer spec."""
    hf: tuple[str, ...]
    """HF names (fused in this order by `split`)."""
    kinds: tuple[str, ...]
    """Shape kind of each HF tensor (see `ModelMapping.HF_SHAPE_KINDS`)."""
    split: Split
    scope: Scope
    tied_output: bool = False
    """The output layer: with tied embeddings it is a copy of the embedding and absent from HF."""

    def mcore_name(self, layer_spec: str) -> str:
        return self.te if layer_spec == "transformer_engine" else self.local


@dataclass(frozen=True)
class Placement:
    """One Megatron tensor of the whole model, placed on the layout."""

    rule: TensorRule
    layer: int | None
    pp_rank: int
    vchunk: int
    key: str
    """Name inside the owning chunk's state dict (local layer index)."""
    hf_names: tuple[str, ...]
    exported: bool
    """False for the tied output layer, which HF does not store (it is the embedding)."""
    ep_rank: int | None = None
    """MoE experts: the expert-parallel rank that holds this expert (None: every expert-parallel rank)."""


class ModelMapping:
    """The mapping of one model (HF config + table) onto Megatron layouts."""

    def __init__(self, hf_config: dict[str, Any], rules: tuple[TensorRule, ...], *, num_layers: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int, ffn_hidden_size: int,
                 vocab_size: int, tie_embeddings: bool, padded_vocab_fn):
        self.hf_config = hf_config
        self.rules = rules
        self.num_layers, self.num_heads, self.num_kv_heads = num_layers, num_heads, num_kv_heads
        self.head_dim, self.hidden_size, self.ffn_hidden_size = head_dim, hidden_size, ffn_hidden_size
        self.vocab_size, self.tie_embeddings = vocab_size, tie_embeddings
        self._padded_vocab_fn = padded_vocab_fn

    # ---- layout-independent facts -------------------------------------------------------------------
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The expected HF state dict (as saved: no tied lm_head), name -> shape, in HF order."""
        out: dict[str, tuple[int, ...]] = {}
        for pl in self.placements(ParallelLayout()):
            if pl.exported:
                out.update(zip(pl.hf_names, self._hf_tensor_shapes(pl.rule), strict=True))
        return out

    def _hf_tensor_shapes(self, rule: TensorRule) -> list[tuple[int, ...]]:
        h, f, hd = self.hidden_size, self.ffn_hidden_size, self.head_dim
        table = {
            "embed": (self.vocab_size, h), "norm": (h,), "o": (h, self.num_heads * hd), "down": (h, f),
            "q": (self.num_heads * hd, h), "kv": (self.num_kv_heads * hd, h), "gate_up": (f, h),
            "q_bias": (self.num_heads * hd,), "kv_bias": (self.num_kv_heads * hd,), "head_norm": (hd,),
        }
        return [table[k] for k in rule.kinds]

    def geometry(self, layout: ParallelLayout) -> Geometry:
        return Geometry(self.num_heads, self.num_kv_heads, self.head_dim, self.vocab_size,
                        self.padded_vocab_size(layout))

    def padded_vocab_size(self, layout: ParallelLayout) -> int:
        return self._padded_vocab_fn(self.vocab_size, layout.make_vocab_size_divisible_by, layout.tp,
                                     layout.vocab_padding)

    def check_layout(self, layout: ParallelLayout) -> None:
        layout.check_model(num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           ffn_hidden_size=self.ffn_hidden_size)

    # ---- placement ----------------------------------------------------------------------------------
    def placements(self, layout: ParallelLayout) -> list[Placement]:
        """Every Megatron tensor of the model, in HF order (embedding, layers 0.., final norm, output)."""
        out: list[Placement] = []
        first, last = layout.first_chunk, layout.last_chunk
        for rule in (r for r in self.rules if r.scope is Scope.FIRST):
            out.append(self._place(rule, None, *first, layout))
        for layer in range(self.num_layers):
            pp_rank, vchunk, local = layout.locate_layer(self.num_layers, layer)
            out.extend(self.layer_placements(layer, pp_rank, vchunk, layout, local))
        for rule in (r for r in self.rules if r.scope is Scope.LAST):
            if rule.tied_output and self.tie_embeddings and first == last:
                continue  # Megatron shares the embedding tensor itself; no separate output weight exists
            out.append(self._place(rule, None, *last, layout))
        return out

    def layer_placements(self, layer: int, pp_rank: int, vchunk: int, layout: ParallelLayout,
                         local: int) -> list[Placement]:
        """The tensors of one transformer layer (every LAYER rule; an MoE family overrides this)."""
        return [self._place(rule, layer, pp_rank, vchunk, layout, local)
                for rule in self.rules if rule.scope is Scope.LAYER]

    def _place(self, rule: TensorRule, layer: int | None, pp_rank: int, vchunk: int, layout: ParallelLayout,
               local: int | None = None) -> Placement:
        key = rule.mcore_name(layout.layer_spec)
        hf_names = rule.hf
        if layer is not None:
            key = key.format(i=local)
            hf_names = tuple(n.format(i=layer) for n in hf_names)
        if rule.tied_output and self.tie_embeddings:
            embed = next(r for r in self.rules if r.scope is Scope.FIRST)
            return Placement(rule, layer, pp_rank, vchunk, key, embed.hf, exported=False)
        return Placement(rule, layer, pp_rank, vchunk, key, hf_names, exported=True)

    def rank_placements(self, layout: ParallelLayout, pp_rank: int,
                        ep_rank: int = 0) -> list[tuple[str, Placement]]:
        """(key in the rank file, placement) for one pipeline (and expert-parallel) rank, chunk by chunk in
        Megatron order."""
        mine = [p for p in self.placements(layout) if p.pp_rank == pp_rank and p.ep_rank in (None, ep_rank)]
        mine.sort(key=lambda p: p.vchunk)  # stable: keeps HF order within a chunk
        return [(layout.chunk_prefix(p.vchunk) + p.key, p) for p in mine]

    @staticmethod
    def split_size(pl: Placement, layout: ParallelLayout) -> int:
        """How many ranks split `pl`: the expert-TP size for an MoE expert's tensors, the TP size for the rest."""
        return layout.expert_tp if pl.ep_rank is not None else layout.tp

    @staticmethod
    def split_rank(pl: Placement, layout: ParallelLayout, tp_rank: int) -> int:
        """The shard of `pl` that the process at TP rank `tp_rank` holds (its expert-TP rank for an expert)."""
        return layout.expert_tp_rank(tp_rank) if pl.ep_rank is not None else tp_rank

    def rank_shape(self, pl: Placement, layout: ParallelLayout) -> tuple[int, ...]:
        return transforms.rank_shape(pl.rule.split, self._hf_tensor_shapes(pl.rule), self.split_size(pl, layout),
                                     self.geometry(layout))

    # ---- transforms ---------------------------------------------------------------------------------
    def shard(self, pl: Placement, source: TensorSource, layout: ParallelLayout, tp_rank: int) -> torch.Tensor:
        """The Megatron tensor for `pl` of the process at TP rank `tp_rank`, read from HF tensors."""
        return transforms.shard(pl.rule.split, source, pl.hf_names, self.split_size(pl, layout),
                                self.split_rank(pl, layout, tp_rank), self.geometry(layout))

    def shard_extents(self, pl: Placement, layout: ParallelLayout, tp_rank: int,
                      itemsize: int) -> list[transforms.Extent]:
        """The Megatron tensor for `pl` of TP rank `tp_rank` as byte ranges of `pl.hf_names` (`transforms.Extent`)."""
        return transforms.shard_extents(pl.rule.split, self._hf_tensor_shapes(pl.rule), itemsize,
                                        self.split_size(pl, layout), self.split_rank(pl, layout, tp_rank),
                                        self.geometry(layout))

    def merge(self, pl: Placement, parts: list[torch.Tensor],
              layout: ParallelLayout) -> list[tuple[str, torch.Tensor]]:
        """All shards of `pl` (`split_size` of them, in shard order) -> HF (name, tensor) pairs; nothing for the
        tied output layer."""
        if not pl.exported:
            return []
        return transforms.merge(pl.rule.split, parts, pl.hf_names, self.geometry(layout))

    def hf_output_shapes(self, pl: Placement) -> list[tuple[str, tuple[int, ...]]]:
        if not pl.exported:
            return []
        return list(zip(pl.hf_names, self._hf_tensor_shapes(pl.rule), strict=True))
