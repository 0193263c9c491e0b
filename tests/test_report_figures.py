"""Figure layout choices of ``dapo-mcore report``: split update panels, log axes, the --compare x axis."""

from __future__ import annotations

import numpy as np
import pytest

from dapo_mcore.telemetry import keys, report
from dapo_mcore.telemetry.metrics import MetricsWriter

pytestmark = pytest.mark.unit


def _run(run_dir, n=6, tokens_per_step=100, seconds_per_step=2.0):
    with MetricsWriter(run_dir) as w:
        w.log(0, {keys.EVAL_AVG_AT_K: 0.2, keys.EVAL_K: 8})
        for s in range(1, n + 1):
            w.log(s, {keys.ROLLOUT_ACC_MEAN: 0.1 * s, keys.TRAIN_GRAD_NORM: 1.0 + s, keys.TRAIN_PPO_KL: 1e-3 * s,
                      keys.MISMATCH_KL: 1e-7 * 10 ** s, keys.MISMATCH_LOGP_ABS_DIFF_MEAN: 2e-7,
                      keys.cost_key("tokens_generated", cumulative=True): tokens_per_step * s,
                      keys.cost_seconds_key("step", cumulative=True): seconds_per_step * s,
                      keys.ROLLOUT_GEN_BATCHES: 1, **({keys.EVAL_AVG_AT_K: 0.2 + 0.1 * s, keys.EVAL_K: 8}
                                                      if s % 3 == 0 else {})})
    return run_dir


def test_log_axis_only_for_positive_series_spanning_decades():
    assert report._use_log(np.array([1e-7, 1e-3, 1e-2]))
    assert not report._use_log(np.array([0.7, 5.0]))               # grad norm: linear
    assert not report._use_log(np.array([-1e-7, 1e-5, 1e-3]))      # crosses zero: linear
    assert not report._use_log(np.array([3.0]))


@pytest.mark.parametrize(("x", "want"), [
    ("step", {0: 0.0, 1: 1.0, 6: 6.0}), ("generated_tokens", {0: 0.0, 1: 100.0, 6: 600.0}),
    ("wall_seconds", {0: 0.0, 1: 2.0, 6: 12.0}),
])
def test_x_values(tmp_path, x, want):
    xs = report.x_values(report.load_run(_run(tmp_path / "r")), x)
    assert {k: xs[k] for k in want} == want


def test_k_is_spelled_in_labels(tmp_path):
    records = report.load_run(_run(tmp_path / "r"))
    assert report._k_label(records, "held-out avg@k") == "held-out avg@8"
    assert report._k_label([{keys.STEP: 1}], "held-out avg@k") == "held-out avg@k"


def test_compare_cli_x_axes(tmp_path, capsys):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", tokens_per_step=300)
    for x in ("step", "wall_seconds", "generated_tokens"):
        out = tmp_path / f"out_{x}"
        assert report.main([str(a), "--compare", str(b), "--out", str(out), "--x", x]) == 0
        assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
        assert (out / "update.png").is_file()
    with pytest.raises(SystemExit) as exc:
        report.main([str(a), "--compare", str(b), "--x", "tokens"])
    assert exc.value.code == 2
