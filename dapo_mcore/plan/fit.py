"""Whether a layout fits, and what to try when it does not: ``check`` refuses a layout over the GPU's memory with the
alternatives that fit (other TP/PP, a smaller micro-batch token budget, a smaller vLLM memory fraction);
``fitting_layouts`` lists the layouts that fit. The estimates themselves are ``planner``'s."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from dapo_mcore.plan.planner import GIB, MemoryEstimate, PlanInput, estimate_host, estimate_memory
from dapo_mcore.telemetry.flops import RECOMPUTE_MODES, ModelShape


class LayoutDoesNotFit(ValueError):
    """A layout whose estimated peak exceeds the GPU; the message lists changes that would fit."""


Names = dict[str, str]
"""How a PlanInput field is spelled in a message: itself (flag mode) or its config key (config mode)."""


def _say(names: Names | None, field: str, value: Any) -> str:
    """``field=value`` in the user's vocabulary; a bool as true/false."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{(names or {}).get(field, field)}={text}"


def _alternatives(p: PlanInput, names: Names | None = None) -> list[tuple[str, PlanInput]]:
    """Single changes worth trying, in the order a user would usually prefer them.

    With ``names`` (config mode) the changes are spelled as config keys.
    """
    shape = ModelShape.from_hf(p.model)
    alts: list[tuple[str, PlanInput]] = []
    if not p.distributed_optimizer and p.data_parallel > 1 and p.precision != "fp32":
        alts.append((_say(names, "distributed_optimizer", True), replace(p, distributed_optimizer=True)))
    for mode in ("selective", "full"):
        if RECOMPUTE_MODES.index(mode) > RECOMPUTE_MODES.index(p.recompute):
            alts.append((_say(names, "recompute", mode), replace(p, recompute=mode)))
    half_dp = max(1, p.data_parallel // 2)
    tp2 = p.tensor_parallel * 2
    if tp2 <= 8 and shape.kv_heads % tp2 == 0 and shape.heads % tp2 == 0:
        alts.append((f"{_say(names, 'tensor_parallel', tp2)} ({_say(names, 'data_parallel', half_dp)} on the same GPUs)",
                     replace(p, tensor_parallel=tp2, data_parallel=half_dp)))
    pp2 = p.pipeline_parallel * 2
    if shape.layers % (pp2 * p.virtual_pipeline) == 0:
        alts.append((f"{_say(names, 'pipeline_parallel', pp2)} ({_say(names, 'data_parallel', half_dp)} on the same GPUs)",
                     replace(p, pipeline_parallel=pp2, data_parallel=half_dp)))
    if p.colocate_vllm and not p.offload_train_state_in_rollout:
        alts.append((_say(names, "offload_train_state_in_rollout", True), replace(p, offload_train_state_in_rollout=True)))
    return alts


def _fits(p: PlanInput) -> bool:
    """Whether every check of :func:`check` passes (no suggestions computed)."""
    est = estimate_memory(p)
    limit, seq = p.gpu_memory_gib * GIB, p.max_prompt_len + p.max_response_len
    rollout_ok = not p.colocate_vllm or (est.rollout_peak <= limit and est.vllm_kv_tokens >= seq)
    return est.train_peak <= limit and rollout_ok and p.micro_batch_tokens >= seq


def fitting_layouts(p: PlanInput, max_tensor_parallel: int = 8, limit: int = 3) -> list[PlanInput]:
    """Model-parallel layouts (TP x PP) on the same GPUs that fit, fewest model-parallel GPUs first.

    TP stays within ``max_tensor_parallel`` (one node's GPUs: TP traffic must stay on NVLink); among equal
    TP x PP the larger TP comes first (no pipeline bubble).
    """
    shape = ModelShape.from_hf(p.model)
    world = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
    found: list[PlanInput] = []
    for tp in range(1, max_tensor_parallel + 1):
        if shape.heads % tp or shape.kv_heads % tp:
            continue
        for pp in range(1, shape.layers + 1):
            if shape.layers % (pp * p.virtual_pipeline) or world % (tp * pp):
                continue
            candidate = replace(p, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=world // (tp * pp))
            try:
                candidate.validate()
            except ValueError:
                continue  # e.g. the mini-batch does not split over this data parallelism: not a candidate
            if _fits(candidate):
                found.append(candidate)
    found.sort(key=lambda c: (c.tensor_parallel * c.pipeline_parallel, -c.tensor_parallel))
    return found[:limit]


def _largest_fitting_budget(p: PlanInput) -> int | None:
    """The largest micro-batch token budget (multiple of 1024) whose training phase fits."""
    limit = p.gpu_memory_gib * GIB
    lo, hi = 0, p.micro_batch_tokens // 1024
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate_memory(replace(p, micro_batch_tokens=mid * 1024)).train_peak <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo * 1024 if lo else None


def _largest_fitting_vllm_fraction(p: PlanInput, est: MemoryEstimate) -> float:
    """The vLLM memory fraction that leaves exactly room for the trainer's state during rollout."""
    free = p.gpu_memory_gib * GIB - (est.rollout_peak - est.vllm_awake)
    return math.floor(100 * free / (p.gpu_memory_gib * GIB)) / 100


def staging_problem(p: PlanInput) -> str | None:
    """Async mode: what the engine ranks' staged versions need of one node's host memory, when it is too much."""
    staging = estimate_host(p).staging_host_bytes
    if staging <= p.host_memory_gib * GIB:
        return None
    return (f"the engine ranks keep {p.async_lead - 1} received version(s) each in host memory: {staging / GIB:.0f} GiB "
            f"per engine node > {p.host_memory_gib:g} GiB (rollout.pipeline.node_host_memory_gib); lower "
            f"rollout.pipeline.max_staleness")


def check(p: PlanInput, names: Names | None = None, max_tensor_parallel: int = 8) -> MemoryEstimate:
    """Return the estimate, or raise LayoutDoesNotFit naming what to change (as ``names`` spells it)."""
    est = estimate_memory(p)
    limit = p.gpu_memory_gib * GIB
    seq = p.max_prompt_len + p.max_response_len
    problems: list[str] = []
    if est.train_peak > limit:
        tried = sorted(((estimate_memory(alt).train_peak, name) for name, alt in _alternatives(p, names)))
        fixes = [f"{name} (train peak {peak / GIB:.1f} GiB)" for peak, name in tried if peak <= limit]
        if not fixes and tried:
            fixes = ["no single change fits; combine the largest savings: " + ", ".join(
                f"{name} ({peak / GIB:.1f} GiB)" for peak, name in tried[:3])]
        budget = _largest_fitting_budget(p)
        if budget and budget >= seq:
            fixes.append(f"{_say(names, 'micro_batch_tokens', budget)} (must still hold one sequence of "
                         f"{_say(names, 'max_prompt_len', p.max_prompt_len)} + "
                         f"{_say(names, 'max_response_len', p.max_response_len)} tokens)")
        problems.append(f"training phase needs {est.train_peak / GIB:.1f} GiB > {p.gpu_memory_gib} GiB on "
                        f"{est.worst_stage}; try: " + ("; ".join(fixes) or "more GPUs per replica (TP x PP)"))
    if p.colocate_vllm and est.rollout_peak > limit:
        frac = _largest_fitting_vllm_fraction(p, est)
        util = (names or {}).get("vllm_gpu_memory_utilization", "vllm_gpu_memory_utilization")
        lower = (f"{util}<={frac:.2f}, " if frac >= 0.1
                 else "(vLLM cannot fit beside the trainer state at any useful fraction) ")
        extra = [] if p.distributed_optimizer else [_say(names, "distributed_optimizer", True)]
        if not p.offload_train_state_in_rollout:
            extra.append(_say(names, "offload_train_state_in_rollout", True))
        problems.append(f"rollout phase needs {est.rollout_peak / GIB:.1f} GiB > {p.gpu_memory_gib} GiB; try "
                        f"{lower}{''.join(e + ', ' for e in extra)}or more TP x PP")
    if p.micro_batch_tokens < seq:
        problems.append(f"{_say(names, 'micro_batch_tokens', p.micro_batch_tokens)} cannot hold one sequence of "
                        f"{seq} tokens; raise it or shorten {(names or {}).get('max_response_len', 'max_response_len')}")
    if p.colocate_vllm and est.vllm_kv_tokens < seq:
        n = names or {}
        problems.append(f"vLLM KV cache holds {est.vllm_kv_tokens} tokens < one sequence of {seq}; raise "
                        f"{n.get('vllm_gpu_memory_utilization', 'vllm_gpu_memory_utilization')} or "
                        f"{n.get('vllm_tensor_parallel', 'vllm_tensor_parallel')}")
    host = estimate_host(p)
    if host.host_peak > p.host_memory_gib * GIB:
        problems.append(f"a checkpoint gathers {host.checkpoint_host_bytes / GIB:.0f} GiB of fp32 optimizer state "
                        f"per node to DP rank 0 (+{host.sleep_host_bytes / GIB:.0f} GiB of vLLM weights asleep at "
                        f"level 1) > host_memory_gib={p.host_memory_gib:g}; use more TP x PP (smaller shards)"
                        + ("" if p.vllm_sleep_level == 2 else f", {_say(names, 'vllm_sleep_level', 2)}"))
    staging = staging_problem(p)
    if staging:
        problems.append(staging)
    if problems:
        layouts = fitting_layouts(p, max_tensor_parallel)
        if layouts:
            problems.append("layouts that fit on the same GPUs: " + "; ".join(
                f"{_say(names, 'tensor_parallel', c.tensor_parallel)} {_say(names, 'pipeline_parallel', c.pipeline_parallel)}"
                f" ({_say(names, 'data_parallel', c.data_parallel)})" for c in layouts))
        raise LayoutDoesNotFit("layout does not fit:\n  - " + "\n  - ".join(problems))
    return est
