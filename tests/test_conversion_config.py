"""Config reading both ways (transformers 4 top-level fields, transformers 5 ``rope_parameters``), and the
features Megatron would compute differently (RoPE scaling, sliding windows) refused with one line."""

from __future__ import annotations

import json

import pytest

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.hf_to_mcore import main as hf_to_mcore_main
from conversion.synthetic import save_tiny_hf_model, tiny_hf_config
from dapo_mcore.model.qwen import HFConfigError, QwenShape, rope_parameters, sliding_window_layers
from dapo_mcore.weights import ParallelLayout

pytestmark = pytest.mark.unit


def _legacy(**kw):
    """A transformers-4 style config.json dict: rope_theta at the top, scaling under rope_scaling."""
    cfg = tiny_hf_config(**kw)
    cfg.pop("rope_parameters", None)
    return cfg


def test_rope_theta_read_from_transformers5_rope_parameters(tmp_path):
    save_tiny_hf_model(tmp_path / "hf", rope_theta=1_000_000.0)
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_theta" not in saved  # what transformers 5 writes
    assert QwenShape.from_hf(saved).rope_theta == 1_000_000.0


@pytest.mark.parametrize("style", ["legacy", "transformers5"])
def test_non_integer_theta_is_kept_exactly(style):
    theta = 1234567.25
    cfg = _legacy(rope_theta=theta) if style == "legacy" else {
        **{k: v for k, v in tiny_hf_config().items() if k != "rope_theta"},
        "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    assert QwenShape.from_hf(cfg).rope_theta == theta


def test_theta_defaults_to_qwen2config_default_when_absent():
    cfg = {k: v for k, v in tiny_hf_config().items() if k != "rope_theta"}
    assert rope_parameters(cfg) == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("cfg,field", [
    (_legacy(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
     "rope_scaling='yarn'"),
    ({**tiny_hf_config(), "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     "rope_parameters.rope_type='linear'"),
    (tiny_hf_config(use_sliding_window=True, sliding_window=16, max_window_layers=1), "use_sliding_window"),
    (tiny_hf_config(use_sliding_window=True, sliding_window=16,
                    layer_types=["full_attention", "sliding_attention"]), "use_sliding_window"),
])
def test_unsupported_features_are_refused_naming_the_field(cfg, field):
    with pytest.raises(HFConfigError, match=field.replace("(", r"\(")) as err:
        QwenShape.from_hf(cfg)
    assert "\n" not in str(err.value)


def test_inactive_sliding_window_is_accepted():
    # Qwen2.5 configs ship sliding_window with use_sliding_window false; max_window_layers >= layers is inert too
    assert sliding_window_layers(tiny_hf_config(use_sliding_window=False, sliding_window=131072)) == []
    assert sliding_window_layers(tiny_hf_config(use_sliding_window=True, sliding_window=64, max_window_layers=2)) == []
    QwenShape.from_hf(tiny_hf_config(use_sliding_window=False, sliding_window=131072))


def test_yarn_model_saved_by_transformers_is_refused_before_writing(tmp_path, capsys):
    save_tiny_hf_model(tmp_path / "hf", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 32})
    with pytest.raises(HFConfigError, match="yarn"):
        convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out", ParallelLayout())
    capsys.readouterr()
    assert hf_to_mcore_main(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rope_parameters.rope_type='yarn'" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
