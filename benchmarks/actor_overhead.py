"""The Megatron actor against plain transformers: same weights, same batch, same DAPO loss, measured side by side.

For each model (the `tiny` preset, and a hidden-512 Qwen2 of a few layers) one random HF checkpoint is loaded by
plain ``transformers.Qwen2ForCausalLM`` and by the Megatron actor, once per core attention of the local spec
(``megatron_local``: Megatron's DotProductAttention; ``sdpa``: dapo_mcore.model.attention). Two measurements:

* train: one DAPO update on the batch. Plain = forward (no attention mask: right padding under causal attention
  changes no real token) + token log-probs + ``algo.loss.policy_loss`` (token-mean) + backward + grad clipping +
  ``torch.optim.AdamW``. Actor = ``MegatronActor.train_mini_batch`` (the same loss, plus its entropy metric).
* logprob: the per-token log-probs of every response without gradients (``compute_logprobs`` for the actor).

Repetitions are interleaved (plain, actor variants, plain, ...) so machine load hits all alike; medians are
reported as ratios plain_time / actor_time (1.0 = the actor is as fast as plain PyTorch); ratios of the minima
are printed beside them. Each call is timed twice: wall clock, and this process's CPU time, which on a shared CPU
machine (other jobs competing for the cores) measures the work itself rather than the wait; with one thread the
CPU-time ratio is the headline on CPU, wall clock on a GPU. Log-probs of all variants are compared first.
Single process, world of one (gloo), CPU or one GPU.
Last line: ``actor_over_plain_train: X`` (median ratio) for the hidden-512 model with the default (sdpa) attention.
``--smoke``: the tiny model only (its ratio is the last line then), 2 short sequences, one repetition (run in CI).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODELS = {
    "tiny": {},
    "h512": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=2000, max_position_embeddings=1024),
}
ATTENTIONS = ("megatron_local", "sdpa")
CLIP = dict(clip_low=0.2, clip_high=0.28)
LR, WD, GRAD_CLIP = 1e-5, 0.1, 1.0


def make_batch(vocab: int, n: int, prompt_len: tuple[int, int], resp_len: tuple[int, int], seed: int):
    from dapo_mcore.actor.megatron_actor import TrainSample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=gen))
        r = int(torch.randint(resp_len[0], resp_len[1] + 1, (1,), generator=gen))
        out.append(TrainSample(torch.randint(3, vocab, (p,), generator=gen).tolist(),
                               torch.randint(3, vocab, (r,), generator=gen).tolist(),
                               advantage=float(torch.randn(1, generator=gen))))
    return out


class Plain:
    """Plain transformers: right-padded rows, one forward, the DAPO loss, AdamW."""

    def __init__(self, hf_dir: Path, samples, device: torch.device):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WD, eps=1e-8)
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        rmax = max(len(s.response_ids) for s in samples)
        self.ids = torch.zeros(len(samples), width, dtype=torch.long)
        self.pos = torch.zeros(len(samples), rmax, dtype=torch.long)  # logit position of each response token
        self.tgt = torch.zeros(len(samples), rmax, dtype=torch.long)
        self.mask = torch.zeros(len(samples), rmax)
        for i, s in enumerate(samples):
            seq = s.prompt_ids + s.response_ids
            self.ids[i, :len(seq)] = torch.tensor(seq)
            r = len(s.response_ids)
            self.pos[i, :r] = torch.arange(r) + len(s.prompt_ids) - 1
            self.tgt[i, :r] = torch.tensor(s.response_ids)
            self.mask[i, :r] = 1.0
        self.adv = torch.tensor([s.advantage for s in samples])
        self.ids, self.pos, self.tgt, self.mask, self.adv = (
            t.to(device) for t in (self.ids, self.pos, self.tgt, self.mask, self.adv))
        self.old = None

    def _logp(self) -> torch.Tensor:
        logits = self.model(input_ids=self.ids).logits.float()
        picked = logits.gather(1, self.pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        return torch.log_softmax(picked, dim=-1).gather(-1, self.tgt.unsqueeze(-1)).squeeze(-1) * self.mask

    @torch.no_grad()
    def logprobs(self) -> torch.Tensor:
        self.model.eval()
        return self._logp()

    def train(self) -> float:
        from dapo_mcore.algo.loss import policy_loss

        self.model.train()
        loss, _ = policy_loss(self._logp(), self.old, self.adv, self.mask, **CLIP, agg="token-mean",
                              global_tokens=float(self.mask.sum()), global_seqs=float((self.mask.sum(1) > 0).sum()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)


def time_runners(runners: dict[str, dict[str, Callable[[], object]]], warmup: int,
                 reps: int) -> dict[tuple[str, str, str], list[float]]:
    """Every ``runners[kind][variant]()`` call timed in turn, ``warmup`` rounds discarded then ``reps`` kept:
    ``{(kind, variant, "wall" | "cpu"): [seconds per kept round]}``."""
    times: dict[tuple[str, str, str], list[float]] = {}
    for rep in range(warmup + reps):
        for kind, variants in runners.items():
            for variant, fn in variants.items():
                wall, cpu = _timed(fn)
                if rep >= warmup:
                    times.setdefault((kind, variant, "wall"), []).append(wall)
                    times.setdefault((kind, variant, "cpu"), []).append(cpu)
    return times


def make_actor(hf_dir: Path, hf_config: dict, attention: str, tokens: int):
    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor
    from dapo_mcore.algo.config import AlgoConfig

    settings = ActorSettings(hf_config=hf_config, attention=attention, lr=LR, weight_decay=WD, eps=1e-8,
                             grad_clip=GRAD_CLIP, micro_batch_tokens=tokens, layout="rows",
                             algo=AlgoConfig(loss_agg="token-mean", **CLIP))
    actor = MegatronActor(settings)
    actor.load_hf(str(hf_dir))
    return actor


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def bench_model(name: str, overrides: dict, args, work: Path, device: torch.device) -> dict[str, float]:
    from conversion.synthetic import save_tiny_hf_model
    from dapo_mcore.model.presets import preset_config

    hf_dir = work / name
    save_tiny_hf_model(hf_dir, seed=0, **overrides)
    hf_config = preset_config("tiny", **overrides)
    samples = make_batch(hf_config["vocab_size"], args.sequences, (args.prompt_min, args.prompt_max),
                         (args.resp_min, args.resp_max), seed=1)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    plain = Plain(hf_dir, samples, device)
    actors = {a: make_actor(hf_dir, hf_config, a, tokens * 2) for a in ATTENTIONS}
    ref = plain.logprobs()
    plain.old = ref.detach() + 0.05 * torch.randn_like(ref) * plain.mask
    for i, s in enumerate(samples):
        s.old_logprobs = plain.old[i, :len(s.response_ids)].cpu()
    for a, actor in actors.items():
        got, _ = actor.compute_logprobs(samples)
        diff = max((g - ref[i, :len(g)].cpu()).abs().max().item() for i, g in enumerate(got) if g.numel())
        print(f"[{name}] log-prob max |actor({a}) - plain| = {diff:.2e}", flush=True)
    runners = {"train": {"plain": plain.train, **{a: (lambda x=x: x.train_mini_batch(samples, LR))
                                                  for a, x in actors.items()}},
               "logprob": {"plain": plain.logprobs, **{a: (lambda x=x: x.compute_logprobs(samples))
                                                       for a, x in actors.items()}}}
    times = time_runners(runners, args.warmup, args.reps)
    out = {}
    print(f"[{name}] hidden {hf_config['hidden_size']}, {hf_config['num_hidden_layers']} layers, "
          f"{hf_config['num_attention_heads']}/{hf_config['num_key_value_heads']} heads, vocab "
          f"{hf_config['vocab_size']}; {len(samples)} sequences, {tokens} tokens; {args.reps} repetitions")
    for kind in runners:
        for clock in ("cpu", "wall"):
            for stat, fn in (("median", statistics.median), ("min", min)):
                base = fn(times[(kind, "plain", clock)])
                parts = [f"plain {base * 1e3:.1f} ms"]
                for a in ATTENTIONS:
                    t = fn(times[(kind, a, clock)])
                    out[f"{kind}_{a}_{clock}_{stat}"] = base / t
                    parts.append(f"actor[{a}] {t * 1e3:.1f} ms = {base / t:.2f}x")
                print(f"[{name}] {kind:8s} {clock} {stat:6s} " + " | ".join(parts), flush=True)
    return out


def start_one_process() -> None:
    """A one-process Megatron world (gloo on CPU) on a free local port, model-parallel groups of 1."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    from dapo_mcore.actor.parallel import init_distributed, init_model_parallel, read_launch_env

    init_distributed(read_launch_env(), "auto")
    init_model_parallel(1, 1, seed=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,h512", help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt-min", type=int, default=8)
    ap.add_argument("--prompt-max", type=int, default=48)
    ap.add_argument("--resp-min", type=int, default=16)
    ap.add_argument("--resp-max", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny model only, 2 short sequences, one repetition (the same update and log-prob code; CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.sequences, args.warmup, args.reps, args.prompt_max, args.resp_max = "tiny", 2, 0, 1, 8, 16
        args.prompt_min, args.resp_min = min(args.prompt_min, 8), min(args.resp_min, 16)
    torch.set_num_threads(args.threads)
    from dapo_mcore.actor.parallel import shutdown

    start_one_process()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    print(f"device {device}, threads {torch.get_num_threads()}, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} (start)", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name] = bench_model(name, MODELS[name], args, Path(tmp), device)
    print(f"load average {os.getloadavg()[0]:.2f} (end)")
    for name, r in results.items():
        print(f"{name}: " + " ".join(f"{k}={v:.3f}" for k, v in r.items()))
    shutdown()
    last = "h512" if "h512" in results else next(iter(results))
    clock = "wall" if device.type == "cuda" else "cpu"
    print(f"actor_over_plain_train: {results[last][f'train_sdpa_{clock}_median']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
