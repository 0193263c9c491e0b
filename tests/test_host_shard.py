"""An engine rank stages only the part of each tensor its engine loads (``rollout.pipeline.host_shard``).

The loader below shards the way vLLM's do at tensor parallel 2 (``narrow`` in ``linear.py``/``parameter.py``,
``vocab_parallel_embedding.py``, ``fused_moe/layer.py``): column-parallel tensors along dim 0, row-parallel along dim
1, the vocabulary padded to 64 rows a rank, norms whole, experts of another rank skipped. What it loads from a staged
version (recorded on a first load, staged, expanded) must equal what it loads from the whole version, and the staged
bytes must be the rank's shard."""

from __future__ import annotations

import pytest
import torch

from dapo_mcore.rollout.pipeline.host_shard import (
    NOT_READ,
    WHOLE,
    ReadRecorder,
    Span,
    expand,
    stage,
    staged_bytes,
)

pytestmark = pytest.mark.unit

TP = 2


def shapes() -> dict[str, tuple[int, ...]]:
    return {"model.embed_tokens.weight": (100, 8), "layers.0.q_proj.weight": (8, 8), "layers.0.q_proj.bias": (8,),
            "layers.0.o_proj.weight": (8, 8), "layers.0.input_layernorm.weight": (8,),
            "layers.0.experts.0.down_proj.weight": (8, 6), "layers.0.experts.1.down_proj.weight": (8, 6),
            "lm_head.weight": (100, 8)}


def version(seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    pairs = [(n, torch.randn(s, generator=g).bfloat16()) for n, s in shapes().items()]
    return [pairs[:3], pairs[3:6], pairs[6:]]


class TPLoader:
    """An engine rank's loader, vLLM-style: what it loads lands in ``params`` (the engine's own shard)."""

    def __init__(self, rank: int):
        self.rank, self.params = rank, {}

    def update_weights(self, buckets):
        for bucket in buckets:
            for name, w in bucket:
                self._load(name, w)

    def _load(self, name: str, w: torch.Tensor) -> None:
        r = self.rank
        if name == "lm_head.weight":  # tied: vLLM's Qwen loaders skip it
            return
        if name.endswith("embed_tokens.weight"):  # VocabParallelEmbedding: 128 padded rows, 64 a rank
            per = 64
            start, size = r * per, max(0, min(w.shape[0], (r + 1) * per) - r * per)
            param = torch.zeros(per, w.shape[1], dtype=w.dtype)
            param[:size].copy_(w.narrow(0, start, size))
        elif "experts." in name:  # expert parallel: expert e on rank e % 2, loaded whole
            if int(name.split("experts.")[1].split(".")[0]) % TP != r:
                return
            param = torch.empty(w.shape, dtype=w.dtype)
            param.copy_(w)
        elif "q_proj" in name:  # column parallel
            shard = w.shape[0] // TP
            param = w.narrow(0, r * shard, shard).clone()
        elif "o_proj" in name:  # row parallel
            assert w.dim() == 2 and w.shape[1] % TP == 0
            shard = w.shape[1] // TP
            param = torch.empty(w.shape[0], shard, dtype=w.dtype)
            param.copy_(w.narrow(1, r * shard, shard))
        else:  # replicated (a norm)
            param = torch.empty(w.shape, dtype=w.dtype)
            param.data.copy_(w)
        self.params[name] = param


def shard_bytes(rank: int) -> int:
    """The bytes of ``shapes()`` rank ``rank`` loads, from the sharding rules (bf16)."""
    s = shapes()
    rows = min(100, (rank + 1) * 64) - rank * 64
    total = rows * 8  # embedding rows of this rank
    total += 8 * 8 // TP + 8 // TP + 8 * 8 // TP + 8  # q_proj, its bias, o_proj, the norm
    total += 8 * 6  # its one expert
    assert "lm_head.weight" in s  # tied, read by no rank
    return 2 * total


@pytest.mark.parametrize("rank", [0, 1])
def test_a_staged_version_loads_as_the_whole_one_and_holds_only_the_shard(rank):
    first = TPLoader(rank)
    recorder = ReadRecorder()
    first.update_weights(recorder.wrap(version(0)))
    regions = recorder.regions()
    assert regions["layers.0.q_proj.weight"] == Span(0, rank * 4, 4)
    assert regions["layers.0.o_proj.weight"] == Span(1, rank * 4, 4)
    assert regions["layers.0.input_layernorm.weight"] == WHOLE
    assert regions["lm_head.weight"] == NOT_READ
    assert regions[f"layers.0.experts.{1 - rank}.down_proj.weight"] == NOT_READ
    assert regions["model.embed_tokens.weight"] == Span(0, rank * 64, 64 if rank == 0 else 36)

    staged = [stage(bucket, regions) for bucket in version(1)]
    whole = sum(t.numel() * t.element_size() for bucket in version(1) for _, t in bucket)
    assert staged_bytes(staged) == (shard_bytes(rank), whole) and shard_bytes(rank) < whole / 1.5

    from_staged, from_whole = TPLoader(rank), TPLoader(rank)
    from_staged.update_weights(expand(bucket) for bucket in staged)
    from_whole.update_weights(version(1))
    assert sorted(from_staged.params) == sorted(from_whole.params)
    for name, p in from_whole.params.items():
        assert torch.equal(from_staged.params[name], p), name


def test_a_use_other_than_narrow_keeps_the_tensor_whole_and_shape_queries_keep_nothing():
    recorder = ReadRecorder()

    class Engine:
        def update_weights(self, buckets):
            for bucket in buckets:
                for name, w in bucket:
                    _ = (w.shape, w.dtype, w.dim(), w.size(0), w.numel())
                    if name == "a":
                        torch.ops.aten.add(w, 1)  # an op outside narrow: all of it may be read
                    if name == "b":
                        w.narrow(0, 0, 1)
                        w.narrow(1, 0, 1)  # two dimensions: no single span

    t = torch.zeros(4, 4)
    Engine().update_weights(recorder.wrap([[("a", t), ("b", t), ("c", t)]]))
    assert recorder.regions() == {"a": WHOLE, "b": WHOLE, "c": NOT_READ}
    staged = stage([("a", t), ("b", t), ("c", t), ("d", t)], recorder.regions())  # d: not recorded, kept whole
    assert [s.nbytes for s in staged] == [64, 64, 0, 64]
    assert staged[0].part.data_ptr() != t.data_ptr()  # a copy: the received buffer is not kept alive
