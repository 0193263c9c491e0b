"""`convert verify` end to end in one process: the Megatron model built from a transformers-5 config with a
non-integer RoPE base matches Hugging Face at fp32 tolerance, and a bf16 Megatron checkpoint verifies with
`--mcore` under the bf16 tolerance."""

from __future__ import annotations

import pytest
from conversion_helpers import run_verify

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.synthetic import save_tiny_hf_model
from dapo_mcore.weights import ParallelLayout

pytestmark = pytest.mark.unit



def test_transformers5_theta_and_bf16_mcore_verify(tmp_path):
    hf = tmp_path / "hf"
    save_tiny_hf_model(hf, seed=3, rope_theta=1234567.5)  # saved as rope_parameters; not an integer
    rc, stats, err = run_verify(tmp_path, "--hf", str(hf), "--seq-len", "48")
    assert rc == 0, err
    assert stats["max_abs_diff"] < 1e-5 and stats["top1_agreement"] == 1.0  # base 10000 or int(theta) fail this

    convert_hf_to_mcore(hf, tmp_path / "m16", ParallelLayout(), dtype=__import__("torch").bfloat16)
    rc, stats, err = run_verify(tmp_path, "--hf", str(hf), "--mcore", str(tmp_path / "m16"), "--dtype", "bfloat16")
    assert rc == 0, err
    assert stats["top1_agreement"] >= 0.95 and stats["max_abs_diff"] <= stats["atol"]
    assert 1e-4 < stats["atol"] and stats["max_abs_diff"] > 0  # bf16 arithmetic differs: fp32's 1e-4 is wrong

    rc, _, err = run_verify(tmp_path, "--hf", str(hf), "--mcore", str(tmp_path / "m16"), "--dtype", "float32")
    assert rc == 2 and "verify --dtype bfloat16" in err and "Traceback" not in err


def test_verify_defaults_to_the_checkpoints_dtype_and_names_torchrun(tmp_path):
    """Issue 30 items 3-4: no --dtype = the checkpoint's (a bf16 --mcore verifies in bf16 instead of failing after
    start-up); --tp 2 --pp 2 in one process says which torchrun line to use, before any process group."""
    from conversion.verify import check_world, checkpoint_dtype
    from dapo_mcore.weights.errors import WeightsError

    hf = tmp_path / "hf"
    save_tiny_hf_model(hf, seed=3)
    convert_hf_to_mcore(hf, tmp_path / "m16", ParallelLayout(), dtype=__import__("torch").bfloat16)
    assert checkpoint_dtype(hf, None) == "float32" and checkpoint_dtype(hf, str(tmp_path / "m16")) == "bfloat16"
    rc, stats, err = run_verify(tmp_path, "--hf", str(hf), "--mcore", str(tmp_path / "m16"))
    assert rc == 0 and "comparing logits in bfloat16" in err and stats["top1_agreement"] >= 0.95, err
    with pytest.raises(WeightsError, match="run under torchrun --nproc_per_node 4 -m conversion.verify"):
        check_world(1, 2, 2)
    check_world(8, 2, 2)
    rc, _, err = run_verify(tmp_path, "--hf", str(hf), "--tp", "2", "--pp", "2")
    assert rc == 2 and "torchrun --nproc_per_node 4" in err and "Traceback" not in err


def test_verify_of_a_checkpoint_at_another_layout_reshards_as_train_does(tmp_path):
    hf = tmp_path / "hf"
    save_tiny_hf_model(hf, seed=4)
    convert_hf_to_mcore(hf, tmp_path / "tp2", ParallelLayout(tp=2))  # verified below on one process, TP=1
    rc, stats, err = run_verify(tmp_path, "--hf", str(hf), "--mcore", str(tmp_path / "tp2"), "--seq-len", "32")
    assert rc == 0, err[-2000:]
    assert stats["top1_agreement"] == 1.0 and stats["max_abs_diff"] < 1e-5
