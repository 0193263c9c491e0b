"""The Megatron actor on a Qwen3-MoE against plain transformers: same weights, same batch, same DAPO update.

Like ``benchmarks/actor_overhead.py`` (whose plain runner, batch and timing this reuses): one random Qwen3-MoE
checkpoint (``Qwen3MoeForCausalLM``, 8 experts, top-2, one dense layer) is loaded by plain transformers (which
loops over the experts a batch hits) and by ``MegatronActor`` (Megatron's MoE layer: TopKRouter, the all-to-all
dispatcher at EP=1, SequentialMLP; SDPA attention). Train = one DAPO update (forward, log-probs, token-mean DAPO
loss, backward, clipping, AdamW); logprob = the per-token log-probs without gradients. Repetitions interleave
plain and actor; ratios are plain_time / actor_time (1.0 = the actor is as fast as plain PyTorch), medians of
this process's CPU time on CPU (wall clock on a GPU). Single process, world of one (gloo).
Last line: ``moe_actor_over_plain: X`` (train, median). ``--smoke``: 2 sequences, one repetition (run in CI).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

MOE = dict(vocab_size=2000, hidden_size=256, intermediate_size=768, moe_intermediate_size=256, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
           mlp_only_layers=[0], max_position_embeddings=1024)


def run(args) -> dict[str, float]:
    from actor_overhead import LR, Plain, make_actor, make_batch, time_runners

    from conversion.synthetic_moe import save_tiny_moe_model, tiny_moe_config

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "moe"
        save_tiny_moe_model(hf_dir, **MOE)
        hf_config = tiny_moe_config(**MOE)
        samples = make_batch(MOE["vocab_size"], args.sequences, (8, 48), (16, 128), seed=1)
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        plain = Plain(hf_dir, samples, device)
        actor = make_actor(hf_dir, hf_config, "sdpa", tokens * 2)
    ref = plain.logprobs()
    plain.old = ref.detach() + 0.05 * torch.randn_like(ref) * plain.mask
    for i, s in enumerate(samples):
        s.old_logprobs = plain.old[i, :len(s.response_ids)].cpu()
    got, _ = actor.compute_logprobs(samples)
    diff = max((g - ref[i, :len(g)].cpu()).abs().max().item() for i, g in enumerate(got) if g.numel())
    print(f"log-prob max |actor - plain| = {diff:.2e} ({len(samples)} sequences, {tokens} tokens)", flush=True)
    runners = {"train": {"plain": plain.train, "actor": lambda: actor.train_mini_batch(samples, LR)},
               "logprob": {"plain": plain.logprobs, "actor": lambda: actor.compute_logprobs(samples)}}
    times = time_runners(runners, args.warmup, args.reps)
    out = {}
    for kind in runners:
        for clock in ("cpu", "wall"):
            base, mine = (statistics.median(times[(kind, v, clock)]) for v in ("plain", "actor"))
            out[f"{kind}_{clock}"] = base / mine
            print(f"{kind:8s} {clock:4s} median: plain {base * 1e3:.1f} ms | actor {mine * 1e3:.1f} ms = "
                  f"{base / mine:.2f}x", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="2 sequences, one repetition (the same code; run in CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sequences, args.warmup, args.reps = 2, 0, 1
    torch.set_num_threads(args.threads)
    from actor_overhead import start_one_process

    from dapo_mcore.actor.parallel import shutdown

    start_one_process()
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, load average {os.getloadavg()[0]:.2f} "
          "(start)", flush=True)
    result = run(args)
    print(f"load average {os.getloadavg()[0]:.2f} (end)")
    shutdown()
    clock = "wall" if torch.cuda.is_available() else "cpu"
    print(f"moe_actor_over_plain: {result[f'train_{clock}']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
