"""Reward throughput: the math verifier in process vs through the worker pool, on the same responses.

10,000 synthetic responses of 50 to 3,000 words, ending in a right, wrong or missing "Answer:" line.
Last line: ``reward_answers_per_s: X`` (in process). ``--smoke``: 200 responses, one worker (seconds; run in CI).
"""

from __future__ import annotations

import argparse
import os
import random
import time

from dapo_mcore.reward import compute_score
from dapo_mcore.reward.pool import RewardPool

WORDS = ("the of and to we so then therefore let sum number integer square root divide multiply equation "
         "solve since thus hence value case \\frac{1}{2} $x$ = + 12 340").split()


def make_responses(n: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    responses, gts = [], []
    for _ in range(n):
        gt = str(rng.randint(0, 99_999))
        body = " ".join(rng.choices(WORDS, k=rng.randint(50, 3000)))
        ending = rng.choice([f"\nAnswer: {gt}", f"\nAnswer: {int(gt) + 1}", f"\nAnswer: ${gt}$ dollars",
                             f"\nAnswer: \\boxed{{{int(gt):,}}}", "\nI could not finish"])
        responses.append(body + ending)
        gts.append(gt)
    return responses, gts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="200 responses, one worker (a seconds-long check, run in CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.workers = 200, 1
    responses, gts = make_responses(args.n, args.seed)
    chars = sum(map(len, responses))
    print(f"{args.n} responses, {chars / args.n:,.0f} characters on average")

    start = time.perf_counter()
    local = [compute_score(r, g) for r, g in zip(responses, gts, strict=True)]
    in_process = args.n / (time.perf_counter() - start)

    with RewardPool("math_dapo", num_workers=args.workers, timeout_s=10.0) as pool:
        pool.score(responses[:100], gts[:100])  # warm-up: imports in the workers
        start = time.perf_counter()
        pooled = pool.score(responses, gts)
        through_pool = args.n / (time.perf_counter() - start)
    assert pooled == local, "pool and in-process results differ"

    acc = sum(r.acc for r in local) / args.n
    print(f"accuracy of the synthetic set: {acc:.3f}")
    print(f"in process:              {in_process:12,.0f} answers/s")
    print(f"pool ({args.workers} workers):        {through_pool:12,.0f} answers/s  "
          f"(ratio pool/in-process {through_pool / in_process:.2f})")
    print(f"reward_answers_per_s: {in_process:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
