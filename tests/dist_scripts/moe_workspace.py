"""A workspace for the MoE worker scripts of this folder: a tiny random Qwen3-MoE saved by Hugging Face
(``conversion.synthetic_moe``), settings and samples (``spec.json``), and Hugging Face's own reference log-probs."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sample(gen: torch.Generator, vocab: int) -> dict:
    plen, rlen = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(2, 8, (1,), generator=gen))
    return {"prompt": torch.randint(3, vocab, (plen,), generator=gen).tolist(),
            "response": torch.randint(3, vocab, (rlen,), generator=gen).tolist(),
            "advantage": float(torch.randn(1, generator=gen))}


@torch.no_grad()
def _hf_logp(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Naive per-token log-probs of the response from Hugging Face's own logits."""
    logits = model(torch.tensor([prompt + response])).logits[0].double() / TEMPERATURE
    return torch.stack([torch.log_softmax(logits[len(prompt) - 1 + j], -1)[t] for j, t in enumerate(response)])


def write_moe_workspace(ws: Path, **config: Any) -> tuple[dict, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Write the workspace; returns (spec, HF's log-probs of ``spec["samples"]``, HF's weights in checkpoint names).
    ``config``: overrides of the tiny model's HF config."""
    from conversion.synthetic_moe import save_tiny_moe_model
    from dapo_mcore.weights.qwen3_moe import per_expert_views

    model = save_tiny_moe_model(ws / "hf", seed=2, **config)
    gen = torch.Generator().manual_seed(4)
    vocab = model.config.vocab_size
    spec = {"seed": 5, "vocab_div": 16, "temperature": TEMPERATURE, "micro_batch_tokens": 24, "lr": 1e-3,
            "adam_eps": 1e-4, "weight_decay": 0.1, "grad_clip": 1.0, "route_seed": 9,
            "algo": {"clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token-mean"},
            "samples": [_sample(gen, vocab) for _ in range(8)]}
    for key in ("update1", "update2", "update3"):
        batch = [_sample(gen, vocab) for _ in range(8)]
        for s in batch:
            logp = _hf_logp(model, s["prompt"], s["response"]).float()
            s["old_logprobs"] = (logp + 0.3 * torch.randn(len(logp), generator=gen)).tolist()
        spec[key] = batch
    (ws / "spec.json").write_text(json.dumps(spec))
    ref = [_hf_logp(model, s["prompt"], s["response"]) for s in spec["samples"]]
    state = dict(model.state_dict())
    views = per_expert_views(state)  # transformers holds each layer's experts fused; checkpoints name them one by one
    fused = {k for k in state if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))}
    named = {**{k: v for k, v in state.items() if k not in fused}, **views}
    return spec, ref, {k: v.detach().clone() for k, v in named.items()}
