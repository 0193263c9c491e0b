"""Sequences -> model inputs for one micro-batch, in two layouts that give identical log-probs.

* ``rows``: one right-padded row per sequence with a causal mask. Right padding never touches earlier tokens,
  and positions run 0..L-1 from each sequence's first token, exactly as an unpadded forward.
* ``packed``: all sequences concatenated in one row with positions restarting at 0 per sequence. On GPU with
  Transformer Engine this is THD (``PackedSeqParams`` with cu_seqlens); with the local spec (CPU) the same
  boundaries become a block-diagonal causal mask.

Either way the response tokens' log-probs come back as a ``[num_seqs, max_response_len]`` tensor via
:meth:`MicroBatch.gather_responses`, rows aligned with the input sequence order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

Layout = Literal["rows", "packed", "thd"]


@dataclass
class MicroBatch:
    """Model inputs for one micro-batch plus the index that pulls response positions back out."""

    tokens: torch.Tensor          # [R, S] input ids
    position_ids: torch.Tensor    # [R, S]
    attention_mask: torch.Tensor | None  # [R or 1, 1, S, S] bool, True = masked; None with THD
    targets: torch.Tensor         # [R, S] next-token ids (0 where unused)
    resp_row: torch.Tensor        # [N, Rmax] row of each response token's logit position
    resp_col: torch.Tensor        # [N, Rmax] column of each response token's logit position
    resp_mask: torch.Tensor       # [N, Rmax] 1.0 on real response tokens
    packed_seq_params: Any = None
    num_tokens: int = 0           # real (non-pad) tokens in the micro-batch
    indices: list[int] | None = None        # which samples of the caller's list, in row order
    old_logp: torch.Tensor | None = None    # [N, Rmax] loss inputs (training only)
    loss_mask: torch.Tensor | None = None   # [N, Rmax]
    adv: torch.Tensor | None = None         # [N]
    tis: torch.Tensor | None = None         # [N, Rmax] truncated importance weights, optional

    def gather_responses(self, per_position: torch.Tensor) -> torch.Tensor:
        """[R, S] per-position values -> [N, Rmax] per-response-token values (0 on padding)."""
        return per_position[self.resp_row, self.resp_col] * self.resp_mask


def _response_index(starts: Sequence[int], prompt_lens: Sequence[int], resp_lens: Sequence[int],
                    rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, rmax = len(resp_lens), max(max(resp_lens, default=0), 1)
    row = torch.zeros(n, rmax, dtype=torch.long)
    col = torch.zeros(n, rmax, dtype=torch.long)
    mask = torch.zeros(n, rmax)
    for i, (start, p, r) in enumerate(zip(starts, prompt_lens, resp_lens, strict=True)):
        # The logit at position (start + p - 1 + j) predicts response token j.
        cols = torch.arange(r) + start + p - 1
        row[i, :r] = rows[i]
        col[i, :r] = cols
        mask[i, :r] = 1.0
    return row, col, mask


def build_micro_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                      layout: Layout = "rows", pad_id: int = 0, pad_to_multiple: int = 1, min_rows: int = 0,
                      min_len: int = 0) -> MicroBatch:
    """Build one micro-batch from prompt and response token ids (response may be empty).

    ``min_rows`` / ``min_len``: pad to at least that many rows (rows layout: rows of padding, no response) and that
    sequence length (the packed total in the packed layouts), so that micro-batches can share one shape.
    """
    if len(prompts) != len(responses) or not prompts:
        raise ValueError("build_micro_batch needs the same, non-zero number of prompts and responses")
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every sequence needs at least one prompt token (the first response token is predicted from it)")
    p_lens, r_lens = [len(p) for p in prompts], [len(r) for r in responses]
    if layout == "rows":
        return _rows(seqs, p_lens, r_lens, pad_id, pad_to_multiple, min_rows, min_len)
    return _packed(seqs, p_lens, r_lens, pad_id, pad_to_multiple, thd=layout == "thd", min_len=min_len)


# Transformer Engine's FP8 GEMMs need the token dimension of every GEMM input to be a multiple of this
# (transformer_engine/pytorch/utils.py ``assert_dim_for_fp8_exec``: leading dims % 8 forward, and the token dim is
# the reduction dim of the weight-gradient GEMM, where cuBLAS FP8 wants % 16; MXFP8 quantizes 32-element blocks
# along both dims, quantizer.cpp ``MXFP8_BLOCK_SIZE``).
FP8_TOKEN_ALIGN = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32}


def sequence_pad_multiple(tensor_parallel: int, sequence_parallel: bool, fp8_recipe: str | None) -> int:
    """What a micro-batch's sequence length (the packed total with THD) must be a multiple of.

    Sequence parallel splits the sequence over the TP ranks, so it must divide by TP; with FP8 each rank's slice
    (all of it without SP) feeds TE's FP8 GEMMs, so the slice must also be a multiple of the recipe's alignment.
    ``fp8_recipe`` is None when FP8 is off.
    """
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel={tensor_parallel} must be >= 1")
    align = 1 if fp8_recipe is None else FP8_TOKEN_ALIGN[fp8_recipe]
    return align * (tensor_parallel if sequence_parallel else 1)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _rows(seqs, p_lens, r_lens, pad_id, pad_to_multiple, min_rows: int = 0, min_len: int = 0) -> MicroBatch:
    s = _round_up(max(max(len(x) for x in seqs), min_len), pad_to_multiple)
    rows = max(len(seqs), min_rows)
    tokens = torch.full((rows, s), pad_id, dtype=torch.long)
    for i, x in enumerate(seqs):
        tokens[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    positions = torch.arange(s).unsqueeze(0).expand(rows, s).contiguous()
    causal = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
    row, col, mask = _response_index([0] * len(seqs), p_lens, r_lens, list(range(len(seqs))))
    return MicroBatch(tokens, positions, causal, targets, row, col, mask, num_tokens=sum(map(len, seqs)))


def pad_segments(pad: int, longest: int) -> list[int]:
    """The lengths of the segments ``pad`` trailing padding tokens form: none longer than the longest real sequence.
    One segment as long as the padding (the largest micro-batch's shape under virtual pipeline stages can be many
    times a small one's) would cost attention quadratic in its length and raise ``max_seqlen``; segments of at most
    ``longest`` cost no more per token than the real sequences and leave ``max_seqlen`` the real one's."""
    longest = max(longest, 1)
    return [longest] * (pad // longest) + ([pad % longest] if pad % longest else [])


def _packed(seqs, p_lens, r_lens, pad_id, pad_to_multiple, thd: bool, min_len: int = 0) -> MicroBatch:
    lens = [len(x) for x in seqs]
    total = sum(lens)
    s = _round_up(max(total, min_len), pad_to_multiple)
    pads = pad_segments(s - total, max(lens))
    flat = [t for x in seqs for t in x] + [pad_id] * (s - total)
    tokens = torch.tensor(flat, dtype=torch.long).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lens + pads]).unsqueeze(0)
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    row, col, mask = _response_index(starts, p_lens, r_lens, [0] * len(seqs))
    if thd:
        from megatron.core.packed_seq_params import PackedSeqParams

        bounds = starts + [total]
        for n in pads:  # trailing pad forms segments of its own so no real sequence attends to it
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, dtype=torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max_len, max_seqlen_kv=max_len)
        return MicroBatch(tokens, positions, None, targets, row, col, mask, params, num_tokens=total)
    segment = torch.cat([torch.full((n,), i) for i, n in enumerate(lens + pads)])
    same = segment.unsqueeze(0) == segment.unsqueeze(1)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    attention_mask = (~(same & causal)).view(1, 1, s, s)
    return MicroBatch(tokens, positions, attention_mask, targets, row, col, mask, num_tokens=total)


def to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    """Move every tensor of a micro-batch to ``device`` (cu_seqlens included)."""
    moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in mb.__dict__.items()}
    if mb.packed_seq_params is not None:
        p = mb.packed_seq_params
        p.cu_seqlens_q = p.cu_seqlens_q.to(device)
        p.cu_seqlens_kv = p.cu_seqlens_kv.to(device)
    return MicroBatch(**moved)
