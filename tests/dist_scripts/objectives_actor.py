"""The GSPO, CISPO and RLOO updates through the Megatron actor at several micro-batch splits and data-parallel sizes.

usage: [torchrun --nproc_per_node P] python objectives_actor.py WS NAME COUNTS [PP [LAYOUT]]

COUNTS: comma-separated micro-batch counts per rank (e.g. "1,2,3"). For each variant of ``VARIANTS`` and each count,
a fresh actor (TP=1, PP (default 1), DP = the rest of the world; LAYOUT rows (default) | packed | thd) from the
workspace's HF weights runs one ``train_mini_batch`` on the
spec's ``update1`` samples with ``actor.micro_batch_tokens`` chosen to give that many micro-batches; the gradient the
optimizer sees (the DP-reduced ``main_grad``) is captured, with the update's metrics and the actor's log-probs before
the update. Written to WS/out/NAME_rank<R>.pt.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

# name: (algo overrides, advantage estimator); clip ranges wide enough that some sequences/tokens clip, not all
VARIANTS = {
    "gspo": ({"objective": "gspo", "clip_low": 0.05, "clip_high": 0.05, "loss_agg": "seq-mean-token-mean"}, "grpo"),
    "cispo": ({"objective": "cispo", "clip_low": 1.0, "clip_high": 0.2, "loss_agg": "token-mean"}, "grpo"),
    "rloo": ({"objective": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token-mean",
              "advantage_estimator": "rloo", "norm_adv_by_std": False}, "rloo"),
    # multi-turn: tool-output spans (loss mask 0, engine log-prob NaN) in bypass mode with token IS, so the NaN is
    # the PPO ratio's old log-prob and the IS weight's input
    "tools": ({"objective": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token-mean"}, "grpo"),
}
TIS_CAP = 2.0


def with_tool_spans(batch: list[dict]) -> list[dict]:
    """``update1`` as a multi-turn batch: tokens 1 and 2 of every response of 4+ tokens are tool output (mask 0,
    old log-prob NaN, as the engine reports them); the rest keeps its mask."""
    out = copy.deepcopy(batch)
    for s in out:
        n = len(s["response"])
        if n >= 4:
            mask = list(s.get("loss_mask", [1.0] * n))
            mask[1:3] = [0.0, 0.0]
            s["loss_mask"] = mask
            s["old_logprobs"][1:3] = [float("nan")] * 2
    return out
REWARDS = [[1.0, -1.0, -1.0, 1.0], [-1.0, -1.0, 1.0, -1.0]]  # update1's 8 samples as 2 groups of 4


def samples_for(spec: dict, estimator: str):
    from dapo_mcore.algo.advantages import group_advantages

    batch = c.samples(spec, "update1")
    adv = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), norm_by_std=estimator == "grpo",
                           estimator=estimator).reshape(-1)
    for s, a in zip(batch, adv.tolist(), strict=True):
        s.advantage = a
    return batch


def budget_for(batch, count: int, dp: int) -> int:
    """The largest micro_batch_tokens that packs this rank's share into exactly ``count`` micro-batches."""
    from dapo_mcore.data.packing import pack_micro_batches

    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in batch]
    for budget in range(sum(lengths), max(lengths) - 1, -1):
        if len(pack_micro_batches(lengths, budget, dp)[0]) == count:
            return budget
    raise AssertionError(f"no token budget gives {count} micro-batches")


def run(ws: Path, spec: dict, variant: str, count: int, dp: int, pp: int = 1, layout: str = "rows") -> dict:
    overrides, estimator = VARIANTS[variant]
    spec = copy.deepcopy(spec)
    spec["algo"] = {**spec["algo"], **overrides}
    if variant == "tools":
        from dapo_mcore.algo.rollout_correction_config import RolloutCorrectionConfig

        spec["update1"] = with_tool_spans(spec["update1"])
        spec["algo"]["rollout_correction"] = RolloutCorrectionConfig(bypass=True, is_level="token",
                                                                     is_threshold=TIS_CAP)
    batch = samples_for(spec, estimator)
    spec["micro_batch_tokens"] = budget_for(batch, count, dp)
    actor = c.make_actor(ws, spec, 1, pp)
    actor.layout = layout
    assert len(actor._my_micro_batches(batch)) == count
    logps, _ = actor.compute_logprobs(batch)
    grads: list[torch.Tensor] = []
    step = actor.optimizer.step

    def capture():
        grads.append(torch.cat([p.main_grad.detach().double().flatten() for m in actor.model
                                for p in m.module.parameters()]))
        return step()

    actor.optimizer.step = capture
    metrics = actor.train_mini_batch(batch, lr=spec["lr"])
    return {"metrics": metrics, "grad": grads[0], "logp": logps, "adv": [s.advantage for s in batch]}


def main() -> None:
    ws, name, counts = Path(sys.argv[1]), sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    pp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    layout = sys.argv[5] if len(sys.argv) > 5 else "rows"
    spec = c.read_spec(ws)
    env = c.start()
    results = {(v, n): run(ws, spec, v, n, env.world_size // pp, pp, layout) for v in VARIANTS for n in counts}
    c.save(results, ws / "out" / f"{name}_rank{env.rank}.pt")
    from dapo_mcore.actor.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main()
