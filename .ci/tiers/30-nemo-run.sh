#!/usr/bin/env bash
# The nemo-run tier: examples/nemo_run/launch.py end to end (tests/test_nemo_run_launch.py): the SlurmExecutor's
# sbatch for the 32B recipe (dry run), LocalExecutor running a gloo probe and the tiny trainer under torchrun, and
# SlurmExecutor jobs on the local single-node Slurm (requeue on exit 75 only, the pre-emption signal's checkpoint and
# resume, the tiny trainer on 2 tasks). nemo-run 0.11.1 imports only with leptonai 0.27.3 (the `launch` extra), so it
# gets its own virtualenv; any skip (nemo-run missing, no Slurm, not root) fails the tier.
set -euo pipefail
source .ci/lib.sh

install() {
    if ! command -v sbatch >/dev/null 2>&1; then  # .ci/run's apt step installs it; this tier may run alone
        ci_step "install slurm" bash -c 'bash slurm/local/install.sh >.cache/ci-slurm-install.out 2>&1 ||
                                         { tail -n 30 .cache/ci-slurm-install.out; exit 1; }'
    fi
    ci_venv .venv-nemo torch==2.13.0 -e ".[dev,launch]"
}
ci_install install
DAPO_MCORE_CI_NO_SKIPS=1 .venv-nemo/bin/python -m pytest -q tests/test_nemo_run_launch.py
