"""The route kernel with packed keys and the approximate sigmoid (routing v9) against the
exact rounds, at S = 32768 on MAGI-2's dims: times per tile, bitwise checks, the rate of
rows the keys cannot vouch for, and the approximate sigmoid's error against torch's.

    PYTHONPATH=src python3 benchmarks/experiments/route_keyed.py $OUT/route_keyed.json

(NOTES.md routing v9; results/routing_v9_keyed.json.)
"""
import json
import sys

import torch
import triton
import triton.language as tl
import triton.testing
from router_inputs import E, K, router_inputs

from mhmoe.bench import copy_bandwidth_tbs, matmul_peak_tflops
from mhmoe.kernels import routing as R

dev = torch.device("cuda")
T = 64
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "triton": triton.__version__}
out["matmul_bf16_TFLOPs"] = matmul_peak_tflops(dev)
out["copy_TBps"] = copy_bandwidth_tbs(dev)
print(out, flush=True)


@triton.jit
def _approx_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, R._sigmoid_approx(x, offs, False), mask=offs < n)


# 1. The approximate sigmoid against torch.sigmoid: a dense sweep and the edges.
xs = torch.cat([torch.linspace(-110, 110, 1 << 25, device=dev),
                torch.randn(1 << 24, device=dev,
                            generator=torch.Generator(dev).manual_seed(1)) * 4,
                torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.3, 88.8, -87.3, -88.8, 103.0, -103.0,
                              1e30, -1e30, float("inf"), float("-inf")], device=dev)])
ys = torch.empty_like(xs)
_approx_kernel[(triton.cdiv(xs.numel(), 1024),)](xs, ys, xs.numel(), BLOCK=1024)
err = (ys.double() - torch.sigmoid(xs).double()).abs()
nan_x = torch.tensor([float("nan")], device=dev)
nan_y = torch.empty_like(nan_x)
_approx_kernel[(1,)](nan_x, nan_y, 1, BLOCK=1024)
out["sigmoid_approx"] = {"max_abs_error": err.max().item(),
                         "bound": float(R.SIGMOID_APPROX_ERROR.value),
                         "argmax_x": xs[err.argmax()].item(),
                         "nan_stays_nan": bool(nan_y.isnan().all())}
print(out["sigmoid_approx"], flush=True)

# 2. Logits as the layer makes them (the default logits kernel), a bias, and hard rows.
x, gate, bias, kw = router_inputs(dev, count_block_t=None)
logits = R.triton_logits_route(x, gate, return_logits=True, **kw)[2]
hard = logits.clone()
hard[:, 0] = 30.0                                     # saturated: every score 1.0
hard[:, 1, :8] = float("inf")
hard[:, 2] = float("nan")
hard[:, 3] = float("-inf")
hard[:, 4, ::3] = 2.0                                 # exact ties
hard[:, 5] = torch.linspace(3.0, 3.001, E, device=dev)  # near-ties everywhere

# Rows the keys could not vouch for (estimated on torch's fp32 selection scores: the
# 8-bit buckets of E = 256; the kernel's margin adds ~2e-6 to a gap).
sel = torch.sigmoid(logits) + bias[:, None, :]
top = sel.topk(K + 1, dim=-1).values
bits = top.contiguous().view(torch.int32).long()
ordered = torch.where(bits < 0, ~bits & 0xFFFFFFFF, bits | 0x80000000)
bucket = ordered >> 8
unsure = ((bucket[..., 1:] == bucket[..., :-1]).any(-1)
          | (top[..., :-1] - top[..., 1:] < 4e-6).any(-1))
out["unsure_rows_estimate"] = unsure.float().mean().item()
out["unsure_programs_estimate"] = {r: 1 - (1 - out["unsure_rows_estimate"]) ** r
                                   for r in (2, 4, 8, 16)}
print("unsure", out["unsure_rows_estimate"], flush=True)

ref = {name: R.triton_route(lg, count_block_t=T, keyed=False, block_rows=2, **kw)
       for name, lg in (("logits", logits), ("hard", hard))}


def same(a, b):
    return (torch.equal(a[0].nan_to_num(7.0), b[0].nan_to_num(7.0)) and torch.equal(a[1], b[1])
            and torch.equal(a[2], b[2]))


rows = []
TILES = [(False, 2, 1, 1)] + [(True, br, nw, it) for br, nw, it in (
    (1, 1, 1), (2, 1, 1), (2, 1, 2), (2, 1, 4), (4, 1, 1), (4, 1, 2), (8, 1, 1), (2, 1, 1))]
for keyed, br, nw, it in TILES:
    r = {"keyed": keyed, "block_rows": br, "num_warps": nw, "iters": it}
    tile = dict(keyed=keyed, block_rows=br, num_warps=nw, iters=it)
    try:
        for name, lg in (("logits", logits), ("hard", hard)):
            r[f"equal_{name}"] = same(R.triton_route(lg, count_block_t=T, **tile, **kw),
                                      ref[name])
        r["ms"] = triton.testing.do_bench(
            lambda tile=tile: R.triton_route(logits, count_block_t=T, **tile, **kw),
            warmup=50, rep=300)
    except Exception as e:  # out of resources
        r["error"] = f"{type(e).__name__}: {e}"[:200]
    print(r, flush=True)
    rows.append(r)
out["route_kernel"] = rows
json.dump(out, open(sys.argv[1], "w"), indent=1)
