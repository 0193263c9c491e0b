"""User errors of the conversion commands: one line on stderr, exit 2, `--debug` for the traceback; inputs
(truncated, corrupt, missing shards) checked against their headers before anything is written."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from conversion.hf_to_mcore import CastOverflowError, convert_hf_to_mcore
from conversion.hf_to_mcore import main as hf_to_mcore_main
from conversion.mcore_to_hf import main as mcore_to_hf_main
from conversion.synthetic import save_tiny_hf_model
from dapo_mcore.weights import ParallelLayout
from dapo_mcore.weights.errors import InputFileError, InputMissingError
from dapo_mcore.weights.safetensors_io import read_header_offsets

pytestmark = pytest.mark.unit


@pytest.fixture()
def hf(tmp_path):
    d = tmp_path / "hf"
    save_tiny_hf_model(d, seed=1, tie_word_embeddings=False)
    return d


def _cli(capsys, main, *args) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main([*map(str, args), "--no-progress"])
    return rc, capsys.readouterr().err.strip().splitlines()


def _one_line(lines: list[str], *needles: str) -> None:
    lines = [ln for ln in lines if ln.startswith("dapo-mcore convert:")]
    assert len(lines) == 1, lines
    for needle in needles:
        assert needle in lines[0], lines[0]


def _only(tmp_path, *names):
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_truncated_file_is_found_before_writing(hf, tmp_path, capsys):
    st = hf / "model.safetensors"
    with open(st, "r+b") as f:
        f.truncate(os.path.getsize(st) - 100)
    with pytest.raises(InputFileError, match=r"model.safetensors: tensor .* ends at byte \d+ but the file has"):
        convert_hf_to_mcore(hf, tmp_path / "out", ParallelLayout())
    rc, err = _cli(capsys, hf_to_mcore_main, "--hf", hf, "--out", tmp_path / "out")
    assert rc == 2
    _one_line(err, str(st), "truncated", "copy or download it again")
    _only(tmp_path, "hf")


def test_corrupt_header_and_overlapping_ranges(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(InputFileError, match="header length 1000000000 exceeds the file size"):
        read_header_offsets(bad)
    blob = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(12))
    with pytest.raises(InputFileError, match="'a' and 'b' overlap"):
        read_header_offsets(bad)
    blob = json.dumps({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(12))
    with pytest.raises(InputFileError, match=r"do not hold a F32 \[3\]"):
        read_header_offsets(bad)
    bad.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(InputFileError, match="not valid JSON"):
        read_header_offsets(bad)


def test_missing_shard_names_it(tmp_path, capsys):
    hf = tmp_path / "hf"
    save_tiny_hf_model(hf, seed=2, max_shard_size="20KB")
    shards = sorted(hf.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(InputMissingError, match=f"{shards[1].name} is listed in model.safetensors.index.json"):
        convert_hf_to_mcore(hf, tmp_path / "out", ParallelLayout())
    rc, err = _cli(capsys, hf_to_mcore_main, "--hf", hf, "--out", tmp_path / "out")
    assert rc == 2
    _one_line(err, shards[1].name, "missing")


@pytest.mark.parametrize("case", ["layout", "exists", "no_config", "no_parent", "bad_size"])
def test_cli_user_errors_are_one_line_exit_2(hf, tmp_path, capsys, case):
    out = tmp_path / "out"
    args = {"layout": ("--hf", hf, "--out", out, "--tp", 3), "exists": ("--hf", hf, "--out", hf),
            "no_config": ("--hf", tmp_path, "--out", out), "no_parent": ("--hf", hf, "--out", tmp_path / "a" / "b")}
    needles = {"layout": ("tensor_parallel=3", "use one of 1, 2, 4"), "exists": (str(hf), "already exists"),
               "no_config": ("config.json does not exist",), "no_parent": ("parent directory", "does not exist")}
    if case == "bad_size":
        convert_hf_to_mcore(hf, tmp_path / "m", ParallelLayout())
        rc, err = _cli(capsys, mcore_to_hf_main, "--mcore", tmp_path / "m", "--out", out, "--max-shard-size", "lots")
        _one_line(err, "cannot read size 'LOTS'")
    else:
        rc, err = _cli(capsys, hf_to_mcore_main, *args[case])
        _one_line(err, *needles[case])
    assert rc == 2
    assert not out.exists()


def test_debug_shows_the_traceback(hf, tmp_path, monkeypatch):
    with pytest.raises(InputMissingError):
        hf_to_mcore_main(["--hf", str(tmp_path), "--out", str(tmp_path / "o"), "--debug"])
    monkeypatch.setenv("DAPO_MCORE_DEBUG", "1")
    with pytest.raises(InputMissingError):
        hf_to_mcore_main(["--hf", str(tmp_path), "--out", str(tmp_path / "o")])


def test_fp16_overflow_names_the_tensor(hf, tmp_path):
    from safetensors.torch import load_file, save_file

    path = os.fspath(hf / "model.safetensors")
    sd = load_file(path)
    sd["model.layers.1.mlp.down_proj.weight"][3, 5] = 1e6
    save_file(sd, path, {"format": "pt"})
    with pytest.raises(CastOverflowError, match=r"decoder.layers.1.mlp.linear_fc2.weight \(model.layers.1.mlp."
                                                r"down_proj.weight\): casting to float16 overflows"):
        convert_hf_to_mcore(hf, tmp_path / "out", ParallelLayout(), dtype=torch.float16)
    _only(tmp_path, "hf")
    convert_hf_to_mcore(hf, tmp_path / "ok", ParallelLayout(), dtype=torch.bfloat16)  # bf16 holds it
