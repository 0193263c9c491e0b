"""Bytes each decoder layer saves for backward, measured with ``torch.autograd.graph.saved_tensors_hooks``: a tiny
Megatron GPT (local spec, SDPA core attention, fp32) of a given structure runs one forward on ``tokens`` tokens;
every tensor an autograd node saves while a layer runs is charged to that layer, once per storage, parameters
excluded. Prints one JSON line per rank: {"dense": bytes/token/layer, "moe": bytes/token/layer}.

Run: [torchrun --nproc_per_node N] tests/dist_scripts/saved_bytes.py TOKENS KIND:TP:EP:RECOMPUTE[:sp] ...
(one process group, one model after another; one line per spec: SAVED {"spec": ..., "rank": r, "bytes": b}).

``:sp`` turns sequence parallelism on. Megatron-Core's local spec refuses it in one place only: its torch norm
(``WrappedTorchNorm``, megatron/core/transformer/torch_norm.py) asserts ``not config.sequence_parallel``, because
a norm's weight then sees a 1/TP slice of the tokens and its gradient needs an all-reduce over TP, which Megatron
does for parameters marked ``sequence_parallel`` (Transformer Engine's norms mark theirs; the torch norm does not).
The norm's forward is per token, the same with or without it, so for a forward's saved bytes the norm is built as
if the flag were off and its weight marked as TE marks it (:func:`_norms_under_sequence_parallelism`); the linear
layers' all-gather / reduce-scatter and the MoE dispatcher run as they are, on gloo.
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


def _norms_under_sequence_parallelism() -> None:
    """Let the local spec's torch norm be built with ``sequence_parallel=True`` (see the module docstring)."""
    from megatron.core.transformer import torch_norm

    built = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        sp, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm = built(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def measure(kind: str, tp: int, ep: int, recompute: str, tokens: int, sp: bool = False) -> float:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config

    init_model_parallel(tp, 1, expert_parallel=ep, seed=1)
    hf = _hf(kind)
    tconfig = transformer_config(hf, tensor_parallel=tp, expert_parallel=ep, recompute=recompute,
                                 sequence_parallel=sp)
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
    return sum(charged.values()) / tokens / len(charged)


def main(tokens: int, specs: list[str]) -> None:
    from dapo_mcore.actor.parallel import init_distributed, read_launch_env, shutdown
    from dapo_mcore.model import cpu_compat

    cpu_compat.apply()
    _norms_under_sequence_parallelism()
    init_distributed(read_launch_env(), "gloo")
    for spec in specs:
        kind, tp, ep, recompute, *sp = spec.split(":")
        saved = measure(kind, int(tp), int(ep), recompute, tokens, sp == ["sp"])
        line = "SAVED " + json.dumps({"spec": spec, "rank": int(os.environ.get("RANK", "0")), "bytes": saved}) + "\n"
        sys.stdout.write(line)  # one write per line: the ranks share this stdout
        sys.stdout.flush()
    shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
