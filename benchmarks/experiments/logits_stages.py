"""Time logits + route (counts) at S=32768 for pipeline depths / warps of the default tile;
check each bitwise against the default and for repeatability (20 calls with junk).

    PYTHONPATH=src python3 benchmarks/experiments/logits_stages.py $OUT/stages.json

(NOTES.md routing v8, item 5; results/routing_v8_stages.json.)
"""
import dataclasses
import json
import sys

import torch
import triton
import triton.testing
from router_inputs import router_inputs

from mhmoe.bench import matmul_peak_tflops
from mhmoe.kernels import routing as R

dev = torch.device("cuda")
x, gate, bias, kw = router_inputs(dev)
base = R.logits_route_config(dev)
ref = R.triton_logits_route(x, gate, config=base, return_logits=True, **kw)
print("matmul", round(matmul_peak_tflops(dev)), flush=True)
rows = []
for bs, nw, ns, be in [(128, 4, 3, 128), (128, 4, 2, 128), (128, 4, 4, 128), (128, 4, 5, 128),
                       (128, 8, 3, 128), (128, 8, 4, 128), (128, 4, 4, 256), (256, 8, 4, 128),
                       (64, 4, 4, 128), (128, 4, 3, 128)]:
    cfg = dataclasses.replace(base, block_s=bs, num_warps=nw, num_stages=ns, block_e=be)
    try:
        out = R.triton_logits_route(x, gate, config=cfg, return_logits=True, **kw)
    except Exception as e:  # out of resources
        print(bs, nw, ns, be, "failed", type(e).__name__, str(e)[:100], flush=True)
        continue
    eq = all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    rep = 0
    for c in range(20):
        torch.empty(1 << 28, device=dev, dtype=torch.int32).fill_(c)
        o2 = R.triton_logits_route(x, gate, config=cfg, return_logits=True, **kw)
        rep += not all(torch.equal(a, b) for a, b in zip(o2, out, strict=True))
    t = triton.testing.do_bench(
        lambda cfg=cfg: R.triton_logits_route(x, gate, config=cfg, **kw), warmup=50, rep=400)
    r = dict(block_s=bs, warps=nw, stages=ns, block_e=be, equal_default=eq,
             unequal_repeats=rep, ms=t)
    print(r, flush=True)
    rows.append(r)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
