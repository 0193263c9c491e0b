"""Where each Megatron tensor lives: the TP/PP/VPP layout and the global-layer -> (pp rank, chunk, local) map.

The assignment of transformer layers to pipeline ranks and virtual chunks reproduces Megatron-Core's own
``get_transformer_layer_offset`` for even splits (no ``pipeline_model_parallel_layout`` and no uneven first/last
stages): chunk ``v`` of pipeline rank ``p`` holds global layers
``v * (L / vpp) + p * (L / (pp * vpp))`` onward, ``L / (pp * vpp)`` of them, numbered locally from 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_mcore.model.vocab import VOCAB_PADDINGS
from dapo_mcore.weights.errors import WeightsError

LAYER_SPECS = ("local", "transformer_engine")


class LayoutError(WeightsError):
    """A parallel layout that cannot hold the model (with the fix in the message)."""


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class ParallelLayout:
    """How one model is cut across tensor- and pipeline-parallel ranks."""

    tp: int = 1
    """Tensor-parallel size: heads, KV heads, FFN and the padded vocabulary are split this many ways."""
    pp: int = 1
    """Pipeline-parallel size: transformer layers are split into this many stages."""
    vpp: int = 1
    """Virtual pipeline chunks per pipeline rank (1 = no interleaving)."""
    layer_spec: str = "local"
    """Megatron layer spec naming: `local` (separate norms) or `transformer_engine` (norms fused into linears)."""
    make_vocab_size_divisible_by: int = 128
    """The divisor of the vocabulary padding rule `vocab_padding` (model.vocab.padded_vocab_size)."""
    vocab_padding: str = "megatron"
    """How the vocabulary is padded (model.vocab): `tp` (only as far as tensor parallelism needs; Megatron-Bridge's
    models) or `megatron` (a multiple of make_vocab_size_divisible_by * tp, Megatron-LM's rule). The dataclass default
    is `megatron`, the rule of every checkpoint written before the field existed; the trainer and the converter pass
    theirs (both default to `tp`)."""
    ep: int = 1
    """Expert-parallel size (MoE models): each layer's experts are split into this many equal groups."""
    etp: int | None = None
    """Expert-tensor-parallel size (MoE models): each expert is split this many ways; a divisor of `tp`. None = `tp`
    (Megatron's default, and every checkpoint written before the field existed)."""

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size (`etp`, or `tp` when unset)."""
        return self.tp if self.etp is None else self.etp

    def expert_tp_rank(self, tp_rank: int) -> int:
        """The expert-TP rank of the process at TP rank `tp_rank`: Megatron's expert grid puts expert-TP innermost,
        and with etp dividing tp that is the TP rank modulo etp."""
        return tp_rank % self.expert_tp

    def rank_files(self) -> list[tuple[int, int]]:
        """The (TP rank, EP rank) pairs of an MoE checkpoint's rank files on each pipeline stage: those some process
        holds (Megatron's expert grid: process q of a stage has TP rank q % tp and EP rank (q // etp) % ep). Every
        pair when etp = tp; with etp < tp fewer (tp=2, etp=1, ep=2: (0, 0) and (1, 1)), and together they hold
        every dense TP shard and every expert shard."""
        etp = self.expert_tp
        period = self.tp * self.ep  # q and q + tp*ep give the same pair
        return sorted({(q % self.tp, (q // etp) % self.ep) for q in range(period)})

    def file_with_tp(self, tp_rank: int) -> int:
        """An EP rank whose file holds the dense tensors of `tp_rank` (the first)."""
        return min(e for t, e in self.rank_files() if t == tp_rank)

    def file_with_expert_shard(self, ep_rank: int, etp_rank: int) -> int:
        """A TP rank whose file (with `ep_rank`) holds expert-TP shard `etp_rank` of that EP rank's experts."""
        return min(t for t, e in self.rank_files() if e == ep_rank and t % self.expert_tp == etp_rank)

    def validate(self) -> None:
        for name in ("tp", "pp", "vpp", "make_vocab_size_divisible_by", "ep", "expert_tp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.tp % self.expert_tp:
            raise LayoutError(f"expert tensor parallel {self.expert_tp} must divide tensor_parallel={self.tp}.")
        if self.layer_spec not in LAYER_SPECS:
            raise LayoutError(f"unknown layer_spec {self.layer_spec!r}; choose one of {', '.join(LAYER_SPECS)}.")
        if self.vocab_padding not in VOCAB_PADDINGS:
            raise LayoutError(f"unknown vocab_padding {self.vocab_padding!r}; choose one of {', '.join(VOCAB_PADDINGS)}.")

    def check_model(self, *, num_layers: int, num_heads: int, num_kv_heads: int, ffn_hidden_size: int) -> None:
        """Raise LayoutError naming the fix when this layout cannot split the model."""
        self.validate()
        if num_heads % self.tp:
            raise LayoutError(f"tensor_parallel={self.tp} does not divide num_attention_heads={num_heads}; "
                              f"use one of {_divisors(num_heads)}.")
        if num_kv_heads % self.tp and self.tp % num_kv_heads:
            ok = [d for d in range(1, num_heads + 1) if num_heads % d == 0 and (num_kv_heads % d == 0 or d % num_kv_heads == 0)]
            raise LayoutError(f"tensor_parallel={self.tp} must divide num_key_value_heads={num_kv_heads} or be a "
                              f"multiple of it (Megatron-Core splits or all-gathers the query groups); use one of "
                              f"{', '.join(map(str, ok))}.")
        if ffn_hidden_size % self.tp:
            raise LayoutError(f"tensor_parallel={self.tp} does not divide intermediate_size={ffn_hidden_size}.")
        if num_layers % (self.pp * self.vpp):
            raise LayoutError(f"pipeline_parallel={self.pp} x virtual_pipeline={self.vpp} does not divide "
                              f"num_hidden_layers={num_layers}; pp*vpp must be one of {_divisors(num_layers)}.")

    def layers_per_chunk(self, num_layers: int) -> int:
        return num_layers // (self.pp * self.vpp)

    def chunk_first_layer(self, num_layers: int, pp_rank: int, vchunk: int) -> int:
        """Global index of the first layer in chunk `vchunk` of pipeline rank `pp_rank` (Megatron's offset)."""
        return vchunk * (num_layers // self.vpp) + pp_rank * self.layers_per_chunk(num_layers)

    def locate_layer(self, num_layers: int, layer: int) -> tuple[int, int, int]:
        """Global layer -> (pp rank, virtual chunk, local index within that chunk)."""
        per_chunk = self.layers_per_chunk(num_layers)
        vchunk, rest = divmod(layer, num_layers // self.vpp)
        pp_rank, local = divmod(rest, per_chunk)
        return pp_rank, vchunk, local

    @property
    def first_chunk(self) -> tuple[int, int]:
        """(pp rank, chunk) holding the embedding (Megatron's pre_process)."""
        return 0, 0

    @property
    def last_chunk(self) -> tuple[int, int]:
        """(pp rank, chunk) holding the final norm and output layer (Megatron's post_process)."""
        return self.pp - 1, self.vpp - 1

    def chunk_prefix(self, vchunk: int) -> str:
        """Key prefix of a chunk's tensors in a rank file: ``chunk{v}.`` when interleaved, else nothing."""
        return f"chunk{vchunk}." if self.vpp > 1 else ""

    def as_dict(self) -> dict:
        out = dict(tp=self.tp, pp=self.pp, vpp=self.vpp, layer_spec=self.layer_spec,
                   make_vocab_size_divisible_by=self.make_vocab_size_divisible_by, vocab_padding=self.vocab_padding)
        if self.ep > 1:  # dense checkpoints' metadata stay as they were
            out["ep"] = self.ep
        if self.etp is not None and self.etp != self.tp:  # as were those of expert-TP = TP
            out["etp"] = self.etp
        return out
