"""Route bytes per step with MoE routing replay, at the Qwen3-30B-A3B recipe's shape, by a shape-only simulation.

The recipe's step: 512 prompts x 16 responses trained (mean 256 + 8192 tokens; lengths drawn around it), 48 MoE
layers x top-8, int16 routes: 768 bytes a token. 128 GPUs: trainer TP=4 x DP=32, 32 engine groups (vLLM TP=4), each
group's leader holding the routes of the prompts it generated (``rollout.scheduling.gather.plan_shares``). No route
tensor is built: each sample's route bytes are its length x 768, and the real planning code decides what moves:
- before: routes travelling with the shared batch (``broadcast_shares``) reach every rank: each rank receives every
  route it did not generate.
- after: ``actor.route_exchange.plan_transfers`` over every rank's (holds, needs) table, where a rank needs the samples
  of its data-parallel rank's micro-batches (``data.packing.pack_micro_batches``, 22528-token budget), in the
  old-log-prob pass and every mini-batch update (32 prompts each).
Run: ``.venv/bin/python benchmarks/route_bytes.py``. Last line ``route_bytes_after_over_before: X``.
``--smoke``: 32 prompts x 4 rollouts on TP=4 x DP=2 with 2 engine groups (the same planning code, seconds; run in CI).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo_mcore.actor.route_exchange import plan_transfers  # noqa: E402
from dapo_mcore.data.packing import pack_micro_batches  # noqa: E402
from dapo_mcore.rollout.scheduling.gather import plan_shares  # noqa: E402

PROMPTS, N, MINI = 512, 16, 32
TP, DP, GROUPS, VLLM_TP = 4, 32, 32, 4
WORLD = TP * DP
BYTES_PER_TOKEN = 48 * 8 * 2
BUDGET = 22528


def _lengths(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(BUDGET, 256 + int(rng.expovariate(1 / 8192))) for _ in range(PROMPTS * N)]


def _holders() -> list[int]:
    """The rank holding each sample's routes: the leader (first rank) of the engine group that generated it."""
    owner = [0] * (PROMPTS * N)
    for g, share in enumerate(plan_shares(PROMPTS, N, GROUPS)):
        for p in share.indices:
            for j in range(N):
                owner[p * N + j] = g * VLLM_TP
    return owner


def _needed(lengths: list[int], start: int, count: int) -> list[set[int]]:
    """Per rank, the samples ``start..start+count`` its data-parallel rank trains on (rank = dp * TP + tp)."""
    per_dp = pack_micro_batches(lengths[start:start + count], BUDGET, DP)
    return [{start + i for mb in per_dp[r // TP] for i in mb} for r in range(WORLD)]


def after_bytes(lengths: list[int], owner: list[int]) -> list[int]:
    n = len(lengths)
    held: list[set[int]] = [set() for _ in range(WORLD)]
    for i, r in enumerate(owner):
        held[r].add(i)
    received = [0] * WORLD
    passes = [(0, n)] + [(s, MINI * N) for s in range(0, n, MINI * N)]  # old log-probs, then each update
    for start, count in passes:
        need = _needed(lengths, start, count)
        table = torch.zeros(WORLD, 5, n, dtype=torch.int64)
        for r in range(WORLD):
            table[r, 0, list(held[r])] = 1
            table[r, 1, list(need[r])] = 1
        for (_src, dst), idx in plan_transfers(table).items():
            received[dst] += sum(lengths[i] for i in idx) * BYTES_PER_TOKEN
            held[dst].update(idx)
    return received


def main(argv: list[str] | None = None) -> None:
    global PROMPTS, N, MINI, DP, GROUPS, WORLD
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true",
                    help="32 prompts x 4 on TP=4 x DP=2, 2 engine groups (a seconds-long check, run in CI)")
    if ap.parse_args(argv).smoke:
        PROMPTS, N, MINI, DP, GROUPS = 32, 4, 8, 2, 2
        WORLD = TP * DP
    lengths, owner = _lengths(), _holders()
    total = sum(lengths) * BYTES_PER_TOKEN
    mine = [0] * WORLD
    for i, r in enumerate(owner):
        mine[r] += lengths[i] * BYTES_PER_TOKEN
    before = [total - m for m in mine]
    after = after_bytes(lengths, owner)
    gb = 1e9
    print(f"shape: {PROMPTS} x {N} rollouts, {sum(lengths) / 1e6:.1f} M tokens, {BYTES_PER_TOKEN} B/token of routes: "
          f"{total / gb:.1f} GB of routes per step; {WORLD} ranks (TP {TP} x DP {DP}), {GROUPS} engine groups")
    print(f"before (routes with the shared batch): {sum(before) / gb:.0f} GB received over the job, "
          f"{max(before) / gb:.1f} GB max per rank")
    print(f"after  (each rank its samples' routes): {sum(after) / gb:.0f} GB received over the job, "
          f"{max(after) / gb:.2f} GB max per rank")
    print(f"route_bytes_after_over_before: {sum(after) / sum(before):.4f}")


if __name__ == "__main__":
    main()
