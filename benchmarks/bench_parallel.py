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
from mhmoe.launch import measure_rank, split_tokens
from mhmoe.parallel import HeadPartition


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_alltoall_ms(counts: list[int], width: int, device: torch.device, runs: int) -> float:
    """Median time of a bare all_to_all_single with the splits of one dispatch.

    Rank r sends counts[r] rows of `width` bf16 values to every rank and gets
    counts[j] rows from rank j: the bytes of our dispatch, without its reshapes.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    send = torch.randn(world * counts[rank], width, device=device).to(torch.bfloat16)
    recv = torch.empty(sum(counts), width, device=device, dtype=torch.bfloat16)
    times = []
    for _ in range(runs + 2):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send, counts, [counts[rank]] * world)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times = sorted(times[2:])
    return times[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens over all ranks")
    parser.add_argument("--experts", type=int, default=256, help="experts per head")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON path (written by rank 0)")
    parser.add_argument("--cpu", action="store_true",
                        help="gloo on CPU processes (a dry run of this script without GPUs)")
    args = parser.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    config = MAGI2_PREVIEW.replace(num_experts=args.experts,
                                   top_k=min(MAGI2_PREVIEW.top_k, args.experts))
    point = measure_rank(config, args.tokens, seed=0, runs=args.runs, device=device)
    partition = HeadPartition(config.num_heads, dist.get_world_size(), dist.get_rank())
    plain = plain_alltoall_ms(split_tokens(args.tokens, dist.get_world_size()),
                              partition.local_heads * config.head_dim, device, args.runs)
    row = asdict(point) | {"plain_alltoall_ms": plain,
                           "dispatch_GBps": point.alltoall_bytes / point.dispatch_ms / 1e6,
                           "plain_GBps": point.alltoall_bytes / plain / 1e6}
    # (bytes this rank sends: its tokens x all padded heads; GB/s per rank, send side)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print(f"{'rank':>4} {'tokens':>7} {'disp ms':>8} {'exp ms':>8} {'undisp ms':>9} "
              f"{'layer ms':>9} {'a2a MB':>8} {'GB/s':>7} {'bare GB/s':>9} {'max diff':>9}")
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
    # Every rank leaves together: a gloo rank that tore its group down while rank 0 was
    # still writing aborted once at exit ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown. With the group already destroyed behind a
    # barrier, a gloo rank still aborted now and then at exit ("terminate called without
    # an active exception", SIGABRT, under the CPU dry run in the test suite): a C++
    # thread of torch.distributed destroyed while still joinable during finalization.
    # Everything this script writes is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
