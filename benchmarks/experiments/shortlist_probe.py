"""Route + layout at S = 32768, MAGI-2 dims, whole rows against shortlists (routing v10):
times (eager, graph), per-kernel times in graph replays (torch profiler), bitwise
equality, repeated calls, the rate of unsure rows, the shortlist route kernel's tiles,
and (added for v11) the two configurations timed interleaved, several rounds. Since
routing v12 the shortlists hold packed keys (0 marks an unsure row), and the probe also
reports the rows whose listed keys do not order their picks ("tied_rows").

    PYTHONPATH=src python3 benchmarks/experiments/shortlist_probe.py $OUT/probe.json

(NOTES.md routing v10, v11, v12.)
"""
import dataclasses
import json
import sys

import torch
from router_inputs import E, K, bench, kernels_in, router_inputs

from mhmoe.bench import matmul_peak_tflops
from mhmoe.kernels import routing as R

dev = torch.device("cuda")
out = {"device": torch.cuda.get_device_name(), "matmul_bf16_TFLOPs": matmul_peak_tflops(dev)}
x, gate, bias, kw = router_inputs(dev)
default = R.logits_route_config(dev)
configs = {"full": dataclasses.replace(default, shortlist=False),
           "shortlist": dataclasses.replace(default, shortlist=True)}



ref = None
for name, cfg in configs.items():
    def route(cfg=cfg):
        return R.triton_logits_route(x, gate, config=cfg, **kw)

    def route_layout(cfg=cfg):
        probs, indices, _, counts = R.triton_logits_route(x, gate, config=cfg, **kw)
        return (probs, indices, counts,
                *R.triton_sort_routes(probs, indices, E, block_counts=counts, block_t=64))

    res = route_layout()
    if ref is None:
        ref = res
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outg = route_layout()
    g.replay()
    torch.cuda.synchronize()
    r = {"equal_default": [torch.equal(a, b) for a, b in zip(ref, res, strict=True)],
         "graph_equal": [torch.equal(a, b) for a, b in zip(res, outg, strict=True)]}
    times = []
    for _ in range(2):
        times.append({"route_eager": bench(route), "route_layout_eager": bench(route_layout),
                      "route_layout_graph": bench(g.replay)})
    r["times"] = times
    r["kernels_graph_us"] = kernels_in(g.replay)
    out[name] = r
    print(name, json.dumps(r, indent=1), flush=True)

# Repeated shortlist calls, freed memory refilled with NaN between them: a read of the
# logits before the bulk store landed would see NaN, not the previous call's logits.
rep_ok = 0
for _ in range(20):
    junk = torch.full((12, 32768, 256), float("nan"), device=dev)
    del junk
    res = R.triton_logits_route(x, gate, config=configs["shortlist"], **kw)
    rep_ok += all(torch.equal(a, b) for a, b in zip(res[:2] + res[3:], ref[:3], strict=True))
out["shortlist_repeat_equal"] = f"{rep_ok}/20"
print("repeat", out["shortlist_repeat_equal"], flush=True)

# Unsure rate of the shortlists, and the shortlist route kernel's tiles.
S = x.shape[0]
H = x.shape[1]
logits = torch.empty(H, S, E, device=dev)
kw2 = {k: v for k, v in kw.items() if k != "count_block_t"}
p0, i0, lg, c0 = R.triton_logits_route(x, gate, config=configs["full"], return_logits=True,
                                       **kw)
# shortlists as the kernel makes them: run the split kernel path by hand
orig = R._launch_shortlist_route
seen = {}


def grab(short, logits, *a, **k):
    seen["short"], seen["logits"] = short, logits
    return orig(short, logits, *a, **k)


R._launch_shortlist_route = grab
R.triton_logits_route(x, gate, config=configs["shortlist"], **kw)
R._launch_shortlist_route = orig
sh, lg2 = seen["short"], seen["logits"]
out["unsure_half_rows"] = (sh[..., ::8] == 0).float().mean().item()
out["unsure_rows"] = (sh == 0).any(-1).float().mean().item()
sure = (sh != 0).all(-1).cpu()
out["tied_rows"] = (R.shortlist_tied_rows(sh, K, E).sum() / sure.sum().clamp(min=1)).item()
tiles = {}
for rows, nw in ((32, 2), (64, 2), (64, 4), (128, 4), (32, 1), (64, 1), (16, 1)):
    probs = torch.empty(H, S, K, device=dev)
    idx = torch.empty(H, S, K, device=dev, dtype=torch.int64)
    counts = torch.zeros(H, S // 64, E, device=dev, dtype=torch.int32)

    def run(probs=probs, idx=idx, counts=counts, rows=rows, nw=nw):
        counts.zero_()
        R._launch_shortlist_route(sh, lg2, K, bias, True, 1e-12, 4.9, probs, idx, counts, 64,
                                  block_rows=rows, num_warps=nw)
    run()
    eq = torch.equal(probs, p0) and torch.equal(idx, i0) and torch.equal(counts, c0)
    tiles[f"{rows}/{nw}"] = (bench(run), eq)
out["shortlist_route_tiles"] = tiles
print(tiles, out["unsure_half_rows"], out["unsure_rows"], out["tied_rows"], flush=True)

# Interleaved: both configurations' graphs of route + layout and their eager route,
# alternating, 4 rounds (the first runs above timed one configuration after the other).
graphs = {}
for name, cfg in configs.items():
    def chain(cfg=cfg):
        probs, indices, _, counts = R.triton_logits_route(x, gate, config=cfg, **kw)
        return R.triton_sort_routes(probs, indices, E, block_counts=counts, block_t=64)
    chain()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    graphs[name] = (g, cfg)
ab = {name: {"route_layout_graph": [], "route_eager": []} for name in graphs}
for _ in range(4):
    for name, (g, cfg) in graphs.items():
        ab[name]["route_layout_graph"].append(bench(g.replay))
        ab[name]["route_eager"].append(
            bench(lambda cfg=cfg: R.triton_logits_route(x, gate, config=cfg, **kw)))
out["interleaved"] = ab
print(json.dumps(ab), flush=True)

json.dump(out, open(sys.argv[1], "w"), indent=1)
