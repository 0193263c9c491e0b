"""torch_dist interop: HF -> Megatron-LM's dist-checkpoint layout -> a GPTModel built as Megatron-LM builds it
(logits equal HF's), and a checkpoint saved by megatron-core's own `dist_checkpointing.save` (with another
vocabulary padding) -> HF bit-exactly. One gloo process, run as this file's worker in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _worker(ws: Path) -> None:
    sys.path.insert(0, str(REPO))
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from safetensors.torch import load_file

    from conversion.torch_dist import TRACKER, _setup, hf_to_torch_dist, torch_dist_to_hf
    from conversion.verify import compare_logits, megatron_logits
    from dapo_mcore.actor.parallel import shutdown
    from dapo_mcore.model.qwen import transformer_config
    from dapo_mcore.weights.live import load_hf_into_model

    out: dict = {}
    hf_config = json.loads((ws / "hf" / "config.json").read_text())
    ids = torch.load(ws / "ids.pt")
    ref_logits = torch.load(ws / "logits.pt")
    ref = load_file(os.fspath(ws / "hf" / "model.safetensors"))
    try:
        _setup(1, 1)
        hf_to_torch_dist(ws / "hf", ws / "mlm")
        out["tracker"] = (ws / "mlm" / TRACKER).read_text().strip()
        out["files"] = sorted(p.name for p in (ws / "mlm" / "release").iterdir())
        common = dist_checkpointing.load_common_state_dict(os.fspath(ws / "mlm" / "release"))
        out["common"] = {"checkpoint_version": common["checkpoint_version"], "iteration": common["iteration"],
                         "tp": common["args"].tensor_model_parallel_size,
                         "padded": common["args"].padded_vocab_size,
                         "divisible_by": common["args"].make_vocab_size_divisible_by}

        def megatron_lm_model(padded: int) -> GPTModel:  # as Megatron-LM's gpt_builders does (local impl)
            cfg = transformer_config(hf_config)
            return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                            vocab_size=padded, max_sequence_length=hf_config["max_position_embeddings"],
                            pre_process=True, post_process=True, parallel_output=True,
                            share_embeddings_and_output_weights=hf_config["tie_word_embeddings"],
                            position_embedding_type="rope", rotary_percent=1.0,
                            rotary_base=hf_config["rope_parameters"]["rope_theta"])

        model = megatron_lm_model(common["args"].padded_vocab_size)
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, os.fspath(ws / "mlm" / "release"))
        model.load_state_dict(state["model"])
        out["mlm_logits"] = compare_logits(ref_logits, megatron_logits([model], ids, hf_config["vocab_size"]))

        # megatron-core's own save, Megatron-Bridge's padding (vocab 96 -> 96: largest power of 2 <= 128 dividing it)
        own = megatron_lm_model(96)
        load_hf_into_model([own], ws / "hf", "local", 96)
        (ws / "own").mkdir()
        dist_checkpointing.save({"model": own.sharded_state_dict()}, os.fspath(ws / "own"))
        torch_dist_to_hf(ws / "own", ws / "hf", ws / "back_own")
        torch_dist_to_hf(ws / "mlm", ws / "hf", ws / "back_mlm")
        for tag in ("own", "mlm"):
            back = load_file(os.fspath(ws / f"back_{tag}" / "model.safetensors"))
            out[f"{tag}_bit_exact"] = sorted(back) == sorted(ref) and all(torch.equal(back[k], ref[k]) for k in ref)
    finally:
        (ws / "result.json").write_text(json.dumps(out))
        shutdown()


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from conversion.synthetic import save_tiny_hf_model

    ws = tmp_path_factory.mktemp("torch_dist")
    model = save_tiny_hf_model(ws / "hf", seed=5, tie_word_embeddings=False, vocab_size=96, rope_theta=50000.0)
    (ws / "hf" / "tokenizer_config.json").write_text("{}")
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    torch.save(ids, ws / "ids.pt")
    with torch.no_grad():
        torch.save(model(ids).logits, ws / "logits.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, __file__, str(ws)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ws)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((ws / "result.json").read_text()), ws


@pytest.mark.unit
def test_megatron_lm_layout_and_common_state(result):
    out, ws = result
    assert out["tracker"] == "release"
    assert {"metadata.json", "common.pt", ".metadata"} <= set(out["files"])
    # the default vocabulary padding is tp: 96 rows stay 96, and Megatron-LM's args carry the divisor
    # (the largest power of two <= 128 whose multiple is 96) that makes Megatron-LM rebuild exactly 96 rows
    assert out["common"] == {"checkpoint_version": 3.0, "iteration": 0, "tp": 1, "padded": 96, "divisible_by": 32}


@pytest.mark.unit
def test_loads_into_a_megatron_lm_built_gpt_model(result):
    stats = result[0]["mlm_logits"]
    assert stats["max_abs_diff"] < 1e-4 and stats["top1_agreement"] == 1.0, stats


@pytest.mark.unit
def test_megatron_core_saved_checkpoints_convert_to_hf_bit_exactly(result):
    out, ws = result
    assert out["own_bit_exact"] and out["mlm_bit_exact"]
    assert (ws / "back_own" / "tokenizer_config.json").exists()


@pytest.mark.distributed
def test_saved_at_tp2_pp2_converts_back_at_tp1_bit_exactly(tmp_path):
    """The CLI under torchrun (4 gloo processes) saves at TP2/PP2; the single-process import reads it at TP1."""
    from safetensors.torch import load_file

    from conversion.mcore_to_hf import main as mcore_to_hf_main
    from conversion.synthetic import save_tiny_hf_model

    save_tiny_hf_model(tmp_path / "hf", seed=2, tie_word_embeddings=False, num_hidden_layers=4)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
                           "29613", "-m", "conversion.hf_to_mcore", "--hf", str(tmp_path / "hf"), "--out",
                           str(tmp_path / "tp2pp2"), "--tp", "2", "--pp", "2", "--format", "torch_dist",
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("wrote") == 1
    common = torch.load(tmp_path / "tp2pp2" / "release" / "common.pt", weights_only=False)
    assert (common["args"].tensor_model_parallel_size, common["args"].pipeline_model_parallel_size) == (2, 2)
    proc = subprocess.run([sys.executable, "-m", "conversion.mcore_to_hf", "--format", "torch_dist", "--mcore",
                           str(tmp_path / "tp2pp2"), "--hf-config", str(tmp_path / "hf"), "--out",
                           str(tmp_path / "back"), "--no-progress"], env={k: v for k, v in env.items()
                                                                          if k not in ("RANK", "WORLD_SIZE")},
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref, back = (load_file(os.fspath(tmp_path / d / "model.safetensors")) for d in ("hf", "back"))
    assert sorted(ref) == sorted(back) and all(torch.equal(ref[k], back[k]) for k in ref)
    assert mcore_to_hf_main(["--format", "torch_dist", "--mcore", str(tmp_path / "tp2pp2"), "--out",
                             str(tmp_path / "x")]) == 2  # --hf-config missing: one line, exit 2


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
