#!/usr/bin/env bash
# The GPU check in one command. Two modes, both from the repository root:
#
#   bash benchmarks/gpu_check.sh prepare    on the development machine (it reaches PyPI): puts the cp312 wheels the
#                                           device image lacks into .whl/ and the tiny base model into
#                                           .cache/dapo-mcore/ (both git-ignored; copy them to the GPU machine)
#   bash benchmarks/gpu_check.sh [ARGS]     on the GPU machine (no network needed): installs the wheels into
#                                           /tmp/site, then runs benchmarks/gpu_check.py ARGS under an overall time
#                                           limit, logging to $OUT (gpu_check.log + the files gpu_check.py writes);
#                                           then the tool-code sandbox's smoke beside a GPU job (sandbox_smoke)
#
# docs/gpu-check.md says how to run it and what each section measures.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the device image lacks (its package list: .library/device/KINDS.md). The megatron-core release follows the
# Python the wheels are for: 0.17+ declare Requires-Python >= 3.12, so Python 3.12 (the device image, clusters)
# gets 0.17.1 and Python 3.11 (the CPU machines) 0.16.1; MCORE_VERSION overrides it (the start-up gate accepts
# 0.16.1-0.19.x). Its wheel needs only torch, numpy, packaging (all in the image). zarr 3 (the rollout store,
# imported by every training run) needs numcodecs, donfig and google-crc32c; pyyaml, numpy and typing-extensions
# are in the image.
mcore_for() {  # the megatron-core release for Python major.minor $1
    if [[ -n "${MCORE_VERSION:-}" ]]; then echo "$MCORE_VERSION"
    elif [[ "$(printf '%s\n3.12\n' "$1" | sort -V | head -1)" == "3.12" ]]; then echo 0.17.1
    else echo 0.16.1; fi
}
OTHER_WHEELS=(zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0)
OTHER_GLOBS=(zarr-3.1.6-* numcodecs-0.16.6-* donfig-0.8.1.post1-* google_crc32c-1.9.0-*)
CACHE=.cache/dapo-mcore
LIMIT_S=${GPU_CHECK_LIMIT_S:-270}   # the check budgets 240 s; with install + copy-back one call stays < 300 s

prepare() {
    local py=${PYTHON:-python3}
    local pyver mcore
    pyver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    mcore=$(mcore_for "$pyver")
    echo "prepare: wheels for Python $pyver ($py): megatron-core==$mcore"
    mkdir -p .whl
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        --platform any -d .whl "megatron-core==$mcore" "${OTHER_WHEELS[@]}"
    # The tiny DAPO job starts from a pre-trained tiny base (minutes of CPU to build): copy it, keyed as the
    # runtime keys it, so the GPU machine gets a cache hit.
    DAPO_MCORE_TARGET="$CACHE" "$py" - <<'EOF'
import os, shutil
from pathlib import Path
from dapo_mcore.config import load_config
from dapo_mcore.data.base_model import ensure_base_model

settings = load_config("examples/tiny_cpu.yaml", []).tiny_base
name = f"{settings.task}-{settings.cache_key()}"
target = Path(os.environ["DAPO_MCORE_TARGET"]) / "tiny_base"
user = Path(os.environ.get("DAPO_MCORE_CACHE", Path.home() / ".cache" / "dapo-mcore")) / "tiny_base" / name
if not (target / name / "DONE").is_file():
    if (user / "DONE").is_file():  # already built on this machine: copy it
        shutil.rmtree(target / name, ignore_errors=True)
        shutil.copytree(user, target / name)
    else:
        ensure_base_model(target, settings)
print(f"tiny base: {target / name}")
EOF
    # The tool-code sandbox's smoke (sandbox_smoke) needs bubblewrap, which GPU images rarely hold: carry this
    # machine's binary (it links only libc, libcap and libselinux).
    if command -v bwrap >/dev/null; then mkdir -p "$CACHE/bin" && cp "$(command -v bwrap)" "$CACHE/bin/bwrap"; fi
    ls -la .whl "$CACHE/tiny_base"
    du -sh .whl "$CACHE"
    echo "carry: [\".whl\", \"$CACHE\"]   command: bash benchmarks/gpu_check.sh   timeout_s: 600"
}

run_check() {
    local py=${PYTHON:-python3}
    local out=${OUT:-gpu_check_out}
    mkdir -p "$out"
    local wheels=() pyver
    pyver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    # The megatron-core wheel for the Python this runs under (prepare fetched it for that Python).
    for g in "megatron_core-$(mcore_for "$pyver")-*" "${OTHER_GLOBS[@]}"; do
        local found=()
        mapfile -t found < <(compgen -G ".whl/$g.whl" || true)
        if [[ ${#found[@]} -ne 1 ]]; then
            echo "gpu_check.sh: need exactly one .whl/$g.whl (found ${#found[@]}): run 'bash benchmarks/gpu_check.sh" \
                 "prepare' where pip works, and carry .whl" | tee "$out/gpu_check.log" >&2
            exit 2
        fi
        wheels+=("${found[0]}")
    done
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${wheels[@]}" 2>&1 | tee "$out/gpu_check.log"
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export DAPO_MCORE_CACHE="$PWD/$CACHE" PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    [[ -d "$CACHE/tiny_base" ]] || echo "gpu_check.sh: WARNING: no carried tiny base in $CACHE: the tiny job" \
        "pre-trains one on the device CPU first (minutes)" | tee -a "$out/gpu_check.log"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 \
        | tee -a "$out/gpu_check.log" || true
    set +e
    timeout -k 15 "$LIMIT_S" "$py" benchmarks/gpu_check.py --out "$out" "$@" 2>&1 | tee -a "$out/gpu_check.log"
    local rc=${PIPESTATUS[0]}
    set -e
    [[ $rc -eq 124 || $rc -eq 137 ]] && echo "gpu_check.sh: stopped at the ${LIMIT_S} s limit" \
        | tee -a "$out/gpu_check.log"
    [[ "${GPU_CHECK_SANDBOX:-1}" == 0 ]] || sandbox_smoke "$py" "$out" || { [[ $rc -ne 0 ]] || rc=1; }
    return "$rc"
}

# Hostile tool code in the sandbox beside a CUDA matmul loop (benchmarks/sandbox_beside_gpu.py, ~15 s, at most 50;
# skipped, with a line saying so, where neither the machine nor the carried cache has bubblewrap.
sandbox_smoke() {
    local py=$1 out=$2 bwrap rc
    bwrap=$(command -v bwrap || true)
    [[ -n "$bwrap" || ! -x "$CACHE/bin/bwrap" ]] || bwrap="$PWD/$CACHE/bin/bwrap"
    if [[ -z "$bwrap" ]]; then
        echo "sandbox smoke: SKIPPED: bubblewrap is not installed here and none was carried ($CACHE/bin/bwrap)" \
            | tee -a "$out/gpu_check.log"
        return 0
    fi
    set +e
    timeout -k 5 45 "$py" benchmarks/sandbox_beside_gpu.py --bwrap "$bwrap" 2>&1 | tee "$out/sandbox_smoke.log" \
        | tee -a "$out/gpu_check.log"
    rc=${PIPESTATUS[0]}
    set -e
    return "$rc"
}

if [[ "${1:-}" == "prepare" ]]; then
    prepare
else
    run_check "$@"
fi
