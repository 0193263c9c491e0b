"""Synthetic Qwen2 / Qwen3 checkpoints for tests, parity checks and benchmarks.

`save_tiny_hf_model` builds a small random ``Qwen2ForCausalLM`` (or, with ``preset="tiny-qwen3"``,
``Qwen3ForCausalLM``) with Hugging Face's own code (biases and norms, q/k norms included, randomised: they
initialise to zeros/ones, which would hide layout bugs) and saves it with ``save_pretrained``.
`write_synthetic_hf_checkpoint` writes a large random checkpoint straight to safetensors shards without any
model object, tensor by tensor, for conversion benchmarks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dapo_mcore.model.presets import preset_config
from dapo_mcore.weights.hf_checkpoint import HFShardedWriter, write_hf_config
from dapo_mcore.weights.registry import get_mapping


def tiny_hf_config(preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """The `tiny` preset (GQA 4 heads / 2 KV heads, QKV bias) or `tiny-qwen3` (q/k norm, head_dim 32 != 64 / 4)
    with overrides, e.g. tie_word_embeddings=False."""
    return preset_config(preset, **overrides)


def build_tiny_hf_model(hf_config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu"):
    """A random HF causal LM of the config's family (Qwen2ForCausalLM, Qwen3ForCausalLM) with every tensor
    (biases, norms included) randomised, built on ``device``."""
    import transformers

    from dapo_mcore.model.hf_config import family_of

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device(device):
        model = getattr(transformers, family_of(hf_config).hf_class)(config)
    model = model.to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_tiny_hf_model(out_dir: str | Path, seed: int = 0, max_shard_size: str | None = None, preset: str = "tiny",
                       **overrides: Any):
    """Build and save a random tiny HF model (``preset`` "tiny" or "tiny-qwen3"); returns the model (eval mode)."""
    model = build_tiny_hf_model(tiny_hf_config(preset, **overrides), seed=seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return model


def write_synthetic_hf_checkpoint(out_dir: str | Path, hf_config: dict[str, Any], *, dtype: torch.dtype,
                                  max_shard_bytes: int = 2 * 10**9, seed: int = 0) -> int:
    """Write random tensors of the config's shapes as HF shards + index + config.json; returns total bytes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    shapes = get_mapping(hf_config).hf_shapes()
    writer = HFShardedWriter(out_dir, [(n, dtype, s) for n, s in shapes.items()], max_shard_bytes)
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes.items():
        writer.write(name, (0.02 * torch.randn(shape, generator=gen)).to(dtype))
    writer.close()
    write_hf_config(out_dir, hf_config, dtype)
    return writer.total
