"""The rollout side: the engine protocol (``protocol``, the only module at this level) and, by concern,
``correction`` (training-inference mismatch metrics, TIS, MoE routes), ``scheduling`` (which prompts, on which
engine, partial rollouts), ``engines`` (the HF engine for CPU and small models, the vLLM engine with its environment,
backend and outputs) and ``pipeline`` (the rollout source the trainer asks, colocated or async). This module exports
the engines and the protocol's types. ``VLLMEngine`` imports vLLM only when built."""

from dapo_mcore.rollout.correction.mismatch import MismatchStats, mismatch_metrics, tis_weights
from dapo_mcore.rollout.engines.hf_engine import HFEngine
from dapo_mcore.rollout.engines.vllm_engine import VLLMEngine, VLLMEngineOptions
from dapo_mcore.rollout.engines.weight_sync import SyncTracker, hf_param_shapes
from dapo_mcore.rollout.protocol import (
    Engine,
    EngineError,
    GroupStream,
    PartialGroup,
    PartialGroupStream,
    PromptFilterResult,
    Response,
    ResumingEngine,
    SamplingParams,
    StreamingEngine,
    WeightBucket,
    filter_prompts,
)

__all__ = [
    "Engine",
    "EngineError",
    "GroupStream",
    "HFEngine",
    "MismatchStats",
    "PartialGroup",
    "PartialGroupStream",
    "PromptFilterResult",
    "Response",
    "ResumingEngine",
    "SamplingParams",
    "StreamingEngine",
    "SyncTracker",
    "VLLMEngine",
    "VLLMEngineOptions",
    "WeightBucket",
    "filter_prompts",
    "mismatch_metrics",
    "hf_param_shapes",
    "tis_weights",
]
