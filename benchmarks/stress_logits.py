"""Repeatability of the router logits kernel: many calls per tile at MAGI-2's full size.

    PYTHONPATH=src python3 benchmarks/stress_logits.py --reps 80 --time --out $OUT/stress.json
    PYTHONPATH=src python3 benchmarks/stress_logits.py --cpu --reps 2   # a dry run

Each call of `triton_logits_route` (logits returned) at S=32768, H=12, E=256, D=256 is
checked against float64 logits (a "bad" element is off by more than 1e-4; an fp32 dot
product of these inputs is off by ~3e-6 at most) and bitwise against the tile's first
call. Every third call first fills 1 GB of freed memory with other bytes, so a read of
stale memory would show. Per tile: the calls with bad elements, the bad elements, the
calls unequal to the first, the worst error; with --time, the median time of logits +
route with counts (`mhmoe.bench.bench_ms`), appended to benchmarks/results.jsonl
unless --no-record. --out writes every tile's row as one JSON file.

This is the check that found the race in the logits kernel and showed its fix
(docs/routing.md, "The race in the logits kernel, and the SASS audit").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

if "--cpu" in sys.argv:  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from mhmoe.bench import append_results, bench_ms, environment, result_row
from mhmoe.config import RouterOptions
from mhmoe.kernels.layout import layout_block_t
from mhmoe.kernels.router_logits import logits_route_config, triton_logits_route
from mhmoe.kernels.tuning import LogitsRouteConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="interpreter dry run at toy sizes")
    ap.add_argument("--reps", type=int, default=30, help="calls per tile")
    ap.add_argument("--time", action="store_true", help="also time each tile")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    ap.add_argument("--no-record", action="store_true",
                    help="do not append the timings to benchmarks/results.jsonl")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    dev = torch.device("cpu" if args.cpu else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("stress_logits.py: no CUDA GPU here (use --cpu for a dry run)")
    H, E, D, K = (2, 32, 32, 2) if args.cpu else (12, 256, 256, 6)
    S = 128 if args.cpu else 32768
    gen = torch.Generator(device=dev).manual_seed(0)
    x_heads = torch.randn(S, H, D, device=dev, generator=gen).to(torch.bfloat16)
    gate = torch.randn(H, E, D, device=dev, generator=gen) * D**-0.5
    bias = torch.randn(H, E, device=dev, generator=gen) * 0.01
    exact = torch.einsum("shd,hed->hse", x_heads.double(), gate.double())
    options = RouterOptions(K, route_scale=4.9)
    count_t = layout_block_t(K)
    base = logits_route_config(dev)
    if args.cpu:
        base = LogitsRouteConfig(block_s=64, block_d=16, num_warps=4, num_stages=1,
                                 from_tile=False, split=True, half_stores=True, block_e=16)
        tiles = {"default": base}
    else:
        rep = dataclasses.replace
        tiles = {
            "default": base,
            "no_halves": rep(base, half_stores=False),
            "stages2": rep(base, num_stages=2),
            "whole_e_8w": rep(base, block_e=None, num_warps=8, num_stages=2,
                              half_stores=False),
            "bd64_st2": rep(base, block_d=64, num_stages=2),
            "fused": rep(base, split=False, block_e=None, half_stores=False, block_s=64,
                         num_warps=4, num_stages=2, tma_store=False, shortlist=False,
                         merged_lists=False),
        }
    env = environment(dev)
    rows, results = [], []
    for name, cfg in tiles.items():
        first = None
        bad_calls = bad_elems = unequal_calls = 0
        worst = 0.0
        for call in range(args.reps):
            if dev.type == "cuda" and call % 3 == 1:
                junk = torch.empty(1 << 28, device=dev, dtype=torch.int32).fill_(call)
                del junk
            out = triton_logits_route(x_heads, gate, options, bias, config=cfg,
                                      return_logits=True, count_block_t=count_t)
            err = (out.logits.double() - exact).abs()
            n_bad = int((err > 1e-4).sum())
            bad_calls += n_bad > 0
            bad_elems += n_bad
            worst = max(worst, err.max().item())
            if first is None:
                first = out
            elif not all(torch.equal(a, b) for a, b in zip(out, first, strict=True)):
                unequal_calls += 1
        row = dict(tile=name, config=dataclasses.asdict(cfg), reps=args.reps,
                   bad_calls=bad_calls, bad_elems=bad_elems, unequal_calls=unequal_calls,
                   worst_abs_err=worst)
        if args.time and dev.type == "cuda":
            row["logits_route_counting_ms"] = bench_ms(
                lambda cfg=cfg: triton_logits_route(x_heads, gate, options, bias, config=cfg,
                                                    count_block_t=count_t),
                warmup=50, rep=300)
            results.append(result_row(
                "logits_route_counting", f"stress:{name}", S, row["logits_route_counting_ms"],
                env=env, script="benchmarks/stress_logits.py", config=row["config"],
                reps=args.reps, bad_calls=bad_calls, unequal_calls=unequal_calls))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if results and not args.no_record:
        print(f"rows appended to {append_results(results)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "S": S, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
