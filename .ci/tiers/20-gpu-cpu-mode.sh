#!/usr/bin/env bash
# The gpu-marked tests in their CPU mode (DAPO_MCORE_GPU_TESTS_ON_CPU=1: gloo and the CPU layers instead of NCCL and
# CUDA, the same assertions), so the code the GPU check depends on cannot rot between the sessions that get a GPU.
# The main suite skips them ("needs CUDA"); here any skip fails the tier. They run in the main suite's .venv (built
# by .ci/run before the tiers; built here when the tier runs alone). Only tests/test_gpu_*.py, less the two files
# with no CPU mode: the vLLM GPU test (tests/test_rollout_vllm.py, not matched) and tests/test_gpu_paths.py (CUDA
# streams and vLLM's CUDA kernels; the prepared GPU check runs it).
# ci-beside-main-at-once: ~25 CPU-s on gloo with free ports and the main .venv alone; it shares nothing with the
# main suite, so it runs first in the lane that starts with the suite instead of after it.
set -euo pipefail
source .ci/lib.sh

ci_main_venv
files=()
for f in tests/test_gpu_*.py; do [[ "$f" == tests/test_gpu_paths.py ]] || files+=("$f"); done
DAPO_MCORE_GPU_TESTS_ON_CPU=1 DAPO_MCORE_CI_NO_SKIPS=1 .venv/bin/python -m pytest -q -m gpu "${files[@]}"
