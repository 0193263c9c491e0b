"""Per-step throughput and MFU of the train and log-prob phases, from the documented FLOPs formula (``flops.py``).

Model FLOPs count each sequence's forward pass (attention at its own length included): 1x for the log-prob pass,
3x for training (recomputation is not counted: MFU is model FLOPs utilisation). MFU needs a device peak: the
configured one, or the data-sheet value of a recognised GPU; on a CPU only tokens/s is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.flops import PEAK_FLOPS, ModelShape, sequence_forward_flops


def device_peak_flops(configured_tflops: float | None, fp8: bool) -> float | None:
    """Peak FLOP/s of one device: the configured value, else a known GPU's data-sheet value, else None."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()
    for chip in ("h200", "h100", "a100"):
        if chip in name:
            return PEAK_FLOPS.get(f"{chip}-{'fp8' if fp8 else 'bf16'}", PEAK_FLOPS.get(f"{chip}-bf16"))
    return None


@dataclass(frozen=True)
class StepWork:
    """The model FLOPs and tokens of one step's log-prob pass and training passes."""

    logprob_flops: float
    train_flops: float
    logprob_tokens: int
    train_tokens: int

    @classmethod
    def of(cls, hf_config: dict[str, Any], seq_lens: Sequence[int], epochs: int) -> StepWork:
        shape = ModelShape.from_hf(hf_config)
        fwd = sum(sequence_forward_flops(shape, n) for n in seq_lens)
        tokens = int(sum(seq_lens))
        return cls(fwd, 3.0 * fwd * epochs, tokens, tokens * epochs)

    def metrics(self, seconds: dict[str, float], devices: int, peak: float | None,
                generated_tokens: int) -> dict[str, float]:
        """Throughput per device: generated tokens over the step's wall time (the keys.py contract), trained and
        log-prob tokens over their own phases, and MFU of those two phases when the device peak is known."""
        out: dict[str, float] = {}
        train_s, lp_s, step_s = seconds.get("train", 0.0), seconds.get("old_logprobs", 0.0), seconds.get("step", 0.0)
        if step_s > 0:
            out[keys.PERF_TOKENS_PER_S_PER_DEVICE] = generated_tokens / step_s / devices
        if seconds.get("generate", 0.0) > 0:  # the decoding rate itself: over the generate phase only
            out["perf/decode_tokens_per_s_per_device"] = generated_tokens / seconds["generate"] / devices
        if train_s > 0:
            out["perf/train_tokens_per_s_per_device"] = self.train_tokens / train_s / devices
            if peak:
                out[keys.PERF_MFU_TRAIN] = self.train_flops / train_s / (devices * peak)
        if lp_s > 0:
            out["perf/logprob_tokens_per_s_per_device"] = self.logprob_tokens / lp_s / devices
            if peak:
                out[keys.PERF_MFU_LOGPROB] = self.logprob_flops / lp_s / (devices * peak)
        return out
