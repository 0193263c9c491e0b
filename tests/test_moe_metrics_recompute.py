"""MoE router metrics under activation recompute: a recomputed layer runs its router's forward a second time inside
backward (Megatron's full recompute re-runs each layer there, as torch's checkpoint does), so a forward hook fires
twice per micro-batch. ``RouterStats`` counts each routed token once, whatever the recompute."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

pytestmark = pytest.mark.unit

EXPERTS, TOPK, HIDDEN = 4, 2, 8


class StandInRouter(torch.nn.Module):
    """Megatron's ``TopKRouter`` output shape: (probs [tokens, experts], routing_map [tokens, experts] bool)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_number = 1
        self.weight = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x @ self.weight.t()
        top = logits.topk(TOPK, dim=-1).indices
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        return logits.softmax(-1) * routing_map, routing_map


def _layer(router: StandInRouter, x: torch.Tensor) -> torch.Tensor:
    probs, _ = router(x)
    return (probs.sum(-1, keepdim=True) * x).tanh()


@pytest.mark.parametrize("recompute", ["none", "reentrant", "non_reentrant"])
def test_tokens_per_expert_count_each_token_once_under_recompute(recompute):
    from dapo_mcore.model.moe import RouterStats

    router = StandInRouter()
    stats = RouterStats([], num_layers=1, num_experts=EXPERTS)
    router.register_forward_hook(stats._record)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    if recompute == "none":
        out = _layer(router, x)
    else:  # the first forward runs without saving activations, as Megatron's CheckpointFunction does
        out = checkpoint(_layer, router, x, use_reentrant=recompute == "reentrant")
    out.sum().backward()
    assert router.weight.grad is not None and x.grad is not None  # the recompute did run (backward reached both)
    expected = torch.zeros(EXPERTS, dtype=torch.float64)  # naive: each token's top-k experts, counted by hand
    with torch.no_grad():
        for token in x:
            for e in (token @ router.weight.t()).topk(TOPK).indices.tolist():
                expected[e] += 1
    assert stats.counts[0].tolist() == expected.tolist()
    assert stats.calls.tolist() == [1.0]
    assert stats.metrics(tensor_parallel=1)["moe/tokens_per_expert_mean"] == pytest.approx(12 * TOPK / EXPERTS)


def test_in_recompute_is_true_only_inside_backward():
    from dapo_mcore.model.moe import in_recompute

    seen = []
    x = torch.ones(2, requires_grad=True)
    y = checkpoint(lambda t: seen.append(in_recompute()) or t * 2, x, use_reentrant=True)
    y.sum().backward()
    assert seen == [False, True]


def test_recipes_promise_no_routing_mismatch_metric_that_vllm_without_replay_does_not_log():
    """vLLM returns routes only with ``enable_return_routed_experts`` (routing replay on), so with vLLM and
    ``router_replay: none`` ``moe/routing_mismatch_frac`` is never logged; a recipe's comment must not promise it."""
    from pathlib import Path

    from dapo_mcore.config import load_config

    checked = 0
    for recipe in sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml")):
        text = recipe.read_text()
        if "routing_mismatch_frac" not in text:
            continue
        cfg = load_config(str(recipe), [])
        if cfg.rollout.engine != "vllm" or cfg.algo.router_replay != "none":
            continue
        checked += 1
        said = " ".join(line.strip().lstrip("#").strip() for line in text.splitlines() if line.strip().startswith("#"))
        assert "routing_mismatch_frac is not logged" in said, recipe.name
    assert checked >= 1  # the MoE recipe (vLLM, replay off) is among them
