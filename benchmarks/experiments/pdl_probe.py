"""Experiment (routing v12, not kept): programmatic dependent launch (`routing.PDL`) on
and off, interleaved, at S = 32768, MAGI-2 dims (the router inputs of router_inputs.py).
The launches with PDL are not on main: apply them first (`PDL_TRIGGER` in the patch:
whether each program also lets the next kernel launch as it starts).

    git apply benchmarks/experiments/pdl.patch
    PYTHONPATH=src python3 benchmarks/experiments/pdl_probe.py OUT.json    # on the H200

Checks first: logits + route + layout with PDL bitwise equal to without, eager and from
a CUDA graph replayed on new inputs (the captured buffers refilled between replays), and
20 eager calls in a row equal to the first. Then four rounds of: route + layout from a
graph, and logits + route eager, for each setting.
"""
import json
import sys

import torch
from router_inputs import E, router_inputs
from triton.testing import do_bench, do_bench_cudagraph

from mhmoe.kernels import routing as R

dev = torch.device("cuda")
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
mm = do_bench(lambda: a @ a, warmup=50, rep=300)
x, gate, bias, kw = router_inputs(dev)
out = {"bf16_matmul_tflops": 2 * 8192**3 / mm / 1e9, "S": x.shape[0]}


def route():
    return R.triton_logits_route(x, gate, **kw)


def total():
    probs, indices, _, counts = route()
    return (probs, indices, counts,
            *R.triton_sort_routes(probs, indices, E, block_counts=counts, block_t=64))


def same(a, b):
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


R.PDL = False
ref = total()
R.PDL = True
got = total()
checks = {"eager_equal": same(ref, got)}
repeat = [same(ref, total()) for _ in range(20)]
checks["eager_repeat_equal"] = all(repeat)
# Graph replay on new inputs: capture with x, then copy other tokens into x and replay.
x_keep = x.clone()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    total()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    captured = total()
x2 = torch.roll(x_keep, 1000, 0).contiguous()
R.PDL = False
x.copy_(x2)
ref2 = total()
R.PDL = True
ok = []
for i in range(6):
    for t in captured:
        t.fill_(float("nan") if t.dtype == torch.float32 else -1)
    x.copy_(x2 if i % 2 == 0 else x_keep)
    g.replay()
    torch.cuda.synchronize()
    ok.append(same(captured, ref2 if i % 2 == 0 else ref))
checks["graph_replays_equal"] = ok
x.copy_(x_keep)
out["checks"] = checks
print(checks, flush=True)

rounds = {"off": {"graph_ms": [], "eager_route_ms": []},
          "on": {"graph_ms": [], "eager_route_ms": []}}
for _ in range(4):
    for name, flag in (("off", False), ("on", True)):
        R.PDL = flag
        rounds[name]["graph_ms"].append(do_bench_cudagraph(total, rep=300))
        rounds[name]["eager_route_ms"].append(do_bench(route, warmup=20, rep=300))
    print({n: {k: [round(v, 4) for v in vs] for k, vs in r.items()}
           for n, r in rounds.items()}, flush=True)
out["rounds"] = rounds
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
