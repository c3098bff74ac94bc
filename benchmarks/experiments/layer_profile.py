"""Where the MAGI-2 layer's time goes at S = 32768 on the GPU, kernel by kernel, with the
expert kernel's one-CTA and cluster variants (expert forward v6).

    PYTHONPATH=src python3 benchmarks/experiments/layer_profile.py OUT.json

For each variant (the Hopper table's warp-specialised rows with cluster 1 and 2, with the
fused combine of forward v7; and cluster 1 without it, v6's fill and finishing pass): the
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

from mhmoe.bench import matmul_peak_tflops
from mhmoe.kernels import configs
from mhmoe.kernels import expert_forward as ef

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


def magi2_layer(device):
    """bench_layer's MAGI-2 layer and an x of S tokens."""
    layer = bench_layer.magi2_layer(device)
    return layer, torch.randn(S, layer.config.hidden_size, device=device).bfloat16()


def main():
    out_path = sys.argv[1]
    device = torch.device("cuda")
    layer, x = magi2_layer(device)
    res = {"matmul_tflops": matmul_peak_tflops(device), "times": [], "profiles": {}}
    with torch.no_grad():
        # (cluster, fused combine): forward v7's fused combine in both variants, and the
        # one-CTA kernel with v6's fill and finishing pass
        tables = {(c, fused): table(c) for c, fused in ((1, True), (2, True), (1, False))}
        fused_default = ef.FUSED_COMBINE
        graphs = {}
        def use(variant):
            configs._TABLES[(9, 0)] = tables[variant]
            ef.FUSED_COMBINE = variant[1]

        for v in tables:
            use(v)
            layer(x)
            graphs[v] = bench_layer.graph_of(lambda: layer(x))[0]
        ys = {}
        for v in tables:
            use(v)
            ys[v] = layer(x).float()
        base = ys[(1, False)]
        res["rel_to_unfused_one_cta"] = {str(v): float((y - base).norm() / base.norm())
                                         for v, y in ys.items()}
        print("layer outputs against the unfused one-CTA kernel's, relative:",
              res["rel_to_unfused_one_cta"], flush=True)
        for _ in range(2):
            for v in tables:
                use(v)
                row = {"cluster": v[0], "fused": v[1],
                       "layer_ms": do_bench(lambda: layer(x), return_mode="median"),
                       "layer_graph_ms": do_bench(graphs[v].replay, return_mode="median")}
                res["times"].append(row)
                print(row, flush=True)
        for v in tables:
            use(v)
            res["profiles"][str(v)] = profile(layer, x)
            print(f"cluster {v[0]}, fused {v[1]}:", flush=True)
            for r in res["profiles"][str(v)][:14]:
                print(f"  {r['us_per_forward']:9.1f} us  x{r['count_per_forward']:.0f}  "
                      f"{r['name']}", flush=True)
    configs._TABLES[(9, 0)] = configs._HOPPER
    ef.FUSED_COMBINE = fused_default
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
