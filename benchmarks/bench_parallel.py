"""Head-parallel layer on several GPUs (NCCL): all-to-all bandwidth and layer time.

Run one world size per torchrun (benchmarks/run_parallel.sh loops over them):

    torchrun --standalone --nproc-per-node 8 benchmarks/bench_parallel.py \
        --tokens 32768 --out results/parallel_w8.json

Per rank it reports dispatch / experts / undispatch / whole-layer times, the
bytes one dispatch sends, and, for the same bytes, a plain NCCL
all_to_all_single, so the achieved bandwidth of our exchange can be compared
with what NCCL gives. The layer output is checked against the one-GPU layer on
the same tokens. `--tokens` is the total over all ranks (split unevenly).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mhmoe import MAGI2_PREVIEW
from mhmoe.bench import environment
from mhmoe.launch import measure_rank


def plain_alltoall_ms(nbytes: int, device: torch.device, runs: int) -> float:
    """Median time of an NCCL all_to_all_single moving `nbytes` from this rank, even splits."""
    world = dist.get_world_size()
    per_peer = max(1, nbytes // 2 // world)  # bf16 elements per peer
    send = torch.randn(per_peer * world, device=device).to(torch.bfloat16)
    recv = torch.empty_like(send)
    times = []
    for _ in range(runs + 2):
        torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times = sorted(times[2:])
    return times[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens over all ranks")
    parser.add_argument("--experts", type=int, default=256, help="experts per head")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON path (written by rank 0)")
    args = parser.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    config = MAGI2_PREVIEW.replace(num_experts=args.experts,
                                   top_k=min(MAGI2_PREVIEW.top_k, args.experts))
    point = measure_rank(config, args.tokens, seed=0, runs=args.runs, device=device)
    plain = plain_alltoall_ms(point.alltoall_bytes, device, args.runs)
    row = asdict(point) | {"plain_alltoall_ms": plain,
                           "dispatch_GBps": point.alltoall_bytes / point.dispatch_ms / 1e6,
                           "plain_GBps": point.alltoall_bytes / plain / 1e6}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print(f"{'rank':>4} {'tokens':>7} {'disp ms':>8} {'exp ms':>8} {'undisp ms':>9} "
              f"{'layer ms':>9} {'a2a MB':>8} {'GB/s':>7} {'NCCL GB/s':>9} {'max diff':>9}")
        for r in rows:
            print(f"{r['rank']:>4} {r['tokens']:>7} {r['dispatch_ms']:>8.3f} "
                  f"{r['experts_ms']:>8.3f} {r['undispatch_ms']:>9.3f} {r['layer_ms']:>9.3f} "
                  f"{r['alltoall_bytes'] / 1e6:>8.2f} {r['dispatch_GBps']:>7.1f} "
                  f"{r['plain_GBps']:>9.1f} {r['max_abs_diff']:>9.2e}")
        if args.out:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"environment": environment(device),
                                       "config": json.loads(config.to_json()),
                                       "world": dist.get_world_size(), "rows": rows},
                                      indent=2) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
