"""A short DAPO run from a tiny random model of each family beyond Qwen2.5: ``dapo-mcore train examples/tiny_cpu.yaml
model.tiny_base=false model.hf_path=<tiny model>`` on two gloo ranks, the transformers engine on each rank.

What both show: the engine (Hugging Face's own class, synced from Megatron after every update) and the Megatron actor
give the same log-probs on the sampled tokens at both steps, so the export's names and merges are right. Then each
family's own risk, read from the saved checkpoint:
- Qwen3 at TP=2 (head_dim 32 != 64 / 4, q/k norms away from 1): Megatron sums the q/k norm gradients over TP ranks
  (each rank sees only its own heads), so the two ranks' replicas stay equal while moving away from the start.
- Llama 3.x at PP=2 with tied embeddings and its own llama3 RoPE: the last stage's output layer is a copy of the first
  stage's embedding, and Megatron keeps the two equal through the updates (its embedding group all-reduces their
  gradients)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conversion.synthetic import save_tiny_hf_model
from dapo_mcore.data.tokenizer import build_tiny_tokenizer
from dapo_mcore.model.hf_config import rope_parameters
from dapo_mcore.weights.checkpoint import read_megatron_rank, read_meta

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SHORT = ("train.steps=2", "train.prompts_per_step=4", "train.mini_batch_prompts=2", "rollout.gen_batch_prompts=4",
         "algo.dynamic_sampling=false", "eval.every=0", "eval.at_start=false", "eval.max_prompts=8",
         "checkpoint.every=0")


def _train_two_steps(cli_env, tmp_path: Path, preset: str, parallel: str) -> tuple[Path, Path]:
    """Two steps from a tiny random ``preset`` at ``parallel`` (an override); the HF dir and the step-2 checkpoint's
    model dir, after checking the engine and the actor agree on every sampled token of both steps."""
    hf = tmp_path / preset
    save_tiny_hf_model(hf, seed=2, preset=preset)
    build_tiny_tokenizer().save_pretrained(hf)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "dapo_mcore.cli", "train",
           str(ROOT / "examples" / "tiny_cpu.yaml"), "model.tiny_base=false", f"model.hf_path={hf}", parallel,
           f"run.dir={run}", *SHORT]
    proc = subprocess.run(cmd, env=cli_env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # step 2 samples with the weights synced after step 1's update
        assert r["mismatch/tokens"] > 0 and r["mismatch/logp_abs_diff_max"] < 1e-5, r
        assert torch.isfinite(torch.tensor(r["train/loss"])) and r["train/grad_norm"] > 0
    return hf, run / "checkpoints" / "step_000002" / "model"


def test_tiny_qwen3_trains_at_tp2_with_exact_engine_sync(cli_env, tmp_path):
    hf, model = _train_two_steps(cli_env, tmp_path, "tiny-qwen3", "parallel.tensor_parallel=2")
    assert read_meta(model).hf_config["model_type"] == "qwen3"
    init = load_file(str(hf / "model.safetensors"))
    ranks = [read_megatron_rank(model, tp_rank, 0) for tp_rank in range(2)]
    for layer in range(2):
        for mine, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            a, b = (r[f"decoder.layers.{layer}.self_attention.{mine}.weight"] for r in ranks)
            assert torch.equal(a, b), (layer, mine)
            assert not torch.equal(a, init[f"model.layers.{layer}.self_attn.{theirs}.weight"]), (layer, mine)


def test_tiny_llama_trains_at_pp2_tied_with_exact_engine_sync(cli_env, tmp_path):
    # tied, llama3 RoPE with a 16-token original context
    hf, model = _train_two_steps(cli_env, tmp_path, "tiny-llama", "parallel.pipeline_parallel=2")
    meta = read_meta(model)
    assert meta.hf_config["model_type"] == "llama" and rope_parameters(meta.hf_config)["rope_type"] == "llama3"
    init = load_file(str(hf / "model.safetensors"))["model.embed_tokens.weight"]
    first, last = read_megatron_rank(model, 0, 0), read_megatron_rank(model, 0, 1)
    embedding, output = first["embedding.word_embeddings.weight"], last["output_layer.weight"]
    assert torch.equal(embedding, output)
    assert not torch.equal(embedding[: init.shape[0]], init)  # the updates moved the shared weight
