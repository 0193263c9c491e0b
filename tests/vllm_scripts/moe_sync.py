"""A tiny Qwen3-MoE through the real vLLM backend (CPU build) and the weight sync; run by tests/test_vllm_moe_sync.py.

    python moe_sync.py OUT_JSON WIDTH      # WIDTH: the experts' moe_intermediate_size

Two Hugging Face ``Qwen3MoeForCausalLM`` A and B (same shape, 8 experts of width WIDTH, top-2, renormalised;
different random weights) are the references. vLLM loads A from disk; then the backend syncs B and A back the way a
run does (``begin_weight_update`` / ``load_weights`` in checkpoint names, one tensor per expert / ``finish_weight_update``).
After each, vLLM's prompt log-probs must match a plain HF forward of the model it holds within TOL (fp32). Width 32 is
what vLLM's CPU experts (vector ISA) use as is; width 16 they zero-pad to 32 when they pack.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dapo_mcore.data.tokenizer import build_tiny_tokenizer  # noqa: E402
from dapo_mcore.rollout.engines.vllm_backend import _LLMBackend  # noqa: E402
from dapo_mcore.rollout.engines.vllm_env import current_platform_traits  # noqa: E402
from dapo_mcore.weights.qwen3_moe import per_expert_views  # noqa: E402

TOL = 1e-4
CONFIG = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=64, num_experts=8,
              num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
              tie_word_embeddings=False, max_position_embeddings=128, rope_theta=10000.0, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
PROMPTS = [[1, 7, 9, 12, 30, 41, 5, 6, 33, 20], [1, 3, 50, 60, 61, 17], [1, 4, 4, 8, 9, 10, 11, 40, 44, 2, 9]]


def make(seed: int, width: int) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**dict(CONFIG, moe_intermediate_size=width))).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


def checkpoint_tensors(model: Qwen3MoeForCausalLM) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors under checkpoint names (one per expert), as the actor's export sends them."""
    sd = model.state_dict()
    fused = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
    items = [(n, t) for n, t in sd.items() if not n.endswith(fused)] + list(per_expert_views(sd).items())
    return [(n, t.detach().clone().contiguous()) for n, t in items]


def hf_logprobs(model: Qwen3MoeForCausalLM) -> torch.Tensor:
    rows = []
    with torch.no_grad():
        for p in PROMPTS:
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
            rows.append(lp[torch.arange(len(p) - 1), torch.tensor(p[1:])])
    return torch.cat(rows)


def vllm_logprobs(backend: _LLMBackend) -> torch.Tensor:
    outs = backend.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [dict(max_tokens=1, prompt_logprobs=0, temperature=1.0)] * len(PROMPTS))
    return torch.cat([torch.tensor([d[t].logprob for t, d in zip(p[1:], o.prompt_logprobs[1:], strict=True)])
                      for p, o in zip(PROMPTS, outs, strict=True)])


def main(out: Path, width: int) -> None:
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1").items():
        os.environ.setdefault(key, value)
    import vllm

    a, b = make(0, width), make(1, width)
    hf_dir = out.parent / "hf_a"
    a.save_pretrained(hf_dir)
    build_tiny_tokenizer().save_pretrained(hf_dir)
    backend = _LLMBackend(vllm, dict(model=str(hf_dir), enforce_eager=True, dtype="float32", seed=0, max_model_len=128,
                                     max_num_seqs=8, distributed_executor_backend="external_launcher"),
                          current_platform_traits())
    diffs = {}
    for tag, model, sync in (("disk_a", a, False), ("sync_b", b, True), ("sync_a", a, True)):
        if sync:
            backend.begin_weight_update()
            backend.load_weights(checkpoint_tensors(model))
            backend.finish_weight_update()
            backend.reset_prefix_cache()
        d = (vllm_logprobs(backend) - hf_logprobs(model)).abs()
        diffs[tag] = {"mean": d.mean().item(), "max": d.max().item()}
        print(tag, diffs[tag], flush=True)
    out.write_text(json.dumps(diffs))
    for tag, d in diffs.items():
        assert d["max"] < TOL, f"{tag}: vLLM vs HF log-prob max diff {d['max']:.3g} (tol {TOL})"


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
