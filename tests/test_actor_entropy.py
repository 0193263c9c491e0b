"""The entropy metric of the training loss, computed chunk by chunk over positions, against a naive per-token
reference: one process (padding columns, temperatures, chunks that do not divide the positions) and two gloo
tensor-parallel ranks (the vocabulary split, padding only on the last rank, reductions over the TP group)."""

from __future__ import annotations

import pytest
import torch

from dapo_mcore.actor.logprobs import token_entropy, token_logprobs

TRUE_VOCAB, PADDED = 37, 64


def _logits(seed: int, b: int = 3, s: int = 7, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, PADDED, generator=gen) * 3
    logits[..., TRUE_VOCAB:] = float("nan")  # padding: a kernel that read it would return NaN
    return logits.to(dtype)


def _naive_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Loop over positions in float64 over the real vocabulary."""
    b, s, _ = logits.shape
    out = torch.zeros(b, s, dtype=torch.float64)
    for i in range(b):
        for j in range(s):
            logp = torch.log_softmax(logits[i, j, :TRUE_VOCAB].double() / temperature, dim=-1)
            out[i, j] = -(logp.exp() * logp).sum()
    return out


@pytest.mark.unit
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_rows", [1, 4, 21, 1000])  # 21 = all positions; 4 leaves a partial last chunk
def test_chunked_entropy_matches_the_naive_reference(temperature, chunk_rows):
    logits = _logits(0)
    want = _naive_entropy(logits, temperature)
    got = token_entropy(logits, temperature, TRUE_VOCAB, chunk_bytes=chunk_rows * 4 * TRUE_VOCAB)
    assert got.shape == (3, 7) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5
    assert want.std() > 0.1


@pytest.mark.unit
def test_bf16_logits_and_no_graph():
    logits = _logits(1, dtype=torch.bfloat16).requires_grad_(True)
    got = token_entropy(logits, 0.8, TRUE_VOCAB, chunk_bytes=5 * 4 * TRUE_VOCAB)
    assert not got.requires_grad  # a metric: nothing of it is kept for backward
    assert (got.double() - _naive_entropy(logits.detach().float(), 0.8)).abs().max() < 1e-5


@pytest.mark.unit
def test_chunking_does_not_change_a_single_chunk_result():
    """With the chunk covering every position (the tiny model's case) the result is bit-identical to a larger chunk:
    the stored tiny trace logs this metric."""
    logits = _logits(2, b=2, s=9)
    assert torch.equal(token_entropy(logits, 1.0, TRUE_VOCAB), token_entropy(logits, 1.0, TRUE_VOCAB, chunk_bytes=1 << 30))


def _tp_worker(rank: int, world: int, port: int, queue) -> None:
    from dapo_mcore.actor.parallel import LaunchEnv, init_distributed, init_model_parallel

    init_distributed(LaunchEnv(rank=rank, local_rank=rank, world_size=world, master_addr="127.0.0.1",
                               master_port=port, source="test"), "gloo")
    init_model_parallel(world, 1)
    full = _logits(3)
    local = full[..., rank * PADDED // world:(rank + 1) * PADDED // world].contiguous()  # rank 1 holds the padding
    got = {t: token_entropy(local, t, TRUE_VOCAB, chunk_bytes=4 * 4 * (PADDED // world)).tolist() for t in (1.0, 0.7)}
    # The loss takes log-probs first, then the entropy of the same logits: Megatron's cross-entropy kernel works in
    # place, so where nothing copies the logits before it (fp32, T=1, one row, no padding: rank 0) it must not
    # overwrite them.
    one_row = full[:1, :, rank * PADDED // world:(rank + 1) * PADDED // world].contiguous()
    before = one_row.clone()
    token_logprobs(one_row, torch.zeros(1, one_row.shape[1], dtype=torch.long), 1.0, TRUE_VOCAB)
    got["untouched"] = bool(torch.equal(one_row.nan_to_num(), before.nan_to_num()))  # rank 1 pads with NaN
    torch.distributed.destroy_process_group()
    queue.put((rank, got))  # plain lists: tensors would travel as shared memory the exiting worker takes away


@pytest.mark.distributed
def test_two_tensor_parallel_gloo_ranks_match_the_naive_reference():
    from tests.gloo_workers import run_gloo_workers

    results = run_gloo_workers(_tp_worker, 2)
    for t in (1.0, 0.7):
        want = _naive_entropy(_logits(3), t)
        for rank in (0, 1):
            assert (torch.tensor(results[rank][t], dtype=torch.float64) - want).abs().max() < 1e-5, (rank, t)
    assert results[0]["untouched"] and results[1]["untouched"]
