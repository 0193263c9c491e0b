"""Report figures, the --compare figure, and the profile summary, from a synthetic logged run."""

from __future__ import annotations

import logging
import math
import random

import pytest

from dapo_mcore.telemetry import keys, profile, report
from dapo_mcore.telemetry.ledger import CostLedger
from dapo_mcore.telemetry.metrics import MetricsWriter

pytestmark = pytest.mark.unit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_run(run_dir, n_steps=12, seed=0, with_perf=True, eval_every=4):
    """Log what the trainer would: rollout/train/time metrics, sparse eval, and the cost ledger."""
    rng = random.Random(seed)
    ledger = CostLedger(run_dir)
    with MetricsWriter(run_dir) as writer:
        for step in range(n_steps):
            phases = {"generate": 2.0 + rng.random(), "reward": 0.1, "old_logprobs": 0.5, "train": 1.5}
            if step % eval_every == 0:
                phases["eval"] = 1.0
            phases["step"] = sum(phases.values()) + 0.2
            metrics = {
                keys.ROLLOUT_ACC_MEAN: min(1.0, 0.2 + 0.05 * step), keys.ROLLOUT_REWARD_MEAN: -0.6 + 0.1 * step,
                keys.TRAIN_ENTROPY: 0.8 - 0.01 * step, keys.ROLLOUT_RESP_LEN_MEAN: 100 + step,
                keys.ROLLOUT_RESP_LEN_MAX: 200 + step, keys.ROLLOUT_RESP_LEN_MIN: 10,
                keys.ROLLOUT_USABLE_GROUP_FRAC: 0.3 + 0.01 * step, keys.TRAIN_CLIPFRAC: 0.01,
                keys.TRAIN_CLIPFRAC_LOW: 0.004, keys.TRAIN_CLIPFRAC_HIGH: 0.006, keys.TRAIN_GRAD_NORM: 0.5,
                **{keys.time_key(p): s for p, s in phases.items()},
            }
            if with_perf:
                metrics[keys.PERF_TOKENS_PER_S_PER_DEVICE] = 1000.0 + step
                metrics[keys.PERF_MFU_TRAIN] = 0.4
            if step % eval_every == 0:
                metrics[keys.EVAL_AVG_AT_K] = 0.1 + 0.02 * step
            metrics.update(ledger.record_step(
                step, prompts_generated=48, prompts_kept=16, rollouts_generated=384, rollouts_kept=128,
                tokens_generated=40000 + step, tokens_generated_kept=12000, tokens_trained=30000,
                phase_seconds=phases, num_devices=8))
            writer.log(step, metrics)
    ledger.close()
    return run_dir


def _assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC, path


def test_report_writes_every_figure(tmp_path, capsys):
    run = _fake_run(tmp_path / "run_a")
    assert report.main([str(run)]) == 0
    names = {p.name for p in (run / "figures").iterdir()}
    assert names == {f"{p.name}.png" for p in report.PANELS if not p.optional} | {"cost.png"}
    for path in (run / "figures").iterdir():
        _assert_png(path)
    assert str(run / "figures" / "cost.png") in capsys.readouterr().out


def test_missing_metrics_are_skipped_with_a_warning(tmp_path, caplog):
    with MetricsWriter(tmp_path / "sparse") as writer:
        for step in range(3):
            writer.log(step, {keys.ROLLOUT_ACC_MEAN: 0.5})
    with caplog.at_level(logging.WARNING):
        written = report.write_report(tmp_path / "sparse", tmp_path / "out")
    assert [p.name for p in written] == ["accuracy.png"]
    assert "skipping figure 'entropy'" in caplog.text and "skipping figure 'cost'" in caplog.text
    assert f"not logged, skipped: ['{keys.EVAL_AVG_AT_K}'" in caplog.text


def test_compare_figure(tmp_path):
    a = _fake_run(tmp_path / "clip_higher", seed=1)
    b = _fake_run(tmp_path / "symmetric", seed=2, n_steps=8)
    out = tmp_path / "figs"
    assert report.main([str(a), "--compare", str(b), "--out", str(out), "--smooth", "3"]) == 0
    _assert_png(out / "compare.png")
    assert report.run_labels([a, b]) == ["clip_higher", "symmetric"]
    assert report.run_labels([tmp_path / "x" / "run", tmp_path / "y" / "run"]) == ["x/run", "y/run"]


def test_report_without_metrics_fails_cleanly(tmp_path, capsys):
    from dapo_mcore import cli

    assert cli.main(["report", str(tmp_path / "nowhere")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "metrics.jsonl does not exist" in out.err and out.err.count("\n") == 1


def test_moving_average_matches_naive():
    records = [{keys.STEP: i, "x": float(i * i)} for i in range(10)]
    _, smooth = report.series(records, "x", smooth=3)
    naive = [sum(i * i for i in range(max(0, j - 2), j + 1)) / (j + 1 - max(0, j - 2)) for j in range(10)]
    assert smooth.tolist() == pytest.approx(naive)


def test_profile_summary_numbers(tmp_path):
    run = _fake_run(tmp_path / "run", n_steps=10)
    records = report.load_run(run)
    summary = profile.summarize(records)
    rows = {r.phase: r for r in summary.phases}
    step_total = sum(r[keys.TIME_STEP] for r in records)
    assert rows["step (wall)"].total_s == pytest.approx(step_total)
    assert rows["generate"].total_s == pytest.approx(sum(r[keys.TIME_GENERATE] for r in records))
    assert rows["eval"].total_s == pytest.approx(3.0)  # steps 0, 4, 8
    assert rows["other (untimed)"].total_s == pytest.approx(0.2 * 10)
    assert math.fsum(r.share for r in summary.phases if r.phase != "step (wall)") == pytest.approx(1.0)
    assert rows["train"].share == pytest.approx(15.0 / step_total)
    assert summary.perf[keys.PERF_TOKENS_PER_S_PER_DEVICE] == pytest.approx((1004.5, 1009.0))
    assert summary.tokens["tokens_generated_kept"] == 120000
    assert summary.tokens["tokens_generated_rejected"] == sum(28000 + s for s in range(10))


def test_profile_cli_runs(tmp_path, capsys):
    run = _fake_run(tmp_path / "myrun", with_perf=False)
    assert profile.main([str(run), "--last", "5"]) == 0
    out = capsys.readouterr().out
    assert "myrun: 5 steps (7..11)" in out
    assert "Where time went" in out and "generate" in out and "not logged" in out
    assert "generated tokens, rejected" in out


def test_base_eval_time_is_shown_apart_and_token_parts_sum_to_the_whole(tmp_path, capsys):
    """The step-0 base evaluation's time/eval is its own line in profile and the run summary, not
    divided into the steps' mean; generated tokens split into kept + filtered + surplus + aborted = all; rates say
    what they count over which time."""
    from dapo_mcore.telemetry.progress import run_summary

    run = tmp_path / "run"
    ledger = CostLedger(run)
    with MetricsWriter(run) as writer:
        writer.log(0, {keys.EVAL_AVG_AT_K: 0.2, keys.EVAL_K: 4, keys.time_key("eval"): 50.0})
        for step in (1, 2):
            phases = {"generate": 3.0, "train": 1.0, "step": 5.0}
            metrics = {keys.TRAIN_LOSS: 0.1, keys.TRAIN_LR: 1e-3, **{keys.time_key(p): s for p, s in phases.items()}}
            metrics.update(ledger.record_step(
                step, prompts_generated=8, prompts_kept=4, rollouts_generated=64, rollouts_kept=32,
                tokens_generated=1000, tokens_generated_kept=400, tokens_trained=900, phase_seconds=phases,
                num_devices=1, tokens_generated_surplus=100, tokens_generated_aborted=50))
            writer.log(step, metrics)
    ledger.close()
    s = profile.summarize(report.load_run(run))
    rows = {r.phase: r for r in s.phases}
    assert s.steps == [1, 2] and s.base_eval_s == 50.0 and "eval" not in rows
    assert rows["step (wall)"].per_step_s == pytest.approx(5.0)  # not (50 + 10) / 3
    t = s.tokens
    assert (t["tokens_generated_kept"], t["tokens_generated_filtered"], t["tokens_generated_surplus"],
            t["tokens_generated_aborted"]) == (800, 900, 200, 100)
    assert sum(t[k] for k in ("tokens_generated_kept", "tokens_generated_filtered", "tokens_generated_surplus",
                              "tokens_generated_aborted")) == t["tokens_generated"] == 2000
    assert profile.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "base evaluation (step 0, before the first step" in out and "50.00 s" in out
    assert "over generate time" in out and "tokens trained (prompt + response" in out
    summary = run_summary(run)
    assert "base evaluation (step 0, before the steps): 50" in summary
    assert "= kept for training 800 (40%) + rejected by dynamic sampling 900 (45%) + surplus groups 200 (10%) + " \
           "aborted 100 (5%)" in summary


def test_profile_shows_the_async_pipeline_means_only_for_an_async_run():
    rows = [{keys.STEP: s, keys.TIME_STEP: 1.0, "async/lag_mean": float(s > 1), "async/trainer_wait_s": 0.1 * s}
            for s in range(1, 4)]
    summary = profile.summarize(rows)
    assert summary.pipeline == {"lag_mean": pytest.approx(2 / 3), "trainer_wait_s": pytest.approx(0.2)}
    assert profile.summarize([{keys.STEP: 1, keys.TIME_STEP: 1.0}]).pipeline == {}
