#!/usr/bin/env bash
# Install the single-node Slurm used by the tests (Debian/Ubuntu, as root).
# Slurm 22.05 on Debian 12; shellcheck is for the script lint test; bubblewrap for the tool-code sandbox's tests
# (.ci/run's apt step runs this script).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y slurmctld slurmd slurm-client munge shellcheck bubblewrap
