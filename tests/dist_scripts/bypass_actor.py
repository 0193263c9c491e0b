"""Bypass mode in the Megatron actor against the decoupled path it must equal on the first update.

usage: [torchrun --nproc_per_node P] python bypass_actor.py WS NAME

The spec's ``update1`` samples carry ``old_logprobs``: here they play the engine's log-probs (pi_rollout). From the
same HF weights this runs one ``train_mini_batch``
  bypass     with algo.rollout_correction bypass (weights, rejection and the batch mean from pi_theta inside the
             loss, denominators and the mean applied to the gradients afterwards);
  decoupled  with pi_old := pi_rollout, the correction computed up front from ``compute_logprobs`` (= pi_theta
             before the update) by ``rollout.correction.mismatch.apply_correction``;
and writes the metrics and exported weights of both to WS/out/NAME_rank<R>.pt.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

CORRECTION = {"is_level": "token", "is_threshold": [0.5, 2.0], "is_batch_normalize": True,
              "rs": ["token_k3", "seq_mean_k1"], "rs_thresholds": [0.08, [0.85, 1.2]]}


def run(ws: Path, spec: dict, bypass: bool) -> dict:
    from dapo_mcore.algo.rollout_correction import RolloutCorrectionConfig
    from dapo_mcore.rollout.correction.mismatch import apply_correction

    spec = copy.deepcopy(spec)
    corr = RolloutCorrectionConfig(**CORRECTION, bypass=bypass)
    spec["algo"]["rollout_correction"] = corr if bypass else RolloutCorrectionConfig()
    actor = c.make_actor(ws, spec, 1, 1)
    batch = c.samples(spec, "update1")
    for s in batch:
        s.extra["engine_logp"] = s.old_logprobs
    out: dict = {"initial": c.export(actor)}
    if not bypass:
        logps, _ = actor.compute_logprobs(batch)
        for s, lp in zip(batch, logps, strict=True):
            s.old_logprobs = lp  # pi_old = pi_theta before the update: what bypass sees in its forward
        out["correction"] = apply_correction(batch, RolloutCorrectionConfig(**CORRECTION))
        for s in batch:
            s.old_logprobs = s.extra["engine_logp"]  # the PPO ratio against pi_rollout, as in bypass
    out["metrics"] = actor.train_mini_batch(batch, lr=spec["lr"])
    out["weights"] = c.export(actor)
    return out


def main() -> None:
    ws, name = Path(sys.argv[1]), sys.argv[2]
    spec = c.read_spec(ws)
    env = c.start()
    results = {"bypass": run(ws, spec, True), "decoupled": run(ws, spec, False)}
    c.save(results, ws / "out" / f"{name}_rank{env.rank}.pt")
    from dapo_mcore.actor.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main()
