"""Experiment (NOTES.md routing v8, not kept): the split logits kernel of head chunk c + 1
on one stream while the route kernel of chunk c runs on another, chunks of G heads.

    PYTHONPATH=src python3 benchmarks/experiments/head_chunk_streams.py --out $OUT/streams.json
    PYTHONPATH=src python3 benchmarks/experiments/head_chunk_streams.py --cpu   # dry run

Calls the kernels of `mhmoe.kernels.routing` directly (launch arguments as of routing v8).
Rows: per G and stream priority, whether probs, indices and counts equal the default path's
bitwise, and the times (do_bench, eager and CUDA-graph replay) of logits + route with
counts, and of that plus the layout from the counts. The recorded run
(results/routing_v8_head_chunk_streams.json) ran before the race fix of routing v8 with
3D x boxes, which is why its `equal` flags are false; its times stand.
"""
import argparse
import json
import os
import sys

if "--cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from mhmoe.bench import copy_bandwidth_tbs, environment, matmul_peak_tflops
from mhmoe.kernels import routing as R

ap = argparse.ArgumentParser()
ap.add_argument("--cpu", action="store_true")
ap.add_argument("--out", default=None)
ap.add_argument("--S", type=int, default=32768)
args = ap.parse_args()
dev = torch.device("cpu" if args.cpu else "cuda")
H, E, D, K = (12, 256, 256, 6) if not args.cpu else (4, 32, 32, 2)
S = args.S if not args.cpu else 256
gen = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(S, H * D, device=dev, generator=gen).to(torch.bfloat16)
x_heads = x.view(S, H, D)
gate = torch.randn(H, E, D, device=dev, generator=gen) * (D ** -0.5)
bias = torch.randn(H, E, device=dev, generator=gen) * 0.01
cfg = R.logits_route_config(dev)
if args.cpu:
    cfg = R.LogitsRouteConfig(block_s=64, block_d=16, num_warps=4, num_stages=1,
                              from_tile=False, split=True, half_stores=True, block_e=16)
assert cfg.split
CT = R.layout_block_t(K)
ROUTE_KW = dict(top_k=K, score_func="sigmoid", expert_bias=bias, route_norm=True,
                norm_eps=1e-12, route_scale=4.9, num_groups=1, topk_groups=1)


def default():
    p, i, _, c = R.triton_logits_route(x_heads, gate, count_block_t=CT, config=cfg, **ROUTE_KW)
    return p, i, c


def make_chunked(G, hi_prio=None, route_prio=None):
    """Head chunks of G heads: logits kernel per chunk on stream A, route per chunk on B."""
    chunks = [(h0, min(h0 + G, H)) for h0 in range(0, H, G)]
    parts = [R.split_router_weight(gate[a:b]).view(3 * (b - a) * E, D) for a, b in chunks]
    block_d = min(cfg.block_d, D & -D)
    block_n = min(cfg.block_e or E, E)
    xd = [TensorDescriptor.from_tensor(x_heads[:, a:b].reshape(S, (b - a) * D),
                                       [cfg.block_s, block_d]) for a, b in chunks]
    wd = [TensorDescriptor.from_tensor(p, [block_n, block_d]) for p in parts]
    biases = [bias[a:b].contiguous() for a, b in chunks]
    cuda = dev.type == "cuda"
    sa = torch.cuda.Stream(priority=hi_prio or 0) if cuda and hi_prio is not None else None
    sb = torch.cuda.Stream(priority=route_prio or 0) if cuda else None

    def run():
        probs = torch.empty(H, S, K, device=dev)
        indices = torch.empty(H, S, K, device=dev, dtype=torch.int64)
        logits = torch.empty(H, S, E, device=dev)
        counts = torch.empty(H, triton.cdiv(S, CT), E, device=dev, dtype=torch.int32)
        cur = torch.cuda.current_stream() if cuda else None
        if cuda:
            if sa is not None:
                sa.wait_stream(cur)
            sb.wait_stream(cur)
        for n, (a, b) in enumerate(chunks):
            Hc = b - a
            ctx = torch.cuda.stream(sa) if sa is not None else torch.cuda.stream(cur) \
                if cuda else torch.no_grad()
            with ctx:
                R._logits_route_kernel[(triton.cdiv(S, cfg.block_s), Hc * (E // block_n))](
                    xd[n], wd[n], logits[a:b], biases[n], probs[a:b], indices[a:b], counts[a:b],
                    S, Hc, counts.shape[1], E, 1e-12, 4.9,
                    E=E, D=D, TOP_K=K, SOFTMAX=False, HAS_BIAS=True, ROUTE_NORM=True,
                    NUM_GROUPS=1, TOPK_GROUPS=1, BLOCK_S=cfg.block_s, BLOCK_D=block_d,
                    BLOCK_K=triton.next_power_of_2(K), BLOCK_G=1, WRITE_LOGITS=True,
                    FROM_TILE=cfg.from_tile, INTERPRET=R._interpreting(), ROUTE=False,
                    COUNT_T=CT, HALF_STORES=cfg.half_stores, BLOCK_N=block_n,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                ev = torch.cuda.Event() if cuda else None
                if cuda:
                    ev.record()
            if cuda:
                sb.wait_event(ev)
            with (torch.cuda.stream(sb) if cuda else torch.no_grad()):
                R._launch_route(logits[a:b], K, "sigmoid", biases[n], True, 1e-12, 4.9, 1, 1,
                                probs[a:b], indices[a:b], counts[a:b], CT)
        if cuda:
            cur.wait_stream(sb)
            if sa is not None:
                cur.wait_stream(sa)
        return probs, indices, counts
    return run


def layout_of(p, i, c):
    return R.triton_sort_routes(p, i, E, block_counts=c, block_t=CT)


ref = default()
rows = []
variants = [("default", None)]
for G in (1, 2, 3, 4, 6, 12):
    variants.append((f"G{G}", dict(G=G, hi_prio=None)))
    if not args.cpu:
        variants.append((f"G{G}_logits_hi", dict(G=G, hi_prio=-1)))
        variants.append((f"G{G}_route_hi", dict(G=G, hi_prio=0, route_prio=-1)))
res = {"env": environment(dev), "S": S}
if not args.cpu:
    res["matmul_tflops"] = matmul_peak_tflops(dev)
    res["copy_tbs"] = copy_bandwidth_tbs(dev)
for name, kw in variants:
    fn = default if kw is None else make_chunked(**kw)
    out = fn()
    eq = all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    row = {"name": name, "equal": eq}
    if not args.cpu:
        torch.cuda.synchronize()
        row["eager_ms"] = triton.testing.do_bench(fn, warmup=50, rep=300)
        row["graph_ms"] = triton.testing.do_bench_cudagraph(fn, rep=300)
        row["eager_total_ms"] = triton.testing.do_bench(lambda fn=fn: layout_of(*fn()), warmup=50,
                                                         rep=300)
        row["graph_total_ms"] = triton.testing.do_bench_cudagraph(lambda fn=fn: layout_of(*fn()),
                                                                   rep=300)
    print(row, flush=True)
    rows.append(row)
res["rows"] = rows
if args.out:
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
