"""The files Megatron-Bridge reads beside a checkpoint's tensors: ``run_config.yaml`` and the train state.

Megatron-Bridge (0.6.2, what `AutoBridge.import_ckpt` writes and what `export_ckpt` / `load_megatron_model` and its
training loader read) keeps the model's definition in ``iter_NNNNNNN/run_config.yaml``: a ``ConfigContainer`` whose
``model:`` section is the model provider (``GPTModelProvider``) with its fields; the loader instantiates that section
alone (`load_model_config`), builds the model from it and loads the tensors. Its training loader also reads
``model.tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` and the ``checkpoint:`` section's ``save_rng``
/ ``save_optim``, and the step from ``train_state.pt`` (``latest_train_state.pt`` in the save dir).

`bridge_run_config` writes the provider's fields as Bridge's Qwen2 / Qwen3 / Qwen3-MoE bridges set them from the HF
config (``provider_bridge``: the CONFIG_MAPPING fields plus RMSNorm, SwiGLU, no linear biases), so the model Bridge
builds from it is the one `hf_to_mcore` built; fields not written take the provider's defaults, as in Bridge's own
checkpoints. ``tests/data/bridge/`` holds checkpoints Bridge wrote itself and the smallest run_config it loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
"""Bridge 0.6.2's Qwen2, Qwen3 and Qwen3-MoE bridges all build this provider (with their own field values)."""


def _callable(target: str) -> dict[str, Any]:
    """How Bridge's YAML names a function or dtype object (not called on load)."""
    return {"_target_": target, "_call_": False}


def bridge_run_config(hf_config: dict[str, Any], *, tp: int, pp: int, dtype: torch.dtype, padded_rows: int,
                      vocab_padding: str, divisible_by: int, tokenizer_model: str | None) -> dict[str, Any]:
    """Megatron-Bridge's run_config.yaml (as a dict) for the model of `hf_config` saved at `tp` x `pp`."""
    from dapo_mcore.model.hf_config import megatron_rope_scaling_factor
    from dapo_mcore.model.qwen import QwenShape
    from dapo_mcore.model.vocab import _power_of_two_divisor, padded_vocab_size

    s = QwenShape.from_hf(hf_config)
    rope_factor = megatron_rope_scaling_factor(hf_config, "a Megatron-Bridge checkpoint")  # Llama 3.1+
    model_type = hf_config["model_type"]
    dtype_name = str(dtype).removeprefix("torch.")
    divisor = _power_of_two_divisor(s.vocab_size, 128)  # what Bridge's import writes
    model: dict[str, Any] = {
        "_target_": PROVIDER,
        "num_layers": s.num_layers, "hidden_size": s.hidden_size, "ffn_hidden_size": s.ffn_hidden_size,
        "num_attention_heads": s.num_heads, "num_query_groups": s.num_kv_heads, "kv_channels": s.head_dim,
        "vocab_size": s.vocab_size, "seq_length": s.max_position_embeddings,
        "layernorm_epsilon": s.rms_norm_eps, "rotary_base": s.rope_theta, "rotary_percent": 1.0,
        "position_embedding_type": "rope", "normalization": "RMSNorm", "gated_linear_unit": True,
        "activation_func": _callable("torch.nn.functional.silu"), "add_bias_linear": False,
        "add_qkv_bias": s.qkv_bias, "qk_layernorm": s.qk_norm,
        "share_embeddings_and_output_weights": s.tie_embeddings,
        "rope_scaling": rope_factor is not None, "rope_scaling_factor": rope_factor or 1.0,  # 1.0: as Bridge writes
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "params_dtype": _callable(f"torch.{dtype_name}"), "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "make_vocab_size_divisible_by": divisor, "should_pad_vocab": padded_rows != s.vocab_size,
        # should_pad_vocab=False (Bridge's default) keeps the vocabulary; where TP needed padding, the divisor
        # below makes Bridge's calculate_padded_vocab_size(vocab, divisor, tp) land on the rows written
    }
    if padded_rows != s.vocab_size:  # Bridge then pads to a multiple of make_vocab_size_divisible_by x TP
        model["make_vocab_size_divisible_by"] = divisible_by if vocab_padding == "megatron" else divisor
        assert padded_vocab_size(s.vocab_size, model["make_vocab_size_divisible_by"], tp) == padded_rows
    if model_type == "qwen3_moe":  # as Bridge's Qwen3MoEBridge.provider_bridge sets them
        from dapo_mcore.model.moe import MoEShape

        moe = MoEShape.from_hf(hf_config)
        model.update(num_moe_experts=moe.num_experts, moe_router_topk=moe.topk,
                     moe_ffn_hidden_size=moe.moe_ffn_hidden_size, moe_grouped_gemm=True,
                     moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=moe.aux_loss_coeff,
                     moe_router_pre_softmax=not moe.norm_topk_prob, moe_token_dispatcher_type="alltoall",
                     moe_permute_fusion=True)
    config: dict[str, Any] = {
        "_target_": "megatron.bridge.training.config.ConfigContainer",
        "model": model,
        "checkpoint": {"_target_": "megatron.bridge.training.config.CheckpointConfig", "ckpt_format": "torch_dist",
                       "save_optim": False, "save_rng": False, "fully_parallel_save": True},
    }
    if tokenizer_model is not None:
        config["tokenizer"] = {"_target_": "megatron.bridge.training.tokenizers.config.TokenizerConfig",
                               "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizer_model}
    return config


TRAIN_STATE_FIELDS = ("step", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")


def train_state() -> dict[str, torch.Tensor]:
    """Megatron-Bridge's TrainState of a checkpoint no training wrote (step 0), as `torch.save`s it."""
    state = {k: torch.tensor(0) for k in TRAIN_STATE_FIELDS}
    state["floating_point_operations_so_far"] = torch.tensor(0.0)
    state.update({k: torch.tensor(False) for k in ("do_train", "do_valid", "do_test")})
    return state


def write_bridge_files(ckpt_dir: Path, hf_config: dict[str, Any], *, tokenizer_model: str | None,
                       **model_kwargs: Any) -> None:
    """run_config.yaml and train_state.pt into the iteration dir, latest_train_state.pt into the save dir
    (`model_kwargs`: `bridge_run_config`'s tp, pp, dtype, padded_rows, vocab_padding, divisible_by)."""
    import yaml

    config = bridge_run_config(hf_config, tokenizer_model=tokenizer_model, **model_kwargs)
    (ckpt_dir / "run_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    state = train_state()
    torch.save(state, ckpt_dir / "train_state.pt")
    torch.save(state, ckpt_dir.parent / "latest_train_state.pt")
