"""One LoRA adapter on one Megatron tensor-parallel linear layer, sharded like the layer it adapts.

Column-parallel layers (``linear_qkv``, ``linear_fc1``: the output rows are split over TP ranks) get
``A [r, in]`` replicated and ``B [out / TP, r]`` split along the output exactly like the base weight (same rows,
same per-rank interleaving of the fused q/k/v groups and of ``[gate_r; up_r]``), so ``B_local @ A`` is this rank's
rows of the update. Row-parallel layers (``linear_proj``, ``linear_fc2``: the input columns are split) get
``A [r, in / TP]`` split along the input like the base weight and ``B [out, r]`` replicated.

Only rank-r activations cross ranks. Let ``x`` be the layer's input as this rank sees it and ``H = x @ A^T``:

* column, no sequence parallelism: every rank's ``x`` is the whole input, so ``H`` is too; its gradient is
  partial per rank (each sees ``dY`` of its rows only), summed by ``copy_to_tensor_model_parallel_region`` in the
  backward; ``dA`` and the input's gradient from the adapter are then whole on every rank.
* column, sequence parallelism: ``x`` is this rank's sequence chunk: ``H`` is all-gathered along the sequence (its
  backward reduce-scatters); ``dA`` is a sum over sequence chunks, so ``A`` enters through the copy region
  (backward: all-reduce over TP).
* row, no sequence parallelism: ``H`` is partial (this rank's input columns) and all-reduced like the base output;
  ``dB`` is whole on every rank (``dY`` is replicated).
* row, sequence parallelism: ``H`` is reduce-scattered along the sequence like the base output; ``dB`` is a sum
  over sequence chunks (``B`` through the copy region).
* experts (Megatron's explicit expert communication: the token dispatcher gathers the input and sums the outputs
  and input gradients over expert-TP ranks): column ``H`` is whole, ``dA`` partial (``A`` through the copy
  region); row ``H @ B^T`` is this rank's partial output, summed by the dispatcher, ``dB`` partial (``B`` through
  the copy region).

At TP = 1 every region is the identity. Megatron's own ``tensor_parallel.mappings`` do every transfer, on the
layer's own group (the expert-TP group for experts).
"""

from __future__ import annotations

import math
import zlib

import torch


class LoRAAdapter(torch.nn.Module):
    """``scale * dropout(x) @ A^T @ B^T`` for one column- or row-parallel layer, this rank's shards."""

    def __init__(self, *, parallel: str, in_features: int, out_features: int, rank: int, scale: float,
                 dropout: float, tp_group, tp_size: int, tp_rank: int, sequence_parallel: bool, explicit_comm: bool,
                 allreduce: bool, dtype: torch.dtype, device: torch.device, init_key: str, seed: int = 0):
        super().__init__()
        assert parallel in ("column", "row"), parallel
        self.parallel, self.rank, self.scale = parallel, rank, scale
        self.group, self.tp_size = tp_group, tp_size
        self.sequence_parallel = sequence_parallel and tp_size > 1 and not explicit_comm
        self.explicit_comm = explicit_comm
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        # in_features / out_features: this rank's shapes of the base weight [out, in]
        global_in = in_features * (tp_size if parallel == "row" else 1)
        a = _init_a(rank, global_in, init_key, seed)
        if parallel == "row":
            a = a[:, tp_rank * in_features:(tp_rank + 1) * in_features]
        self.a = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.b = torch.nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))
        # Megatron's checks (clip_grads, distributed optimizer) count a parameter once per TP group unless it is
        # split over TP: B of a column layer and A of a row layer are, like their base weight.
        split = self.b if parallel == "column" else self.a
        split.tensor_model_parallel = True
        split.partition_dim = 0 if parallel == "column" else 1
        split.partition_stride = 1
        for p in (self.a, self.b):
            # Megatron's DDP reduces a parameter with allreduce=False (an expert's, with expert parallelism) over
            # the expert-data-parallel group: the adapter's follow the base weight's.
            p.allreduce = allreduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings as mp

        if self.dropout is not None:
            x = self._dropout(x)
        a, b, g = self.a, self.b, self.group
        if self.parallel == "column":
            if self.explicit_comm:
                h = x @ mp.copy_to_tensor_model_parallel_region(a, group=g).t()
            elif self.sequence_parallel:
                h = mp.gather_from_sequence_parallel_region(
                    x @ mp.copy_to_tensor_model_parallel_region(a, group=g).t(), group=g)
            else:
                h = mp.copy_to_tensor_model_parallel_region(x @ a.t(), group=g)
            return (h @ b.t()) * self.scale
        partial = x @ a.t()
        if self.explicit_comm:
            return (partial @ mp.copy_to_tensor_model_parallel_region(b, group=g).t()) * self.scale
        if self.sequence_parallel:
            h = mp.reduce_scatter_to_sequence_parallel_region(partial, group=g)
            return (h @ mp.copy_to_tensor_model_parallel_region(b, group=g).t()) * self.scale
        return (mp.reduce_from_tensor_model_parallel_region(partial, group=g) @ b.t()) * self.scale

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs that differ per TP rank (row layers, sequence chunks) draw from Megatron's model-parallel RNG;
        a replicated input draws the same mask on every rank from the default one."""
        if self.parallel == "row" or self.sequence_parallel:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """This rank's shard of the weight update, ``scale * B @ A``, in fp32 (the base weight's shard shape)."""
        return (self.b.float() @ self.a.float()) * self.scale


def _init_a(rank: int, in_features: int, key: str, seed: int) -> torch.Tensor:
    """The whole A of one layer, the same at every layout: Kaiming-uniform as peft draws it (bound 1/sqrt(in)),
    from a generator seeded by the layer's global name (so TP ranks and pipeline stages agree without talking)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=gen, dtype=torch.float32) * 2 - 1) * bound
