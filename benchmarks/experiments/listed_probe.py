"""Experiment (routing v13, not kept): the logits kernel lists each row's shortlisted
logits beside their keys and, unless the logits are returned, no longer stores its tile
(only the rows a list cannot vouch for); the shortlist route kernel reads keys and
logits, 2 C numbers a row, and no [H, S, E] logits. The kernels are in listed.patch:

    git apply benchmarks/experiments/listed.patch
    PYTHONPATH=src python3 benchmarks/experiments/listed_probe.py OUT.json   # the H200

At S = 32768, MAGI-2 dims (router_inputs.py): for whole rows (the control), the
default shortlist tiles and other tiles of the logits kernel, with and without
return_logits: bitwise equality with whole rows (probs, indices, counts, the layout),
route + layout from CUDA graphs interleaved over four rounds, the eager route, and the
kernel times of graph replays (torch profiler).
"""
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from router_inputs import E, bench, router_inputs, time_interleaved

from mhmoe.bench import matmul_peak_tflops
from mhmoe.kernels import routing as R


def main(out_path: str) -> None:
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "matmul_bf16_TFLOPs": matmul_peak_tflops(dev)}
    x, gate, _, kw = router_inputs(dev)
    default = R.logits_route_config(dev)
    tiles = {"full": (dataclasses.replace(default, shortlist=False), False),
             "default": (default, False),
             "default, return_logits": (default, True),
             "full, return_logits": (dataclasses.replace(default, shortlist=False), True)}
    for bs, nw, ns in ((64, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 2), (128, 8, 3)):
        tiles[f"{bs}x128/{nw}/{ns}"] = (dataclasses.replace(
            default, block_s=bs, num_warps=nw, num_stages=ns), False)

    def chain(cfg, keep):
        probs, indices, _, counts = R.triton_logits_route(x, gate, config=cfg,
                                                          return_logits=keep, **kw)
        return (probs, indices, counts,
                *R.triton_sort_routes(probs, indices, E, block_counts=counts, block_t=64))

    ref = chain(*tiles["full"])
    graphs, res = {}, {}
    for name, (cfg, keep) in tiles.items():
        r = {}
        try:
            got = chain(cfg, keep)
            r["equal_full"] = all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outg = chain(cfg, keep)
            g.replay()
            torch.cuda.synchronize()
            r["graph_equal_full"] = all(torch.equal(a, b) for a, b in zip(outg, ref, strict=True))
            graphs[name] = g
        except Exception as e:  # a tile that fails to compile or run is reported
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res[name] = r
        print(name, r, flush=True)
    eager = {name: (lambda cfg=cfg, keep=keep: R.triton_logits_route(
        x, gate, config=cfg, return_logits=keep, **kw)) for name, (cfg, keep) in tiles.items()}
    time_interleaved(graphs, eager, res)
    # Repeated calls of the default, freed memory refilled with NaN between them.
    rep_ok = 0
    for _ in range(20):
        junk = torch.full((12, 32768, 256), float("nan"), device=dev)
        del junk
        rep_ok += all(torch.equal(a, b) for a, b in zip(chain(default, False), ref, strict=True))
    out["default_repeat_equal"] = f"{rep_ok}/20"
    out["tiles"] = res
    # The shortlist route kernel's tiles (rows a program / warps) on the default's lists.
    seen = {}
    orig = R._launch_shortlist_route

    def grab(short, listed, logits, *a, **k):
        seen["args"] = (short, listed, logits)
        return orig(short, listed, logits, *a, **k)

    R._launch_shortlist_route = grab
    probs, indices, _, counts = R.triton_logits_route(x, gate, config=default, **kw)
    R._launch_shortlist_route = orig
    short, listed, logits = seen["args"]
    out["unsure_rows"] = (short == 0).any(-1).float().mean().item()
    route_tiles = {}
    for rows, nw in ((32, 2), (64, 2), (64, 4), (128, 4), (32, 1), (16, 1)):
        p = torch.empty_like(probs)
        i = torch.empty_like(indices)
        c = torch.zeros_like(counts)

        def run(p=p, i=i, c=c, rows=rows, nw=nw):
            c.zero_()
            R._launch_shortlist_route(short, listed, logits, 8, kw["top_k"], kw["expert_bias"],
                                      True, 1e-12, kw["route_scale"], p, i, c, 64,
                                      block_rows=rows, num_warps=nw)
        run()
        eq = torch.equal(p, probs) and torch.equal(i, indices) and torch.equal(c, counts)
        route_tiles[f"{rows}/{nw}"] = (bench(run), eq)
    out["shortlist_route_tiles_ms"] = route_tiles
    print("route tiles", route_tiles, "unsure rows", out["unsure_rows"], flush=True)
    print("repeat", out["default_repeat_equal"], flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
