"""Byte-range conversion plans and the staged (O_DIRECT + thread) writer against naive references."""

from __future__ import annotations

import os
import random

import pytest
import torch
import xxhash

from conversion.synthetic import save_tiny_hf_model, tiny_hf_config
from dapo_mcore.weights import ParallelLayout
from dapo_mcore.weights.registry import get_mapping
from dapo_mcore.weights.safetensors_io import SafetensorsDirSource
from dapo_mcore.weights.staged_io import StagedFileWriter
from dapo_mcore.weights.transforms import ZERO, DictSource

pytestmark = pytest.mark.unit


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("tp", [1, 2, 4, 8])  # 8 > 4 KV heads: query groups split across ranks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extents_give_the_same_bytes_as_shard(tp, dtype):
    # vocab 300 pads to 512 at tp=4 (rank 3 is padding only), 8 heads / 4 KV heads: groups of 2 per rank
    cfg = tiny_hf_config(vocab_size=300, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    mapping = get_mapping(cfg)
    gen = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=gen).to(dtype) for n, s in mapping.hf_shapes().items()}
    source = DictSource(hf)
    layout = ParallelLayout(tp=tp)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for pl in mapping.placements(layout):
        for rank in range(tp):
            want = _bytes(mapping.shard(pl, source, layout, rank))
            got = b"".join(bytes(n) if i == ZERO else _bytes(hf[pl.hf_names[i]])[off:off + n]
                           for i, off, n in mapping.shard_extents(pl, layout, rank, itemsize))
            assert got == want, (pl.key, rank)


@pytest.mark.parametrize("direct", [None, False])
def test_staged_writer_matches_plain_bytes(tmp_path, direct):
    rng = random.Random(0)
    src = tmp_path / "src.bin"
    src.write_bytes(rng.randbytes(100_000))
    ref = bytearray()
    fd = os.open(src, os.O_RDONLY)
    try:
        with StagedFileWriter(tmp_path / "out.bin", direct=direct, buffer_bytes=8192, num_buffers=2,
                              checksum=True) as w:
            for _ in range(60):  # pieces smaller and larger than a buffer, across buffer boundaries
                kind, n = rng.randrange(3), rng.randrange(1, 20_000)
                if kind == 0:
                    data = rng.randbytes(n)
                    w.write(data)
                    ref += data
                elif kind == 1:
                    w.write_zeros(n)
                    ref += bytes(n)
                else:
                    off = rng.randrange(0, 100_000 - n)
                    w.read_into(fd, off, n)
                    ref += src.read_bytes()[off:off + n]
    finally:
        os.close(fd)
    assert (tmp_path / "out.bin").read_bytes() == bytes(ref)  # exact length: O_DIRECT padding truncated
    assert w.hasher.hexdigest() == xxhash.xxh3_64_hexdigest(bytes(ref))  # the manifest's hash: content, no padding


def test_staged_writer_abort_on_error_stops_the_thread(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), StagedFileWriter(tmp_path / "x", buffer_bytes=4096) as w:
        w.write(b"a" * 10_000)
        raise RuntimeError("boom")
    assert not w._thread.is_alive()


@pytest.mark.parametrize("small", [0, 1 << 30])
def test_copy_extents_reads_and_maps_the_same(tmp_path, small):
    save_tiny_hf_model(tmp_path / "hf", seed=3, tie_word_embeddings=False)
    source = SafetensorsDirSource(tmp_path / "hf")
    name = "model.layers.0.mlp.down_proj.weight"
    full = source.read(name)
    extents = [(0, 4, 8), (ZERO, 0, 5), (0, 0, 4), (0, 100, 300)]
    with StagedFileWriter(tmp_path / "out", buffer_bytes=4096) as w:
        source.copy_extents((name,), extents, w, small=small)
    raw = _bytes(full)
    assert (tmp_path / "out").read_bytes() == raw[4:12] + bytes(5) + raw[0:4] + raw[100:400]
