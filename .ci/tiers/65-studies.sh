#!/usr/bin/env bash
# The run-based benchmark studies in their --smoke mode (tests/test_benchmarks_studies.py): rollout_cost, bypass,
# ablation, objectives_study (2 single-process CLI training runs each), async_pipeline, staleness_study (2 runs of 2
# gloo ranks each) and rollout_correction_study (1 run of 2 ranks), one after the other, each script in a fresh
# process; each must exit 0 (a study exits non-zero when any of its runs failed) and end with its headline. The main
# suite skips them (~160 CPU-s is more than its budget has room for); here any skip fails the tier.
# Measured on a 2-core machine at load 8-12, the tiny bases already cached: CPU-s per study (user + system) and
# headline: rollout_cost 16 (generated_tokens_per_kept_group_ratio), bypass 18 (bypass_trainer_time_ratio), ablation
# 25 (dapo_minus_grpo_avg_at_k), objectives_study 20 (gspo_minus_dapo_avg_at_4), async_pipeline 34
# (async_over_sync_wall), staleness_study 27 (fastest_within_noise_speedup), rollout_correction_study 16
# (best_preset_avg_at_4): ~157 CPU-s in ~206 s of wall. The tier through .ci/run (`CI_MAIN=0 CI_TIERS='65-*'`),
# pytest included: 163 CPU-s in 372 s of wall at load 9-17 (0.44 cores on average); 175 CPU-s in 620 s at load 16-27.
# ci-beside-main-at-once: one core's worth at most (the runs go one at a time; a 2-rank run is 2 processes that
# mostly wait on each other), it needs only the main .venv and installs nothing, and it shares nothing with the main
# suite: its run directories are temporary ones of its own, its torchrun jobs take free ports, and the tiny-base
# cache it shares is built whole-or-absent.
set -euo pipefail
source .ci/lib.sh

ci_main_venv
DAPO_MCORE_STUDIES=1 DAPO_MCORE_CI_NO_SKIPS=1 .venv/bin/python -m pytest -q -m studies tests/test_benchmarks_studies.py
