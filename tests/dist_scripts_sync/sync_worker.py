"""torchrun worker of tests/test_weight_sync_distributed.py: Megatron actor (2 gloo processes) -> HFEngine sync.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/dist_scripts_sync/sync_worker.py WORKSPACE

WORKSPACE holds ``spec.json`` (cases, prompts, sampling settings) and, per tie setting, two HF model dirs the
pytest side wrote: ``base_tie{0,1}`` (the engine's starting weights) and ``ref_tie{0,1}`` (the perturbed
reference the actor loads). For every case (tp, pp, tie) each rank:

1. builds a ``MegatronActor`` at that layout, loads ``ref``; builds an ``HFEngine`` on ``base`` (other weights);
2. generates before any sync, syncs (``actor.export_hf_weights`` -> ``engine.update_weights``, small buckets),
   generates greedily and sampled, and scores the sampled tokens with ``actor.compute_logprobs``;
3. makes one optimizer update (``train_mini_batch``), syncs again, checks the engine's parameters equal the
   exported tensors bitwise, generates again, scores with the actor, and checks greedy tokens / log-probs
   against the Megatron model's own logits (``conversion.verify.megatron_logits``);
4. once, syncs with two layers' names swapped and records how far the log-probs move (the checks must see it).

Everything is written to ``results_<rank>.json``; the pytest side compares it with Hugging Face's own model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def _generate(engine, prompts, spec, kind: str) -> list[dict]:
    from dapo_mcore.rollout import SamplingParams

    if kind == "greedy":
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=spec["max_new_tokens"])
    else:
        params = SamplingParams(n=spec["n"], temperature=spec["temperature"], max_new_tokens=spec["max_new_tokens"],
                                seed=spec["seed"])
    out = engine.generate(prompts, params)
    return [{"prompt": i, "tokens": r.token_ids, "logprobs": r.logprobs, "finish": r.finish_reason}
            for i, group in enumerate(out) for r in group]


def _actor_logprobs(actor, prompts, rows: list[dict]) -> list[list[float]]:
    from dapo_mcore.actor.megatron_actor import TrainSample

    samples = [TrainSample(prompt_ids=prompts[r["prompt"]], response_ids=r["tokens"]) for r in rows]
    logps, _ = actor.compute_logprobs(samples)
    return [lp.tolist() for lp in logps]


def _megatron_greedy_check(actor, prompts, rows: list[dict], vocab: int) -> dict:
    """Greedy tokens vs the argmax of the Megatron model's own logits, and their log-probs (temperature 1)."""
    from conversion.verify import megatron_logits

    agree, worst, min_margin = True, 0.0, float("inf")
    for r in rows:
        ids = torch.tensor([prompts[r["prompt"]] + r["tokens"]])
        logits = megatron_logits(actor.chunks, ids, vocab)[0].float()
        start = len(prompts[r["prompt"]]) - 1
        step = logits[start:start + len(r["tokens"])]
        tokens = torch.tensor(r["tokens"])
        agree = agree and torch.equal(step.argmax(-1), tokens)
        top2 = step.topk(2, dim=-1).values
        min_margin = min(min_margin, float((top2[:, 0] - top2[:, 1]).min()))
        ref = torch.log_softmax(step, -1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        worst = max(worst, float((ref - torch.tensor(r["logprobs"])).abs().max()))
    return {"argmax_agrees": agree, "logprob_max_abs_diff": worst, "min_top2_margin": min_margin}


def _sync(actor, engine, bucket_bytes: int, rename=None) -> dict[str, torch.Tensor]:
    """One full sync; returns what was exported (HF name -> tensor, after any rename)."""
    exported: dict[str, torch.Tensor] = {}
    n_buckets = 0

    def stream():
        nonlocal n_buckets
        for bucket in actor.export_hf_weights(bucket_bytes=bucket_bytes):
            n_buckets += 1
            bucket = [(rename(n) if rename else n, t) for n, t in bucket]
            exported.update(bucket)
            yield bucket

    engine.update_weights(stream())
    assert n_buckets > 1, "the test means to exercise several buckets"
    return exported


def _swap_layers(name: str) -> str:
    for a, b in (("layers.0.", "layers.1."), ("layers.1.", "layers.0.")):
        if f".{a}" in name:
            return name.replace(f".{a}", f".{b}")
    return name


def _train_once(actor, prompts, rows, logps, lr: float) -> dict:
    from dapo_mcore.actor.megatron_actor import TrainSample

    samples = [TrainSample(prompt_ids=prompts[r["prompt"]], response_ids=r["tokens"], old_logprobs=torch.tensor(lp),
                           advantage=1.0 if i % 3 else -1.0) for i, (r, lp) in enumerate(zip(rows, logps, strict=True))]
    return actor.train_mini_batch(samples, lr=lr)


def _run_case(ws: Path, spec: dict, tp: int, pp: int, tie: bool, mutate: bool) -> dict:
    from transformers import Qwen2ForCausalLM

    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig
    from dapo_mcore.rollout import HFEngine

    init_model_parallel(tp, pp, seed=3)
    ref_dir, base_dir = ws / f"ref_tie{int(tie)}", ws / f"base_tie{int(tie)}"
    hf_config = json.loads((ref_dir / "config.json").read_text())
    actor = MegatronActor(ActorSettings(hf_config=hf_config, tensor_parallel=tp, pipeline_parallel=pp,
                                        make_vocab_size_divisible_by=128, temperature=spec["temperature"],
                                        micro_batch_tokens=256, algo=AlgoConfig(), lr=spec["lr"]))
    actor.load_hf(str(ref_dir))
    engine = HFEngine(Qwen2ForCausalLM.from_pretrained(base_dir, dtype=torch.float32), eos_token_ids=spec["eos"],
                      pad_token_id=0)
    prompts, bb = spec["prompts"], spec["bucket_bytes"]
    out: dict = {"tp": tp, "pp": pp, "tie": tie, "before": _generate(engine, prompts, spec, "greedy")}
    first = _sync(actor, engine, bb)
    out["greedy1"] = _generate(engine, prompts, spec, "greedy")
    out["sampled1"] = _generate(engine, prompts, spec, "sampled")
    out["actor1"] = _actor_logprobs(actor, prompts, out["sampled1"])
    out["train"] = _train_once(actor, prompts, out["sampled1"], out["actor1"], spec["lr"])
    second = _sync(actor, engine, bb)
    params = dict(engine.model.named_parameters())
    out["engine_equals_export"] = sorted(second) == sorted(k for k in params if not (tie and k == "lm_head.weight")) \
        and all(torch.equal(params[k], t) for k, t in second.items())
    out["min_tensor_change"] = min(float((second[k] - first[k]).abs().max()) for k in first)
    out["greedy2"] = _generate(engine, prompts, spec, "greedy")
    out["sampled2"] = _generate(engine, prompts, spec, "sampled")
    out["actor2"] = _actor_logprobs(actor, prompts, out["sampled2"])
    out["megatron_greedy2"] = _megatron_greedy_check(actor, prompts, out["greedy2"], hf_config["vocab_size"])
    if mutate:
        _sync(actor, engine, bb, rename=_swap_layers)
        out["swapped_sampled"] = _generate(engine, prompts, spec, "sampled")
        out["swapped_actor"] = _actor_logprobs(actor, prompts, out["swapped_sampled"])
    return out


def main(ws: Path) -> None:
    import torch.distributed as dist

    from dapo_mcore.actor.parallel import init_distributed, read_launch_env, shutdown

    torch.set_num_threads(1)
    env = read_launch_env()
    init_distributed(env, "gloo")
    spec = json.loads((ws / "spec.json").read_text())
    results = []
    try:
        for i, (tp, pp, tie) in enumerate(spec["cases"]):
            results.append(_run_case(ws, spec, tp, pp, bool(tie), mutate=i == 0))
            dist.barrier()
    finally:
        (ws / f"results_{env.rank}.json").write_text(json.dumps(results))
        shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
