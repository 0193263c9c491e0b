"""dapo-mcore reads the checkpoints Megatron-Bridge 0.6.2 wrote (committed in tests/data/bridge, made by Bridge's own
import_ckpt at TP1 and TP2; see its README): `dapo-mcore convert mcore-to-hf` of Bridge's save dir gives back the
original HF model bit-exactly (every tensor torch.equal, same dtype and shape). No Bridge needed: it runs in the main
suite, on the project's megatron-core (0.16.1; the common state of these checkpoints is inside the .distcp, as
megatron-core >= 0.17 writes it). The live direction, Bridge running, is tests/bridge_live."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "bridge"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bridge_tensors import hf_differences  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("model", ["qwen2_untied_fp32", "qwen2_tied_bf16"])
def test_dapo_mcore_reads_bridge_written_checkpoints_bit_exactly(model, tp, tmp_path):
    hf = DATA / model / "hf"
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "convert", "mcore-to-hf", "--mcore",
                           str(DATA / model / f"bridge_tp{tp}"), "--out", str(tmp_path / "back"), "--hf-config",
                           str(hf), "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    bad = hf_differences(hf, tmp_path / "back")
    assert not bad, f"{model} bridge_tp{tp} -> dapo-mcore mcore-to-hf: {bad[:8]}"
