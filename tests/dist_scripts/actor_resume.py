"""Exact resume after kill -9: run DAPO updates straight, or stop at a checkpoint and die, or resume.

usage: python actor_resume.py WS MODE
  straight  N steps from the HF weights; per-step metrics -> WS/out/straight_log.json, weights -> straight.pt
  killed    k steps, save_checkpoint(k), one more step, then SIGKILL itself in the middle of save_checkpoint(k+1)
  resume    find_latest -> load_checkpoint -> steps k+1..N, save N (prunes); then models of another shape are refused
  elastic   (2 processes) the TP=1 checkpoint of step k resumed at TP=2: step k+1, saved; that one resumed at PP=2:
            steps k+2..N, and again with the optimizer state dropped (weights_only). Per-step metrics ->
            WS/out/elastic_log.json, final weights of both -> elastic.pt

Each step draws its samples from the global torch RNG (so the RNG state must be restored exactly), takes
on-policy old log-probs from the actor, and runs two mini-batch updates (so the second one is off-policy and
Adam's moments carry over). Everything but `elastic` runs in one process (TP=PP=DP=1).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402


def draw_samples(spec: dict):
    from dapo_mcore.actor.megatron_actor import TrainSample

    vocab = spec["vocab_size"]
    out = []
    for _ in range(spec["resume_batch"]):
        plen, rlen = int(torch.randint(2, 7, (1,))), int(torch.randint(1, 7, (1,)))
        out.append(TrainSample(torch.randint(3, vocab, (plen,)).tolist(), torch.randint(3, vocab, (rlen,)).tolist(),
                               advantage=float(torch.randn(1))))
    return out


def run_steps(actor, spec: dict, first: int, last: int, log_path: Path, on_step_end=None) -> list[dict]:
    """Steps first..last (inclusive); appends each step's metrics to log_path as it goes."""
    log = json.loads(log_path.read_text()) if log_path.is_file() else []
    for step in range(first, last + 1):
        batch = draw_samples(spec)
        logps, _ = actor.compute_logprobs(batch)
        for sample, lp in zip(batch, logps, strict=True):
            sample.old_logprobs = lp
        half = len(batch) // 2
        metrics = [actor.train_mini_batch(part, lr=spec["lr"]) for part in (batch[:half], batch[half:])]
        log.append({"step": step, "loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics]})
        log_path.write_text(json.dumps(log))
        if on_step_end is not None:
            on_step_end(step)
    return log


def straight(ws: Path, spec: dict) -> None:
    actor = c.make_actor(ws, spec, 1, 1)
    torch.manual_seed(spec["resume_seed"])
    log_path = ws / "out" / "straight_log.json"
    log_path.unlink(missing_ok=True)
    run_steps(actor, spec, 1, spec["resume_steps"], log_path)
    c.save(c.export(actor), ws / "out" / "straight.pt")


def killed(ws: Path, spec: dict) -> None:
    from dapo_mcore.actor import checkpoint as ckpt

    actor = c.make_actor(ws, spec, 1, 1)
    torch.manual_seed(spec["resume_seed"])
    k, root = spec["resume_k"], ws / "ckpt"

    def die_inside_save(*args, **kwargs):
        # Model and optimizer files of step k+1 are written by now; COMPLETE and the rename are not.
        os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(step: int) -> None:
        if step == k:
            ckpt.save_checkpoint(root, k, actor, {"step": k}, keep_last=2)
        elif step == k + 1:
            ckpt._rng_state = die_inside_save
            ckpt.save_checkpoint(root, k + 1, actor, {"step": k + 1}, keep_last=2)
            raise AssertionError("the process should have been killed inside save_checkpoint")

    run_steps(actor, spec, 1, k + 1, ws / "out" / "killed_log.json", on_step_end)


def resume(ws: Path, spec: dict) -> None:
    from dapo_mcore.actor import checkpoint as ckpt

    actor = c.make_actor(ws, spec, 1, 1)
    torch.manual_seed(12345)  # a different RNG state: load_checkpoint must restore the saved one
    found = ckpt.find_latest(ws / "ckpt")
    state = ckpt.load_checkpoint(found, actor)
    run_steps(actor, spec, state["step"] + 1, spec["resume_steps"], ws / "out" / "resume_log.json")
    result = {"found": found.name, "state": state, "weights": c.export(actor), "mismatch": {}}
    # The next save completes, prunes to keep_last and removes the .partial left by the killed run.
    final = ckpt.save_checkpoint(ws / "ckpt", spec["resume_steps"], actor, {"step": spec["resume_steps"]}, keep_last=1)
    result["entries_after_next_save"] = sorted(p.name for p in (ws / "ckpt").iterdir())
    for name, change in spec["mismatch_shapes"].items():
        hf = json.loads((ws / "hf" / "config.json").read_text())
        hf.update(change)
        other = c.make_actor(ws, spec, 1, 1, hf_config=hf, load=False)
        before = c.params_snapshot(other)
        try:
            ckpt.load_checkpoint(final, other)
            message = None
        except ValueError as err:  # CheckpointError is a ValueError
            message = f"{type(err).__name__}: {err}"
        result["mismatch"][name] = {"error": message, "untouched": c.same_params(before, c.params_snapshot(other))}
    c.save(result, ws / "out" / "resume.pt")


def elastic(ws: Path, spec: dict) -> None:
    from dapo_mcore.actor import checkpoint as ckpt

    k, n, root = spec["resume_k"], spec["resume_steps"], ws / "ckpt_elastic"
    rank = torch.distributed.get_rank()
    log_path = ws / "out" / ("elastic_log.json" if rank == 0 else f"elastic_log_rank{rank}.json")
    actor = c.make_actor(ws, spec, 2, 1, load=False)
    torch.manual_seed(12345 + rank)  # ranks disagree until load_checkpoint restores the saved state on both
    state = ckpt.load_checkpoint(ws / "ckpt_tp1", actor)
    assert state["step"] == k, state
    run_steps(actor, spec, k + 1, k + 1, log_path)
    ckpt.save_checkpoint(root, k + 1, actor, {"step": k + 1}, keep_last=2)
    actor = c.make_actor(ws, spec, 1, 2, load=False)
    torch.manual_seed(54321 + rank)
    state = ckpt.load_checkpoint(ckpt.find_latest(root), actor)
    assert state["step"] == k + 1, state
    run_steps(actor, spec, k + 2, n, log_path)
    weights = c.export(actor)
    # Guard for the test's tolerance: the same steps with the optimizer state dropped (run.resume_weights_only).
    actor = c.make_actor(ws, spec, 1, 2, load=False)
    ckpt.load_checkpoint(ckpt.find_latest(root), actor, weights_only=True)
    fresh_log = ws / "out" / f"elastic_fresh_log_rank{rank}.json"
    run_steps(actor, spec, k + 2, n, fresh_log)
    fresh = c.export(actor)
    if rank == 0:
        c.save({"weights": weights, "fresh_optimizer_weights": fresh}, ws / "out" / "elastic.pt")


def bf16(ws: Path, spec: dict) -> None:
    """A bf16 actor (fp32 main parameters in the optimizer) saved after one step and loaded into a fresh one:
    Adam's moments, the main parameters and the step come back bit-exact, and the next step matches."""
    from dapo_mcore.actor import checkpoint as ckpt
    from dapo_mcore.actor.optim_state import _targets

    torch.manual_seed(spec["resume_seed"])
    a = c.make_actor(ws, spec, 1, 1, params_dtype=torch.bfloat16)
    run_steps(a, spec, 1, 1, ws / "out" / "bf16_a.json")
    ckpt.save_checkpoint(ws / "ckpt_bf16", 1, a, {"step": 1}, keep_last=1)
    b = c.make_actor(ws, spec, 1, 1, params_dtype=torch.bfloat16, load=False)
    ckpt.load_checkpoint(ckpt.find_latest(ws / "ckpt_bf16"), b)

    def opt_state(actor) -> dict:
        targets, *_ = _targets(actor)
        out = {}
        for key, (target, opt) in targets.items():
            st = opt.state[target]
            out[key] = {"main": target.detach().clone(), "dtype": str(target.dtype), "step": float(st["step"]),
                        "exp_avg": st["exp_avg"].clone(), "exp_avg_sq": st["exp_avg_sq"].clone()}
        return out

    result = {"saved": opt_state(a), "loaded": opt_state(b), "kinds": sorted(p.name for p in
                                                                          (ws / "ckpt_bf16" / "step_000001" / "optim").iterdir())}
    state = torch.get_rng_state()
    run_steps(a, spec, 2, 2, ws / "out" / "bf16_a.json")
    torch.set_rng_state(state)
    run_steps(b, spec, 2, 2, ws / "out" / "bf16_b.json")
    result["next_a"] = json.loads((ws / "out" / "bf16_a.json").read_text())[-1]
    result["next_b"] = json.loads((ws / "out" / "bf16_b.json").read_text())[-1]
    c.save(result, ws / "out" / "bf16.pt")


def main() -> None:
    ws, mode = Path(sys.argv[1]), sys.argv[2]
    spec = c.read_spec(ws)
    c.start()
    {"straight": straight, "killed": killed, "resume": resume, "elastic": elastic,
     "bf16": bf16}[mode](ws, spec)
    from dapo_mcore.actor.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main()
