"""LoRA's share of the planner's memory model: the adapters a GPU holds, and what a frozen base costs.

With LoRA the base weights stay (bf16, or fp32 on CPU) but get no gradient buffer, no fp32 main copy and no Adam
state; the adapters get all of those (Megatron's mixed precision: the adapter in the model's dtype, an fp32 grad
buffer, an fp32 main copy and two fp32 moments). Per targeted layer and rank r, a GPU holds (TP = tensor
parallel, column layers split their output, row layers their input, like `model/lora/adapter.py`)::

    column (linear_qkv, linear_fc1):  r * in + r * out / TP
    row    (linear_proj, linear_fc2): r * in / TP + r * out

An MoE layer's linear_fc1 / linear_fc2 are its experts' (each its own adapter), split over expert parallelism.
"""

from __future__ import annotations

from dapo_mcore.telemetry.flops import ModelShape


def _layer_adapters(shape: ModelShape, rank: int, targets: tuple[str, ...], tp: int, ep: int, moe: bool) -> float:
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_dim
    ffn, experts = (shape.moe_ffn, shape.experts / ep) if moe else (shape.ffn, 1)
    dims = {"linear_qkv": ("column", h, q + 2 * kv, 1), "linear_proj": ("row", q, h, 1),
            "linear_fc1": ("column", h, 2 * ffn, experts), "linear_fc2": ("row", ffn, h, experts)}
    total = 0.0
    for t in targets:
        kind, fan_in, fan_out, copies = dims[t]
        per = rank * fan_in + rank * fan_out / tp if kind == "column" else rank * fan_in / tp + rank * fan_out
        total += per * copies
    return total


def adapter_params_per_gpu(shape: ModelShape, rank: int, targets: tuple[str, ...], *, tensor_parallel: int,
                           pipeline_parallel: int, expert_parallel: int = 1) -> float:
    """Adapter parameters on one GPU of a pipeline stage (layers split evenly over stages)."""
    if rank <= 0:
        return 0.0
    moe_layers = shape.moe_layers if shape.experts else 0
    dense = (shape.layers - moe_layers) * _layer_adapters(shape, rank, targets, tensor_parallel, expert_parallel,
                                                          False)
    sparse = moe_layers * _layer_adapters(shape, rank, targets, tensor_parallel, expert_parallel, True)
    return (dense + sparse) / pipeline_parallel


def lora_persistent_bytes(adapters: float, precision: str) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes of ``adapters`` parameters: their own copy, an fp32 grad buffer, and Adam
    (fp32 main copy + two moments; plain fp32 training: the two moments)."""
    if precision == "fp32":
        return 4.0 * adapters, 4.0 * adapters, 8.0 * adapters
    return 2.0 * adapters, 4.0 * adapters, 12.0 * adapters


def describe_lora(hf: dict, rank: int, alpha: float, targets: list[str], *, tensor_parallel: int,
                  pipeline_parallel: int, expert_parallel: int, precision: str) -> str | None:
    """One line on a config's adapters and what they cost per GPU (None without LoRA)."""
    if rank <= 0:
        return None
    shape = ModelShape.from_hf(hf)
    n = adapter_params_per_gpu(shape, rank, tuple(targets), tensor_parallel=tensor_parallel,
                               pipeline_parallel=pipeline_parallel, expert_parallel=expert_parallel)
    total = sum(lora_persistent_bytes(n, precision))
    return (f"LoRA: rank {rank}, alpha {alpha:g} (scale {alpha / rank:g}) on {', '.join(targets)}; the base frozen "
            f"(weights only); {n / 1e6:.1f}M adapter parameters per GPU, {total / 2**30:.2f} GiB with their grads "
            "and optimizer state")
