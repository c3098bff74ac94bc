"""Experiment (routing v14, not kept): the split logits kernel with shortlists
(`routing._logits_route_kernel`, ROUTE=False, bulk stores, SHORT > 0) in Gluon, its
epilogue on warps of its own, for sm_90.

    python3 benchmarks/experiments/logits_epi_ws.py --compile-only      # here (no GPU)
    PYTHONPATH=src python3 benchmarks/experiments/logits_epi_ws.py OUT.json
    PYTHONPATH=src python3 benchmarks/experiments/logits_epi_ws.py OUT.json --diag

The same outputs as the default, bitwise: the logits [H, S, E] fp32, the shortlists'
packed keys [H, S, C] and the zeroed layout counts. What differs is the schedule. In
Triton each program computes a tile and then runs its epilogue (the tile store and
`routing._shortlist`'s nine rounds over the tile), and the three programs an SM do not
hide those epilogues behind each other's tensor work: the kernel took ~365 us at
MAGI-2's S = 32768 against ~223 us of wgmmas (benchmarks/NOTES.md, routing v10-v13;
v13 tried two MMA warpgroups each running its own epilogue). Here one persistent program
an SM has four partitions:

- the MMA warpgroup: per tile, the exact-split products (`_dot_exact`'s order: per K
  step of BLOCK_D, x @ w3 then x @ w2, over D; then x @ w1 over D), then the fp32 tile
  into one of two staging buffers in shared memory, whence a bulk store writes it to
  the logits;
- two epilogue warpgroups, each taking 64 of the tile's 128 rows from the staging
  buffer: `_shortlist` (the same helper) and the lists' stores, and the counts' zeroing;
- a loader warp: bulk copies of each K step's x slice and weight-part slices into a
  ring of NSTAGE stages.

So the epilogue of tile t runs while the MMA warpgroup computes tile t + 1. The
staging buffer of a tile is free again once both epilogue warpgroups have loaded their
rows (`cfree`) and its bulk store has read it (at most one store in flight).

On the GPU: probs, indices, logits, counts and the layout compared bitwise with the
default at MAGI-2's S = 32768, at S - 5 (a tile ending inside), at S = 1000, without the
bias and without counts; 20 repeated calls; CUDA graphs replayed on other inputs; then
route + layout from graphs and the eager route, interleaved over four rounds, and the
kernel times of the graph replays. --diag: the Gluon kernel alone (do_bench) with its
DIAG 0-3 (1: the epilogues only load their rows, 2: no wgmma, 3: no bulk store of the
logits), three interleaved rounds.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import torch
import triton
from logits_gluon_ws import (
    _load_partition,
    _store_shortlist,
    _tile,
    _tile_products,
    _zero_counts,
    ptxas_info,
    route_with_lists,
    ws_descriptors,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)

from mhmoe.kernels import routing as R

BLOCK_S, BLOCK_N, BLOCK_D = 128, 128, 32  # the Triton kernel's sm_90 tile: the same sums
NSTAGE = 4  # ring stages of x [128, 32] and two weight slices [128, 32] bf16: 24 KB each
# Registers a thread, by warpgroup: the kernel runs 16 warps (the loader's one rounds up
# to a warpgroup) of 128, which fill the SM's 64K; the loader's and the epilogues' give
# back what the MMA warpgroup (the default partition: the rest) takes for its [128, 128]
# fp32 accumulator.
EPI_REGS, LOAD_REGS = gl.constexpr(144), gl.constexpr(24)
MAXNREG = 128


@gluon.jit
def _loader(x_desc, w_desc, xbufs, wbufs, ready, empty, H, NB, num_tiles, D: gl.constexpr,
            E: gl.constexpr, BLOCK_S: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_D: gl.constexpr, NSTAGE: gl.constexpr):
    """The loader warp: v13's, feeding the one MMA warpgroup every tile of the program."""
    _load_partition(0, x_desc, w_desc, xbufs, wbufs, ready, empty, H, NB, num_tiles, D, E,
                    BLOCK_S, BLOCK_N, BLOCK_D, NSTAGE, 1)


@gluon.jit
def _mma(xbufs, wbufs, ready, empty, cbufs, cfull, cfree, l_desc, NB, num_tiles,
         D: gl.constexpr, E: gl.constexpr, BLOCK_S: gl.constexpr, BLOCK_N: gl.constexpr,
         BLOCK_D: gl.constexpr, NSTAGE: gl.constexpr, DIAG: gl.constexpr):
    """The MMA warpgroup (default partition): each tile's logits, into staging buffer
    j % 2 (j: the program's tile count), stored from there."""
    NSPLIT: gl.constexpr = E // BLOCK_N
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    it = 0  # steps taken from the ring
    j = 0  # tiles done
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, h, n = _tile(t, NB, NSPLIT)
        acc, it = _tile_products(xbufs, wbufs, ready, empty, it, 0, acc_layout, D, BLOCK_S,
                                 BLOCK_N, BLOCK_D, NSTAGE, DIAG != 2)

        buf = j % 2
        # The buffer's last tile (j - 2): both epilogue warpgroups loaded it, and its bulk
        # store read it (at most the other buffer's store left in flight).
        mbarrier.wait(cfree.index(buf), ((j // 2) & 1) ^ 1)
        tma.store_wait(1)
        cbuf = cbufs.index(buf)
        cbuf.reshape([BLOCK_S, BLOCK_N]).store(acc)
        fence_async_shared()
        # Rows past S are clipped by the bulk store.
        if DIAG != 3:
            tma.async_copy_shared_to_global(l_desc, [h, b * BLOCK_S, n * BLOCK_N], cbuf)
        mbarrier.arrive(cfull.index(buf), count=1)
        j += 1
    tma.store_wait(0)


@gluon.jit
def _epilogue(HALF: gl.constexpr, cbufs, cfull, cfree, bias_ptr, short_ptr, counts_ptr, S,
              NB, CB, num_tiles, E: gl.constexpr, TOP_K: gl.constexpr, SHORT: gl.constexpr,
              BLOCK_S: gl.constexpr, BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr,
              COUNT_T: gl.constexpr, DIAG: gl.constexpr):
    """Epilogue warpgroup HALF: rows HALF * 64 ... of each tile, from its staging buffer:
    the shortlist of each row (`routing._shortlist`, 0 throughout where unsure) and,
    HALF 0, the zeroing of the counts blocks whose first token lies in the tile."""
    NSPLIT: gl.constexpr = E // BLOCK_N
    ROWS: gl.constexpr = BLOCK_S // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    j = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, h, n = _tile(t, NB, NSPLIT)
        s0 = b * BLOCK_S
        n0 = n * BLOCK_N
        buf = j % 2
        mbarrier.wait(cfull.index(buf), (j // 2) & 1)
        acc = cbufs.index(buf).reshape([BLOCK_S, BLOCK_N]).slice(HALF * ROWS, ROWS,
                                                                 dim=0).load(layout)
        mbarrier.arrive(cfree.index(buf), count=1)
        j += 1
        if DIAG == 1:
            # Keep the load: one value a tile leaves.
            gl.store(short_ptr + t * 2 + HALF, gl.max(gl.max(acc, 1), 0).to(gl.int32))
        else:
            if HALF == 0 and COUNT_T > 0:
                _zero_counts(counts_ptr, s0, n0, h, S, CB, E, BLOCK_S, BLOCK_N, COUNT_T)
            rows = s0 + HALF * ROWS + gl.arange(0, ROWS, layout=rows_layout)
            coln = n0 + gl.arange(0, BLOCK_N, layout=cols_layout)
            _store_shortlist(acc, rows, coln, h, n, bias_ptr, short_ptr, S, E, TOP_K, SHORT,
                             BLOCK_N, HAS_BIAS, cols_layout)


@gluon.jit
def _logits_ws_kernel(x_desc, w_desc, l_desc, bias_ptr, short_ptr, counts_ptr, S, H, NB, CB,
                      num_tiles, D: gl.constexpr, E: gl.constexpr, TOP_K: gl.constexpr,
                      SHORT: gl.constexpr, BLOCK_S: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_D: gl.constexpr, NSTAGE: gl.constexpr, HAS_BIAS: gl.constexpr,
                      COUNT_T: gl.constexpr, DIAG: gl.constexpr = 0):
    """Logits [H, S, E] (l_desc, [1, BLOCK_S, BLOCK_N] boxes), shortlists short
    [H, S, (E // BLOCK_N) * SHORT] and (COUNT_T > 0) the zeroed counts [H, CB, E].
    Persistent: grid (programs,), num_tiles = NB * H * E / BLOCK_N tiles of BLOCK_S
    tokens and BLOCK_N experts, program p taking tiles p, p + programs, ... 4 warps (the
    default partition is the MMA warpgroup) and the workers. DIAG (timing diagnostics,
    wrong results): 1, the epilogues only load their rows; 2, no wgmma; 3, no bulk store
    of the logits."""
    gl.static_assert(SHORT < BLOCK_N, "lists shorter than the column block")
    gl.static_assert(BLOCK_S == 128, "two epilogue warpgroups of 64 rows")
    xbufs = gl.allocate_shared_memory(x_desc.dtype, [NSTAGE] + x_desc.block_type.shape,  # noqa: RUF005 (no * in jit)
                                      x_desc.layout)
    wbufs = gl.allocate_shared_memory(w_desc.dtype, [2 * NSTAGE] + w_desc.block_type.shape,  # noqa: RUF005 (no * in jit)
                                      w_desc.layout)
    cbufs = gl.allocate_shared_memory(l_desc.dtype, [2] + l_desc.block_type.shape,  # noqa: RUF005 (no * in jit)
                                      l_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    cfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    cfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSTAGE):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(cfull.index(i), count=1)
        mbarrier.init(cfree.index(i), count=2)  # both epilogue warpgroups
    gl.warp_specialize([
        (_mma, (xbufs, wbufs, ready, empty, cbufs, cfull, cfree, l_desc, NB, num_tiles, D, E,
                BLOCK_S, BLOCK_N, BLOCK_D, NSTAGE, DIAG)),
        (_epilogue, (0, cbufs, cfull, cfree, bias_ptr, short_ptr, counts_ptr, S, NB, CB,
                     num_tiles, E, TOP_K, SHORT, BLOCK_S, BLOCK_N, HAS_BIAS, COUNT_T, DIAG)),
        (_epilogue, (1, cbufs, cfull, cfree, bias_ptr, short_ptr, counts_ptr, S, NB, CB,
                     num_tiles, E, TOP_K, SHORT, BLOCK_S, BLOCK_N, HAS_BIAS, COUNT_T, DIAG)),
        (_loader, (x_desc, w_desc, xbufs, wbufs, ready, empty, H, NB, num_tiles, D, E,
                   BLOCK_S, BLOCK_N, BLOCK_D, NSTAGE)),
    ], [4, 4, 1], [EPI_REGS, EPI_REGS, LOAD_REGS])


def launch_logits_ws(x2d, parts2d, logits, bias, short, counts, S: int, H: int, D: int,
                     E: int, top_k: int, count_t: int, has_bias: bool,
                     programs: int | None = None, diag: int = 0) -> None:
    """`_logits_ws_kernel` on one persistent program an SM (or `programs`). counts: the
    [H, cdiv(S, count_t), E] int32 layout counts it zeroes (count_t > 0), else any int32
    tensor (unused)."""
    x_desc, w_desc, l_desc = ws_descriptors(x2d, parts2d, logits, BLOCK_S, BLOCK_N, BLOCK_D)
    nb = triton.cdiv(S, BLOCK_S)
    num_tiles = nb * H * (E // BLOCK_N)
    if programs is None:
        programs = torch.cuda.get_device_properties(x2d.device).multi_processor_count
    _logits_ws_kernel[(max(1, min(programs, num_tiles)),)](
        x_desc, w_desc, l_desc, bias, short, counts, S, H, nb,
        counts.shape[1] if count_t else 0, num_tiles,
        D=D, E=E, TOP_K=top_k, SHORT=R.shortlist_size(top_k, BLOCK_N), BLOCK_S=BLOCK_S,
        BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, NSTAGE=NSTAGE, HAS_BIAS=has_bias,
        COUNT_T=count_t, DIAG=diag, num_warps=4, maxnreg=MAXNREG)


def sm90_signature(top_k: int = 6, E: int = 256, D: int = 256, H: int = 12,
                   count_t: int = 64, has_bias: bool = True):
    """(signature, constexprs) of `_logits_ws_kernel` as its launcher calls it, for
    compiling it without a GPU (`sass_audit`)."""
    from triton.runtime.jit import mangle_type

    xd, wd, ld = ws_descriptors(torch.empty(256, H * D, dtype=torch.bfloat16),
                                torch.empty(3 * H * E, D, dtype=torch.bfloat16),
                                torch.empty(H, 256, E), BLOCK_S, BLOCK_N, BLOCK_D)
    sig = {"x_desc": mangle_type(xd), "w_desc": mangle_type(wd), "l_desc": mangle_type(ld),
           "bias_ptr": "*fp32", "short_ptr": "*i32", "counts_ptr": "*i32", "S": "i32",
           "H": "i32", "NB": "i32", "CB": "i32", "num_tiles": "i32"}
    return sig, dict(D=D, E=E, TOP_K=top_k, SHORT=R.shortlist_size(top_k, BLOCK_N),
                     BLOCK_S=BLOCK_S, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, NSTAGE=NSTAGE,
                     HAS_BIAS=has_bias, COUNT_T=count_t)


def compile_only() -> None:
    from mhmoe.kernels import sass_audit

    sig, cx = sm90_signature()
    k = sass_audit.compile_sm90(_logits_ws_kernel, sig, cx, 4, 1, ("S",), MAXNREG)
    print(f"shared {k.metadata.shared} B, {k.metadata.num_warps} warps; {ptxas_info(k)}")


def diag(out_path: str) -> None:
    import json

    from router_inputs import bench, router_inputs

    dev = torch.device("cuda")
    x, gate, bias, kw = router_inputs(dev)
    S, H, D = x.shape
    E, K, T = gate.shape[1], kw["top_k"], kw["count_block_t"]
    parts = R.split_router_weight(gate).view(3 * H * E, D)
    logits = torch.empty(H, S, E, device=dev)
    short = torch.empty(H, S, (E // BLOCK_N) * R.shortlist_size(K, BLOCK_N), device=dev,
                        dtype=torch.int32)
    counts = torch.empty(H, S // T, E, device=dev, dtype=torch.int32)
    res = {str(d): [] for d in range(4)}
    for _ in range(3):
        for d in range(4):
            res[str(d)].append(bench(lambda d=d: launch_logits_ws(
                x.view(S, H * D), parts, logits, bias, short, counts, S, H, D, E, K, T, True,
                diag=d)))
    print(res, flush=True)
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "ms": res}, f, indent=1)


def gpu(out_path: str) -> None:
    import json

    from router_inputs import router_inputs, time_interleaved

    from mhmoe.bench import matmul_peak_tflops

    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "matmul_bf16_TFLOPs": matmul_peak_tflops(dev)}
    x, gate, _, kw = router_inputs(dev)
    E = gate.shape[1]

    def chain(name, xx=x, keep=True, **over):
        k = {**kw, **over}
        if name == "ws":
            probs, indices, logits, counts = route_with_lists(launch_logits_ws, xx, gate, **k)
        else:
            res = R.triton_logits_route(xx, gate, return_logits=True, **k)
            probs, indices, logits = res[:3]
            counts = res[3] if len(res) > 3 else None
        lay = R.triton_sort_routes(probs, indices, E, block_counts=counts,
                                   block_t=k.get("count_block_t") or None)
        return (probs, indices, logits if keep else None, counts, *lay)

    def same(a, b):
        return all(p is q or (p is None and q is None) or torch.equal(p, q)
                   for p, q in zip(a, b, strict=True))

    checks = {}
    for label, args, over in (("S", (x,), {}), ("S-5", (x[:-5],), {}),
                              ("S=1000", (x[:1000],), {}),
                              ("no bias", (x,), {"expert_bias": None}),
                              ("no counts", (x,), {"count_block_t": None})):
        checks[label] = same(chain("ws", *args, **over), chain("default", *args, **over))
        print(label, checks[label], flush=True)
    ref = chain("default")
    ok = 0
    for _ in range(20):
        junk = torch.full((12, 32768, 256), float("nan"), device=dev)
        del junk
        ok += same(chain("ws"), ref)
    checks["repeat_equal"] = f"{ok}/20"
    print("repeat", checks["repeat_equal"], flush=True)
    out["checks"] = checks

    graphs, res = {}, {}
    for name in ("default", "ws"):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outg = chain(name, keep=False)
        x.copy_(x.flip(0))  # replay on other inputs: must equal the eager call on them
        g.replay()
        torch.cuda.synchronize()
        eager = chain(name, keep=False)
        res[name] = {"graph_equal_eager": same(outg, eager)}
        x.copy_(x.flip(0))
        graphs[name] = g
        print(name, res[name], flush=True)
    time_interleaved(graphs, {n: (lambda n=n: chain(n, keep=False)) for n in graphs}, res)
    out["configs"] = res
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    if sys.argv[2:] == ["--diag"]:
        diag(sys.argv[1])
    else:
        from router_inputs import experiment_main

        experiment_main(compile_only, gpu)
