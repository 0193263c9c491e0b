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
    for x in ("step", "wall_seconds", "generated_tokens", "device_hours"):
        out = tmp_path / f"out_{x}"
        assert report.main([str(a), "--compare", str(b), "--out", str(out), "--x", x, "--log-x"]) == 0
        assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
        assert (out / "update.png").is_file()
    with pytest.raises(SystemExit) as exc:
        report.main([str(a), "--compare", str(b), "--x", "tokens"])
    assert exc.value.code == 2


def test_pngs_are_written_atomically_with_integer_steps_and_a_length_line(tmp_path, monkeypatch):
    """A kill mid-savefig leaves the previous figure (or none), never a 0-byte one; a 3-step
    run gets integer step ticks, and response_length.png a line at rollout.max_new_tokens."""
    from matplotlib.figure import Figure

    run = tmp_path / "run"
    with MetricsWriter(run) as w:
        for s in (1, 2, 3):
            w.log(s, {keys.ROLLOUT_ACC_MEAN: 0.1 * s, keys.ROLLOUT_RESP_LEN_MEAN: 3.0 + s})
    (run / "config.yaml").write_text("rollout:\n  max_new_tokens: 6\n")
    drawn = {}
    real_save = report._save

    def spy(fig, path, layout=True):
        out = real_save(fig, path, layout)
        drawn[path.name] = fig
        return out

    monkeypatch.setattr(report, "_save", spy)
    report.write_report(run)
    fig = drawn["response_length.png"]
    ax = fig.axes[0]
    assert any(list(line.get_ydata()) == [6, 6] for line in ax.get_lines())
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
    good = (run / "figures" / "accuracy.png").read_bytes()
    monkeypatch.setattr(report, "_save", real_save)

    def killed(self, fname, **kw):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", killed)
    with pytest.raises(KeyboardInterrupt):
        report.write_report(run)
    assert (run / "figures" / "accuracy.png").read_bytes() == good
    assert not list((run / "figures").glob(".*partial"))


def test_the_async_timeline_draws_both_sides_only_for_an_async_run(tmp_path):
    sync = [{keys.STEP: s, keys.TIME_STEP: 1.0, keys.time_key("train"): 0.5} for s in range(1, 4)]
    assert report.pipeline_figure(sync, tmp_path) is None
    rows = [{**r, "async/trainer_wait_s": 0.2, "async/engine_generate_s": 0.6, "async/engine_reward_s": 0.1,
             "async/engine_wait_weights_s": 0.05, "async/weights_transfer_s": 0.01} for r in sync]
    path = report.pipeline_figure(rows, tmp_path)
    assert path == tmp_path / "pipeline.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(path) as im:
        pixels = np.asarray(im.convert("RGB"))
    # Both lanes are drawn: matplotlib's tab:green (generation, engines) and tab:blue (compute, trainer) appear.
    for rgb in ((44, 160, 44), (31, 119, 180)):
        assert (np.abs(pixels.astype(int) - rgb).sum(axis=2) < 8).any(), rgb


def test_lines_of_one_axis_differ_in_style_so_equal_series_stay_visible(tmp_path):
    records = report.load_run(_run(tmp_path / "r"))
    for r in records:  # nothing clips high: all == low, high == dual clip (the run)
        r.update({keys.TRAIN_CLIPFRAC: 0.01, keys.TRAIN_CLIPFRAC_LOW: 0.01, keys.TRAIN_CLIPFRAC_HIGH: 0.0,
                  keys.TRAIN_DUAL_CLIPFRAC: 0.0})
    fig = report.Figure()
    ax = fig.subplots()
    for i, (key, label) in enumerate(next(p for p in report.PANELS if p.name == "clipfrac").series):
        report._draw(ax, records, key, label, 1, style=i)
    styles = {(ln.get_linestyle(), ln.get_linewidth(), ln.get_marker()) for ln in ax.get_lines()}
    assert len(styles) == 4


def test_tis_figure_only_for_runs_that_log_it(tmp_path, caplog):
    run = _run(tmp_path / "r")
    records = report.load_run(run)
    assert report._line_figure(records, next(p for p in report.PANELS if p.name == "tis"), tmp_path, 1) is None
    assert "tis" not in caplog.text
    for r in records:
        r.update({"mismatch/tis_mean": 0.98, "mismatch/tis_clip_frac": 0.01})
    path = report._line_figure(records, next(p for p in report.PANELS if p.name == "tis"), tmp_path, 1)
    assert path is not None and path.name == "tis.png" and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("objective,ylabel,title", [
    ("gspo", "fraction of tokens in clipped sequences", "GSPO: whole sequences"),
    ("cispo", "fraction of tokens", "CISPO: the tokens keep their gradient"),
    (None, "fraction of tokens", "Clip fractions")])
def test_clip_figure_reads_the_runs_objective(tmp_path, monkeypatch, objective, ylabel, title):
    """GSPO's clip fraction counts tokens of clipped sequences: its figure says so (axis and title), from the run's
    config.yaml; CISPO's names the truncated weights; a run without the key keeps the token clip figure."""
    run = tmp_path / "run"
    with MetricsWriter(run) as w:
        for s in (1, 2, 3):
            w.log(s, {keys.TRAIN_CLIPFRAC: 0.1 * s, keys.TRAIN_CLIPFRAC_LOW: 0.01, keys.TRAIN_CLIPFRAC_HIGH: 0.1 * s})
    (run / "config.yaml").write_text(f"algo:\n  objective: {objective}\n" if objective else "algo: {}\n")
    drawn = {}
    real_save = report._save
    monkeypatch.setattr(report, "_save", lambda fig, path, layout=True: drawn.setdefault(path.name, fig) and
                        real_save(fig, path, layout))
    report.write_report(run)
    ax = drawn["clipfrac.png"].axes[0]
    assert ax.get_ylabel() == ylabel and title in ax.get_title()
