"""Split invariance across 2 data-parallel gloo ranks: summed gradients equal the single-process gradient."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapo_mcore.algo.loss import loss_denominators, policy_loss

pytestmark = pytest.mark.distributed

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
B, T, D, MAX_LEN = 16, 20, 5, 20


def problem(seed: int = 0):
    """A tiny 'model': logp = old_logp + 0.1 * x @ w, so gradients land on a shared parameter w."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    w0 = torch.randn(D, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[1] = 0
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return old, x, w0, adv, mask


def grad_of(rows_per_micro: list[torch.Tensor], mode: str, totals: tuple[int, int]) -> torch.Tensor:
    old, x, w0, adv, mask = problem()
    w = w0.clone().requires_grad_(True)
    for idx in rows_per_micro:  # one backward per micro-batch: gradients accumulate as in training
        logp = old[idx] + 0.1 * x[idx] @ w
        loss, _ = policy_loss(logp, old[idx], adv[idx], mask[idx], clip_low=0.2, clip_high=0.28, dual_clip_c=3.0,
                              agg=mode, global_tokens=totals[0], global_seqs=totals[1], max_response_len=MAX_LEN)
        loss.backward()
    return w.grad


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mask = problem()[4]
        mine = torch.arange(B)[rank::world]  # interleaved rows: ranks see different lengths
        micro = list(mine.chunk(2))
        local = torch.tensor([sum(c) for c in zip(*(loss_denominators(mask[i]) for i in micro), strict=True)],
                             dtype=torch.int64)
        dist.all_reduce(local)  # the caller's job: global counts over micro-batches and ranks
        for mode in MODES:
            g = grad_of(micro, mode, (int(local[0]), int(local[1])))
            dist.all_reduce(g)  # data-parallel gradient SUM
            if rank == 0:
                torch.save(g, os.path.join(out_dir, f"{mode}.pt"))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_match_single_process(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    mask = problem()[4]
    totals = loss_denominators(mask)
    for mode in MODES:
        ref = grad_of([torch.arange(B)], mode, totals)
        got = torch.load(tmp_path / f"{mode}.pt")
        assert ref.abs().sum() > 0
        assert ((got - ref).norm() / ref.norm()).item() <= 1e-6, mode
