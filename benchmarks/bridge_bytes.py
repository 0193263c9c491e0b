"""Bytes a step's batch costs in async mode, before and after ``rollout.pipeline.wire``, by a shape-only model.

The 32B async recipe (examples/qwen2.5-32b-fp8-async.yaml) draws 1536 prompts x 16 responses of up to 20480 tokens a
generation batch, keeps 512 groups, and trains on 32 ranks. Such a batch (503 M tokens at full length) is not built:
real messages (the real StepBatch/GroupData/Response classes, token ids uniform over Qwen2.5's 152064, float32
log-probs) are built at three small shapes, and each format's bytes are fitted exactly as ``fixed + per group x groups
+ per token x tokens`` (every format here is linear in those counts; a fourth shape checks the fit), then priced at
the recipe's shape. Two legs per step:
- ``bridge``: engine rank 0 -> trainer rank 0, one message with every generated group;
- ``fan-out``: trainer rank 0 -> each other trainer rank (31 here). Before: the whole pickled message to each
  (``broadcast_object_list``); after: the kept groups whole, the others without responses (``wire.light``), packed.
Run: ``.venv/bin/python benchmarks/bridge_bytes.py [--tokens 20480]``. Last line ``bridge_bytes_after_over_before: X``
(both legs together; < 1: fewer bytes). ``--smoke``: priced at 24 prompts x 64 tokens on 2 ranks (run in CI).
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo_mcore.algo.dynamic_sampling import SamplingStats  # noqa: E402
from dapo_mcore.data.records import PromptRecord  # noqa: E402
from dapo_mcore.rollout.pipeline import wire  # noqa: E402
from dapo_mcore.rollout.pipeline.source import StepBatch  # noqa: E402
from dapo_mcore.rollout.protocol import Response  # noqa: E402
from dapo_mcore.rollout.scheduling.groups import GroupData  # noqa: E402

VOCAB, GROUP = 152064, 16


def message(groups: int, tokens: int, kept_every: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    made = []
    for i in range(groups):
        responses = [Response(torch.randint(0, VOCAB, (tokens,), generator=g).tolist(),
                              (-torch.rand(tokens, generator=g) * 5).tolist(), "length") for _ in range(GROUP)]
        made.append(GroupData(record=PromptRecord(f"prompt {i} " * 20, "42", "math", i), prompt_ids=list(range(300)),
                              responses=responses, scores=[1.0] * GROUP, acc=[True] * GROUP, rewards=[1.0] * GROUP,
                              gen_batch=0, preds=["42"] * GROUP, kept=i % kept_every == 0))
    batch = StepBatch(kept=[x for x in made if x.kept], generated=made, stats=SamplingStats())
    return {"kind": "batch", "step": 1, "batch": batch, "state": {}, "version": 0, "prefix_version": 0,
            "transfer_s": 0.0, "seconds": {}}


def sizes(groups: int, tokens: int) -> dict[str, int]:
    m = message(groups, tokens)
    return {"pickle": len(pickle.dumps(m)), "packed": wire.pack(m).nbytes,
            "light_packed": wire.pack(wire.light(m)).nbytes}


def fit(shapes: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Per format: (fixed, per group, per token) from three shapes (groups, tokens per response)."""
    got = [sizes(*s) for s in shapes]
    a = torch.tensor([[1.0, g, g * GROUP * t] for g, t in shapes], dtype=torch.float64)
    return {k: torch.linalg.solve(a, torch.tensor([x[k] for x in got], dtype=torch.float64)) for k in got[0]}


def price(coef: torch.Tensor, groups: int, tokens: int) -> float:
    return float(coef @ torch.tensor([1.0, groups, groups * GROUP * tokens], dtype=torch.float64))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=1536)
    ap.add_argument("--kept", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=20480, help="tokens per response (the recipe's maximum)")
    ap.add_argument("--trainer-ranks", type=int, default=32)
    ap.add_argument("--smoke", action="store_true",
                    help="price a 24-prompt, 64-token, 2-rank step (the same fit; a seconds-long check, run in CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.kept, args.tokens, args.trainer_ranks = 24, 8, 64, 2
    coef = fit([(6, 64), (6, 128), (12, 64)])
    check = sizes(9, 96)  # kept_every=3: 3 of 9 kept
    for key, want in check.items():
        assert abs(price(coef[key], 9, 96) - want) / want < 0.01, (key, price(coef[key], 9, 96), want)
    # The light message is fitted with a third of the groups kept, the recipe's 512 of 1536.
    assert args.prompts == 3 * args.kept, "the fit keeps one group in three (kept_every=3)"
    light = price(coef["light_packed"], args.prompts, args.tokens)
    before_bridge = price(coef["pickle"], args.prompts, args.tokens)
    after_bridge = price(coef["packed"], args.prompts, args.tokens)
    fan = args.trainer_ranks - 1
    before, after = before_bridge * (1 + fan), after_bridge + fan * light
    gb = 1e9
    print(f"shape: {args.prompts} prompts x {GROUP} responses x {args.tokens} tokens, {args.kept} kept, "
          f"{args.trainer_ranks} trainer ranks")
    print(f"per token: pickle {coef['pickle'][2].item():.2f} B, packed {coef['packed'][2].item():.2f} B")
    print(f"bridge  (engine rank 0 -> trainer rank 0): before {before_bridge / gb:.2f} GB, after {after_bridge / gb:.2f}"
          f" GB")
    print(f"fan-out (trainer rank 0 -> {fan} ranks): before {before_bridge * fan / gb:.1f} GB, after "
          f"{fan * light / gb:.1f} GB")
    print(f"bridge_bytes_after_over_before: {after / before:.3f}")


if __name__ == "__main__":
    main()
