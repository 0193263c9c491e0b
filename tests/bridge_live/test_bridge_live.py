"""dapo-mcore and NVIDIA Megatron-Bridge exchange checkpoints both ways, Bridge running live.

Run by .ci/tiers/50-bridge.sh only (tests/bridge_live/conftest.py keeps the main suite from collecting this file):
pytest runs in the project's own environment (megatron-core 0.16.1) and calls Bridge 0.6.2 (megatron-core 0.19.2,
its own virtualenv: DAPO_MCORE_BRIDGE_PYTHON, default .venv-bridge/bin/python) as a subprocess through
tests/bridge/bridge_cpu.py. Every comparison is per tensor, torch.equal with the same dtype and shape, against the
original HF model (the committed tiny Qwen2 models of tests/data/bridge, or a model built here from a config).

- Bridge's import, live, then `dapo-mcore convert mcore-to-hf` of its save dir: the original HF tensors, TP1 and TP2
  (also: Bridge's own export of the same import, so a harness problem is told apart from a reader problem).
- `dapo-mcore convert hf-to-mcore --format bridge`, then Bridge's export_ckpt: the original HF tensors, TP1 and TP2;
  and Bridge's training-side loader resolves it as it resolves its own import (iteration 0 in iter_0000000, TP, PP):
  a tracker "0" without latest_train_state.pt is rejected there (megatron/bridge/training/checkpointing.py
  read_metadata asserts iteration > 0 or release).
- Qwen2.5's real vocabulary (151,936, hidden 16) through the same at TP2: stored with 151,936 rows, not padded, as
  Bridge's own import stores it.
- tests/data/bridge/minimal_run_config.yaml in place of a fixture's run_config.yaml: Bridge still exports it exactly.
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

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "bridge"
HARNESS = REPO / "tests" / "bridge" / "bridge_cpu.py"
sys.path.insert(0, str(HARNESS.parent))

from bridge_tensors import hf_differences  # noqa: E402

QWEN25_VOCAB = 151_936


def _bridge_python() -> Path:
    path = Path(os.environ.get("DAPO_MCORE_BRIDGE_PYTHON", REPO / ".venv-bridge" / "bin" / "python"))
    if not path.exists():
        pytest.skip(f"no Megatron-Bridge environment at {path} (.ci/tiers/50-bridge.sh installs it; or set "
                    "DAPO_MCORE_BRIDGE_PYTHON)")
    return path


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _torchrun(python: Path | str, nproc: int) -> list:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc]


def bridge_import(hf: Path, out: Path, tp: int) -> None:
    _run([*_torchrun(_bridge_python(), tp), HARNESS, "import", "--hf", hf, "--out", out, "--tp", tp],
         out.parent, f"Bridge import_ckpt at TP{tp}")


def bridge_export(mcore: Path, out: Path, hf: Path) -> None:
    _run([_bridge_python(), HARNESS, "export", "--mcore", mcore, "--out", out, "--hf", hf], out.parent,
         "Bridge export_ckpt")


def bridge_resolve(save: Path) -> dict:
    """What Bridge's training-side loader (a fine-tune from checkpoint.pretrained_checkpoint) resolves in `save`."""
    proc = _run([_bridge_python(), HARNESS, "resolve", "--mcore", save], save.parent, "Bridge's checkpoint resolution")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("bridge_cpu resolve: ")][-1]
    return json.loads(line.removeprefix("bridge_cpu resolve: "))


def _resolved(tp: int) -> dict:
    return {"exists": True, "iteration": 0, "release": False, "dir": "iter_0000000", "tp_pp": [tp, 1]}


def _dapo_mcore() -> Path:
    """The dapo-mcore console script of the environment running this test."""
    return Path(sys.executable).with_name("dapo-mcore")


def dapo_mcore_to_hf(mcore: Path, out: Path, hf_config: Path) -> None:
    _run([_dapo_mcore(), "convert", "mcore-to-hf", "--mcore", mcore, "--out", out, "--hf-config", hf_config,
          "--no-progress"], out.parent, "dapo-mcore convert mcore-to-hf of a Bridge checkpoint")


def dapo_hf_to_bridge(hf: Path, out: Path, tp: int) -> None:
    args = ["convert", "hf-to-mcore", "--hf", hf, "--out", out, "--tp", tp, "--format", "bridge", "--no-progress"]
    cmd = [_dapo_mcore(), *args] if tp == 1 else [*_torchrun(sys.executable, tp), _dapo_mcore(), *args]
    _run(cmd, out.parent, f"dapo-mcore convert hf-to-mcore --format bridge at TP{tp}")


def _assert_same(expected_hf: Path, got_hf: Path, what: str) -> None:
    bad = hf_differences(expected_hf, got_hf)
    assert not bad, f"{what}: not bit-exact vs the original HF model: {bad[:8]}"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def live_import(request, tmp_path_factory) -> tuple[Path, Path, int]:
    """Bridge's import_ckpt, run now, of the untied fp32 fixture model: (its HF dir, Bridge's save dir, TP)."""
    tp = request.param
    hf = DATA / "qwen2_untied_fp32" / "hf"
    out = tmp_path_factory.mktemp(f"bridge_import_tp{tp}") / "save"
    bridge_import(hf, out, tp)
    return hf, out, tp


def test_dapo_mcore_reads_a_live_bridge_import(live_import, tmp_path):
    """Bridge's import, run now -> dapo-mcore mcore-to-hf: the original tensors (Bridge's own export of its imports
    is checked where the committed fixtures were made, tests/data/bridge/make_fixtures.py)."""
    hf, save, tp = live_import
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert sorted(p.name for p in (save / "iter_0000000").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(tp)]
    if tp == 2:  # the reference for what dapo-mcore's --format bridge must resolve to
        assert bridge_resolve(save) == _resolved(tp)
    dapo_mcore_to_hf(save, tmp_path / "back", hf)
    _assert_same(hf, tmp_path / "back", f"Bridge import (TP{tp}) -> dapo-mcore mcore-to-hf")


@pytest.mark.parametrize(("model", "tp"), [("qwen2_untied_fp32", 2), ("qwen2_tied_bf16", 1)])
def test_bridge_exports_what_dapo_mcore_writes(model, tp, tmp_path):
    """Each model at one TP, each TP with one model (TP2 again below: Qwen3, Qwen2.5's vocabulary, mcore-to-bridge)."""
    hf = DATA / model / "hf"
    dapo_hf_to_bridge(hf, tmp_path / "save", tp)
    if tp == 2:  # Bridge's training side finds it as it finds its own (tracker, iteration, TP/PP)
        assert bridge_resolve(tmp_path / "save") == _resolved(tp)
    bridge_export(tmp_path / "save", tmp_path / "back", hf)
    _assert_same(hf, tmp_path / "back", f"{model}: dapo-mcore hf-to-mcore --format bridge (TP{tp}) -> Bridge export")


def _qwen25_vocab_model(path: Path) -> Path:
    """A Qwen2.5-shaped model with the real vocabulary and a tiny width (bf16, untied), from a config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(25)
    config = Qwen2Config(vocab_size=QWEN25_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, dtype=torch.bfloat16)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _stored_rows(iter_dir: Path) -> dict[str, int]:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
    return {k: meta[k].size[0] for k in ("embedding.word_embeddings.weight", "output_layer.weight")}


def test_bridge_itself_keeps_qwen25_vocabulary_unpadded_at_tp2(tmp_path):
    """The reference for the next test: Bridge's own import at TP2 stores all 151,936 rows and no padding."""
    hf = _qwen25_vocab_model(tmp_path / "hf")
    bridge_import(hf, tmp_path / "save", 2)
    iter_dir = tmp_path / "save" / "iter_0000000"
    assert _stored_rows(iter_dir) == {"embedding.word_embeddings.weight": QWEN25_VOCAB,
                                      "output_layer.weight": QWEN25_VOCAB}
    model = yaml.safe_load((iter_dir / "run_config.yaml").read_text())["model"]
    assert (model["vocab_size"], model["should_pad_vocab"], model["make_vocab_size_divisible_by"]) == \
        (QWEN25_VOCAB, False, 128)


def test_qwen25_vocabulary_is_not_padded_at_tp2(tmp_path):
    hf = _qwen25_vocab_model(tmp_path / "hf")
    dapo_hf_to_bridge(hf, tmp_path / "save", 2)
    iter_dir = tmp_path / "save" / "iter_0000000"
    assert _stored_rows(iter_dir) == {"embedding.word_embeddings.weight": QWEN25_VOCAB,
                                      "output_layer.weight": QWEN25_VOCAB}
    assert yaml.safe_load((iter_dir / "run_config.yaml").read_text())["model"]["vocab_size"] == QWEN25_VOCAB
    bridge_export(tmp_path / "save", tmp_path / "back", hf)
    _assert_same(hf, tmp_path / "back", "Qwen2.5 vocabulary at TP2: dapo-mcore --format bridge -> Bridge export")


@pytest.mark.parametrize("tp", [2], ids=["tp2"])
def test_minimal_run_config_still_exports_exactly(tp, tmp_path):
    """The committed minimal run_config.yaml (what the probe found) replaces Bridge's own; tracker, train_state and
    tokenizer go too: Bridge's export_ckpt still gives back every HF tensor."""
    src = DATA / "qwen2_untied_fp32"
    save = shutil.copytree(src / f"bridge_tp{tp}", tmp_path / "save")
    shutil.copy(DATA / "minimal_run_config.yaml", save / "iter_0000000" / "run_config.yaml")
    for path in (save / "latest_checkpointed_iteration.txt", save / "latest_train_state.pt",
                 save / "iter_0000000" / "train_state.pt"):
        path.unlink()
    shutil.rmtree(save / "iter_0000000" / "tokenizer")
    bridge_export(save, tmp_path / "back", src / "hf")
    _assert_same(src / "hf", tmp_path / "back", f"minimal run_config.yaml at TP{tp} -> Bridge export")


def test_bridge_exports_a_dapo_checkpoint_through_mcore_to_bridge(tmp_path):
    """This project's own checkpoint (the format trainer checkpoints hold, written at TP2) -> `dapo-mcore convert
    mcore-to-bridge` at TP2 -> Bridge's export_ckpt: the original HF tensors, bit for bit."""
    hf = DATA / "qwen2_tied_bf16" / "hf"
    _run([_dapo_mcore(), "convert", "hf-to-mcore", "--hf", hf, "--out", tmp_path / "dapo", "--tp", "2",
          "--no-progress"], tmp_path, "dapo-mcore convert hf-to-mcore (dapo format, TP2)")
    _run([*_torchrun(sys.executable, 2), _dapo_mcore(), "convert", "mcore-to-bridge", "--mcore", tmp_path / "dapo",
          "--out", tmp_path / "save", "--tp", "2"], tmp_path, "dapo-mcore convert mcore-to-bridge at TP2")
    assert bridge_resolve(tmp_path / "save") == _resolved(2)
    assert not list(tmp_path.glob(".save.hf-staging-*"))  # the staging copy is gone
    bridge_export(tmp_path / "save", tmp_path / "back", hf)
    _assert_same(hf, tmp_path / "back", "dapo checkpoint -> mcore-to-bridge (TP2) -> Bridge export")


def test_qwen3_both_ways_at_tp2(tmp_path):
    """Qwen3 dense (q/k norm, no QKV bias, head_dim != hidden/heads): ours -> Bridge's export_ckpt, and Bridge's
    import_ckpt -> ours (the model read from run_config.yaml alone, as qwen3), each bit for bit at TP2."""
    from conversion.synthetic import save_tiny_hf_model

    hf = tmp_path / "hf"
    save_tiny_hf_model(hf, preset="tiny-qwen3", vocab_size=300)
    dapo_hf_to_bridge(hf, tmp_path / "ours", 2)
    bridge_export(tmp_path / "ours", tmp_path / "ours_back", hf)
    _assert_same(hf, tmp_path / "ours_back", "Qwen3: dapo-mcore --format bridge (TP2) -> Bridge export")
    bridge_import(hf, tmp_path / "theirs", 2)
    _run([_dapo_mcore(), "convert", "mcore-to-hf", "--mcore", tmp_path / "theirs", "--out", tmp_path / "theirs_back"],
         tmp_path, "dapo-mcore convert mcore-to-hf of Bridge's Qwen3 checkpoint (no --hf-config)")
    _assert_same(hf, tmp_path / "theirs_back", "Qwen3: Bridge import (TP2) -> dapo-mcore mcore-to-hf")
    assert json.loads((tmp_path / "theirs_back" / "config.json").read_text())["model_type"] == "qwen3"
