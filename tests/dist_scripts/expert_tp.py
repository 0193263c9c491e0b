"""Qwen3-MoE at TP=2 (sequence parallel) x EP=2 on 4 gloo ranks, expert-TP 2 (= TP) and 1, from the same HF weights.

usage: torchrun --nproc_per_node 4 expert_tp.py WS

For each expert-TP (the model parallel groups rebuilt each time) it records, on every rank: the actor's log-probs of
fixed samples, two DAPO updates (loss, grad norm, ...), the HF-named weights exported after them, the names of the
checkpoint's rank files it saved, and a third update after the save. Then an expert-TP 2 actor loads the expert-TP 1
checkpoint (experts resharded over the expert-TP ranks, their Adam moments too), exports, and makes the third update
again. Writes WS/out_rank<R>.pt for pytest.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402


def make_actor(ws: Path, spec: dict, etp: int):
    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig

    init_model_parallel(2, 1, seed=spec["seed"], expert_parallel=2, expert_tensor_parallel=etp)
    hf = json.loads((ws / "hf" / "config.json").read_text())
    settings = ActorSettings(
        hf_config=hf, tensor_parallel=2, sequence_parallel=True, expert_parallel=2, expert_tensor_parallel=etp,
        make_vocab_size_divisible_by=spec["vocab_div"], micro_batch_tokens=spec["micro_batch_tokens"],
        temperature=spec["temperature"], lr=spec["lr"], eps=spec["adam_eps"], weight_decay=spec["weight_decay"],
        grad_clip=spec["grad_clip"], algo=AlgoConfig(**spec["algo"]), layout="rows")
    actor = MegatronActor(settings)
    actor.load_hf(str(ws / "hf"))
    return actor


def run_layout(ws: Path, spec: dict, etp: int) -> dict:
    from dapo_mcore.actor import checkpoint as ckpt

    actor = make_actor(ws, spec, etp)
    batch = c.samples(spec)
    res: dict = {"logp": actor.compute_logprobs(batch)[0]}
    res["metrics"] = [actor.train_mini_batch(c.samples(spec, key), lr=spec["lr"]) for key in ("update1", "update2")]
    res["weights"] = c.export(actor)
    saved = ckpt.save_checkpoint(ws / f"ckpt_etp{etp}", 2, actor, {"step": 2}, keep_last=1)
    res["files"] = sorted(p.name for p in (saved / "model").glob("mp_rank_*"))
    res["optim_files"] = sorted(p.name for p in (saved / "optim" / "exp_avg").glob("mp_rank_*"))
    res["update3"] = actor.train_mini_batch(c.samples(spec, "update3"), lr=spec["lr"])
    res["weights3"] = c.export(actor)
    return res


def main() -> None:
    from dapo_mcore.actor import checkpoint as ckpt
    from dapo_mcore.actor.parallel import shutdown

    ws = Path(sys.argv[1])
    spec = c.read_spec(ws)
    env = c.start()
    out = {f"etp{etp}": run_layout(ws, spec, etp) for etp in (2, 1)}
    actor = make_actor(ws, spec, 2)  # the expert-TP 1 checkpoint, resharded to expert-TP 2
    ckpt.load_checkpoint(ws / "ckpt_etp1" / "step_000002", actor)
    out["resharded"] = {"weights": c.export(actor)}
    out["resharded"]["update3"] = actor.train_mini_batch(c.samples(spec, "update3"), lr=spec["lr"])
    out["resharded"]["weights3"] = c.export(actor)
    c.save(out, ws / f"out_rank{env.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
