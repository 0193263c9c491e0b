"""The planner's activation bytes per layer against the bytes Megatron-Core's layers really save for backward,
measured with ``torch.autograd.graph.saved_tensors_hooks`` (tests/dist_scripts/saved_bytes.py) on tiny models of
the same structure: dense and MoE, TP 1 and 2, EP 2, sequence parallelism at TP 2 (dense, and MoE: Megatron runs MoE
with TP only under it), recompute none and selective, within 10%.

The CPU runs the local spec (composed torch RMSNorm, unfused SwiGLU and rotary embedding: ``fused=False``); the
planner prices Transformer Engine's fused kernels with the same terms less those copies. Sequence parallelism runs
on gloo with the local spec once its torch norm is let through (the one place it refuses: see saved_bytes.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore.plan.activations import layer_activations
from dapo_mcore.telemetry.flops import ModelShape

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "dist_scripts" / "saved_bytes.py"
TOKENS = 256


def _shape(kind: str) -> ModelShape:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from saved_bytes import _hf
    finally:
        sys.path.pop(0)
    return ModelShape.from_hf(_hf(kind))


def _measure(cli_env: dict, nproc: int, specs: list[str]) -> dict[str, float]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else \
        [sys.executable]
    proc = subprocess.run([*launch, str(SCRIPT), str(TOKENS), *specs], cwd=REPO, env=cli_env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # ranks share one stdout: two ranks' lines can run together, so read every "SAVED {...}" wherever it stands
    rows = [json.loads(m) for m in re.findall(r"SAVED (\{[^{}]*\})", proc.stdout)]
    assert rows, proc.stdout[-2000:]
    out: dict[str, list[float]] = {}
    for r in rows:
        out.setdefault(r["spec"], []).append(r["bytes"])
    return {spec: sum(v) / len(v) for spec, v in out.items()}  # EP: routing is uneven per rank, even in sum


def _model(spec: str) -> float:
    kind, tp, _ep, recompute, *sp = spec.split(":")
    return layer_activations(_shape(kind), recompute, 4, int(tp), sequence_parallel=sp == ["sp"], fused=False).total


@pytest.mark.distributed
def test_the_activation_model_matches_measured_saved_bytes(cli_env):
    one = ["dense:1:1:none", "dense:1:1:selective", "moe:1:1:none", "moe:1:1:selective"]
    two = ["dense:2:1:none", "dense:2:1:selective", "moe:1:2:none", "dense:2:1:none:sp", "moe:2:1:none:sp"]
    measured = {**_measure(cli_env, 1, one), **_measure(cli_env, 2, two)}
    assert sorted(measured) == sorted(one + two)
    for spec, got in measured.items():
        assert abs(_model(spec) - got) <= 0.10 * got, (spec, _model(spec), got)
    # Sequence parallelism saves what the model says (the norms' and routing's tokens split over TP), to the byte; and
    # the MoE part at TP 2 with it matches to the byte too, which the 10% alone would not show: the expert-TP
    # all-gather keeps the k x h dispatched tokens whole (dividing them by TP would be 256 bytes a token off here).
    saved = measured["dense:2:1:none"] - measured["dense:2:1:none:sp"]
    assert saved == pytest.approx(_model("dense:2:1:none") - _model("dense:2:1:none:sp"), abs=1)
    moe_part = measured["moe:2:1:none:sp"] - measured["dense:2:1:none:sp"]
    assert moe_part == pytest.approx(_model("moe:2:1:none:sp") - _model("dense:2:1:none:sp"), abs=2)
    # Selective recompute of flash/SDPA attention frees only its log-sum-exp (heads x fp32); the planner used to
    # subtract a whole query width.
    assert measured["dense:1:1:none"] - measured["dense:1:1:selective"] == pytest.approx(4 * 4, abs=1)


@pytest.mark.unit
def test_moe_with_tensor_parallelism_keeps_the_gathered_tokens_whole():
    """30B-A3B at TP=4 (SP, expert-TP = TP): each rank keeps 8 routed tokens x 2048 values per token per layer
    (the dispatcher's all-gather over expert-TP), 16 K bf16 values that the dense-MLP sizing divided by 4."""
    from dapo_mcore.model.presets import preset_config
    from dapo_mcore.plan.planner import activation_bytes_per_token_layer

    shape = ModelShape.from_hf(preset_config("qwen3-30b-a3b"))
    at4 = layer_activations(shape, "none", 2, 4)
    experts = at4.moe_mlp  # the norm, routing and experts of one MoE layer
    gathered = 8 * 2048 * 2
    assert experts > gathered  # the k h term is whole on every TP rank
    assert layer_activations(shape, "none", 2, 4, expert_tensor_parallel=1).moe_mlp < experts - gathered * 0.7
    assert activation_bytes_per_token_layer(shape, "none", 2, 4) == at4.total
    # 48 layers x 22528 tokens: ~55 GiB, against the 9.3 GiB of the dense-MLP sizing
    assert 50 < at4.total * 48 * 22528 / 2**30 < 60


@pytest.mark.unit
def test_tokens_per_expert_counts_each_routed_token_once_under_sequence_parallelism():
    """``moe/tokens_per_expert_mean`` sums every rank's router counts and divides by the ranks that routed the same
    tokens: all TP ranks without sequence parallelism, one with it (each routes its 1/TP slice: the split the
    activation model charges the routing with). Dividing by TP under SP read TP x low."""
    from dapo_mcore.model.moe import routing_copies

    assert routing_copies(4, sequence_parallel=False) == 4
    assert routing_copies(4, sequence_parallel=True) == 1
    shape = _shape("moe")
    with_sp = layer_activations(shape, "none", 2, 2, sequence_parallel=True)
    without = layer_activations(shape, "none", 2, 2, sequence_parallel=False)
    assert with_sp.moe_mlp < without.moe_mlp  # routing (and norms) are split over TP only under SP
