#!/usr/bin/env bash
# Every GPU-side check and benchmark of the library in one device call.
# Usage on the GPU machine, from the repository root: benchmarks/gpu_checks.sh OUT_DIR
# (set MHMOE_COMMIT=<hash> where the tree was copied without .git: results record it)
# Writes OUT_DIR/{gpu_tests.log,layer.json,demo.log,bench.json,bench.png}.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_checks.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
timeout 330 python3 -m pytest -q -p no:cacheprovider --durations=0 tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log" \
    || status=1
timeout 150 python3 benchmarks/bench_layer.py --out "$out/layer.json" 2>&1 | tee "$out/layer.log" || status=1
timeout 60 python3 -m mhmoe demo 2>&1 | tee "$out/demo.log" || status=1
timeout 60 python3 -m mhmoe bench --paths triton --out "$out/bench.json" 2>&1 | tee "$out/bench.log" \
    || status=1
exit $status
