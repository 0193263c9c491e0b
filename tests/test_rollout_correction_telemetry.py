"""rollout_corr/* in diagnose (the off-policy rule), profile (a skipped old-log-prob phase) and report (one figure)."""

from __future__ import annotations

import pytest

from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.diagnose import Run, diagnose
from dapo_mcore.telemetry.profile import summarize
from dapo_mcore.telemetry.report import correction_figure

pytestmark = pytest.mark.unit


def records(n: int = 20, kl=lambda s: 2e-4, rejected=lambda s: 0.0, w_max=1.0, bypass=False) -> list[dict]:
    out = []
    for s in range(1, n + 1):
        r = {keys.STEP: s, keys.TRAIN_LOSS: 0.1, keys.TRAIN_LR: 1e-3, keys.CORR_KL_K3: kl(s), keys.CORR_KL_K1: kl(s),
             keys.CORR_REJECTED_TOKEN_FRAC: rejected(s), keys.CORR_REJECTED_SEQ_FRAC: rejected(s),
             keys.CORR_IS_WEIGHT_MAX: w_max, keys.CORR_IS_WEIGHT_MEAN: 1.0, keys.CORR_IS_WEIGHT_MIN: 0.9,
             keys.CORR_ESS: 0.99, keys.CORR_CHI2: 0.01, keys.CORR_LOG_PPL_DIFF: 0.0,
             keys.time_key("train"): 1.0, keys.TIME_STEP: 2.0}
        if bypass:
            r[keys.CORR_BYPASS] = 1.0
        else:
            r[keys.time_key("old_logprobs")] = 0.5
        out.append(r)
    return out


def off_policy(recs) -> list:
    return [f for f in diagnose(Run(recs, {})).findings if f.rule == "off-policy"]


def test_small_steady_gap_is_fine_and_the_rule_ran():
    d = diagnose(Run(records(), {}))
    assert "off-policy" in d.ok and not off_policy(records())


@pytest.mark.parametrize(("kwargs", "advice"), [
    ({}, "preset token_tis"),
    ({"w_max": 2.0}, "preset geo_rs_token_tis"),
    ({"bypass": True}, "leave bypass mode"),
])
def test_a_growing_gap_names_the_preset_to_try(kwargs, advice):
    (f,) = off_policy(records(kl=lambda s: 1e-4 * s * s, **kwargs))
    assert "grows" in f.message and advice in f.advice and "algo.rollout_correction" in f.advice


def test_rejecting_most_tokens_is_reported():
    (f,) = off_policy(records(rejected=lambda s: 0.9, bypass=True))
    assert "rejects 90%" in f.message and "rs_thresholds" in f.advice


def test_profile_shows_the_skipped_phase_only_in_bypass_mode(tmp_path):
    assert summarize(records(bypass=True)).skipped == ["old_logprobs"]
    assert summarize(records()).skipped == []
    assert correction_figure(records(bypass=True), tmp_path).name == "rollout_correction.png"
    assert correction_figure([{keys.STEP: 1, keys.TRAIN_LOSS: 0.1}], tmp_path) is None
