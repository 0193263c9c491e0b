"""An all-gather of variable-length flat tensors: every rank's (int64, float32) pair, on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dapo_mcore.collectives.device import collective_device


def all_gather_packed(ints: torch.Tensor, floats: torch.Tensor, group=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's (int64, float32) pair of flat tensors, on every rank, on the CPU (a collective over ``group``,
    the default group when None). The tensors may differ in length between ranks: sizes are exchanged first and the
    data padded to the largest. Every tensor travels on the group's collective device."""
    device = collective_device(group)
    world = dist.get_world_size(group)
    sizes = device.to(torch.tensor([ints.numel(), floats.numel()], dtype=torch.int64))
    all_sizes = [device.empty(2, torch.int64) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    counts = [device.host(s) for s in all_sizes]
    max_i = max(max(int(c[0]) for c in counts), 1)
    max_f = max(max(int(c[1]) for c in counts), 1)
    pad_i = torch.zeros(max_i, dtype=torch.int64)
    pad_i[: ints.numel()] = ints
    pad_f = torch.zeros(max_f, dtype=torch.float32)
    pad_f[: floats.numel()] = floats.to(torch.float32)
    got_i = [device.empty(max_i, torch.int64) for _ in range(world)]
    got_f = [device.empty(max_f, torch.float32) for _ in range(world)]
    dist.all_gather(got_i, device.to(pad_i), group=group)
    dist.all_gather(got_f, device.to(pad_f), group=group)
    return [(device.host(gi)[: int(n[0])], device.host(gf)[: int(n[1])])
            for gi, gf, n in zip(got_i, got_f, counts, strict=True)]
