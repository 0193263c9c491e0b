"""Sequence packing vs fixed-size padded micro-batches on a DAPO-like length distribution.

Lengths: prompts uniform-ish in 50..2048 tokens (log-uniform), responses long-tailed up to 20480
(log-normal, clipped; a few hit the cap like DAPO's truncated responses). Packed micro-batches hold at
most ``--budget`` tokens, concatenated THD-style: the only padding is each sequence rounded up to a
multiple of ``--align`` tokens (TE's THD/FP8 kernels want that), so efficiency = real / aligned tokens.
The budget fill (real / (micro-batches x budget)) is printed beside it: it sets memory headroom and the
micro-batch count, not wasted compute. Padded micro-batches hold ``--mbs`` sequences each padded to its
longest (efficiency = real / padded tokens), the classic fixed-size baseline.
Both are measured in this process on the same lengths. Last line: ``packed_token_efficiency: X``.
``--smoke``: 64 sequences over 2 ranks (the same code, seconds; run in CI).
"""

from __future__ import annotations

import argparse
import math
import random
import time

from dapo_mcore.data.packing import balance_across_ranks, padded_efficiency, token_efficiency


def dapo_like_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lengths = []
    for _ in range(n):
        prompt = int(math.exp(rng.uniform(math.log(50), math.log(2048))))
        response = min(20480, max(1, int(rng.lognormvariate(math.log(2500), 0.9))))
        lengths.append(prompt + response)
    return lengths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=512, help="responses per step (DAPO: 512 per mini-batch)")
    ap.add_argument("--dp", type=int, default=8, help="data-parallel ranks")
    ap.add_argument("--budget", type=int, default=2 * 22528, help="packed micro-batch token budget")
    ap.add_argument("--mbs", type=int, default=4, help="padded baseline: sequences per micro-batch")
    ap.add_argument("--align", type=int, default=16, help="packed: pad each sequence to a multiple of this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="64 sequences over 2 ranks (a seconds-long check, run in CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sequences, args.dp = 64, 2
    lengths = dapo_like_lengths(args.sequences, args.seed)
    t0 = time.perf_counter()
    ranks = balance_across_ranks(lengths, args.budget, args.dp)
    pack_s = time.perf_counter() - t0
    micro_batches = [mb for rank in ranks for mb in rank]
    fill = token_efficiency(micro_batches, lengths, args.budget)
    aligned = sum(-(-lengths[i] // args.align) * args.align for mb in micro_batches for i in mb)
    packed = sum(lengths) / aligned
    # Padded baseline: the same ranks' sequences in arrival order, fixed micro-batch size.
    shard = [lengths[r::args.dp] for r in range(args.dp)]
    padded_num = sum(sum(s) for s in shard)
    padded_den = sum(sum(s) / padded_efficiency(s, args.mbs) for s in shard)
    padded = padded_num / padded_den
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in ranks]
    print(f"sequences={len(lengths)} tokens={sum(lengths)} max_len={max(lengths)} "
          f"mean_len={sum(lengths) / len(lengths):.0f} dp={args.dp}")
    print(f"packed : budget={args.budget} micro_batches_per_rank={len(ranks[0])} efficiency={packed:.4f} "
          f"budget_fill={fill:.4f} "
          f"rank_load_max/mean={max(loads) / (sum(loads) / len(loads)):.4f} pack_time_s={pack_s:.4f}")
    print(f"padded : micro_batch_size={args.mbs} efficiency={padded:.4f}")
    print(f"packed/padded efficiency ratio: {packed / padded:.2f}x")
    print(f"packed_token_efficiency: {packed:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
