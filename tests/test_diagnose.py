"""``dapo-mcore diagnose``: each rule on a synthetic run that shows it and on one that does not; recorded real runs.

``tests/data/tiny_run`` is the tiny default (80 steps, held-out 0.27 -> 0.99): it must raise no warning.
``tests/data/stalled_run`` is a base model that is already right 98% of the time, with a 100-step warm-up cut at
step 30: it must warn about both.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.diagnose import Run, diagnose, main, read_run

DATA = Path(__file__).parent / "data"
N = 40
CFG = {"optim": {"lr": 5e-4, "warmup_steps": 0}, "algo": {"clip_high": 0.28}, "rollout": {"max_new_tokens": 6},
       "reward": {"name": "math_dapo"}}


def healthy(n: int = N) -> list[dict]:
    """A run that learns steadily with nothing wrong."""
    out = [{keys.STEP: 0, keys.EVAL_AVG_AT_K: 0.3, keys.EVAL_K: 4}]
    for s in range(1, n + 1):
        f = s / n
        r = {keys.STEP: s, keys.ROLLOUT_USABLE_GROUP_FRAC: 0.8 - 0.1 * f, keys.TRAIN_ENTROPY: 0.3 - 0.1 * f,
             keys.TRAIN_CLIPFRAC_HIGH: 0.004 if s % 3 == 0 else 0.0, keys.ROLLOUT_TRUNCATED_FRAC: 0.01,
             keys.MISMATCH_LOGP_ABS_DIFF_MEAN: 1e-6 * (1 + 0.1 * math.sin(s)), keys.ROLLOUT_REWARD_MEAN: -0.4 + f,
             keys.ROLLOUT_ACC_MEAN: 0.3 + 0.5 * f, keys.TRAIN_LOSS: 0.01 * math.sin(s),
             keys.TRAIN_GRAD_NORM: 1.0 + 0.2 * math.sin(s), keys.TRAIN_LR: 5e-4, keys.ROLLOUT_GEN_BATCHES: 1,
             keys.ROLLOUT_RESP_LEN_MEAN: 4.0}
        if s % 10 == 0:
            r.update({keys.EVAL_AVG_AT_K: 0.3 + 0.5 * f, keys.EVAL_K: 4})
        out.append(r)
    return out


def with_series(records: list[dict], key: str, fn) -> list[dict]:
    """Replace ``key`` in every training step by ``fn(step, fraction of the run)``."""
    out = []
    for r in records:
        r = dict(r)
        if keys.TRAIN_LR in r:
            r[key] = fn(r[keys.STEP], r[keys.STEP] / N)
        out.append(r)
    return out


def with_eval(records: list[dict], fn) -> list[dict]:
    return [dict(r, **{keys.EVAL_AVG_AT_K: fn(r[keys.STEP])}) if keys.EVAL_AVG_AT_K in r else r for r in records]


def findings(records: list[dict], cfg: dict | None = None) -> dict[str, list]:
    d = diagnose(Run(records, CFG if cfg is None else cfg))
    out: dict[str, list] = {}
    for f in d.findings:
        out.setdefault(f.rule, []).append(f)
    return out


def test_healthy_run_has_no_findings():
    d = diagnose(Run(healthy(), CFG))
    assert d.findings == []
    assert d.skipped == []
    assert set(d.ok) == {"cannot-learn", "usable-groups", "entropy", "clip-high", "length-limit", "mismatch",
                         "reward-vs-heldout",
                         "spikes", "warmup", "no-update"}


def test_usable_groups_collapse_hopeless_and_saturated():
    hopeless = with_series(with_series(healthy(), keys.ROLLOUT_USABLE_GROUP_FRAC, lambda s, f: 0.9 * (1 - f) + 0.02),
                           keys.ROLLOUT_ACC_MEAN, lambda s, f: 0.05)
    (f,) = findings(hopeless)["usable-groups"]
    assert f.level == "warn" and "collapsed" in f.message and "hopeless" in f.message
    assert "from step" in f.evidence and "generation batches per step" in f.evidence
    saturated = with_series(hopeless, keys.ROLLOUT_ACC_MEAN, lambda s, f: 0.99)
    (g,) = findings(saturated)["usable-groups"]
    assert "saturated" in g.message and g.level == "info"  # held-out rose 0.3 -> 0.8: learned, then saturated
    stalled = with_eval(saturated, lambda s: 0.3)
    assert findings(stalled)["usable-groups"][0].level == "warn"
    low = with_series(saturated, keys.ROLLOUT_USABLE_GROUP_FRAC, lambda s, f: 0.05)
    assert "from the start" in findings(low)["usable-groups"][0].message


def test_entropy_collapse_is_a_warning_only_before_the_task_is_solved():
    collapsed = with_series(healthy(), keys.TRAIN_ENTROPY, lambda s, f: 0.5 * (1 - f) + 0.005)
    (f,) = findings(collapsed)["entropy"]
    assert f.level == "warn" and "clip_high" in f.advice
    solved = with_series(collapsed, keys.ROLLOUT_ACC_MEAN, lambda s, f: 0.97)
    assert findings(solved)["entropy"][0].level == "info"
    assert "entropy" not in findings(with_series(healthy(), keys.TRAIN_ENTROPY, lambda s, f: 0.5 * (1 - 0.5 * f)))


def test_clip_high_never_and_always_active():
    never = findings(with_series(healthy(), keys.TRAIN_CLIPFRAC_HIGH, lambda s, f: 0.0))["clip-high"]
    assert never[0].level == "info" and "never" in never[0].message and "1.28" in never[0].evidence
    always = findings(with_series(healthy(), keys.TRAIN_CLIPFRAC_HIGH, lambda s, f: 0.12))["clip-high"]
    assert always[0].level == "warn" and "nearly every step" in always[0].message
    sometimes = with_series(healthy(), keys.TRAIN_CLIPFRAC_HIGH, lambda s, f: 0.12 if s % 4 == 0 else 0.0)
    assert "clip-high" not in findings(sometimes)


def test_clip_high_hints_read_the_runs_config():
    quiet = with_series(healthy(), keys.TRAIN_CLIPFRAC_HIGH, lambda s, f: 0.0)
    four = dict(CFG, train={"prompts_per_step": 32, "mini_batch_prompts": 8, "epochs": 1})
    advice = findings(quiet, four)["clip-high"][0].advice
    assert "more mini-batches" not in advice and "4 updates per step" in advice and "optim.lr (now 0.0005)" in advice
    one = dict(CFG, train={"prompts_per_step": 32, "mini_batch_prompts": 32, "epochs": 1})
    assert "train.mini_batch_prompts=8" in findings(quiet, one)["clip-high"][0].advice
    loud = with_series(healthy(), keys.TRAIN_CLIPFRAC_HIGH, lambda s, f: 0.12)
    assert "fewer mini-batches" not in findings(loud, one)["clip-high"][0].advice
    assert "fewer mini-batches" in findings(loud, four)["clip-high"][0].advice


def test_length_limit():
    hit = with_series(healthy(), keys.ROLLOUT_TRUNCATED_FRAC, lambda s, f: 0.4 * f)
    (f,) = findings(hit)["length-limit"]
    assert f.level == "warn" and "max_new_tokens=6" in f.evidence
    assert "length-limit" not in findings(with_series(healthy(), keys.ROLLOUT_TRUNCATED_FRAC, lambda s, f: 0.05))


def test_mismatch_growing():
    growing = with_series(healthy(), keys.MISMATCH_LOGP_ABS_DIFF_MEAN, lambda s, f: 1e-4 * 10 ** (3 * f))
    (f,) = findings(growing)["mismatch"]
    assert f.level == "warn" and "growing" in f.message
    # Large relative growth of a negligible mismatch (fp32 noise) is not a finding.
    noise = with_series(healthy(), keys.MISMATCH_LOGP_ABS_DIFF_MEAN, lambda s, f: 1e-7 * 10 ** (2 * f))
    assert "mismatch" not in findings(noise)


def test_reward_rising_while_heldout_flat():
    flat = with_eval(healthy(), lambda s: 0.31)
    (f,) = findings(flat)["reward-vs-heldout"]
    assert f.level == "warn" and "audit-reward --reward math_dapo" in f.advice and "avg@4" in f.evidence
    assert "reward-vs-heldout" not in findings(healthy())
    # Held-out flat but reward flat too: not this rule.
    assert "reward-vs-heldout" not in findings(with_series(flat, keys.ROLLOUT_REWARD_MEAN, lambda s, f: 0.1))


def test_spikes_and_non_finite_values():
    spiked = with_series(healthy(), keys.TRAIN_GRAD_NORM, lambda s, f: 40.0 if s == 23 else 1.0 + 0.2 * math.sin(s))
    (f,) = findings(spiked)["spikes"]
    assert f.level == "warn" and "step 23: 40" in f.evidence
    nan = with_series(healthy(), keys.TRAIN_LOSS, lambda s, f: float("nan") if s in (7, 8) else 0.01 * math.sin(s))
    (g,) = findings(nan)["spikes"]
    assert "not finite" in g.message and "7, 8" in g.evidence
    # A 3x wiggle of the grad norm is not a spike.
    mild = with_series(healthy(), keys.TRAIN_GRAD_NORM, lambda s, f: 3.0 if s == 23 else 1.0 + 0.2 * math.sin(s))
    assert "spikes" not in findings(mild)


def test_lr_still_in_warmup():
    warm = with_series(healthy(), keys.TRAIN_LR, lambda s, f: 5e-4 * s / 100)
    cfg = dict(CFG, optim={"lr": 5e-4, "warmup_steps": 100})
    (f,) = findings(warm, cfg)["warmup"]
    assert f.level == "warn" and "warmup_steps=100" in f.evidence
    assert findings(warm, {})["warmup"]  # without a config: a still-rising lr
    assert "warmup" not in findings(with_series(healthy(), keys.TRAIN_LR, lambda s, f: 5e-4 * min(1, s / 10)), cfg)


def test_too_few_steps_skips_the_trend_rules_only():
    d = diagnose(Run(healthy(2), CFG))
    assert d.findings == [] and d.skipped == []
    assert sorted(d.ok) == ["cannot-learn", "length-limit", "no-update", "spikes", "usable-groups", "warmup"]
    assert sorted(d.too_short) == ["clip-high", "entropy", "mismatch", "reward-vs-heldout"]


def test_a_short_dead_run_says_why_it_cannot_learn(tmp_path, capsys):
    """A dead run (3 steps, 100% truncation, 0 usable groups, loss 0) gets warnings, not '0 warning(s)' and
    'metrics not logged'."""
    dead = [{keys.STEP: s, keys.ROLLOUT_USABLE_GROUP_FRAC: 0.0, keys.ROLLOUT_TRUNCATED_FRAC: 1.0,
             keys.ROLLOUT_ACC_MEAN: 0.0, keys.ROLLOUT_REWARD_MEAN: -2.0, keys.TRAIN_LOSS: 0.0,
             keys.TRAIN_GRAD_NORM: 0.0, keys.TRAIN_LR: 5e-4, keys.ROLLOUT_RESP_LEN_MEAN: 6.0} for s in (1, 2, 3)]
    d = diagnose(Run(dead, CFG))
    by = {f.rule: f for f in d.findings}
    assert {"cannot-learn", "usable-groups", "length-limit"} <= set(by) and all(f.level == "warn" for f in by.values())
    assert "ran to the length limit" in by["cannot-learn"].message
    assert "rollout.stop_token_ids" in by["cannot-learn"].advice and "loss exactly 0" in by["cannot-learn"].evidence
    assert by["length-limit"].steps == "1-3"
    for name in ("metrics.jsonl",):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in dead))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 warning(s)" in out and "not judged (trends need >= 4 logged training steps): reward-vs-heldout" in out
    wrong = [dict(r, **{keys.ROLLOUT_TRUNCATED_FRAC: 0.0}) for r in dead]
    assert "every answer was wrong" in {f.rule: f for f in diagnose(Run(wrong, CFG)).findings}["cannot-learn"].message
    assert "cannot-learn" not in {f.rule for f in diagnose(Run(healthy(3), CFG)).findings}


def test_tiny_default_run_raises_no_warning():
    d = diagnose(read_run(DATA / "tiny_run"))
    assert [f for f in d.findings if f.level == "warn"] == []
    assert "0.269 (step 0) -> 0.990 (step 80)" in d.summary


def test_stalled_run_is_explained(capsys):
    assert main([str(DATA / "stalled_run")]) == 0
    out = capsys.readouterr().out
    assert "[warn] usable-groups" in out and "low from the start (saturated" in out
    assert "[warn] warmup" in out
    assert main([str(DATA / "stalled_run"), "--fail-on-warn"]) == 1
    assert main([str(DATA / "tiny_run"), "--fail-on-warn"]) == 0
    capsys.readouterr()
    assert main([str(DATA / "tiny_run"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"]


def test_missing_run_dir_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl does not exist" in err


@pytest.mark.parametrize(("key", "rule"), [(keys.TRAIN_ENTROPY, "entropy"), (keys.MISMATCH_LOGP_ABS_DIFF_MEAN, "mismatch")])
def test_rule_without_its_metric_is_skipped(key, rule):
    records = [{k: v for k, v in r.items() if k != key} for r in healthy()]
    d = diagnose(Run(records, CFG))
    assert rule in d.skipped and rule not in d.ok


def _async(trainer_wait: float, engine_wait: float, n: int = 10) -> list[dict]:
    """An async run: 1 s steps, 0.6 s of generation per batch, the given waits on each side."""
    out = healthy(n)
    for r in out[1:]:
        r.update({"time/step": 1.0, "async/trainer_wait_s": trainer_wait, "async/engine_wait_weights_s": engine_wait,
                  "async/engine_generate_s": 0.5, "async/engine_reward_s": 0.1, "async/overlap_frac": 0.5})
    return out


@pytest.mark.parametrize(("trainer_wait", "engine_wait", "finding"), [
    (0.5, 0.0, "the trainer starves"), (0.0, 0.6, "the engines idle"), (0.05, 0.05, None)])
def test_pipeline_rule_names_the_slower_side_and_the_key_to_change(trainer_wait, engine_wait, finding):
    d = diagnose(Run(_async(trainer_wait, engine_wait), CFG))
    found = [f for f in d.findings if f.rule == "pipeline"]
    if finding is None:
        assert not found and "pipeline" in d.ok
        return
    assert len(found) == 1 and found[0].message.startswith(finding), found
    assert "rollout.pipeline.engine_ranks" in found[0].advice
    assert f"{trainer_wait:.0%}" in found[0].evidence


def test_pipeline_rule_stays_out_of_a_sync_runs_report():
    """The async mode's rule neither runs on a sync run nor is listed as skipped (its metrics are not missing)."""
    d = diagnose(Run(healthy(), CFG))
    assert "pipeline" not in d.skipped and "pipeline" not in d.ok and not [f for f in d.findings if f.rule == "pipeline"]


def test_gspo_sequence_clip_fraction_is_not_judged_by_token_thresholds():
    """GSPO clips sequences: 20% of tokens in clipped sequences (a warning for a token clip) is an info finding;
    a majority every step warns; cispo's truncated weights warn only when many, every step."""
    gspo = dict(CFG, algo={"clip_high": 4e-4, "clip_low": 3e-4, "objective": "gspo"})
    usual = with_series(with_series(healthy(), keys.TRAIN_CLIPFRAC, lambda s, f: 0.2),
                        keys.TRAIN_CLIPFRAC_HIGH, lambda s, f: 0.12)
    assert findings(usual)["clip-high"][0].level == "warn"  # the same numbers under ppo_clip
    (f,) = findings(usual, gspo)["clip-high"]
    assert f.level == "info" and "sequence scale" in f.evidence and "20.0%" in f.evidence
    most = with_series(healthy(), keys.TRAIN_CLIPFRAC, lambda s, f: 0.7)
    (f,) = findings(most, gspo)["clip-high"]
    assert f.level == "warn" and "most sequences" in f.message and "now 0.0003 / 0.0004" in f.advice
    cispo = dict(CFG, algo={"clip_high": 4.0, "clip_low": 1.0, "objective": "cispo"})
    assert "clip-high" not in findings(with_series(healthy(), keys.TRAIN_CLIPFRAC_HIGH, lambda s, f: 0.0), cispo)
    (f,) = findings(with_series(healthy(), keys.TRAIN_CLIPFRAC_HIGH, lambda s, f: 0.12), cispo)["clip-high"]
    assert f.level == "warn" and "1+clip_high=5" in f.evidence


def test_an_async_run_is_judged_by_what_it_set():
    # a healthy async run with token TIS on (algo.tis_cap) and the lag's engine/trainer gap: no advice to start
    # token_tis, and the log-prob gap is put down to the lag, not to the engine's dtype
    cfg = {**CFG, "algo": {"clip_high": 0.28, "tis_cap": 2.0}, "rollout": {"max_new_tokens": 6,
                                                                           "pipeline": {"mode": "async"}}}
    records = _async(0.05, 0.05, n=N)
    for r in records[1:]:
        f = r[keys.STEP] / N
        r.update({"async/lag_mean": 1.0, keys.MISMATCH_LOGP_ABS_DIFF_MEAN: 1e-3 * 10 ** (2 * f), keys.MISMATCH_KL: 0.05})
    text = " ".join(f"{x.message} {x.evidence} {x.advice}" for x in diagnose(Run(records, cfg)).findings)
    assert "algo.tis_cap=2.0" in text and "policy lag" in text
    assert "engine dtype" not in text and "preset token_tis or icepop" not in text
    sync = " ".join(x.advice for x in diagnose(Run(with_series(healthy(), keys.MISMATCH_LOGP_ABS_DIFF_MEAN,
                                                                    lambda s, f: 1e-4 * 10 ** (3 * f)), CFG)).findings)
    assert "engine dtype" in sync and "algo.tis_cap (or" in sync  # a sync run without a correction: as before


def test_one_clipped_grad_norm_spike_is_a_note_and_a_repeated_or_unclipped_one_a_warning():
    one = with_series(healthy(), keys.TRAIN_GRAD_NORM, lambda s, f: 6.75 if s == 21 else 1.0 + 0.2 * math.sin(s))
    clipped = {**CFG, "optim": {**CFG["optim"], "grad_clip": 1.0}}
    (f,) = findings(one, clipped)["spikes"]
    assert f.level == "info" and "clipped to optim.grad_clip=1" in f.message
    assert findings(one, {**CFG, "optim": {**CFG["optim"], "grad_clip": 0.0}})["spikes"][0].level == "warn"
    twice = with_series(healthy(), keys.TRAIN_GRAD_NORM,
                        lambda s, f: 6.75 if s in (21, 30) else 1.0 + 0.2 * math.sin(s))
    assert findings(twice, clipped)["spikes"][0].level == "warn"
