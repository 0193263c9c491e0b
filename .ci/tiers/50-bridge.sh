#!/usr/bin/env bash
# The Megatron-Bridge tier: dapo-mcore and NVIDIA Megatron-Bridge, what cluster users of Megatron convert
# checkpoints with, read each other's checkpoints, Bridge running live. Two virtualenvs inside the checkout:
#   .venv-bridge       Bridge 0.6.2 on megatron-core 0.19.2: both declare
#                      Requires-Python >= 3.12 and there is no CPU torch wheel for cp312, so they go into Python 3.11
#                      with --no-deps --ignore-requires-python, beside the few packages `import megatron.bridge` and
#                      its training (save/load) modules need; transformers 5.12.1 is Bridge's cap. Bridge runs on CPU
#                      through tests/bridge/bridge_cpu.py, which patches nothing on disk.
#   .venv              the project as users install it (megatron-core 0.16.1), which runs pytest and dapo-mcore: the
#                      main suite's (.ci/run builds it first), built here when the tier runs alone.
# tests/bridge_live is not collected by the main suite (tests/conftest.py); it is named here explicitly.
# ci-beside-main: Bridge's own virtualenv, the main suite's .venv read only, its own tmp dirs: it shares nothing
# with the main suite that either changes. Run after it the whole run waits on it (~4-5 min).
set -euo pipefail
source .ci/lib.sh

BRIDGE=0.6.2
MCORE=0.19.2
install() {
    ci_venv .venv-bridge torch==2.13.0 transformers==5.12.1 omegaconf "hydra-core==1.3.*" einops \
        nvidia-modelopt==0.47.0 requests datasets "megatron-energon==7.*" tensorboard safetensors pyyaml
    ci_pip .venv-bridge --no-deps --ignore-requires-python "megatron-core==${MCORE}" triton "megatron-bridge==${BRIDGE}"
    ci_main_venv
}
ci_install install
versions=$(.venv-bridge/bin/python tests/bridge/bridge_cpu.py versions 2>/dev/null | grep '^bridge_cpu:')
echo "::: bridge: ${versions}"
[[ "$versions" == *"megatron-bridge ${BRIDGE} megatron-core ${MCORE} "* ]] \
    || { echo "bridge: expected megatron-bridge ${BRIDGE} on megatron-core ${MCORE}, got '${versions}'" >&2; exit 1; }
DAPO_MCORE_CI_NO_SKIPS=1 DAPO_MCORE_BRIDGE_PYTHON="$PWD/.venv-bridge/bin/python" \
    .venv/bin/python -m pytest -q -p no:cacheprovider tests/bridge_live/test_bridge_live.py
