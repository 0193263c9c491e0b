"""Bytes each decoder layer saves for backward, measured with ``torch.autograd.graph.saved_tensors_hooks``: a tiny
Megatron GPT (local spec, SDPA core attention, fp32) of a given structure runs one forward on ``tokens`` tokens;
every tensor an autograd node saves while a layer runs is charged to that layer, once per storage, parameters
excluded. Prints one JSON line per rank: {"dense": bytes/token/layer, "moe": bytes/token/layer}.

Run: [torchrun --nproc_per_node N] tests/dist_scripts/saved_bytes.py KIND TP EP RECOMPUTE TOKENS
"""

from __future__ import annotations

import json
import os
import sys

import torch


def _hf(kind: str) -> dict:
    base = dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False)
    if kind == "moe":
        base.update(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False,
                    router_aux_loss_coef=0.001)
    return base


def measure(kind: str, tp: int, ep: int, recompute: str, tokens: int) -> dict[str, float]:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from dapo_mcore.actor.parallel import init_distributed, init_model_parallel, read_launch_env
    from dapo_mcore.model import cpu_compat
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config

    cpu_compat.apply()
    init_distributed(read_launch_env(), "gloo")
    init_model_parallel(tp, 1, expert_parallel=ep, seed=1)
    hf = _hf(kind)
    tconfig = transformer_config(hf, tensor_parallel=tp, expert_parallel=ep, recompute=recompute)
    model = build_gpt_model(hf, tconfig, make_vocab_size_divisible_by=16)[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current: list[int | None] = [None]
    seen: dict[int, set[int]] = {}
    charged: dict[int, int] = {}

    def pack(t: torch.Tensor):
        layer = current[0]
        ptr = t.untyped_storage().data_ptr()
        if layer is not None and ptr not in params and ptr not in seen.setdefault(layer, set()):
            seen[layer].add(ptr)
            charged[layer] = charged.get(layer, 0) + t.untyped_storage().nbytes()
        return t

    for m in model.modules():
        if isinstance(m, TransformerLayer):
            m.register_forward_pre_hook(lambda mod, _a: current.__setitem__(0, mod.layer_number))
            m.register_forward_hook(lambda mod, _a, _o: current.__setitem__(0, None))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, tokens), generator=g)
    pos = torch.arange(tokens).unsqueeze(0)
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, pos, None)
    out.float().sum().backward()
    per_layer = {k: v / tokens for k, v in charged.items()}
    return {kind: sum(per_layer.values()) / len(per_layer)}


if __name__ == "__main__":
    kind, tp, ep, recompute, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    result = measure(kind, tp, ep, recompute, tokens)
    print("SAVED " + json.dumps({"rank": int(os.environ.get("RANK", "0")), **result}), flush=True)
