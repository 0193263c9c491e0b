"""Build the committed Megatron-Bridge fixtures: tiny HF Qwen2 models and the checkpoints Bridge itself writes of them.

For each model in MODELS: a Qwen2ForCausalLM from its config with a fixed seed (transformers' own class, nothing
downloaded), saved to <model>/hf; then Megatron-Bridge's AutoBridge.import_ckpt of it at TP1 and TP2
(tests/bridge/bridge_cpu.py under torchrun, gloo) into <model>/bridge_tp1 and <model>/bridge_tp2; then, as the check,
Bridge's own AutoBridge.export_ckpt of each back to HF, every tensor torch.equal (same dtype and shape) to the original.
Run from anywhere with the Bridge virtualenv's python (it has the transformers Bridge pins):

    .venv-bridge/bin/python tests/data/bridge/make_fixtures.py [--check-only]

Paths are passed relative to tests/data/bridge/<model>, so the run_config.yaml Bridge writes names no machine path
(model.hf_model_id: hf, checkpoint.save: bridge_tpN). The vocabulary, 300, is even but not a multiple of 128, so a
writer that pads it (dapo-mcore used to pad to 128 x TP) is told apart from Bridge's rule (pad by the largest power of
two <= 128 dividing it: 4, i.e. no padding). --check-only skips the building and re-runs the export check.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
HARNESS = REPO / "tests" / "bridge" / "bridge_cpu.py"
sys.path.insert(0, str(HARNESS.parent))

from bridge_tensors import hf_differences, load_safetensors_dir  # noqa: E402

COMMON = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)
# name -> (config overrides, dtype, seed)
MODELS = {
    "qwen2_untied_fp32": (dict(tie_word_embeddings=False), torch.float32, 1234),
    "qwen2_tied_bf16": (dict(tie_word_embeddings=True), torch.bfloat16, 4321),
}
TPS = (1, 2)


def build_hf(name: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    overrides, dtype, seed = MODELS[name]
    out = HERE / name / "hf"
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(seed)
    config = Qwen2Config(**COMMON, **overrides, dtype=dtype)
    model = Qwen2ForCausalLM(config).to(dtype)
    # Qwen2's q/k/v biases start at zero; give them values, so that a lost or misplaced bias shows.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.02)
        for norm in [model.model.norm] + [m for layer in model.model.layers
                                          for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.normal_(1.0, 0.02)
    model.save_pretrained(out)


def bridge_import(name: str, tp: int) -> None:
    cwd = HERE / name
    shutil.rmtree(cwd / f"bridge_tp{tp}", ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
           str(HARNESS), "import", "--hf", "hf", "--out", f"bridge_tp{tp}", "--tp", str(tp)]
    subprocess.run(cmd, cwd=cwd, check=True)


def check_export(name: str, tp: int) -> int:
    """Bridge's export_ckpt of <name>/bridge_tp<tp>, compared with <name>/hf; returns the number of tensors."""
    cwd = HERE / name
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(HARNESS), "export", "--mcore", f"bridge_tp{tp}", "--out", tmp,
                        "--hf", "hf"], cwd=cwd, check=True)
        bad = hf_differences(cwd / "hf", Path(tmp))
    if bad:
        raise SystemExit(f"{name} bridge_tp{tp}: Bridge's export is not the original HF model: {bad[:5]}")
    return len(load_safetensors_dir(cwd / "hf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check-only", action="store_true")
    args = parser.parse_args()
    for name in MODELS:
        if not args.check_only:
            build_hf(name)
            for tp in TPS:
                bridge_import(name, tp)
        for tp in TPS:
            n = check_export(name, tp)
            print(f"make_fixtures: {name} bridge_tp{tp}: Bridge export_ckpt == original HF, {n} tensors torch.equal")


if __name__ == "__main__":
    main()
