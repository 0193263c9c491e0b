"""Which MoE kernel backend a vLLM engine runs its experts on, pinned before it is built and checked after.

The weight sync writes each expert's checkpoint-order ``[gate; up]`` rows into vLLM's fused ``w13_weight`` in place
(plain ``load_weights`` on a GPU). vLLM picks the unquantized MoE kernel itself (``fused_moe/oracle/unquantized.py``,
``select_unquantized_moe_backend``, read in vLLM's source; not run on a GPU here): on CUDA its priority list puts
FlashInfer TRTLLM and FlashInfer CUTLASS ahead of Triton (on Hopper it moves them behind), with no environment
variable set. ``convert_to_unquantized_kernel_format`` then re-lays out ``w13`` after loading for those two
(CUTLASS swaps the halves to ``[up; gate]``, ``swap_w13_to_w31``; TRTLLM pads and re-blocks them; ROCm AITER
shuffles them), so a later in-place sync would write every expert the wrong way round, silently. Triton (and its
batched form for expert parallelism) keeps the checkpoint layout.

So the engine asks for Triton through vLLM's own setting (``EngineArgs.moe_backend``, the ``--moe-backend`` flag of
the vLLM releases this project supports) where vLLM has it, and after the build reads the backend every MoE layer's
method chose (``UnquantizedFusedMoEMethod.unquantized_backend``) and refuses any other in one line. On vLLM's CPU
platform the only backend is its CPU one, and the CPU weight sync goes through the layer-wise reload, which runs
the post-load processing again after every sync: nothing is pinned there, and the CPU backend is accepted.

On a reload, vLLM 0.32.0's ``UnquantizedFusedMoEMethod._setup_kernel`` treats a method whose ``moe_kernel`` is already
built as a weight update and skips ``moe_kernel.fused_experts.process_weights_after_loading``, which is where the CPU
experts (``CPUUnquantizedExperts``) pad and prepack ``w13``/``w2`` into their grouped-GEMM layout: every sync left the
experts in the checkpoint layout that the CPU kernel then read as packed (log-probs off by whole nats against the
same weights loaded from disk). ``unbuild_cpu_moe_kernels`` drops those kernels before a CPU sync, so the reload
takes vLLM's first-load route for them (kernel rebuilt, weights packed once), whether or not a later vLLM fixes it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from dapo_mcore.rollout.engines.vllm_env import PlatformTraits
from dapo_mcore.rollout.protocol import EngineError

__all__ = ["KEEPS_LAYOUT", "check_moe_backends", "chosen_moe_backends", "moe_backend_pin",
           "unbuild_cpu_moe_kernels"]

PINNED = "triton"
"""The ``moe_backend`` the engine asks vLLM for (its ``MoEBackend`` literal)."""

KEEPS_LAYOUT = {"cuda": ("TRITON", "BATCHED_TRITON"), "cpu": ("CPU",)}
"""Per platform, the ``UnquantizedMoeBackend`` names whose weights stay in the loaded ``[gate; up]`` layout (CPU:
re-processed after every sync by the layer-wise reload)."""


def engine_arg_names() -> set[str]:
    """The fields of vLLM's ``EngineArgs`` (what ``vllm.LLM(**kwargs)`` accepts by name)."""
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    return {f.name for f in dataclasses.fields(arg_utils.EngineArgs)}


def moe_backend_pin(traits: PlatformTraits, arg_names: set[str]) -> dict[str, str]:
    """``LLM`` kwargs that pin the layout-keeping MoE kernel: ``moe_backend="triton"`` on a GPU platform whose vLLM
    has the setting; none on CPU (Triton does not run there) or where vLLM lacks it (the check after the build
    still holds)."""
    if traits.name == "cpu" or "moe_backend" not in arg_names:
        return {}
    return {"moe_backend": PINNED}


def chosen_moe_backends(model: Any) -> dict[str, str]:
    """``{layer name: backend}`` for every MoE layer of a built vLLM model: the ``unquantized_backend`` its quant method
    chose (an ``UnquantizedMoeBackend``: its name), or the method's class name where it has none (a quantized MoE
    method: its own kernels)."""
    chosen = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        backend = getattr(method, "unquantized_backend", None)
        if backend is not None:
            chosen[name] = str(getattr(backend, "name", backend))
        elif type(method).__name__.endswith("MoEMethod"):
            chosen[name] = type(method).__name__
    return chosen


def check_moe_backends(chosen: dict[str, str], traits: PlatformTraits) -> None:
    """EngineError (one line) unless every MoE layer runs a backend that keeps the checkpoint layout; also when no
    MoE layer was found (the model path or vLLM's attribute moved: nothing would have been checked)."""
    keeps = KEEPS_LAYOUT.get(traits.name, KEEPS_LAYOUT["cuda"])
    if not chosen:
        raise EngineError("found no MoE layer with a kernel backend in the built vLLM model (vLLM's "
                          "UnquantizedFusedMoEMethod.unquantized_backend), so the expert weight layout cannot be "
                          "checked; use a vLLM release this project supports (docs/rollout.md).")
    wrong = {b: n for n, b in chosen.items() if b not in keeps}
    if wrong:
        backend, layer = next(iter(wrong.items()))
        raise EngineError(f"vLLM runs the MoE layers on the {backend} kernel backend ({layer} first), which re-lays out "
                          f"each expert's gate/up weights after loading, so the in-place weight sync would write them "
                          f"swapped; use a vLLM release with the moe_backend setting (the engine pins "
                          f"moe_backend={PINNED!r} there) and unset VLLM_USE_FLASHINFER_MOE_FP16 and "
                          f"VLLM_ROCM_USE_AITER_MOE.")


def unbuild_cpu_moe_kernels(model: Any) -> int:
    """Before a layer-wise reload on vLLM's CPU platform: set ``moe_kernel`` to None on every MoE method that runs the
    CPU backend, so the reload's post-load processing builds the kernel again and prepacks the new expert weights
    (see the module docstring). Returns how many it reset."""
    reset = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        backend = getattr(method, "unquantized_backend", None)
        if backend is None or getattr(method, "moe_kernel", None) is None:
            continue
        if str(getattr(backend, "name", backend)) in KEEPS_LAYOUT["cpu"]:
            method.moe_kernel = None
            reset += 1
    return reset
