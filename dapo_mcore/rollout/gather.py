"""Share generated responses between ranks as two flat tensors instead of pickled Python objects.

Each engine group generates its share of a generation batch; every rank then needs all of it. At paper scale a
step holds ~25k responses of up to 20k tokens, so the exchange packs each rank's share into one int64 tensor
(prompt index, response count, and per response: finish reason, token count, log-prob count, token ids) and one
float32 tensor (the log-probs), pads to the largest rank's size and all-gathers both: two collectives of plain
tensors (NCCL on GPU, gloo on CPU) however many responses there are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dapo_mcore.rollout.protocol import Response

_FINISH = ("stop", "length")


def pack_responses(indices: Sequence[int], results: Sequence[Sequence[Response]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ints, floats) holding ``results[j]`` (the responses of prompt ``indices[j]``)."""
    ints: list[int] = [len(indices)]
    floats: list[float] = []
    for index, responses in zip(indices, results, strict=True):
        ints += [index, len(responses)]
        for r in responses:
            ints += [_FINISH.index(r.finish_reason), len(r.token_ids), len(r.logprobs)]
            ints += list(r.token_ids)
            floats += list(r.logprobs)
    return torch.tensor(ints, dtype=torch.int64), torch.tensor(floats, dtype=torch.float32)


def unpack_responses(ints: torch.Tensor, floats: torch.Tensor) -> dict[int, list[Response]]:
    """Inverse of :func:`pack_responses` (trailing padding is ignored)."""
    iv, fv = ints.tolist(), floats.tolist()
    out: dict[int, list[Response]] = {}
    pos, fpos = 1, 0
    for _ in range(iv[0]):
        index, count = iv[pos], iv[pos + 1]
        pos += 2
        responses = []
        for _ in range(count):
            finish, n_tok, n_lp = iv[pos], iv[pos + 1], iv[pos + 2]
            pos += 3
            responses.append(Response(token_ids=iv[pos:pos + n_tok], logprobs=fv[fpos:fpos + n_lp],
                                      finish_reason=_FINISH[finish]))  # type: ignore[arg-type]
            pos += n_tok
            fpos += n_lp
        out[index] = responses
    return out


def all_gather_packed(ints: torch.Tensor, floats: torch.Tensor,
                      device: torch.device | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's (int64, float32) pair of flat tensors, on every rank, on the CPU (collective, default group).

    The tensors may differ in length between ranks: sizes are exchanged first and the data padded to the largest.
    """
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    world = dist.get_world_size()
    sizes = torch.tensor([ints.numel(), floats.numel()], dtype=torch.int64, device=device)
    all_sizes = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes)
    max_i = max(max(int(s[0]) for s in all_sizes), 1)
    max_f = max(max(int(s[1]) for s in all_sizes), 1)
    pad_i = torch.zeros(max_i, dtype=torch.int64, device=device)
    pad_i[: ints.numel()] = ints.to(device)
    pad_f = torch.zeros(max_f, dtype=torch.float32, device=device)
    pad_f[: floats.numel()] = floats.to(device=device, dtype=torch.float32)
    got_i = [torch.empty_like(pad_i) for _ in range(world)]
    got_f = [torch.empty_like(pad_f) for _ in range(world)]
    dist.all_gather(got_i, pad_i)
    dist.all_gather(got_f, pad_f)
    return [(gi[: int(n[0])].cpu(), gf[: int(n[1])].cpu())
            for gi, gf, n in zip(got_i, got_f, all_sizes, strict=True)]


def all_gather_responses(indices: Sequence[int], results: Sequence[Sequence[Response]],
                         device: torch.device | None = None) -> dict[int, list[Response]]:
    """Every rank's (prompt index -> responses), merged, on every rank (a collective over the default group)."""
    merged: dict[int, list[Response]] = {}
    for ints, floats in all_gather_packed(*pack_responses(indices, results), device=device):
        merged.update(unpack_responses(ints, floats))
    return merged
