#!/usr/bin/env bash
# One command for a CUDA machine: set up a venv, run every CUDA-registered suite and the KV IO
# benchmark on the GPU, and print one summary, all within GPU_CHECK_BUDGET_S (default 570 s, so
# the summary is out within 10 minutes).
#
#   bash scripts/ci/gpu_check.sh
#
# Setup, fastest first:
#   - a python3 whose torch already sees a GPU (a CUDA image): the venv reuses it
#     (--system-site-packages), and the project is used from python/ (PYTHONPATH, no build);
#   - else torch==$TORCH_VERSION from PyPI (the default Linux wheel is the CUDA build).
# Either way the project's test/nixl extras are added when pip can reach them (offline machines
# go on without: no CUDA suite needs NIXL, fastapi or moto). WHEEL_DIR=dir installs from local
# wheels only (pip --no-index --find-links dir).
#
# Environment: PYTHON (python3), GPU_CHECK_VENV (.cache/gpu_check/venv), GPU_CHECK_LOGS (.cache/gpu_check/logs),
# GPU_CHECK_BUDGET_S (570), TORCH_VERSION (2.13.0), WHEEL_DIR, SGLANG_HYPOTHESIS_SEED.
# Exit status: 0 when every step passed or was skipped for a stated reason, else 1.
set -uo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-.cache/gpu_check/venv}
LOGS=${GPU_CHECK_LOGS:-.cache/gpu_check/logs}
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
mkdir -p "$LOGS"
SUMMARY=()
FAILED=0
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the CUDA suites test the compiled kernels

left() { echo $((DEADLINE - $(date +%s))); }

# step NAME MAX_S CMD...: run CMD with a timeout of min(MAX_S, time left), log to $LOGS/NAME.log
step() {
    local name=$1 max=$2
    shift 2
    local t=$(left)
    ((t > max)) && t=$max
    if ((t < 10)); then
        SUMMARY+=("$(printf '%-28s %-8s %s' "$name" "SKIP" "no time left in the ${BUDGET_S}s budget")")
        return 0
    fi
    local t0=$(date +%s) rc=0
    echo "=== $name (timeout ${t}s)"
    timeout --kill-after=10 "$t" "$@" 2>&1 | tee "$LOGS/$name.log" || rc=${PIPESTATUS[0]}
    local took=$(($(date +%s) - t0)) status=PASS note=""
    if ((rc == 124 || rc == 137)); then
        status=TIMEOUT note="killed after ${t}s"
    elif ((rc != 0)); then
        status=FAIL note="exit $rc"
    fi
    local last
    last=$(grep -E '^==========|^total:' "$LOGS/$name.log" | tail -n 2 | tr '\n' ' ')
    [[ $status != PASS ]] && FAILED=1
    LAST_STATUS=$status
    SUMMARY+=("$(printf '%-28s %-8s %4ss  %s %s' "$name" "$status" "$took" "$note" "$last")")
    while IFS= read -r line; do SUMMARY+=("    $line"); done < <(grep -E '^FAILED .*; replay: ' "$LOGS/$name.log" | head -n 20)
    return 0
}

skip() { SUMMARY+=("$(printf '%-28s %-8s %s' "$1" "SKIP" "$2")"); }

print_summary() {
    echo
    echo "================ gpu_check summary ($(($(date +%s) - START))s of ${BUDGET_S}s; logs in $LOGS) ================"
    for line in "${SUMMARY[@]}"; do echo "$line"; done
    [[ -f "$LOGS/bench.json" ]] && echo "benchmark records: $LOGS/bench.json"
    echo "gpu_check: $([[ $FAILED == 0 ]] && echo OK || echo FAILED)"
}
trap print_summary EXIT

# ---- environment ----------------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi -L failed); this script is for CUDA machines" >&2
    FAILED=1
    exit 1
fi
nvidia-smi -L | tee "$LOGS/gpus.txt"
NUM_GPUS=$(nvidia-smi -L | grep -c '^GPU ')

setup() {  # run as `bash -c setup` under timeout: reads only exported variables
    local pip_args=(-q)
    [[ -n ${WHEEL_DIR:-} ]] && pip_args+=(--no-index --find-links "$WHEEL_DIR")
    if [[ ! -x $VENV/bin/python ]]; then
        if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
            echo "reusing $("$PYTHON" -c 'import torch; print("torch", torch.__version__)') from $PYTHON"
            "$PYTHON" -m venv --system-site-packages "$VENV" || return 1
        else
            "$PYTHON" -m venv "$VENV" || return 1
            "$VENV/bin/python" -m pip install "${pip_args[@]}" "torch==$TORCH_VERSION" || return 1
        fi
    fi
    # the project itself is used from python/ (PYTHONPATH), so nothing is built; the rest is
    # installed where reachable, and an offline machine goes on with what it has
    "$VENV/bin/python" -m pip install "${pip_args[@]}" pytest hypothesis psutil requests \
        || echo "note: could not install the test packages; using what is installed"
    { "$VENV/bin/python" -m pip install "${pip_args[@]}" nixl-cu12==1.5.1 \
        && "$VENV/bin/python" -m pip install "${pip_args[@]}" --no-deps nixl==1.5.1; } \
        || echo "note: NIXL not installed (no CUDA suite needs it)"
    "$VENV/bin/python" - <<'PYEOF'
import sglang, torch, triton
assert torch.cuda.is_available(), "torch in the venv does not see a GPU"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
PYEOF
}
export -f setup
export PYTHON VENV TORCH_VERSION WHEEL_DIR="${WHEEL_DIR:-}"
LAST_STATUS=""
step setup 300 bash -c setup
PY=$VENV/bin/python
if [[ $LAST_STATUS != PASS ]]; then
    skip "suites and benchmark" "not run: setup failed (see $LOGS/setup.log)"
    exit 1
fi

# ---- suites ---------------------------------------------------------------------------------
export SGLANG_HYPOTHESIS_SEED=${SGLANG_HYPOTHESIS_SEED:-$((RANDOM << 15 | RANDOM))}
echo "hypothesis seed: SGLANG_HYPOTHESIS_SEED=$SGLANG_HYPOTHESIS_SEED"
run_suite() {
    local suite=$1 need=$2
    if ((NUM_GPUS < need)); then
        skip "$suite" "needs $need GPUs, found $NUM_GPUS"
        return
    fi
    if ! "$PY" test/run_suite.py --hw cuda --suite "$suite" --list >"$LOGS/$suite.list" 2>&1; then
        SUMMARY+=("$(printf '%-28s %-8s %s' "$suite" "FAIL" "$(tail -n 1 "$LOGS/$suite.list")")")
        FAILED=1
        return
    fi
    if grep -q '^0 files' "$LOGS/$suite.list"; then
        skip "$suite" "no test file is registered for it"
        return
    fi
    step "$suite" 400 "$PY" test/run_suite.py --hw cuda --suite "$suite" --timeout-per-file 240
}
run_suite per-commit-1-gpu 1
run_suite per-commit-2-gpu 2

# ---- benchmark ------------------------------------------------------------------------------
if "$PY" scripts/bench/bench_kvcacheio.py --help 2>/dev/null | grep -q -- '--device'; then
    step bench_kvcacheio 150 "$PY" scripts/bench/bench_kvcacheio.py --device cuda --repeat 3 --json "$LOGS/bench.json"
else
    skip bench_kvcacheio "scripts/bench/bench_kvcacheio.py has no --device flag"
    FAILED=1
fi

run_suite nightly-1-gpu 1  # last: whatever time is left
exit $FAILED
