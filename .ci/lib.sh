# Shared by .ci/run and the tier scripts (source it; it defines functions only).
#
# ci_step NAME CMD...   runs CMD, prints its wall time, and records "NAME<TAB>seconds<TAB>rc" in $CI_STEPS (the
#                       summary at the end of .ci/run lists it); returns CMD's exit status.
# ci_venv DIR PIP_ARGS... creates the virtualenv DIR (inside the checkout; add DIR/ to .gitignore) and installs
#                       PIP_ARGS into it with uv, as one timed step (ci_uv_install below; pip if uv fails).
# ci_pip DIR PIP_ARGS...  pip's `install PIP_ARGS` into the virtualenv DIR, by this machine's pip from outside it
#                       (`pip --python`; for what uv does not do: --ignore-requires-python), as one timed step.
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
    ci_step "install ${dir}" ci_uv_install "$dir" "$@"
}

ci_pip() {
    local dir=$1
    shift
    ci_step "install into ${dir}: $*" _ci_pip "$dir" install -q "$@"
}
_ci_pip() {
    local dir=$1
    shift
    PIP_CACHE_DIR="$PWD/.cache/pip" python3 -m pip --python "$dir/bin/python" "$@"
}

# ci_uv_install DIR PIP_ARGS...: a new virtualenv DIR (no pip inside: ci_pip installs from outside) and PIP_ARGS
# installed into it by uv. A tier's virtualenv costs uv a tenth of pip's CPU time (pip resolves in Python and
# compiles every module it installs; uv resolves natively, hard-links from its cache, so a package that several tiers
# install, torch above all, is unpacked once, and compiles nothing: .ci/run lets Python cache what is imported). uv
# reads none of pip's configuration, so it gets pip's own (ci_uv_flags). Where uv fails, pip installs instead.
ci_uv_install() {
    local dir=$1 uv flags=()
    shift
    rm -rf "$dir"
    if uv=$(ci_uv) && mapfile -t flags < <(ci_uv_flags) && python3 -m venv --without-pip "$dir" &&
        UV_CACHE_DIR="$PWD/.cache/uv-cache" "$uv" pip install -q --python "$dir/bin/python" \
            --index-strategy unsafe-best-match "${flags[@]}" "$@"; then
        return 0
    fi
    echo "ci_uv_install: uv could not install ${dir}; pip installs it instead" >&2
    rm -rf "$dir"
    python3 -m venv --without-pip "$dir" && _ci_pip "$dir" install -q "$@"
}

# ci_uv_uninstall DIR PACKAGE...: removes the packages from the virtualenv DIR (uv; pip where uv is missing).
ci_uv_uninstall() {
    local dir=$1 uv
    shift
    if uv=$(ci_uv); then "$uv" pip uninstall -q --python "$dir/bin/python" "$@"; else _ci_pip "$dir" uninstall -q -y "$@"; fi
}

# ci_uv: the path of uv (CI_UV_VERSION, pip-installed once into .cache/uv/, git-ignored).
CI_UV_VERSION=0.13.9
ci_uv() {
    local home="$PWD/.cache/uv"
    if [[ ! -x "$home/bin/uv" ]]; then
        rm -rf "$home.new" && python3 -m venv "$home.new" &&
            PIP_CACHE_DIR="$PWD/.cache/pip" "$home.new/bin/pip" install -q "uv==${CI_UV_VERSION}" >&2 &&
            rm -rf "$home" && mv "$home.new" "$home" || return 1
    fi
    echo "$home/bin/uv"
}

# ci_uv_flags: pip's configuration on this machine (its config files and PIP_* variables, as `pip config list`
# prints them) as uv's flags, one per line: find-links (the local CPU torch wheel), index-url, extra-index-url and
# constraint; with --index-strategy unsafe-best-match (ci_uv_install) uv then picks among them as pip does.
ci_uv_flags() {
    python3 -m pip config list 2>/dev/null | python3 -c '
import shlex, sys
flags = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "constraint": "--constraint"}
seen, index_url = [], None
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    name = key.rsplit(".", 1)[-1]
    if name not in flags or not value:
        continue
    for item in " ".join(shlex.split(value)).split():
        if name == "index-url":
            index_url = item if key.startswith(":env:") or index_url is None else index_url
        elif (name, item) not in seen:
            seen.append((name, item))
if index_url:
    print("--index-url"); print(index_url)
for name, item in seen:
    print(flags[name]); print(item)
'
}

ci_main_venv() {  # with pip, as the README installs it
    [[ -x .venv/bin/python ]] || ci_step "install .venv" bash -c \
        'python3 -m venv .venv && PIP_CACHE_DIR="$PWD/.cache/pip" .venv/bin/pip install -q torch==2.13.0 -e ".[dev]"'
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
