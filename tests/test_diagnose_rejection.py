"""A step whose tokens the correction all rejected logs no NaN loss and `diagnose` names the rejection, not the
learning rate; an async run far off-policy by train/ppo_kl or mismatch/kl is not called ok; the active correction is
named; a run whose correction metrics are flat draws no rollout_correction.png."""

from __future__ import annotations

import math

import pytest

from dapo_mcore.run.components import _loss_text
from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.diagnose import Run, diagnose
from dapo_mcore.telemetry.report import correction_figure
from tests.test_diagnose import CFG, healthy

pytestmark = pytest.mark.unit


def _geo_rs_rejecting(loss: float | None) -> list[dict]:
    rows = healthy()
    for r in rows[10:14]:  # 4 steps: every token rejected, no update
        r.update({"train/updates": 0.0, "train/skipped_updates": 2.0, keys.CORR_REJECTED_TOKEN_FRAC: 1.0})
        r.pop(keys.TRAIN_GRAD_NORM)
        r.pop(keys.TRAIN_LOSS)
        if loss is not None:
            r[keys.TRAIN_LOSS] = loss  # what older versions stored
    return rows


@pytest.mark.parametrize("loss", [None, math.nan])
def test_all_rejected_steps_name_the_rejection_not_the_learning_rate(loss):
    cfg = {**CFG, "algo": {**CFG["algo"], "rollout_correction": {"preset": "geo_rs"}}}
    d = diagnose(Run(_geo_rs_rejecting(loss), cfg))
    names = {f.rule: f for f in d.findings}
    assert "no-update" in names, d.findings
    f = names["no-update"]
    assert "rejected every token" in f.message and "preset geo_rs" in f.evidence and "rs_thresholds" in f.advice
    assert "spikes" not in names  # no "lower optim.lr" for a step that trained nothing
    assert "rollout correction: preset geo_rs" in d.summary


def test_the_step_line_says_why_there_is_no_loss():
    assert _loss_text({keys.TRAIN_LOSS: 0.01234}) == "0.0123"
    text = _loss_text({"train/updates": 0.0, keys.CORR_REJECTED_TOKEN_FRAC: 1.0})
    assert "nan" not in text and "rejected every token" in text


def test_an_async_run_far_off_policy_is_not_called_ok():
    rows = healthy()
    for _i, r in enumerate(rows[1:], start=1):
        r.update({"async/lag_mean": 0.5, keys.TRAIN_PPO_KL: 0.005, keys.MISMATCH_KL: 0.001})
    rows[25][keys.TRAIN_PPO_KL] = 0.24
    d = diagnose(Run(rows, CFG))
    found = [f for f in d.findings if f.rule == "off-policy"]
    assert found and "0.24" in found[0].evidence and "step 25" in found[0].evidence, d.findings
    for r in rows[1:]:
        r[keys.TRAIN_PPO_KL], r[keys.MISMATCH_KL] = 0.005, 0.17
    found = [f for f in diagnose(Run(rows, CFG)).findings if f.rule == "off-policy"]
    assert found and keys.MISMATCH_KL in found[0].evidence, found
    for r in rows[1:]:
        r[keys.MISMATCH_KL] = 0.001
    assert "off-policy" in diagnose(Run(rows, CFG)).ok  # a quiet async run stays ok


def test_a_run_without_correction_draws_no_correction_figure(tmp_path):
    import yaml

    from dapo_mcore.telemetry.report import correction_active, correction_label

    rows = [{keys.STEP: s, keys.CORR_KL_K3: 1e-4 * s, keys.CORR_IS_WEIGHT_MEAN: 1.0} for s in range(1, 6)]
    for algo, active in [({}, False), ({"tis_cap": 2.0}, True), ({"rollout_correction": {"preset": "geo_rs"}}, True),
                         ({"rollout_correction": {"preset": "disabled"}}, False)]:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"algo": algo}))
        assert correction_active(tmp_path) is active, algo
        drawn = correction_figure(rows, tmp_path, active=correction_active(tmp_path))
        assert (drawn is not None) is active
    assert correction_label(tmp_path) == "preset disabled"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"algo": {"tis_cap": 2.0}}))
    assert correction_label(tmp_path) == "algo.tis_cap=2.0"
