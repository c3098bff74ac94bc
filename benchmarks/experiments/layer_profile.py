"""Where the MAGI-2 layer's time goes at S = 32768 on the GPU, kernel by kernel, with the
expert kernel's one-CTA and cluster variants (expert forward v6).

    PYTHONPATH=src python3 benchmarks/experiments/layer_profile.py OUT.json

For each variant (the Hopper table's warp-specialised rows with cluster 1, then 2): the
layer forward timed eager and from a CUDA graph (do_bench medians, ms, the variants
interleaved over two rounds), then the torch profiler over 5 eager forwards: every GPU
kernel or memory operation with its time per forward (us) and its count per forward.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_layer

import mhmoe
from mhmoe.bench import matmul_peak_tflops
from mhmoe.kernels import configs

S = 32768


def table(cluster):
    return tuple((bound, dataclasses.replace(c, cluster=cluster) if c.warp_specialized else c)
                 for bound, c in configs._HOPPER)


def profile(layer, x, reps=5):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            layer(x)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append({"name": e.key[:90], "us_per_forward": t / reps,
                         "count_per_forward": e.count / reps})
    rows.sort(key=lambda r: -r["us_per_forward"])
    return rows


def main():
    out_path = sys.argv[1]
    device = torch.device("cuda")
    cfg = mhmoe.MAGI2_PREVIEW
    layer = mhmoe.MultiHeadMoE(cfg, device=device)
    layer.reset_parameters(generator=torch.Generator(device=device).manual_seed(0))
    gen = torch.Generator().manual_seed(0)
    res = {"matmul_tflops": matmul_peak_tflops(device), "times": [], "profiles": {}}
    with torch.no_grad():
        layer.router.expert_bias_ema.copy_(torch.randn(cfg.num_flat_experts, generator=gen)
                                           .mul_(0.01))
        x = torch.randn(S, cfg.hidden_size, device=device).bfloat16()
        tables = {c: table(c) for c in (1, 2)}
        graphs = {}
        for c, t in tables.items():
            configs._TABLES[(9, 0)] = t
            layer(x)
            graphs[c] = bench_layer.graph_of(lambda: layer(x))
        ys = {}
        for c, t in tables.items():
            configs._TABLES[(9, 0)] = t
            ys[c] = layer(x).float()
        res["cluster_vs_one_cta_rel"] = float(
            (ys[2] - ys[1]).norm() / ys[1].norm())
        print("cluster vs one-CTA layer output, relative:", res["cluster_vs_one_cta_rel"],
              flush=True)
        for _ in range(2):
            for c, t in tables.items():
                configs._TABLES[(9, 0)] = t
                row = {"cluster": c,
                       "layer_ms": do_bench(lambda: layer(x), return_mode="median"),
                       "layer_graph_ms": do_bench(graphs[c].replay, return_mode="median")}
                res["times"].append(row)
                print(row, flush=True)
        for c, t in tables.items():
            configs._TABLES[(9, 0)] = t
            res["profiles"][c] = profile(layer, x)
            print(f"cluster {c}:", flush=True)
            for r in res["profiles"][c][:14]:
                print(f"  {r['us_per_forward']:9.1f} us  x{r['count_per_forward']:.0f}  "
                      f"{r['name']}", flush=True)
    configs._TABLES[(9, 0)] = configs._HOPPER
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
