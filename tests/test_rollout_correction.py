"""Rollout correction (algo.rollout_correction) against a naive per-sequence, per-token Python loop."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_mcore.algo.rollout_correction import (
    PRESETS,
    RolloutCorrectionConfig,
    correction,
    correction_packed,
    correction_stats,
)

pytestmark = pytest.mark.unit


def naive(log_ratio, mask, cfg: RolloutCorrectionConfig, weight_mean=None):
    """The issue's definitions, one response and one token at a time, in Python floats."""
    cfg = cfg.resolved()
    b, t = mask.shape
    rows_w, rows_keep, lrs = [], [], []
    for i in range(b):
        valid = [j for j in range(t) if mask[i, j] > 0]
        lr = {j: min(max(float(log_ratio[i, j]), -20.0), 20.0) for j in valid}
        lrs.append(lr)
        seq_w = math.exp(min(max(sum(lr.values()), -20.0), 20.0))
        w = {}
        for j in valid:
            x = 1.0 if cfg.is_level is None else (math.exp(lr[j]) if cfg.is_level == "token" else seq_w)
            thr = cfg.is_threshold
            if cfg.is_level is not None and isinstance(thr, list):
                x = x if thr[0] <= x <= thr[1] else 0.0
            elif cfg.is_level is not None and thr is not None:
                x = min(x, thr)
            w[j] = x
        keep = {j: True for j in valid}
        for opt, thr in zip(cfg.rs, cfg.rs_thresholds, strict=True):
            kind = opt[-2:]
            k = {j: {"k1": lr[j], "k2": lr[j] ** 2 / 2, "k3": math.exp(lr[j]) - 1 - lr[j]}[kind] for j in valid}
            if opt.startswith("token"):
                for j in valid:
                    ok = thr[0] <= math.exp(k[j]) <= thr[1] if kind == "k1" else k[j] <= thr
                    keep[j] = keep[j] and ok
                continue
            how = opt.split("_")[1]
            vals = list(k.values())
            if not vals:
                continue
            stat = sum(vals) if how == "sum" else (sum(vals) / len(vals) if how == "mean" else max(vals))
            ok = thr[0] <= math.exp(min(max(stat, -20.0), 20.0)) <= thr[1] if kind == "k1" else stat <= thr
            for j in valid:
                keep[j] = keep[j] and ok
        rows_w.append(w)
        rows_keep.append(keep)
    if cfg.is_batch_normalize and cfg.is_level is not None:
        if weight_mean is None:
            if cfg.is_level == "token":
                units = [x for w in rows_w for x in w.values()]
            else:
                units = [next(iter(w.values())) for w in rows_w if w]
            weight_mean = sum(units) / len(units)
        rows_w = [{j: x / weight_mean for j, x in w.items()} for w in rows_w]
    weights = torch.zeros(b, t, dtype=torch.float64)
    keep = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        for j, x in rows_w[i].items():
            weights[i, j] = x
            keep[i, j] = rows_keep[i][j]
    n = sum(len(lr) for lr in lrs)
    flat_w = [x for w in rows_w for x in w.values()]
    flat_lr = [x for lr in lrs for x in lr.values()]
    nonempty = [lr for lr in lrs if lr]
    metrics = {
        "is_weight_mean": sum(flat_w) / n, "is_weight_min": min(flat_w), "is_weight_max": max(flat_w),
        "ess": sum(flat_w) ** 2 / (n * sum(x * x for x in flat_w)),
        "rejected_token_frac": sum(1 for i in range(b) for j in rows_keep[i] if not rows_keep[i][j]) / n,
        "rejected_seq_frac": sum(1 for i in range(b) if rows_keep[i] and not any(rows_keep[i].values()))
        / len(nonempty),
        "kl_k1": -sum(flat_lr) / n, "kl_k3": sum(math.exp(x) - 1 - x for x in flat_lr) / n,
        "chi2": sum(math.exp(2 * x) for x in flat_lr) / n - 1,
        "log_ppl_diff": -sum(sum(lr.values()) / len(lr) for lr in nonempty) / len(nonempty),
    }
    return weights, keep, metrics


def batch(seed: int, b: int = 12, t: int = 10, scale: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    lr = scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0], lengths[1] = t, 0
    mask = (torch.arange(t) < lengths.unsqueeze(1)).to(torch.float64)
    mask[2, 1] = 0.0  # a hole inside a response
    lr[mask == 0] = float("nan")  # masked values must not leak
    lr[3, 0] = 45.0  # beyond the clamp
    return lr, mask


CONFIGS = [
    *[PRESETS[name] for name in PRESETS],
    RolloutCorrectionConfig(is_level="token", is_threshold=2.0, is_batch_normalize=True),
    RolloutCorrectionConfig(is_level="sequence", is_threshold=[0.3, 3.0], is_batch_normalize=True),
    RolloutCorrectionConfig(is_level="token", is_threshold=[0.7, 1.4], rs=["token_k1", "token_k2", "token_k3"],
                            rs_thresholds=[[0.6, 1.6], 0.1, 0.08]),
    RolloutCorrectionConfig(rs=["seq_sum_k1", "seq_mean_k1"], rs_thresholds=[[0.2, 5.0], [0.8, 1.25]]),
    RolloutCorrectionConfig(rs=["seq_sum_k2", "seq_mean_k2", "seq_max_k2"], rs_thresholds=[0.5, 0.06, 0.2]),
    RolloutCorrectionConfig(is_level="sequence", is_threshold=5.0,
                            rs=["seq_sum_k3", "seq_mean_k3", "seq_max_k3"], rs_thresholds=[0.5, 0.06, 0.2]),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.is_level}-{c.is_threshold}-{'+'.join(c.rs)}")
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_naive_loop(cfg, seed):
    lr, mask = batch(seed)
    w, keep, metrics = correction(lr, mask, cfg)
    ref_w, ref_keep, ref_metrics = naive(lr, mask, cfg)
    assert torch.equal(keep, ref_keep)
    torch.testing.assert_close(w, ref_w, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(w).all()
    assert metrics.keys() == {f"rollout_corr/{k}" for k in ref_metrics}
    for k, v in ref_metrics.items():
        assert metrics[f"rollout_corr/{k}"] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_rejection_fires_and_keeps_some():
    """The thresholds above are meant to bite: the test would pass vacuously if every token were kept."""
    lr, mask = batch(0)
    for cfg in CONFIGS[-4:]:
        _, keep, m = correction(lr, mask, cfg)
        assert 0 < m["rollout_corr/rejected_token_frac"] < 1 and keep.any()


def test_packed_form_equals_padded():
    lr, mask = batch(3)
    lengths = [int(mask[i].nonzero().max()) + 1 if mask[i].any() else 0 for i in range(mask.shape[0])]
    flat_lr = torch.cat([lr[i, :n] for i, n in enumerate(lengths)])
    flat_m = torch.cat([mask[i, :n] for i, n in enumerate(lengths)])
    cfg = RolloutCorrectionConfig(is_level="sequence", is_threshold=3.0, is_batch_normalize=True,
                                  rs=["seq_mean_k1"], rs_thresholds=[[0.8, 1.25]])
    w, keep, stats = correction_packed(flat_lr, lengths, flat_m, cfg)
    ref_w, ref_keep, _ = naive(lr, mask, cfg)
    assert torch.equal(keep, torch.cat([ref_keep[i, :n] for i, n in enumerate(lengths)]))
    torch.testing.assert_close(w, torch.cat([ref_w[i, :n] for i, n in enumerate(lengths)]))
    assert stats.tokens == float(mask.sum())


def test_batch_normalization_is_global_when_split():
    """The mean over the global batch (passed in) makes two halves equal the whole."""
    lr, mask = batch(4)
    cfg = RolloutCorrectionConfig(is_level="token", is_threshold=2.0, is_batch_normalize=True)
    whole, _, _ = correction(lr, mask, cfg)
    _, _, s1 = correction_stats(lr[:6], mask[:6], cfg, weight_mean=1.0)
    _, _, s2 = correction_stats(lr[6:], mask[6:], cfg, weight_mean=1.0)
    total = s1.merge(s2)
    mean = total.norm_sum / total.norm_count
    halves = torch.cat([correction(lr[:6], mask[:6], cfg, weight_mean=mean)[0],
                        correction(lr[6:], mask[6:], cfg, weight_mean=mean)[0]])
    torch.testing.assert_close(halves, whole)
    local, _, _ = correction(lr[:6], mask[:6], cfg)
    assert not torch.allclose(local, whole[:6])  # the local mean differs: the global one matters


@pytest.mark.parametrize("fields, key", [
    ({"is_level": "token", "is_threshold": [2.0, 0.5]}, "is_threshold"),
    ({"is_level": "token", "is_threshold": -1.0}, "is_threshold"),
    ({"is_level": "token"}, "is_threshold"),
    ({"rs": ["seq_mean_k3"], "rs_thresholds": [[0.1, 0.2]]}, "rs_thresholds[0]"),
    ({"rs": ["seq_mean_k1"], "rs_thresholds": [1.001]}, "rs_thresholds[0]"),
    ({"rs": ["seq_median_k1"], "rs_thresholds": [[0.9, 1.1]]}, "rs"),
    ({"rs": ["token_k2", "token_k3"], "rs_thresholds": [0.1]}, "rs_thresholds"),
    ({"preset": "tis"}, "preset"),
])
def test_bad_settings_are_refused_naming_the_key(fields, key):
    with pytest.raises(ValueError) as err:
        RolloutCorrectionConfig(**fields).validate()
    assert str(err.value).startswith(f"algo.rollout_correction.{key}") and "\n" not in str(err.value)


def test_preset_fields_can_be_overridden():
    cfg = RolloutCorrectionConfig(preset="icepop", is_threshold=[0.4, 3.0]).resolved()
    assert (cfg.is_level, cfg.is_threshold) == ("token", [0.4, 3.0])
    for name, preset in PRESETS.items():
        preset.validate()
        assert RolloutCorrectionConfig(preset=name).resolved() == preset


def test_config_tree_presets_short_form_and_refusals():
    """algo.rollout_correction from YAML/overrides; algo.tis_cap stays the short form of token_tis."""
    from pathlib import Path

    from dapo_mcore.config import ConfigError, load_config

    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
    assert load_config(tiny, ["algo.tis_cap=2.0"]).algo.correction == PRESETS["token_tis"]
    assert not load_config(tiny, []).algo.correction.active  # the default changes nothing
    cfg = load_config(tiny, ["algo.rollout_correction.preset=seq_mis", "algo.rollout_correction.is_threshold=3.0"])
    cfg.validate(2)
    assert (cfg.algo.correction.is_threshold, cfg.algo.correction.rs) == (3.0, ["seq_sum_k1"])
    # async accepts any correction, not only algo.tis_cap
    load_config(tiny, ["rollout.pipeline.mode=async", "algo.rollout_correction.preset=icepop"]).validate(2)
    for overrides, key in [
        (["algo.rollout_correction.preset=icepop", "algo.rollout_correction.is_threshold=[3.0, 0.5]"],
         "algo.rollout_correction.is_threshold"),
        (["algo.rollout_correction.rs=[seq_mean_k1]", "algo.rollout_correction.rs_thresholds=[0.5]"],
         "algo.rollout_correction.rs_thresholds[0]"),
        (["algo.tis_cap=2.0", "algo.rollout_correction.preset=geo_rs"], "algo.tis_cap"),
        (["algo.rollout_correction.preset=bypass_ppo_clip", "rollout.top_p=0.9"], "algo.rollout_correction bypass"),
        (["rollout.pipeline.mode=async", "algo.rollout_correction.preset=disabled"], "rollout.pipeline.mode=async"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(tiny, overrides).validate(2)
        assert str(err.value).startswith(key) and "\n" not in str(err.value), (overrides, str(err.value))


def test_an_older_tis_cap_run_directory_resumes(tmp_path):
    """A run directory written before algo.rollout_correction existed (algo.tis_cap=2.0) is the same run."""
    from pathlib import Path

    import yaml

    from dapo_mcore.actor.parallel import LaunchEnv
    from dapo_mcore.config import ConfigError, load_config, write_resolved
    from dapo_mcore.run.directory import prepare_run_dir

    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
    rank0 = LaunchEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=29500, source="test")
    run_dir = tmp_path / "run"
    write_resolved(load_config(tiny, [f"run.dir={run_dir}", "algo.tis_cap=2.0"]), run_dir)
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    del written["algo"]["rollout_correction"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(written))
    prepare_run_dir(load_config(tiny, [f"run.dir={run_dir}", "algo.tis_cap=2.0"]), rank0)  # resumes
    with pytest.raises(ConfigError, match=r"algo.correction.is_threshold: 2.0 -> \[0.5, 5.0\]"):
        prepare_run_dir(load_config(tiny, [f"run.dir={run_dir}", "algo.rollout_correction.preset=icepop"]), rank0)


def test_loose_spellings_of_the_fields():
    """A single option as a string, its band as a tuple, None for no rejection: the same config as the lists."""
    assert RolloutCorrectionConfig(rs="seq_mean_k1", rs_thresholds=(0.999, 1.001)) == PRESETS["geo_rs"]
    assert RolloutCorrectionConfig(is_level="token", is_threshold=(0.5, 5.0), rs=None, rs_thresholds=None) \
        == PRESETS["icepop"]
    lr, mask = batch(5)
    w, keep, _ = correction(lr.float(), mask.bool(), RolloutCorrectionConfig(rs="token_k3", rs_thresholds=0.05))
    assert keep.dtype == torch.bool and w.dtype == torch.float32 and not keep[mask == 0].any()


def test_bypass_refuses_an_moe_model_with_a_router_aux_loss(tmp_path):
    import json
    from pathlib import Path

    from dapo_mcore.config import ConfigError, load_config
    from dapo_mcore.config.rules import _validate_bypass

    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
    for coef, refused in ((0.001, True), (0.0, False)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4,
                                                          "router_aux_loss_coef": coef, "vocab_size": 64}))
        cfg = load_config(tiny, [f"model.hf_path={tmp_path}", "model.tiny_base=false",
                                 "algo.rollout_correction.preset=bypass_ppo_clip"])
        if refused:
            with pytest.raises(ConfigError, match="^algo.rollout_correction bypass with an MoE model"):
                _validate_bypass(cfg)
        else:
            _validate_bypass(cfg)
