"""Check and time routing and layout at MAGI-2 dims: logits + route kernels, the layout.

    PYTHONPATH=src python3 benchmarks/bench_routing.py [--sizes 1024,32768] [--no-sweep]
    PYTHONPATH=src python3 benchmarks/bench_routing.py --split-sweep
    PYTHONPATH=src python3 benchmarks/bench_routing.py --cpu --out /tmp/routing_cpu.json

Steps, in order (GPU): device-copy and bf16 8192^3 matmul peaks; checks at S=4096:
the logits + route kernel (`triton_logits_route`) against `route_reference` on torch's
fp32 (cuBLAS) logits and on float64 logits (index mismatches not excused by a 1e-6
relative near-tie, the largest relative probability error; recorded, not asserted, so
that a miss still leaves the timings), its gradients against the unfused path, NaN
rows, no host sync; the route kernel, its block counts and the layout against the
reference (asserted). Then, unless --no-sweep, at S=32768: the logits kernel's tiles
(`FUSED_SWEEP`), the layout steps one by one and the tiles of each (`COUNT_SWEEP`,
`RANK_SWEEP`, `SCAN_SWEEP`), variants of one sweep timed in shuffled interleaved rounds
(`mhmoe.bench.interleaved`; docs/measuring.md says why). Then per S: the cuBLAS fp32
router GEMM, the route kernel (with and without counts), logits + route (without and
with the logits returned, with counts), the layout three ways, the totals eager and
replayed from a CUDA graph, and the published torch recipe (medians of
`mhmoe.bench.bench_ms` and `graph_ms`). A table last.

--split-sweep: the peaks, then only the split tiles of `FUSED_SWEEP` at S=32768 as the
layer runs them (logits + route with counts, and with the layout from the counts), each
checked bitwise against a tile with its K step and against float64's routing.
--cpu: the same steps on the CPU under the Triton interpreter at toy sizes (a dry run
of the script, numbers meaningless, nothing recorded).

Rows (`mhmoe.bench.result_row`: kernel, variant, tokens, ms, GPU, versions, commit)
go to benchmarks/results.jsonl unless --no-record; --out also writes the whole run
(environment, checks, rows) as one JSON file. The register and shared-memory use of
the compiled kernels: `python tools/sass_audit.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if "--cpu" in sys.argv:  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

from mhmoe.bench import (
    append_results,
    bench_ms,
    environment,
    graph_ms,
    interleaved,
    measured_peaks,
    rel_err,
    result_row,
    script_command,
    time_fn,
)
from mhmoe.config import RouterOptions
from mhmoe.kernels.layout import (
    layout_block_t,
    layout_count,
    layout_hist,
    layout_offsets,
    layout_rank_scatter,
    layout_scan,
    layout_scatter,
    triton_sort_routes,
)
from mhmoe.kernels.router_logits import logits_route_config, triton_logits_route
from mhmoe.kernels.topk import triton_route
from mhmoe.kernels.tuning import (
    LOGITS_ROUTE_CONFIGS,
    LayoutScanTiles,
    LogitsRouteConfig,
    interpreting,
    layout_sub_t,
)
from mhmoe.reference import route_reference, sort_routes_reference
from mhmoe.routing import route_tokens, sort_routes

SCALE = 4.9
TIE = 1e-6  # the contract's bound: near-tie (relative gap) and probability error


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

# Tiles of the logits kernel swept at S = 32768; the first is the sm_90 default of
# kernels/tuning.py. What each tried and why the default won: docs/routing.md ("Tiles of
# the logits kernel").
_HALVES = dict(from_tile=False, split=True, half_stores=True)
FUSED_SWEEP = (
    LOGITS_ROUTE_CONFIGS[(9, 0)],
    replace(LOGITS_ROUTE_CONFIGS[(9, 0)], merged_lists=False),  # shortlists by rounds
    replace(LOGITS_ROUTE_CONFIGS[(9, 0)], shortlist=False, merged_lists=False),
    LogitsRouteConfig(128, 32, 4, 3, block_e=128, **_HALVES),
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=3, from_tile=False),
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=2, from_tile=False),
    LogitsRouteConfig(block_s=64, block_d=64, num_warps=4, num_stages=2, from_tile=False),
    LogitsRouteConfig(block_s=128, block_d=32, num_warps=8, num_stages=3, from_tile=False),
    LogitsRouteConfig(block_s=128, block_d=32, num_warps=8, num_stages=2, from_tile=False),
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=8, num_stages=3, from_tile=True),
    LogitsRouteConfig(block_s=64, block_d=64, num_warps=8, num_stages=2, from_tile=True),
    # split: the kernel writes the logits only, a route kernel routes them
    LogitsRouteConfig(block_s=128, block_d=64, num_warps=8, num_stages=2, from_tile=False,
                      split=True),
    LogitsRouteConfig(block_s=128, block_d=32, num_warps=8, num_stages=3, from_tile=False,
                      split=True),
    LogitsRouteConfig(block_s=64, block_d=64, num_warps=4, num_stages=3, from_tile=False,
                      split=True),
    # the logits stored in two column halves
    LogitsRouteConfig(64, 32, 4, 2, **_HALVES),
    LogitsRouteConfig(64, 32, 4, 3, **_HALVES),
    LogitsRouteConfig(64, 16, 4, 4, **_HALVES),
    LogitsRouteConfig(128, 32, 8, 2, **_HALVES),
    LogitsRouteConfig(128, 64, 8, 2, **_HALVES),
    # fewer experts a program (block_e): the weight bytes per token of all-E tiles, the
    # registers and shared memory of smaller ones
    LogitsRouteConfig(128, 64, 4, 2, block_e=128, **_HALVES),
    LogitsRouteConfig(128, 32, 8, 3, block_e=128, **_HALVES),
    LogitsRouteConfig(256, 32, 8, 3, block_e=128, **_HALVES),
    LogitsRouteConfig(128, 64, 4, 3, block_e=64, **_HALVES),
    LogitsRouteConfig(256, 32, 4, 3, block_e=64, **_HALVES),
    LogitsRouteConfig(64, 32, 4, 4, block_e=128, **_HALVES),
    LogitsRouteConfig(64, 32, 4, 3, block_e=128, **_HALVES),
    LogitsRouteConfig(128, 32, 8, 2, block_e=128, **_HALVES),
    LogitsRouteConfig(256, 32, 8, 3, block_e=64, **_HALVES),
)
# The "count" count step: (tokens a block, tokens a sub-block, warps).
COUNT_SWEEP = ((64, 8, 2), (8, 8, 4), (64, 8, 4), (64, 8, 8), (32, 8, 2), (128, 8, 2),
               (64, 4, 2), (16, 8, 2))
# The ranking scatter: (tokens a block, routes a step, warps); the first is the default.
# The block is also the route kernel's count block.
RANK_SWEEP = ((64, 64, 2), (64, 32, 1), (64, 16, 1), (64, 64, 1), (32, 32, 1), (128, 32, 1),
              (128, 64, 2), (16, 32, 1))
# The scan: LayoutScanTiles(blocks a step, experts a program, warps); the first is the
# default.
SCAN_SWEEP = (LayoutScanTiles(512, 8, 4), LayoutScanTiles(128, 8, 4), LayoutScanTiles(256, 8, 4),
              LayoutScanTiles(512, 4, 4), LayoutScanTiles(512, 16, 8), LayoutScanTiles(512, 8, 8))


def options(st: Setup, score_func: str = "sigmoid") -> RouterOptions:
    return RouterOptions(st.K, score_func, route_scale=SCALE)


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
    return triton_logits_route(x, gate.view(st.H, st.E, st.D), options(st, score_func), bias,
                               **kw)


def route(st: Setup, logits, bias, score_func="sigmoid", **kw):
    return triton_route(logits, options(st, score_func), bias, **kw)


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


def layout3(out):
    """(gather_ids, sorted_probs, offsets) of a `triton_sort_routes` result."""
    return out.gather_ids, out.sorted_probs, out.offsets


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
    """The contract's criterion against route_reference on ref_logits."""
    pr, ir = route_reference(ref_logits, st.K, score_func, bias.to(ref_logits.dtype), True,
                             1e-12, SCALE)
    ties = near_tie_rows(st, ref_logits, bias, score_func)
    differ = (i != ir).any(-1)
    rel = (p.double() - pr.double()).abs() / pr.double().abs()
    return {"rows": differ.numel(), "near_tie_rows": int(ties.sum()),
            "index_mismatch": int((differ & ~ties).sum()),
            "index_mismatch_any": int(differ.sum()),
            "probs_max_rel": rel[~differ].max().item() if (~differ).any() else None}


def tag(cfg: LogitsRouteConfig) -> str:
    return (f"s{cfg.block_s}_d{cfg.block_d}_w{cfg.num_warps}_st{cfg.num_stages}"
            f"{'_split' if cfg.split else '_tile' if cfg.from_tile else '_mem'}"
            f"{'_half' if cfg.half_stores else ''}{f'_e{cfg.block_e}' if cfg.block_e else ''}"
            f"{'_tma' if cfg.tma_store else ''}{'_short' if cfg.shortlist else ''}"
            f"{'_merged' if cfg.merged_lists else ''}")


# ----------------------------------------------------------------------------- checks


def check_fused(st: Setup, gen: torch.Generator) -> dict:
    """Accuracy of the logits + route kernel at S = check_s (recorded; misses are flagged,
    not fatal)."""
    S = st.check_s
    x, gate, bias = make_inputs(st, S, gen)
    logits32 = logits_gemm(st, x, gate)
    logits64 = logits_gemm(st, x, gate, torch.float64)
    res = {}
    for sf in ("sigmoid", "softmax"):
        p, i, lg, _ = fused(st, x, gate, bias, sf, return_logits=True)
        res[f"{sf}_vs_torch_fp32"] = compare(st, p, i, logits32, bias, sf)
        res[f"{sf}_vs_float64"] = compare(st, p, i, logits64, bias, sf)
        # PyTorch's own fp32 path against float64: the scale of fp32 rounding itself
        p32, i32 = route_reference(logits32, st.K, sf, bias, True, 1e-12, SCALE)
        res[f"{sf}_torch_fp32_vs_float64"] = compare(st, p32, i32, logits64, bias, sf)
        res[f"{sf}_logits_max_abs_vs_fp32"] = (lg - logits32).abs().max().item()
        res[f"{sf}_logits_max_abs_vs_float64"] = (lg.double() - logits64).abs().max().item()
        res[f"{sf}_torch_logits_max_abs_vs_float64"] = (logits32.double() -
                                                        logits64).abs().max().item()
        # the routing of its own logits is the route kernel's, bitwise
        res[f"{sf}_own_logits_route_equal"] = same((p, i), route(st, lg, bias, sf)[:2])
    ok = all(res[f"sigmoid_vs_{r}"]["index_mismatch"] == 0 and
             res[f"sigmoid_vs_{r}"]["probs_max_rel"] <= TIE for r in ("torch_fp32", "float64"))
    res["sigmoid_within_contract_bounds"] = ok
    if not ok:
        print("WARNING: fused sigmoid routing outside the contract's bounds:",
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
        p = route_tokens(xx, gg, options(st), bias, backend="triton", fused=f).probs
        (p * grad_p).sum().backward()
        grads[f] = (xx.grad, gg.grad)
    res["grad_x_rel_err"] = rel_err(grads[True][0], grads[False][0])
    res["grad_gate_rel_err"] = rel_err(grads[True][1], grads[False][1])
    # NaN inputs: the row's probabilities NaN, other rows as the reference on the kernel's
    # own logits.
    xb = x.clone()
    xb[0, 0, 5] = float("nan")
    p, i, lg, _ = fused(st, xb, gate, bias, return_logits=True)
    pr, ir = route_reference(lg, st.K, "sigmoid", bias, True, 1e-12, SCALE)
    res["nan_indices_equal"] = bool(torch.equal(i, ir))
    res["nan_probs_equal"] = bool(torch.allclose(p, pr, rtol=TIE, atol=0, equal_nan=True))
    res["nan_row_is_nan"] = bool(torch.isnan(p[0, 0]).all())
    # No host synchronisation: fused route, then the layout.
    if st.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            gate3 = gate.view(st.H, st.E, st.D)
            routes = route_tokens(x, gate3, options(st), bias, fused=True)
            sort_routes(routes.probs, routes.indices, st.E)
            routes = route_tokens(x, gate3, options(st), bias, fused=True, block_counts=True)
            sort_routes(routes.probs, routes.indices, st.E, block_counts=routes.block_counts)
            res["no_host_sync"] = True
        except RuntimeError as err:
            res["no_host_sync"] = f"failed: {err}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return res


def check_route_layout(st: Setup, gen: torch.Generator) -> dict:
    """The route kernel, its counts and the layout against the reference (asserted)."""
    S = st.check_s
    x, gate, bias = make_inputs(st, S, gen)
    logits = logits_gemm(st, x, gate)
    res = {}
    for sf in ("sigmoid", "softmax"):
        p, i, _ = route(st, logits, bias, sf)
        res[sf] = compare(st, p, i, logits, bias, sf)
        assert res[sf]["index_mismatch"] == 0 and res[sf]["probs_max_rel"] <= TIE, (sf, res)
    p, i, _ = route(st, logits, bias)
    ref = sort_routes_reference(p, i, st.E)
    res["layout_equal"] = same(layout3(triton_sort_routes(p, i, st.E)), ref)
    for bt, sub in ((1, 1), (8, 8), (32, 8), (64, 4), (64, 8), (128, 8)):
        res[f"layout_equal_block{bt}_sub{sub}"] = same(
            layout3(triton_sort_routes(p, i, st.E, block_t=bt, sub_t=sub, ranks="count")), ref)
    skew = i.clone()  # one expert takes every token of head 0
    skew[0, :, 0] = 3
    skew[0, :, 1:] = torch.randint(4, st.E, (S, st.K - 1), device=st.device, generator=gen)
    skew_ref = sort_routes_reference(p, skew, st.E)
    res["layout_skew_equal"] = same(layout3(triton_sort_routes(p, skew, st.E)), skew_ref)
    res["layout_repeat_equal"] = same(layout3(triton_sort_routes(p, i, st.E)),
                                      layout3(triton_sort_routes(p, i, st.E)))
    # Counts from the route kernel: the layout without its count step.
    T = layout_block_t(st.K)
    pc, ic, counts = route(st, logits, bias, count_block_t=T)
    res["counted_route_same_picks"] = same((pc, ic), (p, i))
    res["route_counts_equal"] = bool(torch.equal(counts, block_counts_ref(i, st.E, T)))
    res["layout_from_counts_equal"] = same(
        layout3(triton_sort_routes(p, i, st.E, block_counts=counts)), ref)
    res["layout_from_counts_repeat_equal"] = same(
        layout3(triton_sort_routes(p, i, st.E, block_counts=counts)),
        layout3(triton_sort_routes(p, i, st.E, block_counts=counts)))
    res["layout_scatter_equal"] = same(layout3(triton_sort_routes(p, i, st.E, ranks="scatter")),
                                       ref)
    for bt, chunk, _ in RANK_SWEEP:
        c = route(st, logits, bias, count_block_t=bt).block_counts
        res[f"layout_from_counts_equal_block{bt}_chunk{chunk}"] = same(layout3(
            triton_sort_routes(p, i, st.E, block_counts=c, block_t=bt, chunk=chunk)), ref)
    res["layout_scatter_skew_equal"] = same(
        layout3(triton_sort_routes(p, skew, st.E, ranks="scatter")), skew_ref)
    # one expert takes every token of head 0, chosen by the router itself
    lg_skew = logits.clone()
    lg_skew[0, :, 3] = 30.0
    ps, is_, cs = route(st, lg_skew, bias, count_block_t=T)
    res["layout_from_counts_skew_equal"] = bool((is_[0] == 3).any(-1).all()) and same(
        layout3(triton_sort_routes(ps, is_, st.E, block_counts=cs)),
        sort_routes_reference(ps, is_, st.E))
    # NaN and inf rows: indices in range, counts of them, the reference's layout
    lg_nan = logits.clone()
    lg_nan[0, 0] = float("nan")
    lg_nan[1, 5, :7] = float("inf")
    lg_nan[st.H - 1, 9, 4] = float("nan")
    pn, in_, cn = route(st, lg_nan, bias, count_block_t=T)
    res["nan_route_counts_equal"] = bool(torch.equal(cn, block_counts_ref(in_, st.E, T)))
    res["nan_layout_from_counts_equal"] = same(
        layout3(triton_sort_routes(pn, in_, st.E, block_counts=cn)),
        sort_routes_reference(pn, in_, st.E))
    # the split logits kernel zeroes the counts, the route kernel adds (the sm_90 default)
    pf, if_, _, cf = fused(st, x, gate, bias, count_block_t=T)
    res["fused_counts_equal"] = bool(torch.equal(cf, block_counts_ref(if_, st.E, T)))
    res["fused_layout_from_counts_equal"] = same(
        layout3(triton_sort_routes(pf, if_, st.E, block_counts=cf)),
        sort_routes_reference(pf, if_, st.E))
    for key, value in res.items():
        assert value is not False, (key, res)
    return res


# ----------------------------------------------------------------------------- timing


def rotating(fn, inputs: list[tuple]):
    """A callable without arguments: fn on the next of `inputs` (argument tuples) at each
    call, so that repeated calls on small inputs do not just time L2."""
    state = {"n": 0}

    def step():
        args = inputs[state["n"] % len(inputs)]
        state["n"] += 1
        return fn(*args)

    return step


def timer(st: Setup):
    """time(fn, inputs, graph=False) -> median ms of fn over rotating input sets
    (`bench_ms`; `graph_ms` of the first set with graph=True; `time_fn` on the CPU)."""

    def time(fn, inputs, graph=False) -> float:
        step = rotating(fn, inputs)
        if st.device != "cuda":
            return time_fn(step, warmup=1, runs=3).median_ms
        if graph:
            # Capture needs a fixed input: replays time the launch-free GPU work.
            return graph_ms(lambda: fn(*inputs[0]))
        return bench_ms(step)

    return time


def compare_variants(st: Setup, variants: list[tuple[str, object]]) -> dict[str, object]:
    """name -> median ms of each variant (a callable), timed in interleaved rounds on the
    GPU; a variant that fails when first run (a tile out of resources) gets its error."""
    ok, out = [], {}
    for name, fn in variants:
        try:
            fn()
            ok.append((name, fn))
        except Exception as err:
            out[name] = f"failed: {type(err).__name__}: {err}"[:300]
    if st.device != "cuda":
        out.update({name: time_fn(fn, warmup=1, runs=3).median_ms for name, fn in ok})
    elif ok:
        out.update({name: r.median_ms for name, r in interleaved(ok, rounds=10).items()})
    return {name: out[name] for name, _ in variants}


def sweep(st: Setup, gen: torch.Generator, row) -> list[dict]:
    """The logits kernel's tiles, the layout's steps one by one and their tiles, at
    S = sweep_s."""
    S = st.sweep_s
    rows = []
    x, gate, bias = make_inputs(st, S, gen)
    for with_logits in (False, True):
        times = compare_variants(st, [(tag(cfg), lambda c=cfg, w=with_logits: fused(
            st, x, gate, bias, config=c, return_logits=w)) for cfg in FUSED_SWEEP])
        for cfg in FUSED_SWEEP:
            rows.append(row("logits_route", tag(cfg) + ("+logits" if with_logits else ""), S,
                            times[tag(cfg)], config=asdict(cfg)))
    p, i, _, _ = fused(st, x, gate, bias)
    times = compare_variants(st, [(f"block{bt}_sub{sub}_w{nw}", lambda bt=bt, sub=sub, nw=nw:
                                   layout_count(i, st.E, bt, sub, nw))
                                  for bt, sub, nw in COUNT_SWEEP])
    rows += [row("layout_count_step", name, S, ms) for name, ms in times.items()]
    # The layout's steps one by one, both ways, at the default blocks.
    T = layout_block_t(st.K)
    sub = layout_sub_t(T, st.K, interpreting())
    n = st.H * S * st.K
    gid = torch.empty(n, device=st.device, dtype=torch.int32)
    sp = torch.empty(n, device=st.device)
    pos = torch.empty_like(gid)
    hist, rank = layout_count(i, st.E, T, sub)
    base, totals = layout_scan(hist)
    offsets = layout_offsets(totals, S, st.K)
    counts = route(st, logits_gemm(st, x, gate), bias, count_block_t=T).block_counts
    cbase, ctotals = layout_scan(counts)
    steps = [
        ("count", lambda: layout_count(i, st.E, T, sub)),
        ("scan", lambda: layout_scan(hist)),
        ("offsets", lambda: layout_offsets(totals, S, st.K)),
        ("scatter", lambda: layout_scatter(i, p, rank, base, offsets, gid, sp, pos, T)),
        ("hist", lambda: layout_hist(i, st.E, T)),
        ("rank_scatter", lambda: layout_rank_scatter(i, p, cbase, ctotals, offsets, gid, sp,
                                                     pos, T, RANK_SWEEP[0][1])),
        ("layout_from_counts", lambda: triton_sort_routes(p, i, st.E, block_counts=counts)),
        ("layout_ranks_scatter", lambda: triton_sort_routes(p, i, st.E, ranks="scatter")),
        ("layout_ranks_count", lambda: triton_sort_routes(p, i, st.E, ranks="count")),
    ]
    rows += [row("layout_step", name, S, ms, block_t=T)
             for name, ms in compare_variants(st, steps).items()]
    variants = []
    for bt, chunk, nw in RANK_SWEEP:
        c = route(st, logits_gemm(st, x, gate), bias, count_block_t=bt).block_counts
        b2, t2 = layout_scan(c)
        variants.append((f"block{bt}_chunk{chunk}_w{nw}", lambda bt=bt, chunk=chunk, nw=nw,
                         b2=b2, t2=t2: layout_rank_scatter(
                             i, p, b2, t2, offsets, gid, sp, pos,
                             min(bt, triton.next_power_of_2(S)), chunk, nw)))
    rows += [row("layout_rank_scatter_step", name, S, ms)
             for name, ms in compare_variants(st, variants).items()]
    variants = [(f"blocks{t.block_b}_experts{t.block_ec}_w{t.num_warps}",
                 lambda t=t: layout_scan(counts, t)) for t in SCAN_SWEEP]
    rows += [row("layout_scan_step", name, S, ms)
             for name, ms in compare_variants(st, variants).items()]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def route_and_layout(st: Setup, x, gate, bias, config=None):
    """The layer's path: logits + route counting per block, then the layout from the
    counts."""
    p, i, _, c = fused(st, x, gate, bias, config=config, count_block_t=layout_block_t(st.K))
    return triton_sort_routes(p, i, st.E, block_counts=c)


def split_sweep(st: Setup, gen: torch.Generator, row) -> list[dict]:
    """--split-sweep: the split tiles of FUSED_SWEEP at S = sweep_s as the layer runs them.
    Each is checked bitwise against a tile with the same K step (64 tokens x all E on 4
    warps, 2 stages, the logits stored whole: other K steps round the logits
    differently), and against float64's routing."""
    S = st.sweep_s
    T = layout_block_t(st.K)
    sets = [make_inputs(st, S, gen) for _ in range(2)]
    x, gate, bias = sets[0]
    logits64 = logits_gemm(st, x, gate, torch.float64)
    checks, counting, total = {}, [], []
    for cfg in [c for c in FUSED_SWEEP if c.split]:
        try:
            got = fused(st, x, gate, bias, config=cfg, count_block_t=T)
            plain = replace(cfg, half_stores=False, block_e=None, block_s=64, num_warps=4,
                            num_stages=2, tma_store=False, shortlist=False, merged_lists=False)
            base = fused(st, x, gate, bias, config=plain, count_block_t=T)
            checks[tag(cfg)] = {
                "equal_plain_store": same((got[0], got[1], got[3]), (base[0], base[1], base[3])),
                "vs_float64": compare(st, got[0], got[1], logits64, bias, "sigmoid")}
        except Exception as err:  # an out-of-resources tile must not end the run
            checks[tag(cfg)] = {"error": f"{type(err).__name__}: {err}"[:300]}
            continue
        counting.append((tag(cfg), rotating(lambda x_, g_, b_, c=cfg: fused(
            st, x_, g_, b_, config=c, count_block_t=T), sets)))
        total.append((tag(cfg), rotating(lambda x_, g_, b_, c=cfg: route_and_layout(
            st, x_, g_, b_, c), sets)))
    rows = [row("logits_route_counting", name, S, ms, **checks[name])
            for name, ms in compare_variants(st, counting).items()]
    rows += [row("logits_route_counting", name, S, float("nan"), **check)
             for name, check in checks.items() if "error" in check]
    rows += [row("route_layout", name, S, ms) for name, ms in compare_variants(st, total).items()]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


# (column of timings(), results-file kernel, variant)
TIMING_ROWS = (
    ("gemm", "router_gemm", "cublas_fp32"),
    ("route", "route", "default"),
    ("route_counting", "route", "counting"),
    ("gemm+route", "gemm+route", "default"),
    ("fused", "logits_route", "default"),
    ("fused_with_logits", "logits_route", "with_logits"),
    ("fused_counting", "logits_route", "counting"),
    ("layout", "layout", "ranks_count"),
    ("layout_from_counts", "layout", "from_counts"),
    ("layout_ranks_scatter", "layout", "ranks_scatter"),
    ("unfused_total", "route_layout", "gemm+route+layout_count"),
    ("fused_total", "route_layout", "logits_route+layout_count"),
    ("fused_total_counts", "route_layout", "default"),
    ("fused_total_graph", "route_layout", "logits_route+layout_count_graph"),
    ("fused_total_counts_graph", "route_layout", "graph"),
    ("published+gemm", "published_route_layout", "default"),
)


def timings(st: Setup, gen: torch.Generator) -> list[dict]:
    """Per S: one dict of medians (ms), keyed by the first column of TIMING_ROWS."""
    time = timer(st)
    table = []
    H, E = st.H, st.E
    T = layout_block_t(st.K)
    for S in st.sizes:
        # Rotate input sets so that small S does not just time L2 (up to 4 x 256 MB logits).
        n_sets = max(1, min(4, (256 * 2**20) // (H * S * E * 4)))
        data = [make_inputs(st, S, gen) for _ in range(n_sets)]
        lgs = [(logits_gemm(st, x, g), b) for x, g, b in data]
        pis = [fused(st, x, g, b)[:2] for x, g, b in data]
        pics = [(out.probs, out.indices, out.block_counts)
                for out in (fused(st, x, g, b, count_block_t=T) for x, g, b in data)]
        r = {"S": S, "input_sets": n_sets}
        r["gemm"] = time(lambda x, g, b: logits_gemm(st, x, g), data)
        r["route"] = time(lambda lg, b: route(st, lg, b), lgs)
        r["route_counting"] = time(lambda lg, b: route(st, lg, b, count_block_t=T), lgs)
        r["gemm+route"] = time(lambda x, g, b: route(st, logits_gemm(st, x, g), b), data)
        r["fused"] = time(lambda x, g, b: fused(st, x, g, b), data)
        r["fused_with_logits"] = time(lambda x, g, b: fused(st, x, g, b, return_logits=True),
                                      data)
        r["fused_counting"] = time(lambda x, g, b: fused(st, x, g, b, count_block_t=T), data)
        r["layout"] = time(lambda p, i: triton_sort_routes(p, i, E, ranks="count"), pis)
        r["layout_from_counts"] = time(
            lambda p, i, c: triton_sort_routes(p, i, E, block_counts=c), pics)
        r["layout_ranks_scatter"] = time(
            lambda p, i: triton_sort_routes(p, i, E, ranks="scatter"), pis)
        r["unfused_total"] = time(lambda x, g, b: triton_sort_routes(
            *route(st, logits_gemm(st, x, g), b)[:2], E, ranks="count"), data)
        r["fused_total"] = time(lambda x, g, b: triton_sort_routes(
            *fused(st, x, g, b)[:2], E, ranks="count"), data)
        r["fused_total_counts"] = time(lambda x, g, b: route_and_layout(st, x, g, b), data)
        if st.device == "cuda":
            r["fused_total_graph"] = time(lambda x, g, b: triton_sort_routes(
                *fused(st, x, g, b)[:2], E, ranks="count"), data, graph=True)
            r["fused_total_counts_graph"] = time(
                lambda x, g, b: route_and_layout(st, x, g, b), data, graph=True)
        r["published+gemm"] = time(
            lambda x, g, b: published_route_layout(st, logits_gemm(st, x, g), b), data)
        table.append(r)
        print(json.dumps(r), flush=True)
        del data, lgs, pis, pics
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="comma-separated S (default: 1K..32K)")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--split-sweep", action="store_true",
                        help="only the peaks and the split tiles at S = 32768 (the layer's path)")
    parser.add_argument("--cpu", action="store_true",
                        help="dry run on the CPU (Triton interpreter, toy sizes; not recorded)")
    parser.add_argument("--out", default=None, help="also write the run as one JSON file")
    parser.add_argument("--no-record", action="store_true",
                        help="do not append rows to benchmarks/results.jsonl")
    args = parser.parse_args()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # fail before the run
    st = CPU_SETUP if args.cpu else Setup()
    if args.sizes:
        st = replace(st, sizes=tuple(int(s) for s in args.sizes.split(",")))
    torch.backends.cuda.matmul.allow_tf32 = False  # the contract: fp32 logits
    env = environment(st.device)
    meta = {"env": env, "setup": asdict(st),
            "fused_default": asdict(logits_route_config(torch.device(st.device)))}
    peaks = measured_peaks(st.device)
    if peaks:
        print(f"{env['device']}  torch {env['torch']}  triton {env['triton']}  copy "
              f"{peaks['copy_tbs']:.2f} TB/s  bf16 matmul {peaks['matmul_tflops']:.0f} "
              f"TFLOP/s", flush=True)
    command = script_command("bench_routing.py", sys.argv[1:])

    def row(kernel, variant, tokens, ms, tflops=None, **extra):
        """A results-file row; a variant that failed keeps its error and no time."""
        if isinstance(ms, str):
            extra, ms = {**extra, "error": ms}, float("nan")
        return result_row(kernel, variant, tokens, ms, env=env, tflops=tflops,
                          script="benchmarks/bench_routing.py", command=command, **peaks,
                          **extra)

    gen = torch.Generator(device=st.device).manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows = []
    if args.split_sweep:
        rows = split_sweep(st, gen, row)
    else:
        meta["check_fused"] = check_fused(st, gen)
        print("check fused:", json.dumps(meta["check_fused"]), flush=True)
        meta["check_route_layout"] = check_route_layout(st, gen)
        print("check route + layout:", json.dumps(meta["check_route_layout"]), flush=True)
        if not args.no_sweep:
            rows += sweep(st, gen, row)
        table = timings(st, gen)
        flops = {S: 2 * S * st.H * st.E * st.D for S in st.sizes}  # the fp32 logits GEMM
        for r in table:
            for col, kernel, variant in TIMING_ROWS:
                if col in r:
                    tflops = flops[r["S"]] / (r[col] * 1e-3) / 1e12 if col in (
                        "gemm", "fused") else None
                    rows.append(row(kernel, variant, r["S"], r[col], tflops=tflops))
        cols = [c for c, _, _ in TIMING_ROWS if c in table[0]]
        print("\nms (median). gemm+route: cuBLAS fp32 logits then the route kernel; fused: "
              "logits + route kernels (the sm_90 default splits them), _with_logits: logits "
              "returned (grad mode), _counting: the route kernels also count each expert's "
              "routes per block; layout: ranks=\"count\" (four steps), layout_from_counts: "
              "from those counts (two steps); fused_total_counts: the layer's path; _graph: "
              "CUDA-graph replay")
        print(f"{'S':>6} " + " ".join(f"{c:>24}" for c in cols))
        for r in table:
            print(f"{r['S']:>6} " + " ".join(f"{r[c]:>24.4f}" for c in cols))
    if not (args.no_record or args.cpu):
        # Tiles that failed (out of resources) keep their error in --out only.
        print(f"rows appended to {append_results(r for r in rows if 'error' not in r)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
