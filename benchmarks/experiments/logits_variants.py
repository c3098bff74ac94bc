"""Logits + route (counts) at S=32768 for variants of the split logits kernel: one pass
over D reading x once (`one_pass`) against the two passes, and bulk (TMA) stores of the
logits (`tma_store`) against st.global; every tile's logits checked against float64 (the
fp32 dot-product bound), bitwise against the default's (`equal_default`, two-pass tiles
only: one pass sums in another order) and for repeatability.

    PYTHONPATH=src python3 benchmarks/experiments/logits_variants.py $OUT/variants.json

(NOTES.md routing v9: results/routing_v9_one_pass.json, from the first version of this
script with the one_pass rows only; results/routing_v9_tma_store.json.)
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
VARIANTS = [  # block_s, block_d, warps, stages, block_e, half_stores, one_pass, tma_store
    (128, 32, 4, 3, 128, True, False, False), (128, 32, 4, 3, 128, True, False, True),
    (128, 32, 4, 3, 128, False, False, True), (128, 32, 4, 4, 128, True, False, True),
    (128, 32, 4, 2, 128, True, False, True), (64, 32, 4, 3, 128, True, False, True),
    (64, 32, 4, 4, 128, True, False, True), (128, 64, 4, 2, 128, True, False, True),
    (128, 32, 8, 3, 256, True, False, True), (128, 32, 4, 3, 128, True, False, False),
    (128, 32, 4, 3, 128, True, False, True)]
if "--one-pass" in sys.argv:  # the first run's rows
    VARIANTS = [(128, 32, 4, 3, 128, True, False, False)] + [
        (bs, bd, nw, ns, 128, True, True, False) for bs, bd, nw, ns in (
            (64, 32, 4, 3), (64, 32, 4, 4), (128, 32, 8, 3), (128, 32, 8, 4), (128, 64, 8, 2))
    ] + [(128, 32, 4, 3, 128, True, False, False)]
for bs, bd, nw, ns, be, half, op, tma in VARIANTS:
    cfg = dataclasses.replace(base, block_s=bs, block_d=bd, num_warps=nw, num_stages=ns,
                              block_e=be, half_stores=half, one_pass=op, tma_store=tma)
    r = dict(block_s=bs, block_d=bd, warps=nw, stages=ns, block_e=be, half_stores=half,
             one_pass=op, tma_store=tma)
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
