"""The run-based studies in their ``--smoke`` mode: each is real CLI training runs (one after the other, one or two
gloo processes each), so a study that no longer runs (a config key it overrides renamed, a metric it reads gone, a
run that fails) fails here instead of rotting unseen. Each study exits non-zero when any of its runs failed; its last
line must be its headline, ``name: value`` with a number.

Together ~160 CPU-s (~3.5 min of wall on 2 cores): too much for the main suite, so they run in their own CI tier,
``.ci/tiers/65-studies.sh`` (DAPO_MCORE_STUDIES=1), and are skipped elsewhere. By hand:
    DAPO_MCORE_STUDIES=1 .venv/bin/python -m pytest -q -m studies tests/test_benchmarks_studies.py
"""

from __future__ import annotations

import os

import pytest
from test_benchmarks_smoke import _run

pytestmark = [
    pytest.mark.studies,
    pytest.mark.skipif(os.environ.get("DAPO_MCORE_STUDIES") != "1",
                       reason="the run-based study smokes run in .ci/tiers/65-studies.sh (set DAPO_MCORE_STUDIES=1)"),
]

# script -> the headline its last line names (each script's docstring says what it is).
STUDIES = {
    "rollout_cost.py": "generated_tokens_per_kept_group_ratio",  # 2 single-process runs
    "bypass.py": "bypass_trainer_time_ratio",  # 2 single-process runs
    "ablation.py": "dapo_minus_grpo_avg_at_k",  # 2 single-process runs, side by side
    "objectives_study.py": "gspo_minus_dapo_avg_at_4",  # 2 single-process runs
    "async_pipeline.py": "async_over_sync_wall",  # 2 runs of 2 ranks (sync, async)
    "staleness_study.py": "fastest_within_noise_speedup",  # 2 runs of 2 ranks (paper_sync, async_k2)
    "rollout_correction_study.py": "best_preset_avg_at_4",  # 1 run of 2 ranks (async)
}


@pytest.fixture
def study_env(monkeypatch, tiny_cache, tmp_path):
    """The session's tiny-base cache for the studies' runs (never the user's), and their temporary run directories
    under this test's tmp_path instead of left behind in the system's /tmp."""
    monkeypatch.setenv("DAPO_MCORE_CACHE", tiny_cache)
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.mark.parametrize("script", sorted(STUDIES))
def test_study_smoke(script, study_env):
    out = _run([f"benchmarks/{script}", "--smoke"])
    assert out.strip().splitlines()[-1].startswith(f"{STUDIES[script]}: ")
