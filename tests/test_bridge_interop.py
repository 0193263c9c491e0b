"""Megatron-Bridge interop against checkpoints Megatron-Bridge wrote itself (tests/data/bridge, written by
Bridge 0.6.2 on megatron-core 0.19.2: no common.pt, the common state inside the .distcp, tracker "0" -> iter_0000000,
run_config.yaml), read here on whatever megatron-core this venv has (0.16.1 in the main suite, 0.19.2 in the
mcore-newest tier); and our `--format bridge` output compared with Bridge's own files for the same HF model. The live
round trips through Bridge itself (its export_ckpt reading ours) run in .ci/tiers/50-bridge.sh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "bridge"

pytestmark = pytest.mark.distributed


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
           if nproc > 1 else [sys.executable]) + list(args)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(os.fspath(f)))
    return out


def _assert_bit_exact(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(ref)
    bad = [k for k in ref if got[k].dtype != ref[k].dtype or not torch.equal(got[k], ref[k])]
    assert not bad, f"differ: {bad}"


def _tensor_meta(ckpt: Path) -> dict[str, tuple]:
    """Every tensor of a dist checkpoint: key -> (global shape, dtype); read without megatron (torch's DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(os.fspath(ckpt)).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype) for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


# Each model at one TP and each TP with one model (both TPs, both dtypes, tied and untied, in two conversions per
# test; the bridge tier runs all four pairs live).
PAIRS = [("qwen2_untied_fp32", 2), ("qwen2_tied_bf16", 1)]


@pytest.mark.parametrize(("model", "tp"), PAIRS)
def test_bridge_written_checkpoint_converts_back_bit_exactly(model, tp, tmp_path):
    """Bridge's own checkpoint (its save dir, as Bridge wrote it) -> mcore-to-hf with no --hf-config (the model from
    run_config.yaml): every HF tensor bit for bit, the config's shape and tying as the original's."""
    src = DATA / model / f"bridge_tp{tp}"
    assert (src / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert not (src / "iter_0000000" / "common.pt").exists()  # megatron-core 0.17+'s format, which 0.16.1 refused
    _run("-m", "conversion.mcore_to_hf", "--mcore", os.fspath(src), "--out", os.fspath(tmp_path / "hf"))
    _assert_bit_exact(_hf_tensors(tmp_path / "hf"), _hf_tensors(DATA / model / "hf"))
    ours = json.loads((tmp_path / "hf" / "config.json").read_text())
    ref = json.loads((DATA / model / "hf" / "config.json").read_text())
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings"):
        assert ours[key] == ref[key], key
    assert ours["rope_parameters"]["rope_theta"] == ref["rope_parameters"]["rope_theta"]
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()  # Bridge's tokenizer/ copy came along


def test_bridge_checkpoint_with_hf_config_and_logit_parity_at_tp2(tmp_path):
    """--hf-config on an iter_* dir; then `verify --mcore` builds the model at TP2 from Bridge's TP1 checkpoint and
    its logits match Hugging Face's own model."""
    model = DATA / "qwen2_untied_fp32"
    _run("-m", "conversion.mcore_to_hf", "--mcore", os.fspath(model / "bridge_tp1" / "iter_0000000"),
         "--hf-config", os.fspath(model / "hf"), "--out", os.fspath(tmp_path / "hf"))
    _assert_bit_exact(_hf_tensors(tmp_path / "hf"), _hf_tensors(model / "hf"))
    proc = _run("-m", "conversion.verify", "--hf", os.fspath(model / "hf"), "--mcore", os.fspath(model / "bridge_tp1"),
                "--tp", "2", "--json", os.fspath(tmp_path / "v.json"), nproc=2)
    stats = json.loads((tmp_path / "v.json").read_text())
    assert stats["top1_agreement"] == 1.0 and stats["max_abs_diff"] <= stats["atol"], proc.stdout


BRIDGE_MODEL_FIELDS = ("activation_func", "layernorm_epsilon", "rotary_base", "kv_channels", "seq_length",
                       "params_dtype", "make_vocab_size_divisible_by", "should_pad_vocab", "bf16",
                       "tensor_model_parallel_size", "pipeline_model_parallel_size", "qk_layernorm", "rotary_percent")


@pytest.mark.parametrize(("model", "tp"), PAIRS)
def test_format_bridge_writes_what_bridge_writes(model, tp, tmp_path):
    """`hf-to-mcore --format bridge` of the same HF model: Bridge's tracker and file layout, the same tensors (keys,
    global shapes, dtypes) as Bridge's own checkpoint, run_config.yaml's model section equal to Bridge's on every field
    its loader needs (tests/data/bridge/minimal_run_config.yaml) and those that make the model Qwen2; and back to HF
    bit for bit."""
    hf, ref = DATA / model / "hf", DATA / model / f"bridge_tp{tp}"
    out = tmp_path / "ours"
    _run("-m", "conversion.hf_to_mcore", "--hf", os.fspath(hf), "--out", os.fspath(out), "--format", "bridge",
         "--tp", str(tp), nproc=tp)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == (ref / "latest_checkpointed_iteration.txt").read_text()
    top = {p.name for p in ref.iterdir()}
    assert {p.name for p in out.iterdir()} == top
    def files(d: Path) -> set[str]:  # how many .distcp files a rank writes is the writer's thread count
        return {p.name for p in d.iterdir() if p.suffix != ".distcp"} | {"*.distcp"}

    # common.pt: megatron-core 0.16; dapo_mcore_checksums.json: ours (Bridge reads past it, and its own carry none)
    assert files(out / "iter_0000000") - {"common.pt", "dapo_mcore_checksums.json"} == files(ref / "iter_0000000")
    meta_ours = {k: v for k, v in _tensor_meta(out / "iter_0000000").items() if k != "common_state"}
    meta_ref = {k: v for k, v in _tensor_meta(ref / "iter_0000000").items() if k != "common_state"}
    assert meta_ours == meta_ref
    ours = yaml.safe_load((out / "iter_0000000" / "run_config.yaml").read_text())["model"]
    theirs = yaml.safe_load((ref / "iter_0000000" / "run_config.yaml").read_text())["model"]
    minimal = yaml.safe_load((DATA / "minimal_run_config.yaml").read_text())["model"]
    for key in (*minimal, *BRIDGE_MODEL_FIELDS):
        assert ours[key] == theirs[key], (key, ours.get(key), theirs.get(key))
    for name in ("train_state.pt",):
        assert torch.load(out / "iter_0000000" / name) == torch.load(ref / "iter_0000000" / name)
    _run("-m", "conversion.mcore_to_hf", "--mcore", os.fspath(out), "--out", os.fspath(tmp_path / "back"))
    _assert_bit_exact(_hf_tensors(tmp_path / "back"), _hf_tensors(hf))


def test_qwen25_vocabulary_survives_tp2_unpadded(tmp_path):
    """Qwen2.5's real vocabulary (151,936) through `--format bridge` and the default dapo format at TP2: 151,936
    rows (Megatron-LM's 128 x TP rule would make 152,064), and back to HF bit for bit."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    _run("-m", "conversion.hf_to_mcore", "--hf", os.fspath(tmp_path / "hf"), "--out", os.fspath(tmp_path / "b"),
         "--format", "bridge", "--tp", "2", nproc=2)
    meta = _tensor_meta(tmp_path / "b" / "iter_0000000")
    assert meta["embedding.word_embeddings.weight"][0] == (151936, 16)
    assert meta["output_layer.weight"][0] == (151936, 16)
    run_config = yaml.safe_load((tmp_path / "b" / "iter_0000000" / "run_config.yaml").read_text())["model"]
    assert (run_config["vocab_size"], run_config["should_pad_vocab"]) == (151936, False)
    _run("-m", "conversion.hf_to_mcore", "--hf", os.fspath(tmp_path / "hf"), "--out", os.fspath(tmp_path / "d"),
         "--tp", "2", "--no-progress")
    assert json.loads((tmp_path / "d" / "dapo_mcore_checkpoint.json").read_text())["padded_vocab_size"] == 151936
    _run("-m", "conversion.mcore_to_hf", "--mcore", os.fspath(tmp_path / "b"), "--out", os.fspath(tmp_path / "back"))
    _assert_bit_exact(_hf_tensors(tmp_path / "back"), _hf_tensors(tmp_path / "hf"))


def test_unreadable_formats_say_what_reads_them(tmp_path):
    """A legacy per-rank torch checkpoint, an fsdp_dtensor one, a tracker naming a missing iteration: one line each
    (exit 2), naming the dir and the fix."""
    legacy = tmp_path / "legacy"
    (legacy / "iter_0000005" / "mp_rank_00").mkdir(parents=True)
    (legacy / "latest_checkpointed_iteration.txt").write_text("5")
    fsdp = tmp_path / "fsdp" / "iter_0000001"
    fsdp.mkdir(parents=True)
    (fsdp / "metadata.json").write_text(json.dumps({"sharded_backend": "fsdp_dtensor"}))
    moved = tmp_path / "moved"
    shutil.copytree(DATA / "qwen2_untied_fp32" / "bridge_tp1", moved)
    (moved / "latest_checkpointed_iteration.txt").write_text("7")
    cases = {legacy: "legacy per-rank 'torch' format", tmp_path / "fsdp": "'fsdp_dtensor' checkpoint",
             moved: "points at iter_0000007, which does not exist"}
    for path, words in cases.items():
        proc = subprocess.run([sys.executable, "-m", "conversion.mcore_to_hf", "--mcore", os.fspath(path), "--out",
                               os.fspath(tmp_path / f"out-{path.name}")], cwd=ROOT, env=_env(), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("dapo-mcore convert:")]
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / f"out-{path.name}").exists()


@pytest.fixture(scope="module")
def tiny_base_bridge(cli_env, tmp_path_factory) -> Path:
    """The tiny default's base model as a Megatron-Bridge checkpoint (our --format bridge, which Bridge's export_ckpt
    reads bit-exactly in the bridge tier)."""
    from dapo_mcore.config import load_config
    from dapo_mcore.data.base_model import ensure_base_model

    base = ensure_base_model(Path(cli_env["DAPO_MCORE_CACHE"]) / "tiny_base",
                             load_config(ROOT / "examples" / "tiny_cpu.yaml").tiny_base)
    out = tmp_path_factory.mktemp("tiny_base_bridge") / "bridge"
    _run("-m", "conversion.hf_to_mcore", "--hf", os.fspath(base), "--out", os.fspath(out), "--format", "bridge")
    return out


@pytest.mark.e2e
def test_training_starts_from_a_bridge_checkpoint(cli_env, finished_two_steps, tiny_base_bridge, tmp_path):
    """model.mcore_path at a Megatron-Bridge checkpoint of the tiny default's base model starts the same run as the
    base model itself: the 2-step trace equals the finished 2-step run's exactly."""
    from tests.conftest import TWO_STEPS

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "train", str(ROOT / "examples" / "tiny_cpu.yaml"),
                           f"run.dir={run_dir}", *TWO_STEPS, f"model.mcore_path={tiny_base_bridge}"], env=cli_env,
                          cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(a megatron-bridge dist checkpoint, vocabulary 32 rows)" in proc.stderr

    def trace(d: Path) -> list[dict]:
        keys = ("train/loss", "train/grad_norm", "train/entropy", "rollout/reward_mean", "rollout/acc_mean")
        rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        return [{k: r[k] for k in keys if k in r} for r in rows if "train/loss" in r]

    assert len(trace(run_dir)) == 2 and trace(run_dir) == trace(finished_two_steps)


@pytest.mark.e2e
def test_trainer_checkpoint_goes_to_bridge_layout(finished_two_steps, tmp_path):
    """A DAPO-trained checkpoint (RUN/checkpoints/step_N) -> `convert mcore-to-bridge` -> Bridge's layout, whose
    weights are the trained ones bit for bit (its mcore-to-hf equals the trainer checkpoint's own), with the run's
    tokenizer inside; the bridge tier has Bridge's export_ckpt read this command's output."""
    step = finished_two_steps / "checkpoints" / "step_000002"
    _run("-m", "dapo_mcore.cli", "convert", "mcore-to-bridge", "--mcore", os.fspath(step), "--out",
         os.fspath(tmp_path / "bridge"))
    assert (tmp_path / "bridge" / "iter_0000000" / "tokenizer" / "tokenizer_config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["bridge"]  # no staging copy left beside it
    _run("-m", "dapo_mcore.cli", "convert", "mcore-to-hf", "--mcore", os.fspath(step), "--out",
         os.fspath(tmp_path / "direct"), "--no-progress")
    _run("-m", "dapo_mcore.cli", "convert", "mcore-to-hf", "--mcore", os.fspath(tmp_path / "bridge"), "--out",
         os.fspath(tmp_path / "via_bridge"))
    _assert_bit_exact(_hf_tensors(tmp_path / "via_bridge"), _hf_tensors(tmp_path / "direct"))


@pytest.mark.e2e
def test_a_bridge_checkpoint_of_another_padding_is_refused_in_one_line(cli_env, tiny_base_bridge, tmp_path):
    """The same checkpoint (32 rows) under Megatron-LM's padding (64 rows here): one line naming both sizes and
    model.vocab_padding, exit 2, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "train", str(ROOT / "examples" / "tiny_cpu.yaml"),
                           f"run.dir={tmp_path / 'run'}", "train.steps=1", "model.vocab_padding=megatron",
                           "model.make_vocab_size_divisible_by=64", f"model.mcore_path={tiny_base_bridge}"],
                          env=cli_env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "holds a vocabulary of 32 rows, the model here has 64" in proc.stderr and "model.vocab_padding" in proc.stderr


def test_mcore_to_bridge_failing_on_rank0_ends_every_rank(tmp_path):
    """mcore-to-bridge at TP2 of a checkpoint with a NaN weight: rank 0's HF export refuses it; rank 1 (waiting for
    the staging copy) ends too instead of hanging, with one line in all, and neither output nor staging dir stays."""
    from conversion.synthetic import save_tiny_hf_model

    save_tiny_hf_model(tmp_path / "hf")
    _run("-m", "conversion.hf_to_mcore", "--hf", os.fspath(tmp_path / "hf"), "--out", os.fspath(tmp_path / "d"),
         "--no-progress")
    rank_file = next((tmp_path / "d").rglob("*.safetensors"))
    tensors = load_file(os.fspath(rank_file))
    name = next(iter(tensors))
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, os.fspath(rank_file))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "conversion.mcore_to_bridge", "--mcore", os.fspath(tmp_path / "d"), "--out", os.fspath(tmp_path / "b"),
           "--tp", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("dapo-mcore convert:")]
    assert len(lines) == 1 and "NaN or inf" in lines[0], proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "hf"]


def test_run_config_of_qwen3_moe_reads_back_as_the_hf_config():
    """Our run_config for a Qwen3-MoE model read back by the reader: the same architecture facts (experts, top-k,
    expert FFN, top-k normalization as Bridge stores it, moe_router_pre_softmax = not norm_topk_prob); and a section
    without moe_router_pre_softmax takes megatron-core's default (False: normalized top-k)."""
    from conversion.bridge_config import bridge_run_config
    from conversion.synthetic_moe import tiny_moe_config
    from dapo_mcore.weights.dist_checkpoint import hf_config_from_run_config

    hf = tiny_moe_config()
    config = bridge_run_config(hf, tp=1, pp=1, dtype=torch.float32, padded_rows=hf["vocab_size"], vocab_padding="tp",
                               divisible_by=128, tokenizer_model=None)
    back = hf_config_from_run_config(config, Path("."))
    for key in ("model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "vocab_size"):
        assert back[key] == hf[key], key
    del config["model"]["moe_router_pre_softmax"]
    assert hf_config_from_run_config(config, Path("."))["norm_topk_prob"] is True
