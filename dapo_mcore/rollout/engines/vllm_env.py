"""The process environment vLLM runs in, decided before an engine is built: the launcher variables of the SPMD
``external_launcher`` (``launcher_ranks``, ``launcher_env_defaults``), the model runner pinned for data-parallel
lockstep or routed-expert capture (``pin_model_runner``), the /dev/shm room routed-expert capture needs, and the MoE
kernels whose weight re-layout an in-place sync cannot follow. Plain Python: vLLM is never imported at import time here; the
platform's traits (``PlatformTraits``) are read from ``vllm.platforms`` when asked."""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dapo_mcore.model.gpu_stack import SUPPORTED
from dapo_mcore.rollout.engines.weight_sync import hf_param_shapes
from dapo_mcore.rollout.protocol import EngineError

logger = logging.getLogger(__name__)

SUPPORTED_VLLM: tuple[tuple[int, ...], tuple[int, ...]] = SUPPORTED["vllm"][:2]
"""Supported vLLM releases as [min, max) (``gpu_stack.SUPPORTED``, one source): the APIs used here (V1 engine,
logprobs_mode, sleep-mode tags, external_launcher with data_parallel_size) were read against 0.33; 0.20.1 is the
first release whose sleep mode accepts ``expandable_segments:True`` (``slurm/env.sh``)."""


@dataclass(frozen=True)
class PlatformTraits:
    """What the engine does differently per vLLM platform (read from ``vllm.platforms.current_platform``)."""

    name: str
    """The platform's device type, e.g. "cuda" or "cpu" (for logs and errors)."""
    sleep_mode: bool
    """vLLM can release memory (``enable_sleep_mode``); False on CPU, where vLLM refuses the setting."""
    layerwise_reload: bool
    """Wrap a sync in vLLM's layer-wise reload: on CPU vLLM repacks linear weights for its GEMM kernels at load
    and leaves the parameter empty, so only the reload route (restore, load, re-process) can load them again."""
    cpu_kv_cache: bool
    """The KV cache is host memory sized by VLLM_CPU_KVCACHE_SPACE (GiB); unset, vLLM takes a fraction of RAM."""

    @classmethod
    def of(cls, platform: Any) -> PlatformTraits:
        """Traits of a vLLM ``Platform`` object (``is_cpu()``, ``is_sleep_mode_available()``, ``device_type``)."""
        cpu = bool(platform.is_cpu())
        return cls(name=str(platform.device_type), sleep_mode=bool(platform.is_sleep_mode_available()),
                   layerwise_reload=cpu, cpu_kv_cache=cpu)


GPU_TRAITS = PlatformTraits(name="cuda", sleep_mode=True, layerwise_reload=False, cpu_kv_cache=False)
"""The CUDA platform's traits (what ``llm_kwargs`` assumes unless told otherwise)."""


def current_platform_traits() -> PlatformTraits:
    """Traits of the platform vLLM detected in this process (imports vLLM)."""
    platforms = importlib.import_module("vllm.platforms")
    return PlatformTraits.of(platforms.current_platform)


def launcher_env_defaults(environ: dict[str, str], port: int) -> dict[str, str]:
    """The torchrun variables vLLM's ``external_launcher`` reads, for a single process started without torchrun
    (vLLM raises ``KeyError: 'RANK'`` otherwise). Empty when any of them is set: a partial launch env is the
    launcher's business, not something to paper over."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if any(k in environ for k in keys):
        return {}
    return dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def pin_model_runner(environ: dict[str, str], data_parallel: int, routed_experts: bool = False) -> dict[str, str]:
    """The environment that keeps vLLM's data-parallel engines in lockstep: with data-parallel > 1, vLLM's V1 model
    runner (``VLLM_USE_V2_MODEL_RUNNER=0``). The engine groups step together (``VLLMEngine.groups_step_together``);
    a group with nothing scheduled steps a dummy batch that joins the others' data-parallel sync, which the V1 runner
    guards and vLLM 0.33's Model Runner V2 (its default where it applies) skips (read in vLLM's source, not run), so one group
    would wait forever. Empty with data-parallel 1 or when already pinned; EngineError if V2 is asked for.

    ``routed_experts`` (routing replay): vLLM returns them only from Model Runner V2 ("requires Model Runner V2"), so
    with data-parallel 1 the runner is pinned to V2 and with data-parallel > 1 there is no runner that works: an
    EngineError (``config_rules`` refuses the layout before launch)."""
    if routed_experts:
        return _pin_v2(environ, data_parallel)
    if data_parallel <= 1:
        return {}
    value = environ.get(_RUNNER_ENV)
    if value is None:
        return {_RUNNER_ENV: "0"}
    if value.strip().lower() in ("0", "false"):
        return {}
    raise EngineError(f"{_RUNNER_ENV}={value} with vLLM data-parallel {data_parallel}: Model Runner V2 skips the "
                      f"data-parallel sync on a step with nothing scheduled and the engine groups' lockstep hangs; "
                      f"unset {_RUNNER_ENV} (the engine pins the V1 runner) or use one engine group.")


SHM = "/dev/shm"


def routed_experts_shm_bytes(kv_tokens: int, hf_config: dict[str, Any]) -> int:
    """Host shared memory vLLM's routed-expert capture maps per engine (``RoutedExpertsCapturer.init_buffer`` in
    ``model_executor/layers/fused_moe/routed_experts_capturer.py``: int32 ``[KV-cache tokens, num_hidden_layers,
    num_experts_per_tok]`` through ``multiprocessing.shared_memory``, i.e. a file in /dev/shm)."""
    return 4 * kv_tokens * int(hf_config["num_hidden_layers"]) * int(hf_config["num_experts_per_tok"])


def kv_tokens_bound(hf_config: dict[str, Any], gpu_bytes: float, utilization: float, tensor_parallel: int,
                    dtype_bytes: int = 2) -> int:
    """At most how many tokens vLLM's KV cache holds on one GPU: ``utilization`` of the GPU less this rank's share of
    the weights, over the KV bytes of one token on one GPU (K and V of every layer, the KV heads split over TP and
    replicated past them). An upper bound: vLLM also keeps activations and CUDA graphs out of it."""
    layers, heads = int(hf_config["num_hidden_layers"]), int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    per_token = 2 * layers * max(1, kv_heads // tensor_parallel) * head_dim * dtype_bytes
    weights = dtype_bytes * sum(math.prod(shape) for shape in hf_param_shapes(hf_config).values()) / tensor_parallel
    return max(0, int((utilization * gpu_bytes - weights) // per_token))


def check_routed_experts_shm(free_bytes: int | None, need_bytes: int) -> None:
    """EngineError naming the fix when /dev/shm is missing (None) or smaller than the capture buffer."""
    if free_bytes is None or free_bytes < need_bytes:
        have = "is missing" if free_bytes is None else f"has {free_bytes / 2**30:.2f} GiB free"
        raise EngineError(f"routed-expert capture (algo.router_replay=rollout) maps {need_bytes / 2**30:.2f} GiB of "
                          f"host shared memory per engine and {SHM} {have}; give the job a larger /dev/shm (a "
                          f"container's --shm-size, or the node's tmpfs) or set algo.router_replay=none.")


def shm_free_bytes(path: str = SHM) -> int | None:
    return shutil.disk_usage(path).free if os.path.isdir(path) else None


_RELAYOUT_ENV = ("VLLM_USE_FLASHINFER_MOE_FP16", "VLLM_ROCM_USE_AITER_MOE")


def check_moe_weight_layout(environ: dict[str, str], moe: bool) -> None:
    """EngineError when vLLM would re-lay out bf16 MoE weights after loading: the weight sync writes each expert's
    checkpoint-format ``[gate; up]`` rows straight into ``w13_weight``, so a kernel that swapped them to ``[up; gate]``
    (``UnquantizedFusedMoEMethod.process_weights_after_loading``: ``swap_w13_to_w31`` for FlashInfer's CUTLASS MoE,
    ``VLLM_USE_FLASHINFER_MOE_FP16=1``) or shuffled them (ROCm AITER) would read every synced expert wrong, silently.
    Triton's fused MoE, vLLM's default for bf16 on CUDA, keeps the loaded layout."""
    if not moe:
        return
    for key in _RELAYOUT_ENV:
        value = environ.get(key, "").strip().lower()
        if value not in ("", "0", "false"):
            raise EngineError(f"{key}={environ[key]} with an MoE model: that vLLM MoE kernel re-lays out the expert "
                              f"weights after loading and the in-place weight sync would write them in the checkpoint "
                              f"layout, silently wrong; unset {key} (Triton's fused MoE keeps the layout).")


def _pin_v2(environ: dict[str, str], data_parallel: int) -> dict[str, str]:
    if data_parallel > 1:
        raise EngineError(f"routed-expert capture (algo.router_replay=rollout) with vLLM data-parallel {data_parallel}: "
                          f"vLLM returns routed experts only from Model Runner V2, and the engine groups' lockstep needs "
                          f"the V1 runner; use one engine group (rollout.vllm.tensor_parallel = the engine ranks) or "
                          f"algo.router_replay=none.")
    value = environ.get(_RUNNER_ENV)
    if value is not None and value.strip().lower() in ("0", "false"):
        raise EngineError(f"{_RUNNER_ENV}={value} with routed-expert capture (algo.router_replay=rollout): vLLM returns "
                          f"routed experts only from Model Runner V2; unset {_RUNNER_ENV}.")
    return {} if value is not None and value.strip().lower() in ("1", "true") else {_RUNNER_ENV: "1"}


@contextlib.contextmanager
def launcher_ranks(rank: int, world_size: int, local_rank: int) -> Iterator[None]:
    """``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` as vLLM's ``external_launcher`` must see them while an engine is built
    on a default process group that is not the job's (the async mode's engine ranks), then the job's again.

    vLLM takes the worker's rank from ``RANK`` (``ExecutorWithExternalLauncher._distributed_args``) and derives its
    data-parallel rank as ``RANK // (world_size // data_parallel_size)`` (``ParallelConfig.__post_init__``; the same
    code in vLLM 0.20.1, 0.32 and 0.33), assuming the torch.distributed world is the job. On the engine ranks it is
    the engine side's group (ranks 0..E-1) while the job's RANK counts the trainer ranks first: engine ranks past
    the data-parallel size raise "data_parallel_rank (N) must be in the range", the others take a wrong rank.
    ``LOCAL_RANK`` is the node-local index that picks the GPU. Read once, at construction; restored after so that
    the job's messages name the job's rank."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    if saved["RANK"] != str(rank):
        logger.info("vLLM external_launcher: RANK=%d WORLD_SIZE=%d (this side's process group; the job's RANK is %s)",
                    rank, world_size, saved["RANK"])
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
