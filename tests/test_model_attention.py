"""The SDPA core attention of the local layer spec (dapo_mcore.model.attention).

One worker process (tests/dist_scripts/attention_check.py, a world of one on gloo) compares it with Megatron's own
DotProductAttention (outputs and q/k/v gradients; causal, unmasked, block-diagonal and general masks; GQA and MHA;
THD packing with and without padded cu_seqlens), the whole GPTModel with Hugging Face's eager Qwen2 (logits and
every parameter gradient, also under selective recompute), and the actor built with each attention (log-probs,
entropy and one DAPO update in the rows, packed and THD layouts). TP=2 / PP=2 / DP=2 with the SDPA default are
covered by tests/test_actor_parity.py. The spec and config plumbing is checked in-process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("attention") / "res.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "dist_scripts" / "attention_check.py"), str(out)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.distributed
def test_module_equals_megatron_local_attention_with_gradients(res):
    keys = [k for k in res if k.startswith("module_")]
    # 2 head layouts x (causal mask, no mask, block mask, general mask)
    assert len(keys) == 8, keys
    for k in keys:
        assert res[k] <= TOL, (k, res[k])


@pytest.mark.distributed
def test_thd_packing_equals_block_diagonal_local_attention(res):
    for heads in ("h4g2", "h4g4"):
        assert res[f"thd_{heads}"] <= TOL, heads
        assert res[f"thd_padded_{heads}"] <= TOL, heads
        assert res[f"thd_padded_pad_rows_abs_{heads}"] == 0.0, heads


@pytest.mark.distributed
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_gpt_model_with_sdpa_equals_hf_eager_logits_and_every_gradient(res, recompute):
    assert res[f"model_grad_names_equal_{recompute}"]
    assert res[f"model_logits_{recompute}"] <= TOL
    assert res["model_grad_scale"] > 1e-3  # gradients are not trivially zero
    assert res[f"model_grads_{recompute}"] <= TOL * max(1.0, res["model_grad_scale"])


@pytest.mark.distributed
def test_actor_logprobs_and_update_equal_megatron_local(res):
    for key in [k for k in res if k.startswith(("actor_logp_", "actor_entropy_", "actor_update_metrics_",
                                                 "actor_update_weights_"))]:
        assert res[key] <= TOL, (key, res[key])
    assert {k for k in res if k.startswith("actor_logp_sdpa")} == {
        "actor_logp_sdpa_rows_rows", "actor_logp_sdpa_rows_packed", "actor_logp_sdpa_thd_thd"}
    assert res["actor_update_ok_sdpa_rows"] == res["actor_update_ok_sdpa_thd"] == 1.0
    # Guards: the update moved every tensor, clipped some ratios, and hit the gradient clip.
    assert res["actor_update_min_move"] > 1e-5
    assert 0.0 < res["actor_update_clipfrac"] < 1.0 and res["actor_update_grad_norm"] > 1.0


def test_layer_spec_swaps_only_the_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from dapo_mcore.model.attention import SDPAttention
    from dapo_mcore.model.qwen import layer_spec

    old, new = layer_spec("local", "megatron_local"), layer_spec("local")
    assert old.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert new.submodules.self_attention.submodules.core_attention is SDPAttention
    assert layer_spec("local", "sdpa").submodules.self_attention.submodules.core_attention is SDPAttention
    assert new.submodules.self_attention.submodules.linear_qkv is old.submodules.self_attention.submodules.linear_qkv
    assert new.submodules.mlp == old.submodules.mlp
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        layer_spec("local", "flash")
    with pytest.raises(ValueError, match="model.attention=sdpa applies to the local layer spec"):
        layer_spec("transformer_engine", "sdpa")


def test_config_attention_field_and_validation():
    from dapo_mcore.config import Config, ConfigError
    from dapo_mcore.config.tree import from_dict

    cfg = from_dict(Config, {"model": {"tiny_base": True}})
    assert cfg.model.attention == "auto"
    cfg.model.attention = "megatron_local"
    cfg.model.validate()
    cfg.model.layer_spec = "transformer_engine"
    with pytest.raises(ConfigError, match="model.attention=megatron_local applies to the local layer spec"):
        cfg.model.validate()
