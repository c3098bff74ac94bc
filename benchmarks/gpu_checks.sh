#!/usr/bin/env bash
# The GPU test suite (tests/test_gpu.py) in one device call, ending with a summary line.
# Usage on the GPU machine, from the repository root:
#     benchmarks/gpu_checks.sh OUT_DIR [PYTEST_ARGS...]     e.g. -k "not int32"
# Writes OUT_DIR/gpu.txt (the card, its clocks and memory, the workers),
# OUT_DIR/gpu_tests.log (pytest -v)
# and prints, last, "GPU suite: P passed, F failed, E errors, S skipped, N not run of T".
#
# Why several workers: on a fresh machine most of the suite's time is Triton and
# Gluon compiling the kernels at MAGI-2's tiles, one process after another; pytest-xdist
# workers compile (and run) in parallel on the one GPU. MHMOE_GPU_WORKERS sets how many.
# The default follows the card's memory: each worker holds its own 6 GB MAGI-2 layer and
# workspaces, up to 34.7 GiB at its peak (the out-of-memory reports of 2026-12-06), so 3
# on a card of 100 GiB or more (the H200) and 2 below (on an 80 GB H100, three workers ran
# out of memory in 7 of 73 tests, which passed on one worker). An unreadable memory size
# counts as below. MHMOE_GPU_TIMEOUT bounds the whole run (default 540 s, inside a 600 s call):
# where it strikes, the summary still counts what ran and what did not.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_checks.sh OUT_DIR [PYTEST_ARGS...]}
shift
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null \
    | head -n 1 | tr -d ' \r')
[[ $mem_mib =~ ^[0-9]+$ ]] || mem_mib=0
workers=${MHMOE_GPU_WORKERS:-$(( mem_mib >= 102400 ? 3 : 2 ))}
limit=${MHMOE_GPU_TIMEOUT:-540}
log="$out/gpu_tests.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,memory.total \
    --format=csv | tee "$out/gpu.txt"
echo "workers: $workers" | tee -a "$out/gpu.txt"
total=$(python3 -m pytest --collect-only -q -p no:cacheprovider tests/test_gpu.py "$@" 2>/dev/null \
    | grep -c '::')
timeout "$limit" python3 -m pytest -v -p no:cacheprovider -n "$workers" --durations=15 \
    tests/test_gpu.py "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# xdist's -v progress lines, "[gw1] [ 40%] PASSED tests/...": one per test outcome (the
# short summary at the end repeats failures and skips, so it is not counted).
count() { grep -cE "^\[gw[0-9]+\] \[ *[0-9]+%\] $1 " "$log"; }
passed=$(count PASSED) failed=$(count FAILED) errors=$(count ERROR) skipped=$(count SKIPPED)
missing=$((total - passed - failed - errors - skipped))
(( rc == 124 )) && echo "gpu_checks: stopped by the ${limit} s limit"
echo "GPU suite: $passed passed, $failed failed, $errors errors, $skipped skipped," \
     "$missing not run of $total"
(( failed == 0 && errors == 0 && missing == 0 && total > 0 ))
