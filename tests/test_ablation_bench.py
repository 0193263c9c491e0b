"""benchmarks/ablation.py: the rows are the paper's cumulative progression; per-run summaries read the metrics."""

import importlib.util
import math
from pathlib import Path

import pytest

from dapo_mcore.config import load_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ablation", ROOT / "benchmarks" / "ablation.py")
ablation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablation)


def _algo(row: int):
    return load_config(ablation.CONFIG, ablation.row_overrides(row))


def test_rows_add_one_technique_each_and_end_at_dapo():
    grpo, last = _algo(0), _algo(len(ablation.ROWS) - 1)
    assert (grpo.algo.clip_high, grpo.algo.loss_agg, grpo.algo.dynamic_sampling, grpo.algo.overlong_shaping,
            grpo.algo.overlong_filter) == (0.2, "seq-mean-token-mean", False, False, False)
    assert grpo.rollout.gen_batch_prompts == grpo.train.prompts_per_step
    assert (last.algo.clip_high, last.algo.loss_agg, last.algo.dynamic_sampling, last.algo.overlong_shaping,
            last.algo.overlong_filter) == (0.28, "token-mean", True, True, True)
    fields = ("clip_high", "loss_agg", "dynamic_sampling", "overlong_shaping", "overlong_filter")
    for row in range(1, len(ablation.ROWS)):
        before, after = _algo(row - 1).algo, _algo(row).algo
        assert sum(getattr(before, f) != getattr(after, f) for f in fields) == 1, ablation.ROWS[row][0]
    for row in range(len(ablation.ROWS)):
        _algo(row).validate(1)


def test_summarize_and_aggregate():
    recs = [{"step": 0, "eval/avg_at_k": 0.1, "eval/k": 4},
            {"step": 1, "train/entropy": 0.5, "rollout/resp_len_mean": 10, "rollout/truncated_frac": 0.2,
             "train/clipfrac": 0.1, "train/clipfrac_low": 0.05, "train/clipfrac_high": 0.05,
             "rollout/usable_group_frac": 0.5, "cost/total/tokens_generated": 100},
            {"step": 2, "train/entropy": 0.3, "rollout/resp_len_mean": 20, "rollout/truncated_frac": 0.0,
             "train/clipfrac": 0.3, "train/clipfrac_low": 0.1, "train/clipfrac_high": 0.2,
             "rollout/usable_group_frac": 1.0, "cost/total/tokens_generated": 250, "eval/avg_at_k": 0.4}]
    s = ablation.summarize_run(recs, wall_s=12.0)
    assert s["avg_at_k"] == 0.4 and s["avg_at_k_base"] == 0.1 and s["gen_tokens"] == 250
    assert math.isclose(s["entropy_end"], 0.4) and s["resp_len"] == 15 and math.isclose(s["truncated"], 0.1)
    assert math.isclose(s["usable"], 0.75) and s["wall_s"] == 12.0
    agg = ablation.aggregate([s, {**s, "avg_at_k": 0.6}])
    assert agg["avg_at_k"] == pytest.approx((0.5, 0.1)) and agg["gen_tokens"] == (250, 0)
    table = ablation.format_table({"grpo": agg}, k=4)
    assert "avg@4" in table and "| grpo | 0.500±0.100 |" in table
