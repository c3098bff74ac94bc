"""Experiment (routing v13, not kept): the split logits kernel with shortlists
(`routing._logits_route_kernel`, ROUTE=False, bulk stores, SHORT > 0) in Gluon with warp
specialisation, for sm_90.

    python3 benchmarks/experiments/logits_gluon_ws.py --compile-only        # here
    PYTHONPATH=src python3 benchmarks/experiments/logits_gluon_ws.py OUT.json ws/4/st/epi

Why. Triton 3.6 runs that kernel as one tile a program: each program's shortlist
epilogue (~85 us at MAGI-2's S = 32768) runs after its tensor work, and the programs
beside it on the SM do not hide it (NOTES.md, routing v10-v12); Triton's own warp
specialisation rejects or miscompiles the loop (routing v12). Here the schedule is
written out: one persistent program an SM, two MMA warpgroups taking the program's
tiles in turn (tile i to warpgroup i % 2), each fed by its own loader warp through its
own ring of NSTAGE stages (bulk copies of each K step's x slice and weight slices), so
that one warpgroup's epilogue (tile store, counts zeroing, shortlist) can run beside the
other's MMAs.

The same numbers, bitwise: each logit is accumulated by the same wgmma instructions in
the same order as the Triton kernel (per K step of BLOCK_D: x @ w3, then x @ w2, over
D; then x @ w1 over D), and the epilogue calls the same helper (`routing._shortlist`).

The variant name is ws/STAGES/STORE/EPI: STORE tma (bulk, through a 64 KB buffer a
warpgroup), st (st.global from the registers) or none; EPI epi (counts and shortlists)
or none. Only ws/*/tma|st/epi compute what the route needs (the others are for timing,
their outputs are not compared). Each variant runs beside the default in one process
(a kernel fault ends the process): probs, indices, logits, counts and the layout
compared bitwise, also at a token count ending inside a tile and over 20 repeated calls,
then route + layout from CUDA graphs interleaved over four rounds, the eager route and
the kernel times of graph replays (torch profiler).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mhmoe.kernels import routing as R

# Registers a thread, by partition: the two MMA warpgroups (a [128, 128] fp32 accumulator
# is 128 of them, the epilogue's keys as many again while it converts), the two loader
# warps. The kernel's limit (`maxnreg`) is what leaves 232 to the default partition too:
# 12 warps (the loaders' two round up to a warpgroup) of 168 fill the 64K registers of an
# SM.
MMA_REGS, LOAD_REGS = gl.constexpr(232), gl.constexpr(40)
MAXNREG = 168



@gluon.jit
def _tile(t, NB, NSPLIT: gl.constexpr):
    """Tile t of the program's walk: (token block, head, column block); consecutive tiles
    share the weight slices and differ in tokens, as the grid of the Triton kernel."""
    hn = t // NB
    return t % NB, hn // NSPLIT, hn % NSPLIT


@gluon.jit
def _load_partition(WHICH: gl.constexpr, x_desc, w_desc, xbufs, wbufs, ready, empty, H, NB,
                    num_tiles, D: gl.constexpr, E: gl.constexpr, BLOCK_S: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, NSTAGE: gl.constexpr,
                    WAYS: gl.constexpr = 2):
    """One warp feeding MMA warpgroup WHICH of WAYS (tiles WHICH, WHICH + WAYS, ... of the
    program's walk): for each of its tiles, 2 * D / BLOCK_D steps into its ring of NSTAGE
    stages (slots WHICH * NSTAGE ...). Step s < D / BLOCK_D brings x[:, d] with w3[:, d]
    and w2[:, d]; the later steps x[:, d] with w1[:, d]. (Also routing v14's loader, with
    WAYS = 1: logits_epi_ws.py.)"""
    NSPLIT: gl.constexpr = E // BLOCK_N
    KSTEPS: gl.constexpr = D // BLOCK_D
    X_BYTES: gl.constexpr = x_desc.block_type.nbytes
    W_BYTES: gl.constexpr = w_desc.block_type.nbytes
    nprog = gl.num_programs(0)
    it = 0
    for t in range(gl.program_id(0) + WHICH * nprog, num_tiles, WAYS * nprog):
        b, h, n = _tile(t, NB, NSPLIT)
        s0 = b * BLOCK_S
        n0 = n * BLOCK_N
        for s in gl.static_range(2 * KSTEPS):
            slot = WHICH * NSTAGE + it % NSTAGE
            # A stage is free once its MMAs retired (mbarriers start with phase 1 done).
            mbarrier.wait(empty.index(slot), ((it // NSTAGE) & 1) ^ 1)
            d0 = (s % KSTEPS) * BLOCK_D
            bar = ready.index(slot)
            if s < KSTEPS:
                mbarrier.expect(bar, X_BYTES + 2 * W_BYTES)
                tma.async_copy_global_to_shared(x_desc, [s0, h * D + d0], bar, xbufs.index(slot))
                tma.async_copy_global_to_shared(w_desc, [(2 * H + h) * E + n0, d0], bar,
                                                wbufs.index(2 * slot))
                tma.async_copy_global_to_shared(w_desc, [(H + h) * E + n0, d0], bar,
                                                wbufs.index(2 * slot + 1))
            else:
                mbarrier.expect(bar, X_BYTES + W_BYTES)
                tma.async_copy_global_to_shared(x_desc, [s0, h * D + d0], bar, xbufs.index(slot))
                tma.async_copy_global_to_shared(w_desc, [h * E + n0, d0], bar,
                                                wbufs.index(2 * slot))
            it += 1


@gluon.jit
def _tile_products(xbufs, wbufs, ready, empty, it, FIRST, acc_layout: gl.constexpr,
                   D: gl.constexpr, BLOCK_S: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_D: gl.constexpr, NSTAGE: gl.constexpr, MMA: gl.constexpr = True):
    """One tile's logits from the ring of NSTAGE stages at slots FIRST ..., its steps
    taken from step `it` of the ring on (the loader's order, `_load_partition`): returns
    (the [BLOCK_S, BLOCK_N] fp32 tile, it past the tile), each stage released once its
    wgmmas retired. MMA=False (a timing diagnostic): the stages waited for and released,
    no wgmma (a zero tile)."""
    KSTEPS: gl.constexpr = D // BLOCK_D
    acc = gl.zeros([BLOCK_S, BLOCK_N], gl.float32, acc_layout)
    prev = 0
    for s in gl.static_range(2 * KSTEPS):
        slot = FIRST + it % NSTAGE
        mbarrier.wait(ready.index(slot), (it // NSTAGE) & 1)
        xs = xbufs.index(slot)
        if MMA:
            acc = warpgroup_mma(xs, wbufs.index(2 * slot).permute((1, 0)), acc, is_async=True)
            if s < KSTEPS:
                acc = warpgroup_mma(xs, wbufs.index(2 * slot + 1).permute((1, 0)), acc,
                                    is_async=True)
        # All but the newest MMA retired: the previous step's stage is free.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if s > 0:
            mbarrier.arrive(empty.index(prev), count=1)
        prev = slot
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(prev), count=1)
    return acc, it


@gluon.jit
def _zero_counts(counts_ptr, s0, n0, h, S, CB, E: gl.constexpr, BLOCK_S: gl.constexpr,
                 BLOCK_N: gl.constexpr, COUNT_T: gl.constexpr):
    """The counts blocks [h, j] whose first token lies in the tile of tokens s0 ...: zeroed
    in the tile's columns n0 ... (`_logits_route_kernel`'s COUNT_T > 0 with ROUTE=False)."""
    zero_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    NJ: gl.constexpr = (BLOCK_S + COUNT_T - 1) // COUNT_T
    first = s0 + gl.arange(0, NJ, layout=gl.SliceLayout(1, zero_layout)) * COUNT_T
    clear = (first % COUNT_T == 0) & (first < S)
    crow = (h * CB + first // COUNT_T).to(gl.int64)
    ccol = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, zero_layout))
    gl.store(counts_ptr + crow[:, None] * E + ccol[None, :],
             gl.zeros([NJ, BLOCK_N], gl.int32, zero_layout), mask=clear[:, None])


@gluon.jit
def _store_shortlist(acc, rows, coln, h, n, bias_ptr, short_ptr, S, E: gl.constexpr,
                     TOP_K: gl.constexpr, SHORT: gl.constexpr, BLOCK_N: gl.constexpr,
                     HAS_BIAS: gl.constexpr, cols_layout: gl.constexpr):
    """The shortlists of the logits acc [rows, BLOCK_N] of column block n (`routing._shortlist`,
    0 throughout where unsure) into short [H, S, (E // BLOCK_N) * SHORT]; rows past S left
    out. coln: the block's columns, in cols_layout (acc's column slice)."""
    if HAS_BIAS:
        bias_n = gl.load(bias_ptr + h * E + coln)
    else:
        bias_n = gl.zeros([BLOCK_N], gl.float32, cols_layout)
    scol = gl.arange(0, SHORT, layout=cols_layout)[None, :]
    keys, unsure = R._shortlist(acc, coln, bias_n, scol, E, TOP_K, SHORT, BLOCK_N, HAS_BIAS,
                                R.SIGMOID_APPROX_ERROR, False)
    so = ((h.to(gl.int64) * S + rows) * (E // BLOCK_N) + n)[:, None] * SHORT + scol
    gl.store(short_ptr + so, gl.where(unsure[:, None], 0, keys).to(gl.int32, bitcast=True),
             mask=(rows < S)[:, None])


@gluon.jit
def _mma_partition(WHICH: gl.constexpr, xbufs, wbufs, ready, empty, cbuf, l_desc, logits_ptr,
                   bias_ptr, short_ptr, counts_ptr, S, H, NB, CB, num_tiles, D: gl.constexpr,
                   E: gl.constexpr, TOP_K: gl.constexpr, SHORT: gl.constexpr,
                   BLOCK_S: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                   NSTAGE: gl.constexpr, HAS_BIAS: gl.constexpr, COUNT_T: gl.constexpr,
                   STORE: gl.constexpr, EPI: gl.constexpr):
    """One warpgroup: tiles WHICH, WHICH + 2, ... of the program's walk, from its own
    ring of NSTAGE stages (slots WHICH * NSTAGE ...). Per tile: the MMAs, then
    the epilogue of `_logits_route_kernel` (ROUTE=False, bulk stores, shortlists)."""
    NSPLIT: gl.constexpr = E // BLOCK_N
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    it = 0  # steps taken from this warpgroup's ring
    for t in range(pid + WHICH * nprog, num_tiles, 2 * nprog):
        b, h, n = _tile(t, NB, NSPLIT)
        s0 = b * BLOCK_S
        n0 = n * BLOCK_N
        acc, it = _tile_products(xbufs, wbufs, ready, empty, it, WHICH * NSTAGE, acc_layout, D,
                                 BLOCK_S, BLOCK_N, BLOCK_D, NSTAGE)

        # The tile leaves through shared memory by a bulk store (rows past S clipped);
        # the previous tile's store must have read cbuf first.
        rows = s0 + gl.arange(0, BLOCK_S, layout=rows_layout)
        coln = n0 + gl.arange(0, BLOCK_N, layout=cols_layout)
        if STORE == 1:
            tma.store_wait(0)
            cbuf.reshape([BLOCK_S, BLOCK_N]).store(acc)
            fence_async_shared()
            tma.async_copy_shared_to_global(l_desc, [h, s0, n0], cbuf)
        elif STORE == 2:
            base = (h.to(gl.int64) * S + rows) * E
            gl.store(logits_ptr + base[:, None] + coln[None, :], acc, mask=(rows < S)[:, None])

        if EPI and COUNT_T > 0:
            _zero_counts(counts_ptr, s0, n0, h, S, CB, E, BLOCK_S, BLOCK_N, COUNT_T)
        if EPI:
            _store_shortlist(acc, rows, coln, h, n, bias_ptr, short_ptr, S, E, TOP_K, SHORT,
                             BLOCK_N, HAS_BIAS, cols_layout)
        if STORE == 0 and not EPI:
            # Keep the MMAs: the tile's sum leaves.
            gl.store(logits_ptr + t, gl.sum(gl.sum(acc, 1), 0))
    if STORE == 1:
        tma.store_wait(0)


@gluon.jit
def _logits_ws_kernel(x_desc, w_desc, l_desc, logits_ptr, bias_ptr, short_ptr, counts_ptr, S,
                      H, NB, CB,
                      num_tiles, D: gl.constexpr, E: gl.constexpr, TOP_K: gl.constexpr,
                      SHORT: gl.constexpr, BLOCK_S: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_D: gl.constexpr, NSTAGE: gl.constexpr, HAS_BIAS: gl.constexpr,
                      COUNT_T: gl.constexpr, STORE: gl.constexpr, EPI: gl.constexpr):
    """Logits [H, S, E] (l_desc, [1, BLOCK_S, BLOCK_N] boxes), shortlists short [H, S, C]
    and (COUNT_T > 0) zeroed counts [H, CB, E], as `_logits_route_kernel` with ROUTE=False,
    bulk stores and SHORT > 0. Persistent: grid (programs,), num_tiles = NB * H * E /
    BLOCK_N tiles of BLOCK_S tokens and BLOCK_N experts. 4 warps (the default partition
    is the first MMA warpgroup)."""
    gl.static_assert(SHORT < BLOCK_N, "lists shorter than the column block")
    xbufs = gl.allocate_shared_memory(x_desc.dtype, [2 * NSTAGE] + x_desc.block_type.shape,  # noqa: RUF005 (no * in jit)
                                      x_desc.layout)
    wbufs = gl.allocate_shared_memory(w_desc.dtype, [4 * NSTAGE] + w_desc.block_type.shape,  # noqa: RUF005 (no * in jit)
                                      w_desc.layout)
    if STORE == 1:
        cbufs = gl.allocate_shared_memory(l_desc.dtype, [2] + l_desc.block_type.shape,  # noqa: RUF005 (no * in jit)
                                          l_desc.layout)
        cbuf0 = cbufs.index(0)
        cbuf1 = cbufs.index(1)
    else:
        cbuf0 = xbufs
        cbuf1 = xbufs
    ready = gl.allocate_shared_memory(gl.int64, [2 * NSTAGE, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2 * NSTAGE, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2 * NSTAGE):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    gl.warp_specialize([
        (_mma_partition, (0, xbufs, wbufs, ready, empty, cbuf0, l_desc, logits_ptr,
                          bias_ptr, short_ptr, counts_ptr, S, H, NB, CB, num_tiles, D, E, TOP_K,
                          SHORT, BLOCK_S, BLOCK_N, BLOCK_D, NSTAGE, HAS_BIAS, COUNT_T,
                          STORE, EPI)),
        (_mma_partition, (1, xbufs, wbufs, ready, empty, cbuf1, l_desc, logits_ptr,
                          bias_ptr, short_ptr, counts_ptr, S, H, NB, CB, num_tiles, D, E, TOP_K,
                          SHORT, BLOCK_S, BLOCK_N, BLOCK_D, NSTAGE, HAS_BIAS, COUNT_T,
                          STORE, EPI)),
        (_load_partition, (0, x_desc, w_desc, xbufs, wbufs, ready, empty, H, NB, num_tiles, D,
                           E, BLOCK_S, BLOCK_N, BLOCK_D, NSTAGE)),
        (_load_partition, (1, x_desc, w_desc, xbufs, wbufs, ready, empty, H, NB, num_tiles, D,
                           E, BLOCK_S, BLOCK_N, BLOCK_D, NSTAGE)),
    ], [4, 1, 1], [MMA_REGS, LOAD_REGS, LOAD_REGS])


def ws_descriptors(x2d, parts2d, logits, block_s: int, block_n: int, block_d: int):
    """Gluon tensor descriptors of x [S, H * D] bf16, the weight parts [3 * H * E, D] bf16
    and the logits [H, S, E] fp32, in the kernel's boxes."""
    def desc(t, box):
        return TensorDescriptor.from_tensor(
            t, box, gl.NVMMASharedLayout.get_default_for(box, gl.float32 if t.dtype.itemsize == 4
                                                         else gl.bfloat16))
    return (desc(x2d, [block_s, block_d]), desc(parts2d, [block_n, block_d]),
            desc(logits, [1, block_s, block_n]))


def launch_logits_ws(x2d, parts2d, logits, bias, short, counts, S: int, H: int, D: int,
                     E: int, top_k: int, short_n: int, count_t: int, has_bias: bool,
                     block_s: int = 128, block_n: int = 128, block_d: int = 32,
                     stages: int = 2, programs: int | None = None, store: int = 1,
                     epilogue: bool = True) -> None:
    """`_logits_ws_kernel` on one persistent program per SM (or `programs`)."""
    import torch

    x_desc, w_desc, l_desc = ws_descriptors(x2d, parts2d, logits, block_s, block_n, block_d)
    nb = triton.cdiv(S, block_s)
    num_tiles = nb * H * (E // block_n)
    if programs is None:
        programs = torch.cuda.get_device_properties(x2d.device).multi_processor_count
    _logits_ws_kernel[(min(programs, num_tiles),)](
        x_desc, w_desc, l_desc, logits, bias, short, counts, S, H, nb,
        counts.shape[1] if count_t else 0, num_tiles,
        D=D, E=E, TOP_K=top_k, SHORT=short_n, BLOCK_S=block_s, BLOCK_N=block_n,
        BLOCK_D=block_d, NSTAGE=stages, HAS_BIAS=has_bias, COUNT_T=count_t,
        STORE=store, EPI=epilogue, num_warps=4, maxnreg=MAXNREG)


def route_with_lists(launch, x, gate, top_k, expert_bias=None, route_norm=True,
                     norm_eps=1e-12, route_scale=1.0, count_block_t=None, score_func="sigmoid"):
    """`triton_logits_route(x, gate, ..., return_logits=True)` with an experimental kernel
    for the logits, lists and counts: (probs, indices, logits, counts or None), as the
    default returns them (sigmoid scores, no groups: the shortlists' domain). launch(x2d,
    parts2d, logits, bias, short, counts, S, H, D, E, top_k, count_t, has_bias) runs the
    kernel (counts: a placeholder int32 tensor when count_t is 0); the shortlist route
    kernel then routes from its lists."""
    import torch

    assert score_func == "sigmoid"
    S, H, D = x.shape
    E = gate.shape[1]
    dev = x.device
    probs = torch.empty(H, S, top_k, device=dev)
    indices = torch.empty(H, S, top_k, device=dev, dtype=torch.int64)
    logits = torch.empty(H, S, E, device=dev)
    short = torch.empty(H, S, (E // 128) * R.shortlist_size(top_k, 128), device=dev,
                        dtype=torch.int32)
    counts = (None if count_block_t is None else
              torch.empty(H, triton.cdiv(S, count_block_t), E, device=dev, dtype=torch.int32))
    bias = R._bias_arg(expert_bias, H, E, probs)
    parts = R.split_router_weight(gate).view(3 * H * E, D)
    launch(x.reshape(S, H * D), parts, logits, bias, short, short if counts is None else counts,
           S, H, D, E, top_k, count_block_t or 0, expert_bias is not None)
    R._launch_shortlist_route(short, logits, top_k, expert_bias, route_norm, norm_eps,
                              route_scale, probs, indices, counts, count_block_t or 0)
    return probs, indices, logits, counts


def route_ws(x, gate, kw, stages: int, store: int, epilogue: bool, return_logits=False):
    """`route_with_lists` with this kernel on the default's tiles: (probs, indices, logits
    or None, counts). The kernel is told a bias is given (the router inputs have one)."""
    def launch(x2d, parts2d, logits, bias, short, counts, S, H, D, E, top_k, count_t, _):
        launch_logits_ws(x2d, parts2d, logits, bias, short, counts, S, H, D, E, top_k,
                         R.shortlist_size(top_k, 128), count_t, True, stages=stages,
                         store=store, epilogue=epilogue)

    probs, indices, logits, counts = route_with_lists(launch, x, gate, **kw)
    return probs, indices, logits if return_logits else None, counts


def ptxas_info(kernel) -> str:
    """`ptxas -v`'s registers and spills of a kernel compiled here for sm_90 (its PTX)."""
    import subprocess
    import tempfile

    from mhmoe.kernels.sass_audit import toolchain

    with tempfile.TemporaryDirectory() as tmp:
        with open(tmp + "/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([toolchain()[0], "-arch=sm_90a", "-v", tmp + "/k.ptx", "-o",
                               tmp + "/k.cubin"], capture_output=True, text=True).stderr
    return "; ".join(ln.split(":")[-1].strip() for ln in info.splitlines()
                     if "registers" in ln or "spill" in ln)


def compile_only() -> None:
    """Compile each variant for sm_90 here (no GPU): registers, spills, shared memory."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import mangle_type

    H, D, E = 12, 256, 256
    xd, wd, ld = ws_descriptors(torch.empty(256, H * D, dtype=torch.bfloat16),
                                torch.empty(3 * H * E, D, dtype=torch.bfloat16),
                                torch.empty(H, 256, E), 128, 128, 32)
    sig = {"x_desc": mangle_type(xd), "w_desc": mangle_type(wd), "l_desc": mangle_type(ld),
           "logits_ptr": "*fp32", "bias_ptr": "*fp32", "short_ptr": "*i32",
           "counts_ptr": "*i32", "S": "i32", "H": "i32", "NB": "i32", "CB": "i32",
           "num_tiles": "i32"}
    fn = _logits_ws_kernel
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
             for k in ("logits_ptr", "bias_ptr", "short_ptr", "counts_ptr", "S")}
    for stages, store, epi in ((2, 1, True), (3, 2, True), (4, 2, True), (4, 2, False),
                               (4, 0, False)):
        ce = dict(D=D, E=E, TOP_K=6, SHORT=8, BLOCK_S=128, BLOCK_N=128, BLOCK_D=32,
                  NSTAGE=stages, HAS_BIAS=True, COUNT_T=64, STORE=store, EPI=epi)
        src = gluon._runtime.GluonASTSource(
            fn=fn, signature={**sig, **{k: "constexpr" for k in ce}}, constexprs=ce,
            attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "maxnreg": MAXNREG})
        print(f"stages {stages} store {store} epilogue {epi}: shared {k.metadata.shared} B, "
              f"{k.metadata.num_warps} warps; {ptxas_info(k)}", flush=True)


def gpu(out_path: str, variant: str) -> None:
    import json

    import torch
    from router_inputs import router_inputs, time_interleaved

    from mhmoe.bench import matmul_peak_tflops

    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "matmul_bf16_TFLOPs": matmul_peak_tflops(dev)}
    x, gate, _, kw = router_inputs(dev)
    E = gate.shape[1]
    _, st, store, epi = variant.split("/")
    store = {"none": 0, "tma": 1, "st": 2}[store]
    epi = epi == "epi"
    routes = {"default": lambda xx, keep: R.triton_logits_route(xx, gate, return_logits=keep,
                                                                **kw),
              variant: lambda xx, keep: route_ws(xx, gate, kw, int(st), store, epi, keep)}
    checked = store > 0 and epi

    def chain(name, xx=x, keep=True):
        probs, indices, logits, counts = routes[name](xx, keep)
        return (probs, indices, logits, counts,
                *R.triton_sort_routes(probs, indices, E, block_counts=counts, block_t=64))

    def same(a, b):
        return all(p is q or torch.equal(p, q) for p, q in zip(a, b, strict=True))

    ref, ref_odd = chain("default"), chain("default", x[:-5])
    graphs, res = {}, {}
    for name in routes:
        r = {}
        if checked or name == "default":
            r["equal_default"] = same(chain(name), ref)
            r["equal_default_odd_S"] = same(chain(name, x[:-5]), ref_odd)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outg = chain(name, keep=False)
        g.replay()
        torch.cuda.synchronize()
        if checked or name == "default":
            r["graph_equal_default"] = same(outg[:2] + outg[3:], ref[:2] + ref[3:])
        graphs[name] = g
        res[name] = r
        print(name, r, flush=True)
    time_interleaved(graphs, {n: (lambda n=n: routes[n](x, False)) for n in graphs}, res)
    if checked:
        ok = 0
        for _ in range(20):
            junk = torch.full((12, 32768, 256), float("nan"), device=dev)
            del junk
            ok += same(chain(variant), ref)
        res[variant]["repeat_equal"] = f"{ok}/20"
        print(variant, "repeat", res[variant]["repeat_equal"], flush=True)
    out["configs"] = res
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--compile-only"]:
        compile_only()
    elif len(sys.argv) == 3:
        gpu(sys.argv[1], sys.argv[2])
    else:
        sys.exit("usage: logits_gluon_ws.py --compile-only | OUT.json ws/STAGES/STORE/EPI")
