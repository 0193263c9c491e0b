"""The Megatron actor at several TP/PP/DP layouts, all from the same HF weights; results for pytest to compare.

usage: [torchrun --nproc_per_node P] python actor_layouts.py WS NAME TPxPP[,TPxPP...] [--straight]

Per layout (the model parallel groups are rebuilt for each) this records, on every rank:
  logits        full-vocab logits of a plain forward (conversion.verify.megatron_logits) on fixed ids
  logp_rows / entropy_rows / logp_packed / entropy_packed / logp_thd / entropy_thd   actor.compute_logprobs in
                the rows, packed (block-diagonal mask) and THD (cu_seqlens) layouts
  grads         forward + backward through Megatron's schedule: per-stage grad finiteness and norms
  metrics       two DAPO updates (train_mini_batch) from the same starting weights
  weights       the HF-named weights exported after them (export_hf_weights)
  elastic       the HF-named weights after loading the workspace's TP=1 trainer checkpoint into this layout
                (with 2 processes: at TP=2, PP=2 or DP=2): resharded on load
and writes them to WS/out/NAME_rank<R>.pt. With --straight, it then runs the uninterrupted resume baseline.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402


def grad_check(actor, batch, spec: dict) -> dict:
    """Forward and backward through get_forward_backward_func; every parameter of this stage gets a finite grad."""
    from megatron.core import parallel_state as ps

    from dapo_mcore.actor.logprobs import token_logprobs

    for m in actor.model:
        m.train()
    mbs = [actor._make_mb(batch, idx, with_loss_inputs=False) for idx in actor._my_micro_batches(batch)]

    def loss_fn(mb, logits):
        loss = -mb.gather_responses(token_logprobs(logits, mb.targets, spec["temperature"], spec["vocab_size"])).sum()
        return loss, {"loss": loss.detach()}

    actor._run(mbs, loss_fn, forward_only=False)
    grads = [p.main_grad.detach().clone() for m in actor.model for p in m.module.parameters()]
    out = {"stage": ps.get_pipeline_model_parallel_rank(), "num_params": len(grads),
           "all_finite": all(bool(torch.isfinite(g).all()) for g in grads),
           "num_nonzero": sum(int(g.abs().sum() > 0) for g in grads),
           "sq_norm": float(sum(g.double().pow(2).sum() for g in grads))}
    for m in actor.model:
        m.zero_grad_buffer()
    actor.optimizer.zero_grad()
    return out


def check_layout(ws: Path, spec: dict, tp: int, pp: int) -> dict:
    from conversion.verify import megatron_logits
    from dapo_mcore.actor import checkpoint as ckpt

    actor = c.make_actor(ws, spec, tp, pp)
    res: dict = {"logits": megatron_logits(actor.chunks, torch.tensor(spec["ids"]), spec["vocab_size"])}
    batch = c.samples(spec)
    res["logp_rows"], res["entropy_rows"] = actor.compute_logprobs(batch, with_entropy=True)
    res["num_micro_batches"] = len(actor._my_micro_batches(batch))
    actor.layout = "packed"
    res["logp_packed"], res["entropy_packed"] = actor.compute_logprobs(batch, with_entropy=True)
    actor.layout = "thd"  # packed with cu_seqlens: the SDPA core attention's varlen path
    res["logp_thd"], res["entropy_thd"] = actor.compute_logprobs(batch, with_entropy=True)
    actor.layout = "rows"
    res["grads"] = grad_check(actor, batch, spec)
    res["metrics"] = [actor.train_mini_batch(c.samples(spec, key), lr=spec["lr"]) for key in ("update1", "update2")]
    res["weights"] = c.export(actor)
    tp1_ckpt = ws / "ckpt_tp1"
    if torch.distributed.get_world_size() > 1 and tp1_ckpt.is_dir():
        state = ckpt.load_checkpoint(tp1_ckpt, actor)
        res["elastic"] = {"state": state, "weights": c.export(actor)}
    return res


def main() -> None:
    ws, name, layouts = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    spec = c.read_spec(ws)
    env = c.start()
    results = {}
    for layout in layouts.split(","):
        tp, pp = (int(x) for x in layout.split("x"))
        dp = env.world_size // (tp * pp)
        results[f"tp{tp}_pp{pp}_dp{dp}"] = check_layout(ws, spec, tp, pp)
    c.save(results, ws / "out" / f"{name}_rank{env.rank}.pt")
    if "--straight" in sys.argv:
        import actor_resume

        actor_resume.straight(ws, spec)
    from dapo_mcore.actor.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main()
