"""Qwen3-MoE on Megatron: router and sparse-layer semantics against Hugging Face's own classes, the
per-expert name table, expert-parallel layout errors, and the EP conversion round trip (all in one process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    from conversion.synthetic_moe import save_tiny_moe_model

    out = tmp_path_factory.mktemp("moe") / "hf"
    save_tiny_moe_model(out)
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_router_matches_qwen3_moe_router(norm_topk_prob):
    """Megatron's top-k routing with the kwargs model/moe.py derives gives HF's experts and gates, including on
    near-tied logits (pairs of router rows 1e-3 apart, as in the tiny test model)."""
    import transformers
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from dapo_mcore.model.moe import moe_transformer_kwargs

    hf = dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=3, moe_intermediate_size=4,
              num_hidden_layers=2, norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.01)
    kw = moe_transformer_kwargs(hf)
    assert kw["moe_router_pre_softmax"] is (not norm_topk_prob) and kw["moe_aux_loss_coeff"] == 0.01
    router = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                                           norm_topk_prob=norm_topk_prob))
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(8, 16, generator=gen)
    rows[1::2] = rows[0::2] + 1e-3 * torch.randn(4, 16, generator=gen)
    with torch.no_grad():
        router.weight.copy_(rows)
    hidden = torch.randn(64, 16, generator=gen)
    logits, gates, experts = router(hidden)
    probs, routing_map = topk_routing_with_score_function(
        logits, kw["moe_router_topk"], use_pre_softmax=kw["moe_router_pre_softmax"],
        score_function=kw["moe_router_score_function"])
    want = torch.zeros(64, 8, dtype=torch.bool).scatter(1, experts, True)
    assert torch.equal(routing_map, want)
    torch.testing.assert_close(probs.gather(1, experts), gates, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("mlp_only", "step"), [([0], 1), ([], 2), ([1, 2], 1), ([3], 3)])
def test_sparse_layers_are_the_ones_transformers_builds(mlp_only, step):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from dapo_mcore.model.moe import MoEShape

    cfg = dict(vocab_size=16, hidden_size=8, intermediate_size=8, moe_intermediate_size=4, num_hidden_layers=6,
               num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=4, num_experts_per_tok=2,
               mlp_only_layers=mlp_only, decoder_sparse_step=step)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg))
    built = tuple(i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock))
    shape = MoEShape.from_hf({"model_type": "qwen3_moe", **cfg})
    assert shape.moe_layers == built and shape.layer_pattern == [int(i in built) for i in range(6)]


def test_name_table_covers_the_saved_checkpoint_and_engine_views(tiny_moe_dir):
    """The mapping's HF tensors are exactly what save_pretrained wrote (per expert); the engine's per-expert views
    of transformers' fused expert parameters hold the same values."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    from conversion.synthetic_moe import build_tiny_moe_model
    from dapo_mcore.weights.qwen3_moe import per_expert_views
    from dapo_mcore.weights.registry import get_mapping

    mapping = get_mapping(json.loads((tiny_moe_dir / "config.json").read_text()))
    with safe_open(str(tiny_moe_dir / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert mapping.hf_shapes() == saved
    views = per_expert_views(dict(build_tiny_moe_model().named_parameters()))
    tensors = load_file(str(tiny_moe_dir / "model.safetensors"))
    assert len(views) == 3 * 4 * 3 and all(torch.equal(v, tensors[k]) for k, v in views.items())


def test_expert_layout_errors_name_the_fix():
    from dapo_mcore.actor.parallel import expert_layout_error
    from dapo_mcore.model.moe import MoEConfigError, MoEShape, check_expert_parallel

    assert expert_layout_error(4, 1, 2, 2) is None and expert_layout_error(8, 2, 1, 4) is None
    msg = expert_layout_error(4, 2, 1, 4)  # expert-TP = TP = 2: EP x 2 must divide the 4 ranks
    assert "expert_parallel=4 x expert_tensor_parallel=2 must divide the 4 ranks" in msg
    assert "use an expert_parallel among 1, 2" in msg
    assert expert_layout_error(4, 2, 1, 4, expert_tensor_parallel=1) is None  # whole experts: EP spans TP
    shape = MoEShape.from_hf({"model_type": "qwen3_moe", "num_local_experts": 6, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 4, "num_hidden_layers": 2})
    with pytest.raises(MoEConfigError, match="does not divide num_experts=6; use one of 1, 2, 3, 6"):
        check_expert_parallel(shape, 4)
    with pytest.raises(MoEConfigError, match="needs an MoE model"):
        check_expert_parallel(None, 2)


@pytest.mark.parametrize(("overrides", "says"), [
    (["parallel.expert_parallel=3"], "parallel.expert_parallel=3 does not divide num_experts=4"),
    (["algo.router_replay=rollout", "rollout.schedule.streaming=true", "rollout.schedule.partial=true",
      "algo.tis_cap=2"], "algo.router_replay=rollout with rollout.schedule.partial"),
])
def test_config_refuses_moe_misuse_in_one_line(tiny_moe_dir, cli_env, overrides, says):
    """Before any process group or run directory: exit 2, one line naming the field and the fix."""
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "config", "examples/tiny_cpu.yaml",
                           "model.tiny_base=false", f"model.hf_path={tiny_moe_dir}", *overrides],
                          cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr


def test_convert_round_trip_at_ep2_pp2_is_bit_exact(tiny_moe_dir, tmp_path):
    from safetensors.torch import load_file

    from conversion.hf_to_mcore import convert_hf_to_mcore
    from conversion.mcore_to_hf import convert_mcore_to_hf
    from dapo_mcore.weights.checkpoint import read_megatron_rank
    from dapo_mcore.weights.layout import ParallelLayout

    meta = convert_hf_to_mcore(tiny_moe_dir, tmp_path / "mc", ParallelLayout(pp=2, ep=2), direct=False)
    assert meta.layout.ep == 2
    names = sorted(p.name for p in (tmp_path / "mc").glob("mp_rank_*"))
    assert names == ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]
    src = load_file(str(tiny_moe_dir / "model.safetensors"))
    # layer 1 is the first MoE layer (layer 0 is dense); EP rank 1 holds experts 2, 3 as local experts 0, 1
    rank = read_megatron_rank(tmp_path / "mc", 0, 0, 1)
    assert torch.equal(rank["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"],
                       src["model.layers.1.mlp.experts.3.down_proj.weight"])
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back", direct=False)
    back = {}
    for f in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(str(f)))
    assert back.keys() == src.keys()
    assert all(torch.equal(back[k], src[k]) for k in src)
