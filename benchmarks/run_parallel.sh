#!/usr/bin/env bash
# The multi-GPU benchmark of the head-parallel layer (NCCL): one torchrun per world size
# (1, 2, 4, 8, as many as the machine has), then the scaling table.
# Usage (on a machine with N GPUs, from anywhere):
#     benchmarks/run_parallel.sh OUT_DIR [TOKENS_PER_RANK] [CHECKPOINT_DIR]
# TOKENS_PER_RANK: comma-separated, default 4096,32768. CHECKPOINT_DIR: where the
# loading measurement's 2-layer MAGI-2-sized checkpoint lives; written there first
# (python3 -m mhmoe make-checkpoint, 12 GB) if it holds none. Without it, no loading row.
# Writes OUT_DIR/parallel_wW.json per world size and appends rows to
# benchmarks/results.jsonl; exits non-zero if a check against one process failed.
# World size 1 is the baseline the scaling table compares with.
set -euo pipefail
out=${1:?usage: benchmarks/run_parallel.sh OUT_DIR [TOKENS_PER_RANK] [CHECKPOINT_DIR]}
tokens=${2:-4096,32768}
ckpt=${3:-}
# The paths as the caller gave them, before moving to the repository root.
out=$(realpath -m -- "$out")
[[ -n $ckpt ]] && ckpt=$(realpath -m -- "$ckpt")
cd "$(dirname "$0")/.."
mkdir -p "$out"
rm -f "$out"/parallel_w*.json  # the scaling table reads this run's files only
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off (the machines require it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
load=()
if [[ -n $ckpt ]]; then
    if [[ ! -e $ckpt/model.safetensors && ! -e $ckpt/model.safetensors.index.json ]]; then
        python3 -m mhmoe make-checkpoint "$ckpt" --layers 0,1 --experts 256
    fi
    load=(--checkpoint "$ckpt")
fi
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
status=0
for world in 1 2 4 8; do
    if (( world > gpus )); then break; fi
    echo "== world size $world =="
    torchrun --standalone --nproc-per-node "$world" benchmarks/bench_parallel.py \
        --tokens-per-rank "$tokens" --out "$out/parallel_w${world}.json" ${load[@]+"${load[@]}"} \
        || status=1
done
python3 benchmarks/bench_parallel.py --summarize "$out"
exit $status
