"""The layout's last step at S = 32768, MAGI-2 dims: the rank scatter (the default) against
a sorting scatter (defined here; measured in routing v11, not kept in the library) over
several tokens a program and warps; bitwise checks of every output; registers and spills;
the whole layout and logits + route + layout from CUDA graphs, both ways, interleaved.

    PYTHONPATH=src python3 benchmarks/experiments/layout_sort.py $OUT/layout_sort.json

(NOTES.md routing v11; results/routing_v11_layout_sort.json.)
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


@triton.jit
def _layout_sort_scatter_kernel(
    indices_ptr, probs_ptr,  # [H, S, K] int, fp32; contiguous
    base_ptr, totals_ptr,  # the scan's [H, NB, E] and [H, E] int32 (blocks of BLOCK_T tokens)
    offsets_ptr,  # output [H*E + 1] int64 (written by the programs of big block 0)
    gather_ids_ptr, sorted_probs_ptr,  # outputs [H*S*K] int32, fp32
    positions_ptr,  # output [H*S*K] int32: the place of route (h, s, k) in the layout
    S, NB,
    E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, SORT_T: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, WRITE_POS: tl.constexpr = True,
):
    """The layout's last step, sorting: a big block's routes sorted by expert, stored in runs.

    Launch grid: (cdiv(S, SORT_T), H). Program (g, h) owns the routes of tokens
    [g * SORT_T, (g + 1) * SORT_T) of head h (SORT_T a multiple of the counts'
    BLOCK_T; BLOCK_R >= SORT_T * K routes, padded). It sorts the keys
    e * BLOCK_R + r (expert, then route order: the layout's stable order) in
    registers; sorted slot q then holds the (q - first[e])-th route of its
    expert e in the block, where first is the exclusive prefix of the block's
    histogram, and its place in the layout is cursor[e] + q - first[e] (cursor
    as in ranks="scatter": expert e's offset in the head plus the scan's base of
    the block's first BLOCK_T tokens). Consecutive slots of one expert go to
    consecutive places, so a warp's stores fall in a few runs instead of 32
    scattered words (the rank scatter's stores are L2-bound, NOTES.md routing
    v10). The same layout as `routing._layout_rank_scatter_kernel`. positions,
    in route order, goes out scattered inside the block's own range. Writes stay
    inside head h's slice whatever the counts held; routes of out-of-range expert
    ids sort last and are left out.
    """
    g = tl.program_id(0)
    h = tl.program_id(1)
    col = tl.arange(0, BLOCK_E)
    col_ok = col < E
    routes = S * TOP_K  # of one head; int32 as `positions` (R < 2**31)
    head_start = h.to(tl.int64) * routes
    totals = tl.load(totals_ptr + h * E + col, mask=col_ok, other=0)
    start = tl.cumsum(totals, 0) - totals  # expert e's first place within the head
    if g == 0:
        tl.store(offsets_ptr + h * E + col, head_start + start.to(tl.int64), mask=col_ok)
        tl.store(offsets_ptr + tl.num_programs(1) * E + col,
                 head_start + tl.sum(totals, 0).to(tl.int64),
                 mask=(col == 0) & (h == tl.num_programs(1) - 1))
    b = g * (SORT_T // BLOCK_T)  # the block of the counts where this one starts
    cursor = start + tl.load(base_ptr + (h * NB + b).to(tl.int64) * E + col, mask=col_ok,
                             other=0)

    r = tl.arange(0, BLOCK_R)
    first_route = g * (SORT_T * TOP_K)
    ok = (r < SORT_T * TOP_K) & (first_route + r < routes)
    e = tl.load(indices_ptr + head_start + first_route + r, mask=ok, other=-1)
    p = tl.load(probs_ptr + head_start + first_route + r, mask=ok, other=0.0)
    # Range check before narrowing: a huge int64 must not wrap into [0, E).
    ok = ok & (e >= 0) & (e < E)
    e = tl.where(ok, e, E).to(tl.int32)  # left-out routes sort after every expert
    hist = tl.histogram(tl.where(ok, e, 0), BLOCK_E, mask=ok)
    # shift[e] = cursor[e] - first[e]: sorted slot q of expert e goes to shift[e] + q.
    shift = cursor - (tl.cumsum(hist, 0) - hist)
    key = tl.sort(e * BLOCK_R + r)
    e_q = key // BLOCK_R
    r_q = key % BLOCK_R
    pos = tl.gather(shift, tl.minimum(e_q, E - 1), 0) + r
    write = (e_q < E) & (pos >= 0) & (pos < routes)
    tl.store(gather_ids_ptr + head_start + pos, (first_route + r_q) // TOP_K, mask=write)
    tl.store(sorted_probs_ptr + head_start + pos, tl.gather(p, r_q, 0), mask=write)
    if WRITE_POS:
        # The inverse permutation: the backward of sorted_probs is a gather by it.
        tl.store(positions_ptr + head_start + first_route + r_q,
                 (head_start + pos).to(tl.int32), mask=write)



def _layout_sort_scatter(indices, probs, base, totals, offsets, gather_ids, sorted_probs,
                         positions, block_t, sort_t, num_warps=None, write_pos=True):
    H, S, K = indices.shape
    NB, E = base.shape[1:]
    BLOCK_R = triton.next_power_of_2(sort_t * K)
    if num_warps is None:
        num_warps = max(1, min(8, BLOCK_R // 512))  # 16 sorted keys a thread
    return _layout_sort_scatter_kernel[(triton.cdiv(S, sort_t), H)](
        indices, probs, base, totals, offsets, gather_ids, sorted_probs, positions, S, NB,
        E=E, TOP_K=K, BLOCK_T=block_t, SORT_T=sort_t, BLOCK_R=BLOCK_R,
        BLOCK_E=triton.next_power_of_2(E), WRITE_POS=write_pos, num_warps=num_warps)


dev = torch.device("cuda")
T = 64
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "triton": triton.__version__, "matmul_bf16_TFLOPs": matmul_peak_tflops(dev),
       "copy_TBps": copy_bandwidth_tbs(dev)}
print(out, flush=True)


def bench(fn):
    return round(triton.testing.do_bench(fn, warmup=50, rep=400), 4)


def graph_of(fn):
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = fn()
    g.replay()
    torch.cuda.synchronize()
    return g, res


x, gate, bias, kw = router_inputs(dev)
probs, indices, _, counts = R.triton_logits_route(x, gate, **kw)
H, S, _ = indices.shape
ref = R.triton_sort_routes(probs, indices, E, block_counts=counts, block_t=T,
                           return_positions=True)
base, totals = R._layout_scan(counts)
R_ = H * S * K


def step(sort_t, num_warps, write_pos=True):
    outs = (torch.empty(R_, device=dev, dtype=torch.int32),
            torch.empty(R_, device=dev, dtype=torch.float32),
            torch.empty(H * E + 1, device=dev, dtype=torch.int64),
            torch.empty(R_, device=dev, dtype=torch.int32))

    def run():
        if sort_t is None:
            R._layout_rank_scatter(indices, probs, base, totals, outs[2], outs[0], outs[1],
                                   outs[3], T, 64)
        else:
            return _layout_sort_scatter(indices, probs, base, totals, outs[2], outs[0], outs[1],
                                   outs[3], T, sort_t, num_warps=num_warps,
                                   write_pos=write_pos)
    return run, outs


# 1. The last step alone (the scan's output shared), every variant against the rank scatter.
steps = {}
for sort_t, warps in ((None, None), (64, 2), (128, 2), (128, 4), (256, 4), (256, 8),
                      (512, 4), (512, 8), (1024, 8), (1024, 16)):
    run, outs = step(sort_t, warps)
    try:
        run()
        torch.cuda.synchronize()
    except Exception as exc:  # a tile that does not compile (shared memory) is reported
        steps[f"{sort_t}/{warps}"] = {"error": repr(exc)[:300]}
        print(sort_t, warps, "error", repr(exc)[:300], flush=True)
        continue
    eq = [torch.equal(a, b) for a, b in zip(outs, ref, strict=True)]
    r = {"ms": bench(run), "equal": eq}
    if sort_t is not None:
        run_np, outs_np = step(sort_t, warps, write_pos=False)
        run_np()
        r["ms_without_positions"] = bench(run_np)
        r["equal_without_positions"] = all(torch.equal(a, b) for a, b in
                                           zip(outs_np[:3], ref[:3], strict=True))
        kern = run()
        r["n_regs"], r["n_spills"] = kern.n_regs, kern.n_spills
    steps["rank_scatter" if sort_t is None else f"{sort_t}/{warps}"] = r
    print(sort_t, warps, r, flush=True)
out["last_step"] = steps

# 2. The whole layout from the counts, and logits + route + layout, from CUDA graphs,
# interleaved (rank scatter, then sort at each of the best two tiles), 3 rounds.
ok = {n: r for n, r in steps.items() if "ms" in r and all(r["equal"])}
best = sorted((r["ms"], n) for n, r in ok.items() if n != "rank_scatter")[:2]
variants = {"rank_scatter": {}}
for _, n in best:
    variants[f"sort {n}"] = {"sort_t": int(n.split("/")[0]), "warps": int(n.split("/")[1])}
graphs = {}
def sorted_layout(p, i, c, sort_t, warps):
    """triton_sort_routes(p, i, E, block_counts=c, return_positions=True) with the sorting
    scatter as its last step."""
    n = p.numel()
    outs = (torch.empty(n, device=dev, dtype=torch.int32),
            torch.empty(n, device=dev, dtype=torch.float32),
            torch.empty(H * E + 1, device=dev, dtype=torch.int64),
            torch.empty(n, device=dev, dtype=torch.int32))
    base, totals = R._layout_scan(c)
    _layout_sort_scatter(i, p, base, totals, outs[2], outs[0], outs[1], outs[3], T, sort_t,
                         num_warps=warps)
    return outs


def layout_of(p, i, c, opts):
    if not opts:
        return R.triton_sort_routes(p, i, E, block_counts=c, block_t=T, return_positions=True)
    return sorted_layout(p, i, c, **opts)


for name, opts in variants.items():
    def layout(opts=opts):
        return layout_of(probs, indices, counts, opts)

    def chain(opts=opts):
        p, i, _, c = R.triton_logits_route(x, gate, **kw)
        return (p, i, c, *layout_of(p, i, c, opts))
    gl, res_l = graph_of(layout)
    gc, res_c = graph_of(chain)
    graphs[name] = (gl, gc, layout)
    out.setdefault("graph_equal", {})[name] = (
        [torch.equal(a, b) for a, b in zip(res_l, ref, strict=True)] +
        [torch.equal(a, b) for a, b in zip(res_c[3:], ref, strict=True)])
times = {name: {"layout_graph": [], "route_layout_graph": [], "layout_eager": []}
         for name in graphs}
for _ in range(3):
    for name, (gl, gc, layout) in graphs.items():
        times[name]["layout_graph"].append(bench(gl.replay))
        times[name]["route_layout_graph"].append(bench(gc.replay))
        times[name]["layout_eager"].append(bench(layout))
out["interleaved"] = times
print(json.dumps(times, indent=1), flush=True)

json.dump(out, open(sys.argv[1], "w"), indent=1)
