# Shared by .ci/run and the tier scripts (source it; it defines functions only).
#
# ci_step NAME CMD...   runs CMD, prints its wall time, and records "NAME<TAB>seconds<TAB>rc" in $CI_STEPS (the
#                       summary at the end of .ci/run lists it); returns CMD's exit status.
# ci_venv DIR PIP_ARGS... creates the virtualenv DIR (inside the checkout; add DIR/ to .gitignore) and pip-installs
#                       PIP_ARGS into it, with pip's download cache under .cache/pip (git-ignored), as one timed step.
# ci_main_venv          the main suite's .venv (the README's install), built as a timed step only where it is missing
#                       (a tier run alone); .ci/run builds it before any tier.
# ci_install FUNC       (below) a tier's install steps, which .ci/run may run ahead, beside the main suite.

ci_step() {
    local name=$1 start rc
    shift
    start=$(date +%s)
    echo "::: ${name}: $*"
    "$@" && rc=0 || rc=$?
    local took=$(( $(date +%s) - start ))
    echo "::: ${name}: exit ${rc} after ${took} s"
    if [[ -n "${CI_STEPS:-}" ]]; then
        printf '%s\t%s\t%s\n' "$name" "$took" "$rc" >>"$CI_STEPS"
    fi
    return "$rc"
}

ci_venv() {
    local dir=$1
    shift
    ci_step "install ${dir}" bash -c 'python3 -m venv "$0" && PIP_CACHE_DIR="$PWD/.cache/pip" "$0/bin/pip" install -q "$@"' \
        "$dir" "$@"
}

ci_main_venv() {
    [[ -x .venv/bin/python ]] || ci_venv .venv torch==2.13.0 -e ".[dev]"
}

# ci_install FUNC       a tier's install steps, gathered in the function FUNC, run where the tier stands; but
#                       - with CI_INSTALL_ONLY=1 (.ci/run's install-tiers step, in the background while the main suite
#                         runs): runs FUNC, records that it passed in $CI_INSTALLED, and ends the tier script there;
#                       - when that step already installed this tier in this CI run ($CI_INSTALLED/<tier> exists;
#                         .ci/run sets CI_INSTALLED): says so and returns. A tier run on its own always installs.
ci_install() {
    local func=$1 tier
    tier=$(basename "$0" .sh)
    if [[ "${CI_INSTALL_ONLY:-0}" == 1 ]]; then
        [[ -n "${CI_INSTALLED:-}" ]] || { echo "ci_install: CI_INSTALL_ONLY=1 needs CI_INSTALLED" >&2; exit 1; }
        "$func"
        mkdir -p "$CI_INSTALLED" && touch "$CI_INSTALLED/$tier"
        exit 0
    fi
    if [[ -n "${CI_INSTALLED:-}" && -f "$CI_INSTALLED/$tier" ]]; then
        echo "::: ${tier}: installed earlier in this run by .ci/run's install-tiers step (its time is listed there)"
        return 0
    fi
    "$func"
}
