"""A tiny random Qwen3-MoE built with Hugging Face's own ``Qwen3MoeForCausalLM``, for tests and benchmarks.

Every tensor is randomised away from its initial value (norms, q/k norms around 1), ``head_dim`` differs from
hidden / heads, one layer is dense (``mlp_only_layers``) and the router rows come in near-tied pairs (expert
``2j + 1``'s row is expert ``2j``'s plus 1e-3 noise): a token's top-2 is mostly one pair whose two gates are nearly
equal, so a converter that swapped the experts of a pair, or a router that took the k-th/(k+1)-th order differently,
would change the output by the difference of two experts' MLPs, not by rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_MOE: dict[str, Any] = dict(
    model_type="qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1,
    max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    router_aux_loss_coef=0.001, attention_bias=False,
)


def tiny_moe_config(**overrides: Any) -> dict[str, Any]:
    return {**TINY_MOE, **overrides}


def build_tiny_moe_model(hf_config: dict[str, Any] | None = None, seed: int = 0, tie_gap: float = 1e-3):
    """A random HF Qwen3MoeForCausalLM (eval mode, float32) with norms away from 1 and near-tied router pairs."""
    import transformers

    cfg = dict(hf_config or TINY_MOE)
    cfg.pop("model_type", None)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                rows = torch.randn_like(p)
                rows[1::2] = rows[0::2] + tie_gap * torch.randn_like(rows[0::2])
                p.copy_(rows)
            elif "experts" in name:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def save_tiny_moe_model(out_dir: str | Path, seed: int = 0, **overrides: Any):
    """Build and save a tiny random Qwen3-MoE (per-expert tensors, as transformers saves them); returns the model."""
    model = build_tiny_moe_model(tiny_moe_config(**overrides), seed=seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


TINY_MOE_BASE: dict[str, Any] = dict(
    model_type="qwen3_moe", vocab_size=32, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
    max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
    router_aux_loss_coef=0.001, attention_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
"""A trainable tiny Qwen3-MoE on the tiny tokenizer's 32-token vocabulary (4 experts, top-2, both layers sparse)."""


def save_tiny_moe_base(out_dir: str | Path, steps: int = 200, seed: int = 0, settings: Any = None) -> Path:
    """A tiny Qwen3-MoE pre-trained on the max4 corpus like the embedded tiny base (`data.base_model.pretrain`),
    saved with the tiny tokenizer: a directory that `dapo-mcore train model.hf_path=...` takes. ``settings``
    (a ``TinyBaseSettings``, e.g. a run config's ``tiny_base`` for another task) replaces steps and seed."""
    import transformers

    from dapo_mcore.data.base_model import pretrain
    from dapo_mcore.data.tiny_base_settings import TinyBaseSettings
    from dapo_mcore.data.tokenizer import build_tiny_tokenizer

    cfg = dict(TINY_MOE_BASE)
    cfg.pop("model_type")
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg))
    tokenizer = build_tiny_tokenizer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the weights must not depend on the caller's thread count
    try:
        pretrain(model, tokenizer, settings if settings is not None else TinyBaseSettings(steps=steps, seed=seed))
    finally:
        torch.set_num_threads(threads)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
