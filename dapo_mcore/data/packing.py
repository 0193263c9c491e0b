"""Sequence packing: micro-batches by token budget, balanced across data-parallel ranks.

Pure Python over sequence lengths; everything returns lists of indices into the input.
- :func:`pack_by_token_budget`: first-fit-decreasing into as few micro-batches as possible, each
  holding at most ``max_tokens`` tokens (dynamic batch size; the sequences of one micro-batch are
  concatenated THD-style, so nothing is padded).
- :func:`balance_across_ranks`: first spread sequences over ranks so their token loads are even
  (longest-processing-time greedy), then pack each rank and split its fullest micro-batches until
  every rank runs the same number of micro-batches (needed for lock-step pipeline/DP execution), a multiple of
  ``multiple_of`` when asked (Megatron's interleaved pipeline schedule runs micro-batches in groups of the pipeline's
  size: with virtual pipeline stages it refuses a count that is not a multiple of it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def _check(lengths: Sequence[int], max_tokens: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence length must be >= 1")
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens exceeds max_tokens={max_tokens}; set the micro-batch "
                         f"token budget to at least max_prompt_len + max_response_len ({longest} here)")


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing: micro-batches of indices whose lengths sum to at most ``max_tokens``.

    Micro-batches come out in creation order (the first holds the longest sequence); indices within
    one are in decreasing length. Every index appears exactly once.
    """
    _check(lengths, max_tokens)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        # Linear first-fit scan; fine for the thousands of sequences of one step.
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(max_tokens - n)
    return bins


def partition_by_load(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Spread indices over ``parts`` groups with near-equal length sums (longest first to the lightest)."""
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    heap = [(0, p) for p in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, p = heapq.heappop(heap)
        groups[p].append(i)
        heapq.heappush(heap, (load + lengths[i], p))
    return groups


def _split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int, why: str = "") -> list[list[int]]:
    """Split micro-batches (the one holding most sequences first) until there are ``count`` of them."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        b = max(range(len(bins)), key=lambda j: (len(bins[j]), sum(lengths[i] for i in bins[j])))
        if len(bins[b]) < 2:
            raise ValueError(f"cannot form {count} non-empty micro-batches{why} from {sum(map(len, bins))} "
                             "sequences on one rank; use fewer data-parallel ranks, more prompts per step, or a "
                             "larger micro-batch token budget")
        members = sorted(bins[b], key=lambda i: -lengths[i])
        first, second = _halves(members, lengths)
        bins[b:b + 1] = [first, second]
    return bins


def _halves(members: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Two non-empty groups of near-equal token sums (greedy, longest first)."""
    a: list[int] = [members[0]]
    b: list[int] = [members[1]]
    load_a, load_b = lengths[members[0]], lengths[members[1]]
    for i in members[2:]:
        if load_a <= load_b:
            a.append(i)
            load_a += lengths[i]
        else:
            b.append(i)
            load_b += lengths[i]
    return a, b


def balance_across_ranks(lengths: Sequence[int], max_tokens: int, dp_size: int,
                         multiple_of: int = 1) -> list[list[list[int]]]:
    """Per data-parallel rank, its micro-batches (lists of indices into ``lengths``).

    Guarantees: every index exactly once over all ranks; each micro-batch within ``max_tokens``;
    every rank has the same number of micro-batches, a multiple of ``multiple_of``; rank token loads are balanced
    greedily.
    """
    _check(lengths, max_tokens)
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    if len(lengths) < dp_size:
        raise ValueError(f"{len(lengths)} sequences cannot feed {dp_size} data-parallel ranks; "
                         "sample more prompts per step or use fewer ranks")
    groups = partition_by_load(lengths, dp_size)
    per_rank: list[list[list[int]]] = []
    for group in groups:
        local = [lengths[i] for i in group]
        per_rank.append([[group[j] for j in mb] for mb in pack_by_token_budget(local, max_tokens)])
    count = -(-max(len(r) for r in per_rank) // multiple_of) * multiple_of
    why = f" (a multiple of {multiple_of})" if multiple_of > 1 else ""
    return [_split_to_count(r, lengths, count, why) for r in per_rank]


def token_efficiency(micro_batches: Sequence[Sequence[int]], lengths: Sequence[int], max_tokens: int) -> float:
    """Real tokens over the token capacity of the micro-batches (``len(micro_batches) * max_tokens``)."""
    real = sum(lengths[i] for mb in micro_batches for i in mb)
    return real / (len(micro_batches) * max_tokens) if micro_batches else 0.0


def padded_efficiency(lengths: Sequence[int], micro_batch_size: int) -> float:
    """Real tokens over the tokens of fixed-size micro-batches each padded to its longest sequence."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    padded = sum(max(lengths[s:s + micro_batch_size]) * len(lengths[s:s + micro_batch_size])
                 for s in range(0, len(lengths), micro_batch_size))
    return sum(lengths) / padded if padded else 0.0


# The name the actor calls: per DP rank, its token-budget micro-batches.
pack_micro_batches = balance_across_ranks
