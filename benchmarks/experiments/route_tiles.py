"""Experiment (routing v13): the shortlist route kernel's tiles (rows a program / warps)
inside route + layout from CUDA graphs. The v10-v12 sweeps timed the kernel alone with
do_bench and disagreed across sessions on 16/1 (0.120 ms in v12, 0.068 in v13's first
call against 0.077 for the default 32/2).

    PYTHONPATH=src python3 benchmarks/experiments/route_tiles.py OUT.json   # the H200

Each tile's route + layout is captured in a graph (the launcher's tile patched in during
capture), checked bitwise against the default's, then the graphs are replayed
interleaved over six rounds; kernel times from the profiler over 30 replays each.
"""
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from router_inputs import E, bench, kernels_in, router_inputs

from mhmoe.bench import matmul_peak_tflops
from mhmoe.kernels import routing as R

TILES = ((32, 2), (16, 1), (64, 4), (32, 1), (16, 2))


def main(out_path: str) -> None:
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "matmul_bf16_TFLOPs": matmul_peak_tflops(dev)}
    x, gate, _, kw = router_inputs(dev)
    orig = R._launch_shortlist_route

    def chain():
        probs, indices, _, counts = R.triton_logits_route(x, gate, **kw)
        return (probs, indices, counts,
                *R.triton_sort_routes(probs, indices, E, block_counts=counts, block_t=64))

    graphs, res, ref = {}, {}, None
    for rows, warps in TILES:
        name = f"{rows}/{warps}"
        R._launch_shortlist_route = functools.partial(orig, block_rows=rows, num_warps=warps)
        try:
            got = chain()
            ref = got if ref is None else ref
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outg = chain()
        finally:
            R._launch_shortlist_route = orig
        g.replay()
        torch.cuda.synchronize()
        res[name] = {"equal_default": all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)),
                     "graph_equal": all(torch.equal(a, b) for a, b in zip(outg, ref, strict=True)),
                     "route_layout_graph": []}
        graphs[name] = g
    for _ in range(6):
        for name, g in graphs.items():
            res[name]["route_layout_graph"].append(bench(g.replay))
    for name, g in graphs.items():
        res[name]["kernels_us"] = kernels_in(g.replay)
        print(name, json.dumps(res[name]), flush=True)
    out["tiles"] = res
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
