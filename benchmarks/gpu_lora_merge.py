"""The LoRA merge on the device: a LoRA-adapted Megatron model (local spec, TP=1, a world of one) on the GPU.

What it checks, in one process (the ``lora`` section of benchmarks/gpu_check.py; docs/gpu-check.md):

1. the model is built with the project's builders (``transformer_config``, ``build_gpt_model``, ``attach_lora``),
   every parameter on the device; B gets random values (as after training: at init B = 0 and the merge is a no-op);
2. one forward and backward of the summed logits: every base parameter has no gradient, every adapter's A and B a
   finite, non-zero one;
3. the shard-local merge the weight sync and the merged export do (``W + delta()``, in float32, on the device) equals a
   naive reference built on the CPU in float32, ``W + scale * sum_k outer(B[:, k], A[k, :])`` (max abs diff);
4. the merged export itself (``iter_hf_weights``, which merges each shard on the device before it is sent) equals the
   export of a model whose base weights were replaced by that naive merge and whose adapters were zeroed: within one
   rounding of the model's dtype, and every adapted HF tensor differs from the base's;
5. timings: the shard-local merge of every adapted layer (CUDA-synchronized, mean of ``--iters``) and one whole
   merged export.

On a GPU: bf16, Qwen2.5-0.5B widths cut to 2 layers and a 4k vocabulary. ``--smoke`` (and any machine without CUDA):
the "tiny" preset in float32 on the CPU, gloo, seconds. Prints ``name: value`` lines, the last ``gpu_lora_merge: ok``
(or ``gpu_lora_merge: FAILED``, exit code 1); ``--result PATH`` also writes them as JSON.

    python benchmarks/gpu_lora_merge.py [--smoke] [--rank 16] [--result lora.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_measure import device, start_single_process_world, synchronize  # noqa: E402


def build(smoke: bool, rank: int, dev: torch.device):
    """(model chunks, hf config, dtype): the project's builders, adapters attached, B random."""
    from dapo_mcore.model.lora.attach import adapted_layers, attach_lora
    from dapo_mcore.model.lora.config import LoRAConfig
    from dapo_mcore.model.presets import preset_config
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config

    cuda = dev.type == "cuda"
    hf = (preset_config("qwen2.5-0.5b", num_hidden_layers=2, vocab_size=4096, tie_word_embeddings=False)
          if cuda and not smoke else preset_config("tiny"))
    dtype = torch.bfloat16 if cuda else torch.float32
    chunks = build_gpt_model(hf, transformer_config(hf, params_dtype=dtype), make_vocab_size_divisible_by=1)
    for chunk in chunks:
        chunk.to(device=dev, dtype=dtype)
    attach_lora(chunks, LoRAConfig(rank=rank, alpha=2.0 * rank))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in adapted_layers(chunks):
            b = layer.adapter.b
            b.copy_((torch.randn(b.shape, generator=gen) * 0.05).to(b.device, b.dtype))
    return chunks, hf, dtype


def forward_backward(chunks: list, hf: dict, dev: torch.device) -> dict:
    """Summed logits of one batch, backward; which parameters got gradients."""
    from dapo_mcore.model.lora.attach import is_adapter_param

    model = chunks[0]
    b, s = 2, 32
    tokens = torch.randint(0, hf["vocab_size"], (b, s), generator=torch.Generator().manual_seed(3)).to(dev)
    positions = torch.arange(s, device=dev).expand(b, s)
    mask = ~torch.ones(s, s, dtype=torch.bool, device=dev).tril().view(1, 1, s, s)  # True = masked
    logits = model(tokens, positions, mask)
    logits.float().sum().backward()
    base_with_grad, adapters, adapters_ok = [], 0, 0
    for name, p in model.named_parameters():
        grad = getattr(p, "main_grad", None) if p.grad is None else p.grad
        if is_adapter_param(name):
            adapters += 1
            adapters_ok += int(grad is not None and bool(torch.isfinite(grad).all()) and grad.abs().max() > 0)
        elif grad is not None or p.requires_grad:
            base_with_grad.append(name)
    for p in model.parameters():
        p.grad = None
    return {"logits_finite": bool(torch.isfinite(logits).all()), "adapter_params": adapters,
            "adapter_params_with_grad": adapters_ok, "base_params_with_grad": len(base_with_grad),
            "base_params_with_grad_names": base_with_grad[:5]}


def naive_merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A`` on the CPU in float32, as a sum of rank-1 outer products (no matmul)."""
    out = w.detach().float().cpu().clone()
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    for k in range(a.shape[0]):
        out += scale * torch.outer(b[:, k], a[k])
    return out


def shard_local_merge(layers: list) -> list[torch.Tensor]:
    """The merge as ``weights.export`` does it for each adapted shard (float32 on the weight's device)."""
    return [layer.module.weight.detach().float() + layer.adapter.delta().to(layer.module.weight.device)
            for layer in layers]


def export(chunks: list, hf: dict) -> dict[str, torch.Tensor]:
    from dapo_mcore.weights.export import iter_hf_weights

    return {n: t.float().cpu() for bucket in iter_hf_weights(chunks, hf) for n, t in bucket}


def check_merge(chunks: list, hf: dict, dtype: torch.dtype, iters: int) -> dict:
    """Items 3-5 of the module docstring."""
    from dapo_mcore.model.lora.attach import adapted_layers

    layers = adapted_layers(chunks)
    merged = shard_local_merge(layers)
    refs = [naive_merge(x.module.weight, x.adapter.a, x.adapter.b, x.adapter.scale) for x in layers]
    local_diff = max(float((m.cpu() - r).abs().max()) for m, r in zip(merged, refs, strict=True))
    local_ref = max(float(r.abs().max()) for r in refs)
    delta_max = max(float(x.adapter.delta().abs().max()) for x in layers)
    synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        shard_local_merge(layers)
    synchronize()
    merge_ms = (time.perf_counter() - t0) / iters * 1e3
    t0 = time.perf_counter()
    got = export(chunks, hf)  # B random: merged on the device
    export_s = time.perf_counter() - t0
    saved = [(x.module.weight.detach().clone(), x.adapter.b.detach().clone()) for x in layers]
    with torch.no_grad():
        for x in layers:
            x.adapter.b.zero_()
        base = export(chunks, hf)  # B = 0: the base weights as they are
        for x, ref in zip(layers, refs, strict=True):
            x.module.weight.copy_(ref.to(x.module.weight.device, dtype))
        want = export(chunks, hf)  # the naive merge in the base weights, no adapter
        for x, (w, b) in zip(layers, saved, strict=True):
            x.module.weight.copy_(w)
            x.adapter.b.copy_(b)
    ulp = torch.finfo(dtype).eps  # one rounding of the model's dtype, relative
    export_diff = max(float((got[n] - want[n]).abs().max()) for n in want)
    bad = [n for n in want if not torch.allclose(got[n], want[n], rtol=ulp, atol=1e-6)]
    changed = sum(1 for n in want if not torch.equal(got[n], base[n]))
    expected_changed = sum(1 for n in want if not torch.equal(want[n], base[n]))
    return {"layers": len(layers), "rank": layers[0].adapter.rank, "merge_vs_naive_fp32_max_abs_diff": local_diff,
            "naive_max_abs": local_ref, "delta_max_abs": delta_max, "merge_ms": merge_ms, "export_s": export_s,
            "export_vs_naive_max_abs_diff": export_diff, "export_tensors": len(want),
            "export_tensors_outside_one_rounding": len(bad), "export_tensors_changed_by_merge": changed,
            "export_tensors_the_naive_merge_changes": expected_changed}


def verdict(r: dict) -> list[str]:
    """What failed (empty: every check passed)."""
    problems = []
    if not r["logits_finite"]:
        problems.append("non-finite logits")
    if r["base_params_with_grad"]:
        problems.append(f"{r['base_params_with_grad']} base parameters got a gradient: {r['base_params_with_grad_names']}")
    if r["adapter_params"] == 0 or r["adapter_params_with_grad"] != r["adapter_params"]:
        problems.append(f"{r['adapter_params_with_grad']}/{r['adapter_params']} adapter parameters got a finite, "
                        f"non-zero gradient")
    if not r["merge_vs_naive_fp32_max_abs_diff"] <= 1e-5 * max(1.0, r["naive_max_abs"]):
        problems.append(f"shard-local merge differs from the naive fp32 merge by {r['merge_vs_naive_fp32_max_abs_diff']:.3g}")
    if r["export_tensors_outside_one_rounding"]:
        problems.append(f"{r['export_tensors_outside_one_rounding']} exported tensors differ from the naive merge "
                        f"by more than one rounding")
    if not 0 < r["export_tensors_the_naive_merge_changes"] == r["export_tensors_changed_by_merge"]:
        problems.append(f"the merged export changed {r['export_tensors_changed_by_merge']} tensors, the naive merge "
                        f"{r['export_tensors_the_naive_merge_changes']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny preset (the CPU mode; also used without CUDA)")
    p.add_argument("--rank", type=int, default=16, help="adapter rank")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions of the shard-local merge")
    p.add_argument("--result", default=None, help="also write the numbers to this JSON file")
    args = p.parse_args(argv)
    backend = start_single_process_world()
    dev = device()
    torch.manual_seed(0)
    chunks, hf, dtype = build(args.smoke, args.rank, dev)
    r = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "backend": backend,
         "dtype": str(dtype).replace("torch.", ""), "hidden_size": hf["hidden_size"],
         "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,  # TF32 would blur the fp32 comparison
         "base_params": sum(p.numel() for c in chunks for p in c.parameters() if not p.requires_grad),
         "adapter_params_numel": sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)}
    r.update(forward_backward(chunks, hf, dev))
    r.update(check_merge(chunks, hf, dtype, args.iters))
    problems = verdict(r)
    r.update(status="ok" if not problems else "FAILED", **({"error": "; ".join(problems)} if problems else {}))
    for key, value in r.items():
        if key not in ("status", "base_params_with_grad_names"):
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}", flush=True)
    if args.result:
        Path(args.result).write_text(json.dumps(r, indent=1))
    print(f"gpu_lora_merge: {r['status']}", flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
