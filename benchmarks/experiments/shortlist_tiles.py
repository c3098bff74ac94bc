"""Experiment (routing v12): the logits kernel's tiles, re-swept with shortlists and bulk
stores (the v7 sweep predates both). Tiles of all 256 experts list 8 experts a row
instead of 2 x 8, so the shortlist route kernel gathers half the logits.

    python3 benchmarks/experiments/shortlist_tiles.py --compile-only    # here, no GPU
    PYTHONPATH=src python3 benchmarks/experiments/shortlist_tiles.py OUT.json  # the H200

On the GPU each tile's probs, indices and counts are compared bitwise with the default
tile's (every tile here has the default's K step of 32, so the same logits), then logits
+ route + layout is timed from CUDA graphs, interleaved with the default, four rounds.
"""
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from router_inputs import experiment_main

from mhmoe.kernels import routing as R
from mhmoe.kernels.configs import LOGITS_ROUTE_CONFIGS

DEFAULT = LOGITS_ROUTE_CONFIGS[(9, 0)]
H, E, D, K = 12, 256, 256, 6
# (block_s, num_warps, num_stages, block_e); block_d 32 throughout
TILES = ((128, 4, 3, 128), (64, 4, 2, 256), (64, 4, 3, 256), (64, 4, 4, 256),
         (128, 8, 2, 256), (128, 8, 3, 256), (64, 4, 3, 128), (64, 4, 4, 128),
         (128, 4, 2, 128), (128, 4, 4, 128), (256, 8, 3, 128), (128, 8, 3, 128),
         (64, 4, 2, 128), (128, 8, 2, 128))


def tile_config(block_s, num_warps, num_stages, block_e):
    return dataclasses.replace(DEFAULT, block_s=block_s, num_warps=num_warps,
                               num_stages=num_stages, block_e=block_e)


def compile_only() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench_routing import sm90_compile
    for t in TILES:
        bs, nw, ns, bn = t
        sig = {"x_desc": f"tensordesc<bf16[{bs}, 32]>", "w_desc": f"tensordesc<bf16[{bn}, 32]>",
               "logits_ptr": "*fp32", "bias_ptr": "*fp32", "probs_ptr": "*fp32",
               "indices_ptr": "*i64", "counts_ptr": "*i32", "S": "i32", "H": "i32",
               "NB": "i32", "group_size": "i32", "norm_eps": "fp32", "route_scale": "fp32",
               "l_desc": f"tensordesc<fp32[1, {bs}, {bn // 2}]>", "short_ptr": "*i32"}
        cx = dict(E=E, D=D, TOP_K=K, SOFTMAX=False, HAS_BIAS=True, ROUTE_NORM=True,
                  NUM_GROUPS=1, TOPK_GROUPS=1, BLOCK_S=bs, BLOCK_D=32, BLOCK_K=8, BLOCK_G=1,
                  WRITE_LOGITS=True, FROM_TILE=False, INTERPRET=False, ROUTE=False, COUNT_T=64,
                  HALF_STORES=True, BLOCK_N=bn, SHORT=R.shortlist_size(K, bn))
        try:
            info = sm90_compile(R._logits_route_kernel, sig, cx, nw, ns)
        except Exception as e:
            info = f"FAILED {type(e).__name__}"
        print(f"tile {t}: {info}", flush=True)


def gpu(out_path: str) -> None:
    from router_inputs import router_inputs
    from triton.testing import do_bench, do_bench_cudagraph

    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm = do_bench(lambda: a @ a, warmup=50, rep=300)
    x, gate, _, kw = router_inputs(dev)
    result = {"bf16_matmul_tflops": 2 * 8192**3 / mm / 1e9, "S": x.shape[0], "tiles": {}}

    def total(cfg):
        p, i, _, c = R.triton_logits_route(x, gate, config=cfg, **kw)
        return R.triton_sort_routes(p, i, E, block_counts=c, block_t=64)

    ref = R.triton_logits_route(x, gate, config=DEFAULT, **kw)
    ref_layout = total(DEFAULT)
    cfgs = {str(t): tile_config(*t) for t in TILES}
    for name, cfg in cfgs.items():
        rec = {}
        try:
            got = R.triton_logits_route(x, gate, config=cfg, **kw)
            lay = total(cfg)
            pairs = [*zip(got, ref, strict=True), *zip(lay, ref_layout, strict=True)]
            rec["bitwise"] = all(torch.equal(a, b) for a, b in pairs if a is not None)
            rec["route_eager_ms"] = do_bench(lambda c=cfg: R.triton_logits_route(
                x, gate, config=c, **kw), warmup=20, rep=200)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["tiles"][name] = rec
        print(name, rec, flush=True)
    ok = [n for n, r in result["tiles"].items() if "error" not in r]
    rounds = {n: [] for n in ok}
    for _ in range(4):
        for n in ok:
            rounds[n].append(do_bench_cudagraph(lambda c=cfgs[n]: total(c), rep=200))
    for n in ok:
        result["tiles"][n]["route_layout_graph_ms"] = rounds[n]
        print(n, "graph", [round(v, 4) for v in rounds[n]], flush=True)
    # Kernel times (us a call) under the profiler, 20 eager calls a tile.
    from torch.profiler import ProfilerActivity, profile
    for n in ok:
        for _ in range(3):
            total(cfgs[n])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                total(cfgs[n])
            torch.cuda.synchronize()
        kern = {}
        for ev in prof.key_averages():
            tot = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if ev.count and tot and "kernel" in ev.key:
                kern[ev.key[:60]] = round(tot / 20, 1)
        result["tiles"][n]["kernels_us"] = kern
        print(n, "kernels", kern, flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    experiment_main(compile_only, gpu)
