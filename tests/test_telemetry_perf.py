"""Per-step throughput and MFU (telemetry.perf) against hand-computed values."""

from __future__ import annotations

import pytest

from dapo_mcore.model.presets import preset_config
from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.flops import ModelShape, sequence_forward_flops
from dapo_mcore.telemetry.perf import StepWork, device_peak_flops

pytestmark = pytest.mark.unit


def test_step_work_counts_each_sequence_at_its_own_length():
    hf = preset_config("qwen2.5-0.5b")
    shape = ModelShape.from_hf(hf)
    work = StepWork.of(hf, [100, 300], epochs=2)
    fwd = sequence_forward_flops(shape, 100) + sequence_forward_flops(shape, 300)
    # Not the same as one 400-token sequence: attention is quadratic per sequence.
    assert fwd < sequence_forward_flops(shape, 400)
    assert work.logprob_flops == pytest.approx(fwd)
    assert work.train_flops == pytest.approx(3 * fwd * 2)
    assert (work.logprob_tokens, work.train_tokens) == (400, 800)


def test_metrics_divide_by_phase_seconds_devices_and_peak():
    work = StepWork(logprob_flops=2e12, train_flops=6e12, logprob_tokens=1000, train_tokens=2000)
    m = work.metrics({"train": 2.0, "old_logprobs": 0.5, "step": 4.0}, devices=2, peak=1e12, generated_tokens=800)
    assert m[keys.PERF_TOKENS_PER_S_PER_DEVICE] == pytest.approx(800 / 4.0 / 2)
    assert m["perf/train_tokens_per_s_per_device"] == pytest.approx(2000 / 2.0 / 2)
    assert m[keys.PERF_MFU_TRAIN] == pytest.approx(6e12 / 2.0 / (2 * 1e12))
    assert m[keys.PERF_MFU_LOGPROB] == pytest.approx(2e12 / 0.5 / (2 * 1e12))


def test_no_mfu_without_a_peak_and_a_configured_peak_wins():
    work = StepWork(1.0, 3.0, 10, 10)
    m = work.metrics({"train": 1.0, "old_logprobs": 1.0, "step": 1.0}, devices=1, peak=None, generated_tokens=5)
    assert keys.PERF_MFU_TRAIN not in m and keys.PERF_MFU_LOGPROB not in m
    assert device_peak_flops(123.0, fp8=False) == pytest.approx(123e12)


def test_decoded_tokens_count_each_token_in_the_step_that_decoded_it():
    """Generation throughput with partial rollouts: a step's carried tokens are its own, and the resumed prefixes
    that the next step's finished groups contain are not that step's."""
    from dapo_mcore.run.components import _decoded_tokens

    step_s = {"sampling/tokens_generated": 100, "sampling/tokens_aborted": 20, "sampling/tokens_partial_buffered": 30}
    step_s1 = {"sampling/tokens_generated": 130, "sampling/tokens_resumed_stale": 30}
    assert _decoded_tokens(step_s) == 150 and _decoded_tokens(step_s1) == 100
    assert _decoded_tokens({"sampling/tokens_generated": 77}) == 77  # no streaming: unchanged
