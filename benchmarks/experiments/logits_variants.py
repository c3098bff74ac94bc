"""Logits + route (counts) at S=32768 for variants of the split logits kernel: bulk (TMA)
stores of the logits (`tma_store`) against st.global, pipeline depths, tiles; every tile's
logits checked against float64 (the fp32 dot-product bound), bitwise against the default's
(`equal_default`) and for repeatability.

    PYTHONPATH=src python3 benchmarks/experiments/logits_variants.py $OUT/variants.json

(NOTES.md routing v9: results/routing_v9_tma_store.json. results/routing_v9_one_pass.json
came from this script's first version, the rows of `--one-pass` at commit cd2be91, whose
kernel had the `one_pass` variant, since removed.)
"""
import dataclasses
import json
import sys

import torch
import triton.testing
from router_inputs import D, router_inputs

from mhmoe.bench import matmul_peak_tflops
from mhmoe.kernels import routing as R

dev = torch.device("cuda")
x, gate, bias, kw = router_inputs(dev)
exact = torch.einsum("shd,hed->hse", x.double(), gate.double())
bound = D * 2.0**-24 * torch.einsum("shd,hed->hse", x.double().abs(), gate.double().abs())
base = R.logits_route_config(dev)
print("matmul", round(matmul_peak_tflops(dev)), flush=True)
rows = []
ref = R.triton_logits_route(x, gate, config=base, return_logits=True, **kw)
VARIANTS = [  # block_s, block_d, warps, stages, block_e, half_stores, tma_store
    (128, 32, 4, 3, 128, True, False), (128, 32, 4, 3, 128, True, True),
    (128, 32, 4, 3, 128, False, True), (128, 32, 4, 4, 128, True, True),
    (128, 32, 4, 2, 128, True, True), (64, 32, 4, 3, 128, True, True),
    (64, 32, 4, 4, 128, True, True), (128, 64, 4, 2, 128, True, True),
    (128, 32, 8, 3, 256, True, True), (128, 32, 4, 3, 128, True, False),
    (128, 32, 4, 3, 128, True, True)]
for bs, bd, nw, ns, be, half, tma in VARIANTS:
    cfg = dataclasses.replace(base, block_s=bs, block_d=bd, num_warps=nw, num_stages=ns,
                              block_e=be, half_stores=half, tma_store=tma)
    r = dict(block_s=bs, block_d=bd, warps=nw, stages=ns, block_e=be, half_stores=half,
             one_pass=False, tma_store=tma)
    try:
        out = R.triton_logits_route(x, gate, config=cfg, return_logits=True, **kw)
        r["equal_default"] = all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
        err = (out[2].double() - exact).abs()
        r["within_bound"] = bool((err <= bound).all())
        r["max_err_over_bound"] = (err / bound).max().item()
        r["max_abs_err"] = err.max().item()
        rep = 0
        for c in range(5):
            torch.empty(1 << 28, device=dev, dtype=torch.int32).fill_(c)
            o2 = R.triton_logits_route(x, gate, config=cfg, return_logits=True, **kw)
            rep += not all(torch.equal(a, b) for a, b in zip(o2, out, strict=True))
        r["unequal_repeats"] = rep
        r["ms"] = triton.testing.do_bench(
            lambda cfg=cfg: R.triton_logits_route(x, gate, config=cfg, **kw), warmup=50, rep=400)
    except Exception as e:  # out of resources
        r["error"] = f"{type(e).__name__}: {e}"[:200]
    print(r, flush=True)
    rows.append(r)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
