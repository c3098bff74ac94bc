#!/usr/bin/env bash
# The multi-GPU benchmark of the head-parallel layer: one torchrun per world size.
# Usage (on a machine with N GPUs): benchmarks/run_parallel.sh [OUT_DIR] [TOKENS]
# World size 1 is the one-GPU baseline that the layer times are compared with.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
tokens=${2:-32768}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for world in 1 2 4 8; do
    if (( world > gpus )); then break; fi
    echo "== world size $world =="
    torchrun --standalone --nproc-per-node "$world" benchmarks/bench_parallel.py \
        --tokens "$tokens" --out "$out/parallel_w${world}.json"
done
