"""GSPO, CISPO and RLOO advantages are split-invariant: summed over 1-3 micro-batches and over 2 data-parallel gloo
ranks, with rollout-correction weights and rejection, the loss and gradient equal the whole batch's (float64)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapo_mcore.algo.advantages import group_advantages
from dapo_mcore.algo.loss import loss_denominators, policy_loss
from dapo_mcore.algo.rollout_correction import RolloutCorrectionConfig, correction

B, G, T, D, MAX_LEN = 16, 4, 20, 5, 20
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# (objective, clip_low, clip_high, advantage estimator): gspo's range is wide enough that some sequences clip
VARIANTS = {"gspo": ("gspo", 0.02, 0.03, "grpo"), "cispo": ("cispo", 1.0, 0.2, "grpo"),
            "rloo": ("ppo_clip", 0.2, 0.28, "rloo")}
CFG = RolloutCorrectionConfig(is_level="token", is_threshold=[0.6, 1.8], rs=["token_k3"], rs_thresholds=[0.1])


def problem(estimator: str, seed: int = 0):
    """logp = old + 0.1 * x @ w (gradients land on w); 4 groups of 4 responses with +-1 rewards."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    w0 = torch.randn(D, generator=g, dtype=torch.float64)
    rewards = torch.where(torch.rand(B // G, G, generator=g) > 0.5, 1.0, -1.0).to(torch.float64)
    rewards[0] = torch.tensor([1.0, -1.0, -1.0, -1.0])
    adv = group_advantages(rewards, norm_by_std=estimator == "grpo", estimator=estimator).reshape(B)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[1], lengths[2] = 0, T
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    weights, keep, _ = correction(old - rollout, mask, CFG)
    return old, x, w0, adv, mask, weights, keep


def loss_and_grad(variant: str, rows: list[torch.Tensor], mode: str, totals: tuple[int, int]):
    objective, lo, hi, estimator = VARIANTS[variant]
    old, x, w0, adv, mask, weights, keep = problem(estimator)
    w = w0.clone().requires_grad_(True)
    total, clipped = torch.zeros((), dtype=torch.float64), 0.0
    for idx in rows:  # one backward per micro-batch, each trimmed to its longest response (as packing does)
        width = max(int(mask[idx].sum(-1).max()), 1)
        logp = old[idx, :width] + 0.1 * x[idx, :width] @ w
        loss, m = policy_loss(logp, old[idx, :width], adv[idx], mask[idx, :width], clip_low=lo, clip_high=hi,
                              agg=mode, global_tokens=totals[0], global_seqs=totals[1], max_response_len=MAX_LEN,
                              tis_weights=weights[idx, :width], keep=keep[idx, :width], objective=objective)
        loss.backward()
        total = total + loss.detach()
        clipped += float(m["clipfrac"])
    return total, w.grad, clipped


def whole(variant: str, mode: str):
    *_, mask, _, keep = problem(VARIANTS[variant][3])
    return loss_and_grad(variant, [torch.arange(B)], mode, loss_denominators(mask * keep))


@pytest.mark.unit
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("parts", [2, 3])
def test_micro_batch_splits_sum_to_the_whole_batch(variant, mode, parts):
    *_, mask, _, keep = problem(VARIANTS[variant][3])
    l1, g1, c1 = whole(variant, mode)
    assert 0 < c1 < 1 and 0 < int(keep.sum()) < int(mask.sum())  # the clip and the rejection both bite
    rows = list(torch.randperm(B, generator=torch.Generator().manual_seed(parts)).chunk(parts))
    totals = tuple(map(sum, zip(*(loss_denominators((mask * keep)[r]) for r in rows), strict=True)))
    ln, gn, cn = loss_and_grad(variant, rows, mode, totals)
    assert ln.item() == pytest.approx(l1.item(), rel=1e-12)
    assert cn == pytest.approx(c1, rel=1e-12)
    torch.testing.assert_close(gn, g1, rtol=1e-11, atol=1e-14)


@pytest.mark.unit
def test_per_micro_batch_sequence_ratio_would_break_gspo():
    """Guard: GSPO's ratio is per sequence; a sequence ratio pooled over a micro-batch's rows would not be."""
    old, x, w0, adv, mask, *_ = problem("grpo")
    pooled = torch.exp(((x[:4] @ w0 * 0.1) * mask[:4]).sum() / mask[:4].sum())
    per_seq = torch.exp(((x[:4] @ w0 * 0.1) * mask[:4]).sum(-1) / mask[:4].sum(-1).clamp(min=1))
    assert (per_seq - pooled).abs().max() > 1e-3


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for variant in VARIANTS:
            *_, mask, _, keep = problem(VARIANTS[variant][3])
            mine = torch.arange(B)[rank::world]
            micro = list(mine.chunk(2))
            local = torch.tensor([sum(c) for c in zip(*(loss_denominators((mask * keep)[i]) for i in micro),
                                                      strict=True)], dtype=torch.int64)
            dist.all_reduce(local)
            for mode in MODES:
                loss, g, _ = loss_and_grad(variant, micro, mode, (int(local[0]), int(local[1])))
                dist.all_reduce(loss)
                dist.all_reduce(g)  # data-parallel gradient SUM
                if rank == 0:
                    torch.save((loss, g), os.path.join(out_dir, f"{variant}-{mode}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_gloo_ranks_match_the_whole_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for variant in VARIANTS:
        for mode in MODES:
            l1, g1, _ = whole(variant, mode)
            loss, g = torch.load(tmp_path / f"{variant}-{mode}.pt")
            assert loss.item() == pytest.approx(l1.item(), rel=1e-12), (variant, mode)
            torch.testing.assert_close(g, g1, rtol=1e-11, atol=1e-14)
