"""The DAPO loss with rollout-correction weights and rejection inside the exact global token denominator: summed over
micro-batches (several splits) and over 2 data-parallel gloo ranks it equals the one-batch loss (float64)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapo_mcore.algo.loss import clipped_token_loss, loss_denominators, policy_loss
from dapo_mcore.algo.rollout_correction import RolloutCorrectionConfig, correction

B, T, D, MAX_LEN = 16, 20, 5, 20
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
CFG = RolloutCorrectionConfig(is_level="token", is_threshold=[0.6, 1.8], is_batch_normalize=True,
                              rs=["token_k3", "seq_mean_k1"], rs_thresholds=[0.1, [0.85, 1.15]])


def problem(seed: int = 0):
    """logp = old + 0.1 * x @ w (gradients land on w); the engine's log-probs are old plus noise."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    w0 = torch.randn(D, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[1], lengths[2] = 0, T
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return old, rollout, x, w0, adv, mask


def loss_and_grad(rows: list[torch.Tensor], weights, keep, mode: str, totals: tuple[int, int]):
    old, _, x, w0, adv, mask = problem()
    w = w0.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for idx in rows:  # one backward per micro-batch, as in training
        width = max(int(mask[idx].sum(-1).max()), 1)
        logp = old[idx, :width] + 0.1 * x[idx, :width] @ w
        loss, _ = policy_loss(logp, old[idx, :width], adv[idx], mask[idx, :width], clip_low=0.2, clip_high=0.28,
                              agg=mode, global_tokens=totals[0], global_seqs=totals[1], max_response_len=MAX_LEN,
                              tis_weights=weights[idx, :width], keep=keep[idx, :width])
        loss.backward()
        total = total + loss.detach()
    return total, w.grad


def whole_batch(mode: str):
    old, rollout, *_, mask = problem()
    weights, keep, _ = correction(old - rollout, mask, CFG)
    return loss_and_grad([torch.arange(B)], weights, keep, mode, loss_denominators(mask * keep)), keep


@pytest.mark.unit
def test_whole_batch_loss_equals_a_naive_sum_over_kept_tokens():
    old, rollout, x, w0, adv, mask = problem()
    (loss, _), keep = whole_batch("token-mean")
    weights, _, _ = correction(old - rollout, mask, CFG)
    assert 0 < int(keep.sum()) < int(mask.sum())  # rejection bites
    logp = old + 0.1 * x @ w0
    ref, kept = 0.0, 0
    for i in range(B):
        for t in range(T):
            if mask[i, t] and keep[i, t]:
                tok, _, _ = clipped_token_loss(torch.exp(logp[i, t] - old[i, t]), adv[i], 0.2, 0.28, None)
                ref += float(weights[i, t] * tok)
                kept += 1
    assert loss.item() == pytest.approx(ref / kept, rel=1e-12)


@pytest.mark.unit
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_micro_batch_splits_sum_to_the_whole_batch(mode, parts):
    old, rollout, *_, mask = problem()
    weights, keep, _ = correction(old - rollout, mask, CFG)  # the trainer computes it once over the step's batch
    (l1, g1), _ = whole_batch(mode)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(parts))
    rows = list(perm.chunk(parts))
    totals = tuple(map(sum, zip(*(loss_denominators((mask * keep)[r]) for r in rows), strict=True)))
    assert totals == loss_denominators(mask * keep)
    ln, gn = loss_and_grad(rows, weights, keep, mode, totals)
    assert ln.item() == pytest.approx(l1.item(), rel=1e-12)
    torch.testing.assert_close(gn, g1, rtol=1e-11, atol=1e-14)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        old, rollout, *_, mask = problem()
        mine = torch.arange(B)[rank::world]
        # each rank corrects its own rows: the batch-normalization mean is all-reduced over the group
        w_mine, k_mine, _ = correction(old[mine] - rollout[mine], mask[mine], CFG, group=dist.group.WORLD)
        weights = torch.zeros(B, T, dtype=torch.float64)
        keep = torch.zeros(B, T, dtype=torch.bool)
        weights[mine], keep[mine] = w_mine, k_mine
        micro = list(mine.chunk(2))
        local = torch.tensor([sum(c) for c in zip(*(loss_denominators((mask * keep)[i]) for i in micro),
                                                  strict=True)], dtype=torch.int64)
        dist.all_reduce(local)
        for mode in MODES:
            loss, g = loss_and_grad(micro, weights, keep, mode, (int(local[0]), int(local[1])))
            dist.all_reduce(loss)
            dist.all_reduce(g)
            if rank == 0:
                torch.save((loss, g), os.path.join(out_dir, f"{mode}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_gloo_ranks_match_the_whole_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for mode in MODES:
        (l1, g1), _ = whole_batch(mode)
        loss, g = torch.load(tmp_path / f"{mode}.pt")
        assert loss.item() == pytest.approx(l1.item(), rel=1e-12), mode
        torch.testing.assert_close(g, g1, rtol=1e-11, atol=1e-14)
