"""A tiny model of each family with its own traits through the real vLLM engine on vLLM's CPU build (the ``vllm``
tier). Two ranks, actor TP=2 and one vLLM engine at TP=2, a short DAPO run from a tiny random HF model (head_dim 32, the
smallest vLLM's CPU attention accepts; tied embeddings): the weights the actor exports after every update load into
vLLM's own model, and its log-probs on the sampled tokens match the Megatron actor's.

- Qwen3 (``Qwen3ForCausalLM``): the exported HF names include the q/k norms.
- Llama 3.x (``LlamaForCausalLM``, tied as Llama 3.2 1B/3B): the llama3 RoPE scaling with a 16-token original context,
  so vLLM's own llama3 frequencies and Megatron's must agree within the sampled sequences; the tied LM head is
  re-dispatched.

Same skip rule as ``test_rollout_vllm_cpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_rollout_vllm_cpu import CONFIG, ROOT, TOL, _free_port, pytestmark  # noqa: F401 (the same skip rule)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_tiny_dapo_run_on_vllm_tp2(tmp_path, preset):
    from conversion.synthetic import save_tiny_hf_model
    from dapo_mcore.data.tokenizer import build_tiny_tokenizer

    hf = tmp_path / "hf"
    save_tiny_hf_model(hf, seed=2, preset=preset)
    build_tiny_tokenizer().save_pretrained(hf)
    env = dict(os.environ)
    env["DAPO_MCORE_CACHE"] = str(tmp_path / "cache")  # nothing is pre-trained: the model comes from hf_path
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(key, None)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "dapo_mcore.cli", "train", str(CONFIG), "model.tiny_base=false",
           f"model.hf_path={hf}", "parallel.tensor_parallel=2", "rollout.vllm.tensor_parallel=2", f"run.dir={run}",
           "train.steps=2", "train.prompts_per_step=4", "train.mini_batch_prompts=2", "rollout.gen_batch_prompts=4",
           "algo.dynamic_sampling=false", "eval.at_start=false", "eval.every=0", "eval.max_prompts=8", "checkpoint.every=0",
           "run.rollout_store=false"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "mismatch/logp_abs_diff_max" in r]
    assert len(steps) == 2, rows
    for r in steps:  # step 2 generates with the weights synced into vLLM after step 1's update
        assert r["mismatch/tokens"] > 0 and r["mismatch/logp_abs_diff_max"] < TOL, r
        assert r["mismatch/logp_abs_diff_mean"] < TOL / 10, r
