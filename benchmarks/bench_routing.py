"""Check and time routing and layout at MAGI-2 dims: fused logits + route, layout (issue 4).

    PYTHONPATH=src python3 benchmarks/bench_routing.py --out $OUT/routing_v6.json
    PYTHONPATH=src python3 benchmarks/bench_routing.py --cpu --out /tmp/routing_cpu.json
    PYTHONPATH=src python3 benchmarks/bench_routing.py --compile-only
    PYTHONPATH=src python3 benchmarks/bench_routing.py --split-sweep --out $OUT/split.json

Steps, in order (GPU): device-copy and bf16 8192^3 matmul peaks; checks at
S=4096: the fused logits + route kernel against `route_reference` on torch's
fp32 (cuBLAS) logits and on float64 logits (index mismatches not excused by a
1e-6 relative near-tie, max relative probability error; both recorded, not
asserted, so a miss still leaves the timings), its gradients against the
unfused path, NaN rows, the unfused Triton route and the layout against the
reference (asserted, as before), no host sync; a sweep at S=32768 of the
fused kernel's tiles and of the layout count step's blocks, and the layout
steps one by one; then per S: cuBLAS fp32 GEMM, Triton route, fused
logits + route (without and with the logits written for a backward), layout,
the two totals, the fused total replayed from a CUDA graph, the published
torch recipe. Medians of `do_bench`. Prints a table last, writes JSON rows
(GPU, versions, commit) to --out.

v6, the counts from the routing: the route kernels add each pick to the layout's
per-block expert counts, and the layout built from them skips its count step
(scan, then a scatter that ranks each block itself and writes the offsets).
Checked against the reference (asserted: block sizes, chunks, NaN rows, one
expert taking a head, the split logits kernel's zeroing); swept at S=32768 (the
ranking scatter's block, chunk and warps; the scan's step); the layout steps of
both paths one by one; and per S, next to the old columns: route with counts,
layout from counts, the standalone layout with ranks="scatter", and the totals
old ("fused_total": logits + route, then count + scan + offsets + scatter) and
new ("fused_total_counts": logits + route counting, then scan + ranking
scatter), eager and replayed from a CUDA graph.

--cpu: the same steps on the CPU under the Triton interpreter at toy sizes (a
dry run of the script, numbers meaningless). --split-sweep: the peaks, then only
the split tiles of FUSED_SWEEP at S=32768 as the layer runs them (logits + route
with counts, and with the layout from the counts), each checked bitwise against
its K step's whole-tile store and against float64's routing. --compile-only: compile the
fused kernel's sweep tiles and the route and layout kernels for sm_90 on this
machine (no GPU needed) and print registers, spills and shared memory (ptxas -v).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

if "--cpu" in sys.argv:  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

from mhmoe.bench import environment, matmul_peak_tflops, time_fn
from mhmoe.kernels import routing as R
from mhmoe.kernels.routing import (
    LogitsRouteConfig,
    triton_logits_route,
    triton_route,
    triton_sort_routes,
)
from mhmoe.reference import route_reference, sort_routes_reference
from mhmoe.routing import route_tokens, sort_routes

SCALE = 4.9
TIE = 1e-6  # the bound: near-tie (relative gap) and probability error


@dataclass(frozen=True)
class Setup:
    """Problem dims and where it runs (MAGI-2 on the GPU; toy dims for --cpu)."""

    H: int = 12
    E: int = 256
    K: int = 6
    D: int = 256
    device: str = "cuda"
    sizes: tuple = (1024, 4096, 16384, 32768)
    check_s: int = 4096
    sweep_s: int = 32768


CPU_SETUP = Setup(H=2, E=256, K=6, D=64, device="cpu", sizes=(64, 128), check_s=128,
                  sweep_s=128)

# Tiles swept at S = 32768 (the first is the sm_90 default of kernels/configs.py).
FUSED_SWEEP = (
    LogitsRouteConfig(block_s=128, block_d=32, num_warps=4, num_stages=3, from_tile=False,
                      split=True, half_stores=True, block_e=128),
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=3, from_tile=False),
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=2, from_tile=False),
    LogitsRouteConfig(block_s=64, block_d=64, num_warps=4, num_stages=2, from_tile=False),
    LogitsRouteConfig(block_s=128, block_d=32, num_warps=8, num_stages=3, from_tile=False),
    LogitsRouteConfig(block_s=128, block_d=32, num_warps=8, num_stages=2, from_tile=False),
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=8, num_stages=3, from_tile=True),
    LogitsRouteConfig(block_s=64, block_d=64, num_warps=8, num_stages=2, from_tile=True),
    # split: the kernel writes the logits only, `_route_kernel` routes them
    LogitsRouteConfig(block_s=128, block_d=64, num_warps=8, num_stages=2, from_tile=False,
                      split=True),
    LogitsRouteConfig(block_s=128, block_d=32, num_warps=8, num_stages=3, from_tile=False,
                      split=True),
    LogitsRouteConfig(block_s=64, block_d=64, num_warps=4, num_stages=3, from_tile=False,
                      split=True),
    # Two programs an SM, so that one's logits store overlaps the other's dots (sm_90
    # compile-only, logits stored in two column halves: 64/32/4/2 70 KB of shared memory
    # and 176 registers a thread, 64/32/4/3 107 KB; 128/32/8/2 74 KB but 174 registers
    # on 8 warps, so one program an SM). Routing v7: 64/32/4/3 0.717 ms against 0.736 for
    # the v6 default (route + counts at S=32768), the others slower (NOTES.md).
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=2, from_tile=False,
                      split=True, half_stores=True),
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=3, from_tile=False,
                      split=True, half_stores=True),
    LogitsRouteConfig(block_s=64, block_d=16, num_warps=4, num_stages=4, from_tile=False,
                      split=True, half_stores=True),
    LogitsRouteConfig(block_s=128, block_d=32, num_warps=8, num_stages=2, from_tile=False,
                      split=True, half_stores=True),
    LogitsRouteConfig(block_s=128, block_d=64, num_warps=8, num_stages=2, from_tile=False,
                      split=True, half_stores=True),
    # Fewer experts a program (block_e): 128 tokens x 128 experts read as many weight bytes
    # per token as 128 x 256 tiles (the parts are 393 KB a head, read from L2 by every
    # program) with the registers and shared memory of 64 x 256 ones: two programs an SM.
    LogitsRouteConfig(block_s=128, block_d=64, num_warps=4, num_stages=2, from_tile=False,
                      split=True, half_stores=True, block_e=128),
    LogitsRouteConfig(block_s=128, block_d=32, num_warps=8, num_stages=3, from_tile=False,
                      split=True, half_stores=True, block_e=128),
    LogitsRouteConfig(block_s=256, block_d=32, num_warps=8, num_stages=3, from_tile=False,
                      split=True, half_stores=True, block_e=128),
    LogitsRouteConfig(block_s=128, block_d=64, num_warps=4, num_stages=3, from_tile=False,
                      split=True, half_stores=True, block_e=64),
    LogitsRouteConfig(block_s=256, block_d=32, num_warps=4, num_stages=3, from_tile=False,
                      split=True, half_stores=True, block_e=64),
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=4, from_tile=False,
                      split=True, half_stores=True, block_e=128),
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=3, from_tile=False,
                      split=True, half_stores=True, block_e=128),
    LogitsRouteConfig(block_s=128, block_d=32, num_warps=8, num_stages=2, from_tile=False,
                      split=True, half_stores=True, block_e=128),
    LogitsRouteConfig(block_s=256, block_d=32, num_warps=8, num_stages=3, from_tile=False,
                      split=True, half_stores=True, block_e=64),
)
# Layout count step: (tokens a block, tokens a sub-block, warps); (8, 8, 4) was v3's.
COUNT_SWEEP = ((8, 8, 4), (64, 8, 2), (64, 8, 4), (64, 8, 8), (32, 8, 2), (128, 8, 2),
               (64, 4, 2), (16, 8, 2))
# The ranking scatter (ranks="scatter"): (tokens a block, routes a step, warps); the first
# is the default (64 routes on 2 warps since routing v6; 32 on one warp before). The block
# size is also the route kernel's count block.
RANK_SWEEP = ((64, 64, 2), (64, 32, 1), (64, 16, 1), (64, 64, 1), (32, 32, 1), (128, 32, 1),
              (128, 64, 2), (16, 32, 1))
# The scan: (blocks a step, experts a program, warps); the first is the default.
SCAN_SWEEP = ((512, 8, 4), (128, 8, 4), (256, 8, 4), (512, 4, 4), (512, 16, 8), (512, 8, 8))


def make_inputs(st: Setup, S: int, gen: torch.Generator):
    """x [S, H, D] bf16, gate [H*E, D] fp32 (trained-router scale), bias [H, E] fp32."""
    x = torch.randn(S, st.H, st.D, device=st.device, generator=gen).to(torch.bfloat16)
    gate = torch.randn(st.H * st.E, st.D, device=st.device, generator=gen) * st.D**-0.5
    bias = torch.randn(st.H, st.E, device=st.device, generator=gen) * 0.02
    return x, gate, bias


def logits_gemm(st: Setup, x, gate, dtype=torch.float32):
    """Router logits [H, S, E] as the unfused path computes them (cuBLAS fp32, no tf32)."""
    g = gate.view(st.H, st.E, st.D).to(dtype)
    return torch.bmm(x.transpose(0, 1).to(dtype), g.transpose(1, 2))


def fused(st: Setup, x, gate, bias, score_func="sigmoid", **kw):
    return triton_logits_route(x, gate.view(st.H, st.E, st.D), st.K, score_func, bias, True,
                               1e-12, SCALE, **kw)


def route(st: Setup, logits, bias, score_func="sigmoid", **kw):
    return triton_route(logits, st.K, score_func, bias, True, 1e-12, SCALE, **kw)


def published_route_layout(st: Setup, logits, bias):
    """The published MAGI-2 style: sigmoid, bias, torch.topk, normalise, argsort + bincount."""
    H, E, K = st.H, st.E, st.K
    scores = torch.sigmoid(logits)
    _, idx = torch.topk(scores + bias.view(H, 1, E), K, dim=-1)
    probs = scores.gather(-1, idx)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12) * SCALE
    flat = (idx + torch.arange(H, device=idx.device).view(H, 1, 1) * E).reshape(-1)
    order = torch.argsort(flat, stable=True)
    gather_ids = (order // K % logits.shape[1]).to(torch.int32)
    sorted_probs = probs.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=H * E)
    offsets = torch.zeros(H * E + 1, device=idx.device, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return gather_ids, sorted_probs, offsets


def same(xs, ys) -> bool:
    """Every pair of tensors bitwise equal (shapes, dtypes and values; NaN equals NaN)."""
    def eq(a, b):
        if a.is_floating_point() and b.is_floating_point():
            return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0),
                                                                     b.nan_to_num(0.0))
        return torch.equal(a, b)
    return all(eq(a, b) for a, b in zip(xs, ys, strict=True))


def block_counts_ref(indices, E: int, block_t: int):
    """[H, cdiv(S, block_t), E] int32 by torch: the counts the route kernels must make."""
    H, S, _ = indices.shape
    NB = triton.cdiv(S, block_t)
    blocks = (torch.arange(S, device=indices.device) // block_t).view(1, S, 1)
    heads = torch.arange(H, device=indices.device).view(H, 1, 1)
    flat = ((heads * NB + blocks) * E + indices).reshape(-1)
    return torch.bincount(flat, minlength=H * NB * E).view(H, NB, E).to(torch.int32)


def near_tie_rows(st: Setup, logits, bias, score_func="sigmoid", tol=TIE):
    """Rows whose reference selection has two adjacent scores (top K+1) within tol relative."""
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, -1)
    sel = scores + bias.view(st.H, 1, st.E).to(scores.dtype)
    top = torch.sort(sel, dim=-1, descending=True).values[..., :st.K + 1]
    gap = (top[..., :-1] - top[..., 1:]).abs() <= tol * top[..., :-1].abs()
    return gap.any(-1)


def compare(st: Setup, p, i, ref_logits, bias, score_func) -> dict:
    """The issue's criterion against route_reference on ref_logits."""
    pr, ir = route_reference(ref_logits, st.K, score_func, bias.to(ref_logits.dtype), True,
                             1e-12, SCALE)
    ties = near_tie_rows(st, ref_logits, bias, score_func)
    differ = (i != ir).any(-1)
    rel = (p.double() - pr.double()).abs() / pr.double().abs()
    return {"rows": differ.numel(), "near_tie_rows": int(ties.sum()),
            "index_mismatch": int((differ & ~ties).sum()),
            "index_mismatch_any": int(differ.sum()),
            "probs_max_rel": rel[~differ].max().item() if (~differ).any() else None}


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def check_fused(st: Setup, gen: torch.Generator) -> dict:
    """Accuracy of the fused kernel at S = check_s (recorded; misses are flagged, not fatal)."""
    S = st.check_s
    x, gate, bias = make_inputs(st, S, gen)
    logits32 = logits_gemm(st, x, gate)
    logits64 = logits_gemm(st, x, gate, torch.float64)
    res = {}
    for sf in ("sigmoid", "softmax"):
        p, i, lg = fused(st, x, gate, bias, sf, return_logits=True)
        res[f"{sf}_vs_torch_fp32"] = compare(st, p, i, logits32, bias, sf)
        res[f"{sf}_vs_float64"] = compare(st, p, i, logits64, bias, sf)
        # PyTorch's own fp32 path against float64: the scale of fp32 rounding itself
        p32, i32 = route_reference(logits32, st.K, sf, bias, True, 1e-12, SCALE)
        res[f"{sf}_torch_fp32_vs_float64"] = compare(st, p32, i32, logits64, bias, sf)
        res[f"{sf}_logits_max_abs_vs_fp32"] = (lg - logits32).abs().max().item()
        res[f"{sf}_logits_max_abs_vs_float64"] = (lg.double() - logits64).abs().max().item()
        res[f"{sf}_torch_logits_max_abs_vs_float64"] = (logits32.double() -
                                                        logits64).abs().max().item()
        # the fused routing of its own logits is the unfused kernel's, bitwise
        res[f"{sf}_own_logits_route_equal"] = same((p, i), route(st, lg, bias, sf))
    ok = all(res[f"sigmoid_vs_{r}"]["index_mismatch"] == 0 and
             res[f"sigmoid_vs_{r}"]["probs_max_rel"] <= TIE for r in ("torch_fp32", "float64"))
    res["sigmoid_within_issue_bounds"] = ok
    if not ok:
        print("WARNING: fused sigmoid routing outside the issue's bounds:",
              json.dumps({k: v for k, v in res.items() if k.startswith("sigmoid")}), flush=True)
    # Other tiles: the gather mode never changes a bit; other tiles may round the logits
    # differently (block_d changes the accumulation order), recorded.
    base = fused(st, x, gate, bias)[:2]
    for cfg in FUSED_SWEEP[1:]:
        try:
            res[f"equal_{tag(cfg)}"] = same(fused(st, x, gate, bias, config=cfg)[:2], base)
        except Exception as err:  # an out-of-resources tile must not end the run
            res[f"equal_{tag(cfg)}"] = f"failed: {type(err).__name__}: {err}"[:300]
    # Gradients through the probabilities: fused against the unfused path.
    grads = {}
    grad_p = torch.randn(st.H, S, st.K, device=st.device, generator=gen)
    for f in (True, False):
        xx = x.clone().requires_grad_()
        gg = gate.view(st.H, st.E, st.D).clone().requires_grad_()
        p, _ = route_tokens(xx, gg, st.K, "sigmoid", bias, route_scale=SCALE, backend="triton",
                            fused=f)
        (p * grad_p).sum().backward()
        grads[f] = (xx.grad, gg.grad)
    res["grad_x_rel_err"] = rel_err(grads[True][0], grads[False][0])
    res["grad_gate_rel_err"] = rel_err(grads[True][1], grads[False][1])
    # NaN inputs: the row's probabilities NaN, other rows as the reference on the kernel's
    # own logits.
    xb = x.clone()
    xb[0, 0, 5] = float("nan")
    p, i, lg = fused(st, xb, gate, bias, return_logits=True)
    pr, ir = route_reference(lg, st.K, "sigmoid", bias, True, 1e-12, SCALE)
    res["nan_indices_equal"] = bool(torch.equal(i, ir))
    res["nan_probs_equal"] = bool(torch.allclose(p, pr, rtol=TIE, atol=0, equal_nan=True))
    res["nan_row_is_nan"] = bool(torch.isnan(p[0, 0]).all())
    # No host synchronisation: fused route, then the layout.
    if st.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            p, i = route_tokens(x, gate.view(st.H, st.E, st.D), st.K, "sigmoid", bias,
                                route_scale=SCALE, fused=True)
            sort_routes(p, i, st.E)
            p, i, c = route_tokens(x, gate.view(st.H, st.E, st.D), st.K, "sigmoid", bias,
                                   route_scale=SCALE, fused=True, block_counts=True)
            sort_routes(p, i, st.E, block_counts=c)
            res["no_host_sync"] = True
        except RuntimeError as err:
            res["no_host_sync"] = f"failed: {err}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return res


def check_route_layout(st: Setup, gen: torch.Generator) -> dict:
    """The unfused Triton route and the layout against the reference (asserted, as in v3)."""
    S = st.check_s
    x, gate, bias = make_inputs(st, S, gen)
    logits = logits_gemm(st, x, gate)
    res = {}
    for sf in ("sigmoid", "softmax"):
        p, i = route(st, logits, bias, sf)
        res[sf] = compare(st, p, i, logits, bias, sf)
        assert res[sf]["index_mismatch"] == 0 and res[sf]["probs_max_rel"] <= TIE, (sf, res)
    p, i = route(st, logits, bias)
    ref = sort_routes_reference(p, i, st.E)
    res["layout_equal"] = same(triton_sort_routes(p, i, st.E), ref)
    for bt, sub in ((1, 1), (8, 8), (32, 8), (64, 4), (64, 8), (128, 8)):
        res[f"layout_equal_block{bt}_sub{sub}"] = same(
            triton_sort_routes(p, i, st.E, block_t=bt, sub_t=sub, ranks="count"), ref)
    skew = i.clone()  # one expert takes every token of head 0
    skew[0, :, 0] = 3
    skew[0, :, 1:] = torch.randint(4, st.E, (S, st.K - 1), device=st.device, generator=gen)
    res["layout_skew_equal"] = same(triton_sort_routes(p, skew, st.E),
                                    sort_routes_reference(p, skew, st.E))
    res["layout_repeat_equal"] = same(triton_sort_routes(p, i, st.E),
                                      triton_sort_routes(p, i, st.E))
    # v6: counts from the route kernels, the layout without its count step.
    T = R.layout_block_t(st.K)
    pc, ic, counts = route(st, logits, bias, count_block_t=T)
    res["counted_route_same_picks"] = same((pc, ic), (p, i))
    res["route_counts_equal"] = bool(torch.equal(counts, block_counts_ref(i, st.E, T)))
    res["layout_from_counts_equal"] = same(triton_sort_routes(p, i, st.E, block_counts=counts),
                                           ref)
    res["layout_from_counts_repeat_equal"] = same(
        triton_sort_routes(p, i, st.E, block_counts=counts),
        triton_sort_routes(p, i, st.E, block_counts=counts))
    res["layout_scatter_equal"] = same(triton_sort_routes(p, i, st.E, ranks="scatter"), ref)
    for bt, chunk, _ in RANK_SWEEP:
        c = route(st, logits, bias, count_block_t=bt)[2]
        res[f"layout_from_counts_equal_block{bt}_chunk{chunk}"] = same(
            triton_sort_routes(p, i, st.E, block_counts=c, block_t=bt, chunk=chunk), ref)
    res["layout_scatter_skew_equal"] = same(
        triton_sort_routes(p, skew, st.E, ranks="scatter"), sort_routes_reference(p, skew, st.E))
    # one expert takes every token of head 0, chosen by the router itself
    lg_skew = logits.clone()
    lg_skew[0, :, 3] = 30.0
    ps, is_, cs = route(st, lg_skew, bias, count_block_t=T)
    res["layout_from_counts_skew_equal"] = bool((is_[0] == 3).any(-1).all()) and same(
        triton_sort_routes(ps, is_, st.E, block_counts=cs), sort_routes_reference(ps, is_, st.E))
    # NaN and inf rows: indices in range, counts of them, the reference's layout
    lg_nan = logits.clone()
    lg_nan[0, 0] = float("nan")
    lg_nan[1, 5, :7] = float("inf")
    lg_nan[st.H - 1, 9, 4] = float("nan")
    pn, in_, cn = route(st, lg_nan, bias, count_block_t=T)
    res["nan_route_counts_equal"] = bool(torch.equal(cn, block_counts_ref(in_, st.E, T)))
    res["nan_layout_from_counts_equal"] = same(
        triton_sort_routes(pn, in_, st.E, block_counts=cn), sort_routes_reference(pn, in_, st.E))
    # the split logits kernel zeroes the counts, the route kernel adds (the sm_90 default)
    pf, if_, _, cf = fused(st, x, gate, bias, count_block_t=T)
    res["fused_counts_equal"] = bool(torch.equal(cf, block_counts_ref(if_, st.E, T)))
    res["fused_layout_from_counts_equal"] = same(
        triton_sort_routes(pf, if_, st.E, block_counts=cf), sort_routes_reference(pf, if_, st.E))
    for key, value in res.items():
        assert value is not False, (key, res)
    return res


def tag(cfg: LogitsRouteConfig) -> str:
    return (f"s{cfg.block_s}_d{cfg.block_d}_w{cfg.num_warps}_st{cfg.num_stages}"
            f"{'_split' if cfg.split else '_tile' if cfg.from_tile else '_mem'}"
            f"{'_half' if cfg.half_stores else ''}{f'_e{cfg.block_e}' if cfg.block_e else ''}")


def make_bench(st: Setup):
    """bench(fn, inputs, graph=False): median ms of fn over rotating input sets."""

    def bench(fn, inputs, graph=False) -> float:
        state = {"n": 0}

        def step():
            args = inputs[state["n"] % len(inputs)]
            state["n"] += 1
            return fn(*args)

        if st.device != "cuda":
            return time_fn(step, warmup=1, runs=3).median_ms
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            # Capture needs a fixed input: replays time the launch-free GPU work.
            return do_bench_cudagraph(lambda: fn(*inputs[0]), rep=50, return_mode="median")
        return do_bench(step, warmup=10, rep=60, return_mode="median")

    return bench


def sweep(st: Setup, gen: torch.Generator, bench) -> list[dict]:
    """Fused tiles, count-step blocks and the layout steps at S = sweep_s."""
    S = st.sweep_s
    rows = []
    x, gate, bias = make_inputs(st, S, gen)
    sets = [(x, gate, bias)]
    for cfg in FUSED_SWEEP:
        for with_logits in (False, True):
            try:
                ms = bench(lambda x, g, b, c=cfg, w=with_logits: fused(
                    st, x, g, b, config=c, return_logits=w), sets)
            except Exception as err:
                ms = f"failed: {type(err).__name__}: {err}"[:300]
            rows.append({"what": "sweep_fused", "S": S, **asdict(cfg),
                         "return_logits": with_logits, "ms": ms})
            print(f"sweep fused {tag(cfg)} logits={with_logits}: {ms}", flush=True)
    p, i, _ = fused(st, x, gate, bias)
    for bt, sub, nw in COUNT_SWEEP:
        count_ms = bench(lambda ii, bt=bt, sub=sub, nw=nw: R._layout_count(ii, st.E, bt, sub, nw),
                         [(i,)])
        sort_ms = bench(lambda pp, ii, bt=bt, sub=sub: triton_sort_routes(
            pp, ii, st.E, block_t=bt, sub_t=sub, ranks="count"), [(p, i)])
        rows.append({"what": "sweep_count", "S": S, "block_t": bt, "sub_t": sub,
                     "count_warps": nw, "count_ms": count_ms, "sort_ms": sort_ms})
        print(f"sweep count block_t={bt} sub_t={sub} warps={nw}: count {count_ms:.4f} ms, "
              f"whole layout (default warps) {sort_ms:.4f} ms", flush=True)
    # The four layout steps one by one, default blocks (64 tokens, sub-blocks of 8).
    bt, sub = 64, 8
    n = st.H * S * st.K
    gid = torch.empty(n, device=st.device, dtype=torch.int32)
    sp = torch.empty(n, device=st.device)
    pos = torch.empty_like(gid)
    hist, rank = R._layout_count(i, st.E, bt, sub)
    base, totals = R._layout_scan(hist)
    offsets = R._layout_offsets(totals, S, st.K)
    steps = {
        "count": lambda: R._layout_count(i, st.E, bt, sub),
        "scan": lambda: R._layout_scan(hist),
        "offsets": lambda: R._layout_offsets(totals, S, st.K),
        "scatter": lambda: R._layout_scatter(i, p, rank, base, offsets, gid, sp, pos, bt),
    }
    for name, fn in steps.items():
        ms = bench(fn, [()])
        rows.append({"what": "sort_step", "S": S, "step": name, "block_t": bt, "sub_t": sub,
                     "ms": ms})
        print(f"sort step {name}: {ms:.4f} ms", flush=True)
    rows += sweep_counts_path(st, S, x, gate, bias, p, i, bench)
    return rows


def split_sweep(st: Setup, gen: torch.Generator, bench) -> list[dict]:
    """--split-sweep: the split tiles of FUSED_SWEEP at S = sweep_s as the layer runs them
    (logits + route counting, then the layout from the counts). Each is checked bitwise
    against a reference tile with the same K step (64 tokens x all E on 4 warps, 2 stages,
    the logits stored whole: other K steps round the logits differently), and against
    float64's routing."""
    from dataclasses import replace

    S = st.sweep_s
    T = R.layout_block_t(st.K)
    sets = [make_inputs(st, S, gen) for _ in range(2)]
    x, gate, bias = sets[0]
    logits64 = logits_gemm(st, x, gate, torch.float64)
    rows = []
    for cfg in [c for c in FUSED_SWEEP if c.split]:
        row = {"what": "split_sweep", "S": S, **asdict(cfg)}
        try:
            got = fused(st, x, gate, bias, config=cfg, count_block_t=T)
            plain = replace(cfg, half_stores=False, block_e=None, block_s=64, num_warps=4,
                            num_stages=2)
            base = fused(st, x, gate, bias, config=plain, count_block_t=T)
            row["equal_plain_store"] = same((got[0], got[1], got[3]),
                                            (base[0], base[1], base[3]))
            row["vs_float64"] = compare(st, got[0], got[1], logits64, bias, "sigmoid")
            row["route_counting_ms"] = bench(lambda x, g, b, c=cfg: fused(
                st, x, g, b, config=c, count_block_t=T), sets)
            row["route_layout_ms"] = bench(lambda x, g, b, c=cfg: _total(st, x, g, b, c, T),
                                           sets)
        except Exception as err:  # an out-of-resources tile must not end the run
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _total(st: Setup, x, gate, bias, cfg, T):
    p, i, _, c = fused(st, x, gate, bias, config=cfg, count_block_t=T)
    return triton_sort_routes(p, i, st.E, block_counts=c)


def sweep_counts_path(st: Setup, S, x, gate, bias, p, i, bench) -> list[dict]:
    """v6 at S: the route kernels with and without counting, the new layout's steps one by
    one, the ranking scatter's blocks, chunks and warps, the scan's steps."""
    rows = []
    T = R.layout_block_t(st.K)
    lg = logits_gemm(st, x, gate)
    n = st.H * S * st.K
    gid = torch.empty(n, device=st.device, dtype=torch.int32)
    sp = torch.empty(n, device=st.device)
    pos = torch.empty_like(gid)
    offsets = torch.empty(st.H * st.E + 1, device=st.device, dtype=torch.int64)
    counts = route(st, lg, bias, count_block_t=T)[2]
    base, totals = R._layout_scan(counts)
    steps = {
        "route": lambda: route(st, lg, bias),
        "route_counting": lambda: route(st, lg, bias, count_block_t=T),
        "fused": lambda: fused(st, x, gate, bias),
        "fused_counting": lambda: fused(st, x, gate, bias, count_block_t=T),
        "hist (ranks=scatter, no counts)": lambda: R._layout_hist(i, st.E, T),
        "scan": lambda: R._layout_scan(counts),
        # the default chunk and warps (RANK_SWEEP's first entry)
        "rank_scatter": lambda: R._layout_rank_scatter(i, p, base, totals, offsets, gid, sp, pos,
                                                       T, *RANK_SWEEP[0][1:]),
        "layout_from_counts": lambda: triton_sort_routes(p, i, st.E, block_counts=counts),
        "layout_ranks_scatter": lambda: triton_sort_routes(p, i, st.E, ranks="scatter"),
        "layout_ranks_count": lambda: triton_sort_routes(p, i, st.E, ranks="count"),
    }
    for name, fn in steps.items():
        ms = bench(fn, [()])
        rows.append({"what": "counts_step", "S": S, "step": name, "block_t": T, "ms": ms})
        print(f"v6 step {name}: {ms:.4f} ms", flush=True)
    for bt, chunk, nw in RANK_SWEEP:
        c = route(st, lg, bias, count_block_t=bt)[2]
        b2, t2 = R._layout_scan(c)
        ms = bench(lambda bt=bt, chunk=chunk, nw=nw, b2=b2, t2=t2: R._layout_rank_scatter(
            i, p, b2, t2, offsets, gid, sp, pos, min(bt, triton.next_power_of_2(S)), chunk, nw),
            [()])
        whole = bench(lambda bt=bt, chunk=chunk, c=c: triton_sort_routes(
            p, i, st.E, block_counts=c, block_t=bt, chunk=chunk), [()])
        rows.append({"what": "sweep_rank_scatter", "S": S, "block_t": bt, "chunk": chunk,
                     "warps": nw, "rank_scatter_ms": ms, "layout_from_counts_ms": whole})
        print(f"sweep rank scatter block_t={bt} chunk={chunk} warps={nw}: {ms:.4f} ms, layout "
              f"from counts {whole:.4f} ms", flush=True)
    for bb, ec, nw in SCAN_SWEEP:
        ms = bench(lambda bb=bb, ec=ec, nw=nw: R._layout_scan(counts, ec, bb, nw), [()])
        rows.append({"what": "sweep_scan", "S": S, "block_b": bb, "block_ec": ec, "warps": nw,
                     "ms": ms})
        print(f"sweep scan block_b={bb} experts={ec} warps={nw}: {ms:.4f} ms", flush=True)
    return rows


def timings(st: Setup, gen: torch.Generator, bench) -> tuple[list[dict], list[dict]]:
    rows, table = [], []
    H, E, D = st.H, st.E, st.D
    for S in st.sizes:
        # Rotate input sets so that small S does not just time L2 (up to 4 x 256 MB logits).
        n_sets = max(1, min(4, (256 * 2**20) // (H * S * E * 4)))
        data = [make_inputs(st, S, gen) for _ in range(n_sets)]
        lgs = [(logits_gemm(st, x, g), b) for x, g, b in data]
        pis = [fused(st, x, g, b)[:2] for x, g, b in data]
        T = R.layout_block_t(st.K)
        pics = [(pp, ii, cc) for pp, ii, _, cc in (fused(st, x, g, b, count_block_t=T)
                                                   for x, g, b in data)]
        r = {"S": S, "input_sets": n_sets}
        r["gemm"] = bench(lambda x, g, b: logits_gemm(st, x, g), data)
        r["route"] = bench(lambda lg, b: route(st, lg, b), lgs)
        r["route_counting"] = bench(lambda lg, b, T=T: route(st, lg, b, count_block_t=T), lgs)
        r["gemm+route"] = bench(lambda x, g, b: route(st, logits_gemm(st, x, g), b), data)
        r["fused"] = bench(lambda x, g, b: fused(st, x, g, b), data)
        r["fused_with_logits"] = bench(lambda x, g, b: fused(st, x, g, b, return_logits=True),
                                       data)
        r["fused_counting"] = bench(lambda x, g, b, T=T: fused(st, x, g, b, count_block_t=T),
                                    data)
        r["layout"] = bench(lambda p, i: triton_sort_routes(p, i, E, ranks="count"), pis)
        r["layout_from_counts"] = bench(
            lambda p, i, c: triton_sort_routes(p, i, E, block_counts=c), pics)
        r["layout_ranks_scatter"] = bench(
            lambda p, i: triton_sort_routes(p, i, E, ranks="scatter"), pis)
        r["unfused_total"] = bench(
            lambda x, g, b: triton_sort_routes(*route(st, logits_gemm(st, x, g), b), E,
                                               ranks="count"), data)
        r["fused_total"] = bench(
            lambda x, g, b: triton_sort_routes(*fused(st, x, g, b)[:2], E, ranks="count"), data)
        r["fused_total_counts"] = bench(lambda x, g, b: new_total(st, x, g, b), data)
        if st.device == "cuda":
            r["fused_total_graph"] = bench(
                lambda x, g, b: triton_sort_routes(*fused(st, x, g, b)[:2], E, ranks="count"), data,
                graph=True)
            r["fused_total_counts_graph"] = bench(lambda x, g, b: new_total(st, x, g, b), data,
                                                  graph=True)
        r["published+gemm"] = bench(
            lambda x, g, b: published_route_layout(st, logits_gemm(st, x, g), b), data)
        flops = 2 * S * H * E * D
        r["gemm_TFLOPs"] = flops / r["gemm"] / 1e9
        r["fused_TFLOPs_bf16"] = 3 * flops / r["fused"] / 1e9  # three bf16 dots
        rows.append({"what": "time", **r})
        table.append(r)
        print(json.dumps(r), flush=True)
        del data, lgs, pis, pics
    return rows, table


def new_total(st: Setup, x, gate, bias):
    """v6: logits + route counting per block, then the layout from those counts."""
    p, i, _, c = fused(st, x, gate, bias, count_block_t=R.layout_block_t(st.K))
    return triton_sort_routes(p, i, st.E, block_counts=c)


def sm90_compile(fn, sig: dict, constexprs: dict, num_warps: int, num_stages: int = 1,
                 divisible=("S",)) -> str:
    """Compile fn for sm_90 here (no GPU): 'registers R, spill stores/loads (a, b) B,
    shared N B' from ptxas -v."""
    import re
    import subprocess
    import tempfile

    from mhmoe.kernels.sass_audit import compile_sm90, toolchain

    kernel = compile_sm90(fn, sig, constexprs, num_warps, num_stages, divisible)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    info = subprocess.run([toolchain()[0], "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
                          capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", info)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return (f"registers {regs[0] if regs else '?'}, spill stores/loads "
            f"{spill[0] if spill else '?'} B, shared {kernel.metadata.shared} B")


def compile_only(args) -> None:
    """sm_90 compile here (no GPU) of the fused kernel's sweep tiles, the route kernel and
    the layout kernels at their swept settings: registers, spills, shared memory."""
    st = Setup()
    BK = triton.next_power_of_2(st.K)
    T = 64  # the GPU's layout_block_t
    fn = R._logits_route_kernel
    for cfg in FUSED_SWEEP:
        for write in sorted({not cfg.from_tile, True}):
            for count_t in (0, T):
                bn = min(cfg.block_e or st.E, st.E) if cfg.split else st.E
                sig = {"x_desc": f"tensordesc<bf16[{cfg.block_s}, {cfg.block_d}]>",
                       "w_desc": f"tensordesc<bf16[{bn}, {cfg.block_d}]>",
                       "logits_ptr": "*fp32", "bias_ptr": "*fp32", "probs_ptr": "*fp32",
                       "indices_ptr": "*i64", "counts_ptr": "*i32", "S": "i32", "H": "i32",
                       "NB": "i32", "group_size": "i32", "norm_eps": "fp32",
                       "route_scale": "fp32"}
                cx = dict(E=st.E, D=st.D, TOP_K=st.K, SOFTMAX=False, HAS_BIAS=True,
                          ROUTE_NORM=True, NUM_GROUPS=1, TOPK_GROUPS=1, BLOCK_S=cfg.block_s,
                          BLOCK_D=cfg.block_d, BLOCK_K=BK, BLOCK_G=1, WRITE_LOGITS=write,
                          FROM_TILE=cfg.from_tile, INTERPRET=False, ROUTE=not cfg.split,
                          COUNT_T=count_t, HALF_STORES=cfg.half_stores,
                          BLOCK_N=min(cfg.block_e or st.E, st.E) if cfg.split else st.E)
                info = sm90_compile(fn, sig, cx, cfg.num_warps, cfg.num_stages)
                print(f"logits{'' if cfg.split else '+route'} {tag(cfg)} write_logits={write} "
                      f"count_t={count_t}: {info}", flush=True)
    # stride_le = 1 is a constant, as the JIT specializes it at a launch (16-byte loads)
    route_sig = {"logits_ptr": "*fp32", "stride_lh": "i32", "stride_ls": "i32",
                 "bias_ptr": "*fp32", "probs_ptr": "*fp32",
                 "indices_ptr": "*i64", "counts_ptr": "*i32", "S": "i32", "NB": "i32",
                 "group_size": "i32", "norm_eps": "fp32", "route_scale": "fp32"}
    for count_t in (0, T):
        cx = dict(E=st.E, TOP_K=st.K, SOFTMAX=False, HAS_BIAS=True, ROUTE_NORM=True,
                  NUM_GROUPS=1, TOPK_GROUPS=1, BLOCK_ROWS=2, BLOCK_E=st.E, BLOCK_K=BK, BLOCK_G=1,
                  ITERS=1, INTERPRET=False, COUNT_T=count_t, stride_le=1)
        info = sm90_compile(R._route_kernel, route_sig, cx, 1,
                            divisible=("S", "stride_lh", "stride_ls"))
        print(f"route 2 rows 1 warp count_t={count_t}: {info}", flush=True)
    idx = {"indices_ptr": "*i64"}
    for bt, sub, nw in COUNT_SWEEP:
        sig = {**idx, "hist_ptr": "*i32", "rank_ptr": "*i32", "S": "i32", "NB": "i32"}
        cx = dict(E=st.E, TOP_K=st.K, BLOCK_T=bt, SUB_T=sub, BLOCK_K=BK, BLOCK_E=st.E)
        print(f"count (ranks=count) block_t={bt} sub_t={sub} warps={nw}: "
              f"{sm90_compile(R._layout_count_kernel, sig, cx, nw)}", flush=True)
    sig = {**idx, "hist_ptr": "*i32", "S": "i32", "NB": "i32"}
    cx = dict(E=st.E, TOP_K=st.K, BLOCK_T=T, BLOCK_R=triton.next_power_of_2(T * st.K),
              BLOCK_E=st.E)
    print(f"hist (ranks=scatter) block_t={T} warps=4: "
          f"{sm90_compile(R._layout_hist_kernel, sig, cx, 4)}", flush=True)
    for bb, ec, nw in SCAN_SWEEP:
        sig = {"hist_ptr": "*i32", "base_ptr": "*i32", "totals_ptr": "*i32", "NB": "i32"}
        cx = dict(E=st.E, BLOCK_B=bb, BLOCK_EC=ec)
        print(f"scan block_b={bb} experts={ec} warps={nw}: "
              f"{sm90_compile(R._layout_scan_kernel, sig, cx, nw, divisible=('NB',))}",
              flush=True)
    sig = {**idx, "probs_ptr": "*fp32", "base_ptr": "*i32", "totals_ptr": "*i32",
           "offsets_ptr": "*i64", "gather_ids_ptr": "*i32", "sorted_probs_ptr": "*fp32",
           "positions_ptr": "*i32", "S": "i32", "NB": "i32"}
    for bt, chunk, nw in RANK_SWEEP:
        cx = dict(E=st.E, TOP_K=st.K, BLOCK_T=bt, BLOCK_R=chunk, BLOCK_E=st.E)
        print(f"rank scatter block_t={bt} chunk={chunk} warps={nw}: "
              f"{sm90_compile(R._layout_rank_scatter_kernel, sig, cx, nw)}", flush=True)
    sig = {**idx, "probs_ptr": "*fp32", "rank_ptr": "*i32", "base_ptr": "*i32",
           "offsets_ptr": "*i64", "gather_ids_ptr": "*i32", "sorted_probs_ptr": "*fp32",
           "positions_ptr": "*i32", "S": "i32", "NB": "i32"}
    cx = dict(E=st.E, TOP_K=st.K, BLOCK_T=T, BLOCK_K=BK)
    print(f"scatter (ranks=count) block_t={T} warps=4: "
          f"{sm90_compile(R._layout_scatter_kernel, sig, cx, 4)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="routing.json")
    parser.add_argument("--sizes", default=None, help="comma-separated S (default: 1K..32K)")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--split-sweep", action="store_true",
                        help="only the peaks and the split tiles at S = 32768 (the layer's path)")
    parser.add_argument("--cpu", action="store_true",
                        help="dry run on the CPU (Triton interpreter, toy sizes)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the routing kernels for sm_90 here; print regs/smem/spills")
    args = parser.parse_args()
    if args.compile_only:
        compile_only(args)
        return
    st = CPU_SETUP if args.cpu else Setup()
    if args.sizes:
        st = Setup(**{**asdict(st), "sizes": tuple(int(s) for s in args.sizes.split(","))})
    torch.backends.cuda.matmul.allow_tf32 = False  # the spec: fp32 logits
    meta = {"env": environment(st.device), "setup": asdict(st),
            "fused_default": asdict(R.logits_route_config(torch.device(st.device)))}
    gen = torch.Generator(device=st.device).manual_seed(int.from_bytes(os.urandom(4), "little"))
    if st.device == "cuda":
        from mhmoe.bench import copy_bandwidth_tbs

        meta["copy_TBps"] = copy_bandwidth_tbs(st.device)
        meta["matmul_bf16_TFLOPs"] = matmul_peak_tflops(st.device)
        print(f"{meta['env']['device']}  torch {meta['env']['torch']}  triton "
              f"{meta['env']['triton']}  copy {meta['copy_TBps']:.2f} TB/s  bf16 matmul "
              f"{meta['matmul_bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    if args.split_sweep:
        rows = split_sweep(st, gen, make_bench(st))
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        return
    meta["check_fused"] = check_fused(st, gen)
    print("check fused:", json.dumps(meta["check_fused"]), flush=True)
    meta["check_route_layout"] = check_route_layout(st, gen)
    print("check route + layout:", json.dumps(meta["check_route_layout"]), flush=True)

    bench = make_bench(st)
    rows = [] if args.no_sweep else sweep(st, gen, bench)
    time_rows, table = timings(st, gen, bench)
    rows += time_rows

    cols = ["gemm", "route", "route_counting", "gemm+route", "fused", "fused_counting",
            "fused_with_logits", "layout", "layout_from_counts", "layout_ranks_scatter",
            "unfused_total", "fused_total", "fused_total_counts", "fused_total_graph",
            "fused_total_counts_graph", "published+gemm"]
    cols = [c for c in cols if c in table[0]]
    print("\nms (median, do_bench). gemm+route: cuBLAS fp32 logits then the Triton route; "
          "fused: logits + route in one kernel, no logits returned (the default sm_90 tile "
          "still writes them as scratch for its gather), _with_logits: returned (grad "
          "mode); layout: ranks=\"count\" (four steps, as before v7's default moved to "
          "\"scatter\"), which the unfused and fused totals add; _graph: CUDA-graph replay; "
          "_counting: the route "
          "kernels also count each expert's routes per 64-token block; layout_from_counts: "
          "the layout from those counts (no count step); fused_total_counts: the two "
          "together, logits + route counting, then the layout from the counts")
    print(f"{'S':>6} " + " ".join(f"{c:>24}" for c in cols))
    for r in table:
        print(f"{r['S']:>6} " + " ".join(f"{r[c]:>24.4f}" for c in cols))
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
