"""What the GPU check measures, as functions: bf16 log-prob parity with Hugging Face, train-step and log-prob
throughput with MFU, the matmul peak rate. ``benchmarks/gpu_check.py`` runs them in worker processes
(``worker_main``); tests/test_gpu_actor.py calls the same functions, so the check and the tests agree.

Every function works on CUDA (NCCL) and, with tiny shapes, on the CPU (gloo + the CPU compatibility layer).
"""

from __future__ import annotations

import json
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Plan:
    """What one mode measures: the GPU check proper, or the CPU smoke run of the same plumbing."""

    smoke: bool
    """True for the CPU smoke mode (tiny shapes, fp32 matmul rate)."""
    parity_preset: str
    """Model preset of the parity check (dapo_mcore.model.presets)."""
    parity_overrides: dict[str, Any]
    """HF config fields replaced in the parity preset (e.g. fewer layers)."""
    parity_prompts: int
    """Random prompts the HF engine samples responses for."""
    parity_n: int
    """Responses sampled per prompt."""
    parity_prompt_len: int
    """Tokens per prompt."""
    parity_new_tokens: int
    """Longest sampled response."""
    bench_models: tuple[tuple[str, str, dict[str, Any]], ...]
    """(label, preset, overrides) of each model the throughput section measures."""
    bench_budgets: tuple[int, ...]
    """Tokens per micro-batch (the actor's micro_batch_tokens), ascending: a budget that runs out of memory ends
    the model's list early without losing the smaller ones."""
    bench_seq_len: int
    """Tokens of every benchmark sequence (prompt + response)."""
    bench_minibatch_tokens: int
    """Tokens of the mini-batch that one train step / log-prob pass covers (split into micro-batches by budget)."""
    bench_iters: int
    """Timed repetitions per measurement, after one warm-up."""
    matmul_n: int
    """Square matmul size of the peak-rate measurement."""
    tiny_steps: int
    """train.steps of the tiny DAPO job."""
    tiny_overrides: tuple[str, ...]
    """Extra dotted overrides of the tiny job (smoke mode shrinks it)."""
    pytest_paths: tuple[str, ...]
    """What pytest collects."""
    budget_s: float
    """Wall-clock budget of the whole check; sections get what is left, minus the floors of later sections."""
    caps: dict[str, float] = field(default_factory=dict)
    """Most seconds a section may take."""
    floors: dict[str, float] = field(default_factory=dict)
    """Fewest seconds worth starting a section with (reserved for it while earlier sections run)."""


# ---- small helpers -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def start_single_process_world(seed: int = 1234) -> str:
    """A world of one (NCCL on GPU, gloo + the CPU compatibility layer on CPU) with TP=PP=1 groups, after the same
    GPU-stack gate as ``dapo-mcore``'s start-up (the parity and throughput sections build the local-spec actor:
    megatron-core only)."""
    from dapo_mcore.actor.parallel import LaunchEnv, init_distributed, init_model_parallel
    from dapo_mcore.model.gpu_stack import check_gpu_stack

    check_gpu_stack(transformer_engine=False, vllm=False)
    backend = init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", free_port(), "single"), "auto")
    init_model_parallel(1, 1, seed=seed)
    return backend


def make_actor(hf_config: dict[str, Any], micro_batch_tokens: int, lr: float = 1e-6):
    """A bf16 Megatron actor (local spec, TP=PP=1) with the DAPO defaults."""
    import torch

    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor
    from dapo_mcore.algo.config import AlgoConfig

    return MegatronActor(ActorSettings(hf_config=hf_config, params_dtype=torch.bfloat16, layer_spec="local",
                                       micro_batch_tokens=micro_batch_tokens, lr=lr, algo=AlgoConfig()))


def random_hf_model(hf_config: dict[str, Any], dev, seed: int = 0):
    """A random HF Qwen2ForCausalLM in bf16 on ``dev``, norms and biases randomised."""
    import torch

    from conversion.synthetic import build_tiny_hf_model

    return build_tiny_hf_model(hf_config, seed, torch.bfloat16, device=dev)


def sample_sequences(model, hf_config: dict[str, Any], prompts: int, n: int, prompt_len: int, new_tokens: int,
                     seed: int = 1):
    """Responses the model itself samples (the project's HFEngine, temperature 1): (TrainSamples, engine log-probs)."""
    import torch

    from dapo_mcore.actor.megatron_actor import TrainSample
    from dapo_mcore.rollout.engines.hf_engine import HFEngine
    from dapo_mcore.rollout.protocol import SamplingParams

    eos = int(hf_config["eos_token_id"])
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, hf_config["vocab_size"], (prompt_len,), generator=gen).tolist() for _ in range(prompts)]
    engine = HFEngine(model, eos_token_ids=eos, pad_token_id=eos)
    out = engine.generate(ids, SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens, seed=seed))
    samples, engine_lp = [], []
    for prompt, group in zip(ids, out, strict=True):
        for resp in group:
            samples.append(TrainSample(prompt, list(resp.token_ids)))
            engine_lp.append(torch.tensor(resp.logprobs, dtype=torch.float32))
    return samples, engine_lp


def hf_logprobs(model, samples) -> list:
    """Naive reference: one unpadded forward per sequence, fp32 log_softmax over the full vocabulary."""
    import torch

    dev = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=dev)
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            p, r = len(s.prompt_ids), len(s.response_ids)
            target = torch.tensor(s.response_ids, device=dev)
            out.append(logp[p - 1:p + r - 1].gather(-1, target.unsqueeze(-1)).squeeze(-1).cpu())
    return out


def diff_stats(got: list, want: list) -> dict[str, float]:
    """max / mean / p99 of |got - want| over every token of every sequence."""
    import torch

    a, b = torch.cat([g.double() for g in got]), torch.cat([w.double() for w in want])
    d = (a - b).abs()
    return {"max": float(d.max()), "mean": float(d.mean()), "p99": float(d.quantile(0.99)), "tokens": int(d.numel())}


def parity_verdict(stats: dict[str, dict[str, float]]) -> tuple[bool, str]:
    """bf16 parity holds when Megatron's error against the fp32 reference is within twice HF's own bf16 error
    (plus a small slack) and no token is off by more than 0.5 nat against HF bf16. A real bug (positions, masks,
    rotary, QKV layout) moves log-probs by far more than the bf16 noise floor."""
    floor = stats["hf_bf16_vs_hf_fp32"]["mean"]
    mine = stats["megatron_vs_hf_fp32"]["mean"]
    worst = stats["megatron_vs_hf_bf16"]["max"]
    ok = mine <= 2.0 * floor + 2e-3 and worst <= 0.5
    return ok, (f"mean|megatron-hf_fp32|={mine:.4g} vs 2*floor+2e-3={2 * floor + 2e-3:.4g}; "
                f"max|megatron-hf_bf16|={worst:.4g} (<= 0.5)")


def measure_matmul_rate(n: int, warmup: int = 3, iters: int = 10) -> dict[str, Any]:
    """Square matmul FLOP/s (bf16 with CUDA events on GPU; fp32 with a wall clock on CPU): the MFU denominator."""
    import torch

    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(warmup):
        a @ b
    synchronize()
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            a @ b
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        seconds = time.perf_counter() - t0
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "iters": iters, "seconds": seconds,
            "tflops": 2.0 * n ** 3 * iters / seconds / 1e12}


# ---- worker sections (each in its own process) -----------------------------------------------------------------
def run_parity(plan: Plan, workdir: Path) -> dict[str, Any]:
    from dapo_mcore.model.presets import preset_config

    backend = start_single_process_world()
    dev = device()
    cfg = preset_config(plan.parity_preset, **plan.parity_overrides)
    hf16 = random_hf_model(cfg, dev)
    hf_dir = workdir / "parity_hf"
    hf16.save_pretrained(hf_dir, safe_serialization=True)
    samples, engine_lp = sample_sequences(hf16, cfg, plan.parity_prompts, plan.parity_n, plan.parity_prompt_len,
                                          plan.parity_new_tokens)
    ref16 = hf_logprobs(hf16, samples)
    ref32 = hf_logprobs(hf16.float(), samples)  # the same weights, upcast: the fp32 reference
    del hf16
    actor = make_actor(cfg, micro_batch_tokens=8192)
    actor.load_hf(str(hf_dir))
    synchronize()
    t0 = time.perf_counter()
    got, _ = actor.compute_logprobs(samples)
    synchronize()
    seconds = time.perf_counter() - t0
    stats = {"megatron_vs_hf_bf16": diff_stats(got, ref16), "megatron_vs_hf_fp32": diff_stats(got, ref32),
             "hf_bf16_vs_hf_fp32": diff_stats(ref16, ref32), "hf_engine_vs_megatron": diff_stats(engine_lp, got)}
    ok, verdict = parity_verdict(stats)
    import torch

    flat = torch.cat(ref32)
    out = {"backend": backend, "device": str(dev), "model": plan.parity_preset, "sequences": len(samples),
           "logprob_seconds": seconds, "ref_logp_mean": float(flat.mean()), "ref_logp_std": float(flat.std()),
           "stats": stats, "verdict": verdict}
    if not ok:
        out.update(status="FAILED", error=f"bf16 parity outside tolerance: {verdict}")
    return out


def bench_samples(vocab: int, seq_len: int, count: int, seed: int = 2) -> list:
    """``count`` sequences of ``seq_len`` tokens (1/8 prompt, 7/8 response), random ids, advantages +-1."""
    import torch

    from dapo_mcore.actor.megatron_actor import TrainSample

    gen = torch.Generator().manual_seed(seed)
    p = max(1, seq_len // 8)
    out = []
    for i in range(count):
        ids = torch.randint(3, vocab, (seq_len,), generator=gen).tolist()
        out.append(TrainSample(ids[:p], ids[p:], advantage=1.0 if i % 2 == 0 else -1.0))
    return out


def _timed(fn: Callable[[], Any], iters: int) -> tuple[float, Any]:
    """Mean seconds of ``fn`` over ``iters`` runs after one warm-up (device synchronised around each)."""
    result = fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        result = fn()
    synchronize()
    return (time.perf_counter() - t0) / iters, result


def bench_model(label: str, hf_config: dict[str, Any], plan: Plan, peak_tflops: float,
                record: Callable[[dict[str, Any]], None]) -> None:
    """Log-prob pass then train step of one model at each micro-batch budget; each row goes to ``record``."""
    import torch

    from dapo_mcore.data.packing import pack_micro_batches
    from dapo_mcore.telemetry.flops import PEAK_FLOPS, ModelShape, sequence_forward_flops

    cuda = torch.cuda.is_available()
    actor = make_actor(hf_config, micro_batch_tokens=plan.bench_budgets[0])
    shape = ModelShape.from_hf(hf_config)
    samples = bench_samples(hf_config["vocab_size"], plan.bench_seq_len,
                            plan.bench_minibatch_tokens // plan.bench_seq_len)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    tokens = sum(lengths)
    fwd = len(samples) * sequence_forward_flops(shape, plan.bench_seq_len)
    for budget in plan.bench_budgets:
        row: dict[str, Any] = {"model": label, "params": shape.num_params(), "budget": budget, "tokens": tokens,
                               "seq_len": plan.bench_seq_len}
        actor.s.micro_batch_tokens = budget
        row["micro_batches"] = len(pack_micro_batches(lengths, budget, 1)[0])
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            logp_s, (logps, _) = _timed(lambda: actor.compute_logprobs(samples), plan.bench_iters)
            for s, lp in zip(samples, logps, strict=True):
                s.old_logprobs = lp
            train_s, metrics = _timed(lambda: actor.train_mini_batch(samples, lr=1e-6), plan.bench_iters)
        except torch.OutOfMemoryError as exc:
            row.update(status="OOM", error=str(exc).splitlines()[0])
            record(row)
            continue
        row.update(status="ok", logp_s=logp_s, train_s=train_s, logp_tok_s=tokens / logp_s,
                   train_tok_s=tokens / train_s, logp_mfu=fwd / logp_s / (peak_tflops * 1e12),
                   train_mfu=3 * fwd / train_s / (peak_tflops * 1e12),
                   train_mfu_datasheet=3 * fwd / train_s / PEAK_FLOPS["h200-bf16"],
                   loss_finite=bool(torch.isfinite(torch.tensor(metrics["loss"]))),
                   peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
        record(row)


def run_throughput(plan: Plan, workdir: Path, partial: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    import gc

    import torch

    from dapo_mcore.model.presets import preset_config

    backend = start_single_process_world()
    out: dict[str, Any] = {"backend": backend, "device": str(device()), "matmul": measure_matmul_rate(plan.matmul_n),
                           "rows": [], "model_flops": "6*N-style matmul FLOPs, causal attention (dapo_mcore.telemetry.flops)"}
    peak = out["matmul"]["tflops"]

    def record(row: dict[str, Any]) -> None:
        out["rows"].append(row)
        partial(out)

    for label, preset, overrides in plan.bench_models:
        try:
            bench_model(label, preset_config(preset, **overrides), plan, peak, record)
        except Exception as exc:  # recorded as FAILED and the next model still runs
            record({"model": label, "status": "FAILED", "error": error_text(exc)})
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    bad = [r for r in out["rows"] if r["status"] != "ok"]
    if bad:
        out.update(status="FAILED", error="; ".join(f"{r['model']}@{r.get('budget')}: {r['status']}" for r in bad))
    return out


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def worker_main(section: str, plan: Plan, result: Path, workdir: Path) -> int:
    """Run one worker section and write its result JSON (a failure is recorded there, with its traceback)."""
    t0 = time.perf_counter()

    def write(data: dict[str, Any]) -> None:
        payload = {"status": "ok", **data, "seconds": time.perf_counter() - t0}
        tmp = result.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1, default=str))
        tmp.replace(result)

    try:
        if section == "parity":
            data = run_parity(plan, workdir)
        else:
            data = run_throughput(plan, workdir, lambda d: write({**d, "status": "running"}))
    except Exception as exc:  # the whole point: record it and let the driver go on
        traceback.print_exc()
        data = {"status": "FAILED", "error": error_text(exc), "traceback": traceback.format_exc()[-4000:]}
    write(data)
    from dapo_mcore.actor.parallel import shutdown

    shutdown()
    return 0
