# Shared by .ci/run and the tier scripts (source it; it defines functions only).
#
# ci_step NAME CMD...   runs CMD, prints its wall time, and records "NAME<TAB>seconds<TAB>rc" in $CI_STEPS (the
#                       summary at the end of .ci/run lists it); returns CMD's exit status.
# ci_venv DIR PIP_ARGS... creates the virtualenv DIR (inside the checkout; add DIR/ to .gitignore) and pip-installs
#                       PIP_ARGS into it, with pip's download cache under .cache/pip (git-ignored), as one timed step.

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
