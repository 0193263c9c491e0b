#!/usr/bin/env bash
# The newest megatron-core: clusters and NGC containers run Python 3.12 with megatron-core 0.17-0.19;
# the main suite runs 0.16.1. megatron-core 0.17+ declare Requires-Python >= 3.12 and no CPU torch wheel for cp312 is
# on PyPI, so this tier installs 0.19.2 into a Python 3.11 virtualenv with --no-deps --ignore-requires-python (with its
# dependencies it tries to build numpy from source) plus triton, which it imports at module load.
# It prints the megatron-core version it runs, then the tiny e2e run, the actor's
# log-prob/entropy/parity tests, the conversion round trip and the reading of Megatron-Bridge's own checkpoints
# against it. The tiny-base cache is the main suite's
# (.ci/run exports it): the base is pre-trained with 0.16.1's model code, which 0.19.2 loads like any checkpoint.
# ci-beside-main: its own virtualenv; the tiny-base cache it reads is built whole-or-absent by whichever run
# needs it first; its own tmp dirs. Run after the main suite the whole run waits on it.
set -euo pipefail
source .ci/lib.sh

MCORE=0.19.2
install() {
    ci_venv .venv-mcore-newest torch==2.13.0 -e ".[dev]"
    ci_pip .venv-mcore-newest --no-deps --ignore-requires-python "megatron-core==${MCORE}" triton
}
ci_install install
version=$(.venv-mcore-newest/bin/python -c 'import megatron.core as m; print(m.__version__)' 2>/dev/null | tail -1)
echo "::: mcore-newest: megatron-core ${version}"
[[ "${version%%+*}" == "$MCORE" ]] || { echo "mcore-newest: expected megatron-core ${MCORE}, got '${version}'" >&2; exit 1; }
DAPO_MCORE_CI_NO_SKIPS=1 .venv-mcore-newest/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_e2e_tiny.py::test_tiny_run_learns_and_writes_every_artifact \
    tests/test_actor_logprobs.py tests/test_actor_entropy.py tests/test_actor_parity.py \
    tests/test_conversion_roundtrip.py tests/test_gpu_stack.py \
    tests/test_bridge_interop.py::test_bridge_written_checkpoint_converts_back_bit_exactly
