"""A model type or feature dapo-mcore cannot build faithfully is refused at config validation in
one line naming the field and what is supported (exit 2), before any process group or the run directory, by
``train``, ``eval``, ``config``, ``plan`` and ``convert`` alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conversion.synthetic import save_tiny_hf_model
from dapo_mcore.cli import main
from dapo_mcore.model.hf_config import HFConfigError, QwenShape
from dapo_mcore.model.presets import preset_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")


def _qwen3(**overrides):
    return preset_config("tiny-qwen3", **overrides)


REFUSED = [
    ({"model_type": "mistral"}, "model_type='mistral' is not supported", "qwen2 (Qwen2 / Qwen2.5), qwen3 (Qwen3 dense)"),
    ({"model_type": "qwen3_5"}, "model_type='qwen3_5' is not supported", "qwen3 (Qwen3 dense)"),
    ({"model_type": "qwen3_next"}, "model_type='qwen3_next'", "qwen3 (Qwen3 dense)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope_scaling='yarn' (RoPE scaling) is not supported", "supported: 'default'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     "rope_parameters.rope_type='linear'", "supported: 'default'"),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, "use_sliding_window=true",
     "supported: full attention"),
    ({"attention_bias": True}, "attention_bias=true is not supported for model_type='qwen3'", "supported: false"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported", "supported: 'silu'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5", "supported: 1.0"),
]


@pytest.mark.parametrize("overrides,field,supported", REFUSED, ids=[r[1].split()[0] for r in REFUSED])
def test_unsupported_config_names_field_and_what_is_supported(overrides, field, supported):
    with pytest.raises(HFConfigError) as info:
        QwenShape.from_hf(_qwen3(**overrides))
    msg = str(info.value)
    assert field in msg and supported in msg and "\n" not in msg, msg


def test_supported_qwen3_shapes():
    tiny = QwenShape.from_hf(_qwen3())
    assert (tiny.head_dim, tiny.qk_norm, tiny.qkv_bias, tiny.tie_embeddings) == (32, True, False, True)
    big = QwenShape.from_hf(preset_config("qwen3-32b"))
    assert big.head_dim * big.num_heads == 8192 != big.hidden_size and not big.tie_embeddings
    qwen2 = QwenShape.from_hf(preset_config("tiny"))
    assert (qwen2.head_dim, qwen2.qk_norm, qwen2.qkv_bias) == (16, False, True)
    no_head_dim = {k: v for k, v in _qwen3().items() if k != "head_dim"}
    assert QwenShape.from_hf(no_head_dim).head_dim == 128  # transformers' Qwen3Config default, not hidden/heads


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mistral")
    (d / "config.json").write_text(json.dumps(_qwen3(model_type="mistral", architectures=["MistralForCausalLM"])))
    return d


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_every_command_refuses_in_one_line_before_starting(mistral_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("keep")
    model = ["model.tiny_base=false", f"model.hf_path={mistral_dir}"]
    for argv in (["train", TINY, *model, f"run.dir={run_dir}"], ["eval", TINY, *model, f"run.dir={run_dir}"],
                 ["config", TINY, *model], ["plan", TINY, *model, "--nodes", "1"],
                 ["plan", "--hf-config", str(mistral_dir / "config.json")]):
        assert main(argv) == 2, argv
        assert "model_type='mistral' is not supported" in _one_line(capsys), argv
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]  # no lock, no config.yaml, nothing deleted
    assert main(["convert", "hf-to-mcore", "--hf", str(mistral_dir), "--out", str(tmp_path / "out")]) == 2
    assert "unsupported model_type 'mistral'" in _one_line(capsys) and not (tmp_path / "out").exists()
    sliding = tmp_path / "sliding"  # a real Qwen3 checkpoint whose config.json asks for sliding windows
    save_tiny_hf_model(sliding, preset="tiny-qwen3")
    capsys.readouterr()  # save_pretrained's progress bar
    (sliding / "config.json").write_text(json.dumps(_qwen3(use_sliding_window=True, sliding_window=16, max_window_layers=0)))
    for argv in (["verify", "--hf", str(sliding)], ["hf-to-mcore", "--hf", str(sliding), "--out", str(tmp_path / "o2")]):
        assert main(["convert", *argv]) == 2
        assert "use_sliding_window=true with sliding_window=16 on layers [0, 1] is not supported" in _one_line(capsys)
    assert not (tmp_path / "o2").exists()


def test_train_as_a_user_runs_it(mistral_dir, tmp_path, cli_env):
    """The command of the issue: before, a traceback and exit 1 after locking the run directory."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "train", TINY, "model.tiny_base=false",
                           f"model.hf_path={mistral_dir}", f"run.dir={run_dir}"], env=cli_env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not run_dir.exists(), proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dapo-mcore: configuration error: model.hf_path="), lines
    assert "model_type='mistral' is not supported; dapo-mcore trains model_type qwen2" in lines[0]
