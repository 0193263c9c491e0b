#!/usr/bin/env bash
# The second half of the recipe rehearsals (60-rehearse.sh's REHEARSE_B: the MoE, LoRA and tool-use recipes), a tier
# of its own so that neither half passes the per-tier limit. Same rules as 60-rehearse.sh.
# ci-beside-main-at-once: like 60-rehearse.sh, it shares nothing with the main suite (its own run dirs under .cache/rehearse,
# its own bases under the cache's rehearse/ folder, free ports).
set -euo pipefail
export DAPO_MCORE_CI_NO_SKIPS=1  # as in 60-rehearse.sh: nothing here may be skipped
REHEARSE_PART=b exec bash .ci/tiers/60-rehearse.sh
