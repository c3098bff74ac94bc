"""The expert backward's panel kernel for Hopper (sm_90) in Gluon, warp-specialised.

The work of `expert_backward._expert_dx_kernel` with PANELS and without dx (DX=False),
scheduled as the Gluon forward (`expert_forward_sm90.py`) schedules the forward: for
every route row, g, u = x Wg, x Wu and t = dy Wd^T over I in slices of 64, the SwiGLU7
backward on those fp32 accumulators, dprobs = rowsum(a t), and the weight gradients'
operands written to the panels (x, dy, dg, du, a p; layout in `expert_backward._Panels`).
dx then comes from the panels (`_panel_dx_kernel`), so no [rows, D] fp32 accumulator
sits in the registers beside g, u and t: that accumulator and the gate|up weights it
would keep across the SwiGLU backward are what do not fit on chip in a fused Gluon dx
kernel (docs/expert-backward.md).

One persistent program an SM walks the tiles of 128 routes of the forward's tile map.
Partitions:

- two MMA warpgroups, each owning 64 of the tile's rows. Per slice j of I a warpgroup
  runs one block of wgmmas: gu = x @ [W_gate[:, j] | W_up[:, j]] (one N = 128
  accumulator over four K = 64 chunks, the forward's) and t = dy @ W_down[j]^T (N = 64,
  four K = 64 chunks); then, while the other warpgroup's block keeps the tensor cores
  busy, the SwiGLU7 backward, the dprobs sum and the stores of its dg, du and a p rows
  (the two take turns on a pair of mbarriers, as in the forward).
- the forward's weight loader warp, unchanged: its ring order (per slice four gate|up
  stages, then two W_down stages, each [64, 128] bf16) is the order the blocks read.
  W_down's stages are [64 rows of I, 128 of D]; t reads them transposed (K-major).
- an x / dy loader warp: gathers a warpgroup's 64 x rows and 64 dy rows (cp.async, rows
  past the expert's end zero-filled) once that warpgroup's last block of the previous
  tile retired, then copies both to the x and dy panels by TMA from shared memory.
- two idle warps, so that the loaders' warpgroup is whole (setmaxnreg).

Shared memory: x and dy halves of both warpgroups (128 KB) and the ring (6 stages of
16 KB, one block's worth; `tuning.PanelsSm90Config`).

Numerics: the operations of `_expert_dx_kernel` (its `_swiglu7_backward`, the rounding
of a to the weight dtype before a t and a p, dg, du and a p rounded to bf16), with g, u
and t summed by wgmma in ascending K; dprobs is summed per slice of 64, then over the
slices in order (the Triton kernel's slices are its block_i wide, and its in-slice row
sums follow its register layout), so dprobs may differ from the Triton kernel's in the
last bits (each mode is reproducible either way: one owner per output, fixed orders).
`ExpertBackwardConfig.sigmoid_rcp` changes the sigmoid's reciprocal in both kernels alike;
`panel_store_bytes` only how the same bf16 values are stored (RCP, STORE_BYTES).

Shapes it takes (`panels_fit`): bf16 x, dy and weights, D = 256, I a multiple of 64,
sm_90.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .expert_forward_sm90 import (
    _divide,
    _gate_up_first,
    _gate_up_rest,
    _idle,
    _release,
    _tile_rows0,
    _w_loader,
    _wait_stage,
    weight_descriptors,
)
from .tuning import PanelsSm90Config, on_sm90, panels_sm90_config


@gluon.jit
def _xdy_loader(x_ptr, dy_ptr, H, gather_ids_ptr, xs, dys, x_ready, x_empty, xp_desc, dyp_desc,
                tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr, first_expert, E,
                D: gl.constexpr, CH: gl.constexpr = 8):
    """x and dy rows of each tile into the warpgroups' halves (cp.async, CH rows at a
    time, rows past the expert's end zero-filled), then both halves to the panels' rows
    of the tile by TMA."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    r = gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    num_tiles = gl.load(ntiles_ptr)
    k = 0
    for u in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        f, row0, end = _tile_rows0(u, tile_expert_ptr, tile_first_ptr, offsets_ptr,
                                   first_expert)
        head = (f // E).to(gl.int64)
        for w in gl.static_range(2):
            # The half is free once its warpgroup's last block of the previous tile
            # retired (mbarriers start with phase 1 complete) and the panel copies of
            # the previous tile have read it: each copy is a bulk group of its own, and
            # the other half's copies (issued since) may stay in flight.
            mbarrier.wait(x_empty.index(w), (k & 1) ^ 1)
            tma.store_wait(2 * (D // 64))
            for c in gl.static_range(64 // CH):
                rows = row0 + w * 64 + c * CH + r
                ok = rows < end
                tok = gl.load(gather_ids_ptr + rows, mask=ok, other=0).to(gl.int64)
                offs = (tok * H + head)[:, None] * D + d[None, :]
                async_copy.async_copy_global_to_shared(
                    xs.index(w).slice(c * CH, CH, dim=0), x_ptr + offs, mask=ok[:, None])
                async_copy.async_copy_global_to_shared(
                    dys.index(w).slice(c * CH, CH, dim=0), dy_ptr + offs, mask=ok[:, None])
            async_copy.mbarrier_arrive(x_ready.index(w), increment_count=False)
            async_copy.commit_group()
            # The panels: this thread's copies landed, are made visible to the async
            # proxy, and the warp syncs before one lane issues the bulk copies that read
            # every lane's rows.
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
            prow = u * 128 + w * 64
            for c in gl.static_range(D // 64):
                tma.async_copy_shared_to_global(xp_desc, [prow, c * 64],
                                                xs.index(w).slice(c * 64, 64, dim=1))
                tma.async_copy_shared_to_global(dyp_desc, [prow, c * 64],
                                                dys.index(w).slice(c * 64, 64, dim=1))
        k += 1
    tma.store_wait(0)


@gluon.jit
def _t_product(dyh, stages, ready, empty, held, n, t_layout: gl.constexpr,
               NSTAGE: gl.constexpr):
    """Issues t = dy_half @ W_down[slice]^T from stages n (columns 0-127 of D) and n + 1
    (128-255): four K = 64 chunks, each stage's halves read transposed, behind the
    gate|up wgmma in flight on stage `held`. Keeps one wgmma in flight and releases each
    stage once the wgmmas that read it retired (`held` after the first chunk, n after
    the third), so that the loader refills them while the block runs; returns (t in
    flight, its stage n + 1, still held)."""
    t = gl.zeros([64, 64], gl.float32, t_layout)
    for h in gl.static_range(2):
        st = _wait_stage(stages, ready, n + h, NSTAGE)
        for c in gl.static_range(2):
            t = warpgroup_mma(dyh.slice(h * 128 + c * 64, 64, dim=1),
                              st.slice(c * 64, 64, dim=1).permute((1, 0)), t,
                              use_acc=h + c > 0, is_async=True)
            t = warpgroup_mma_wait(num_outstanding=1, deps=(t,))
            if h + c == 0:
                _release(empty, held, NSTAGE)
            if h == 1 and c == 0:
                _release(empty, n, NSTAGE)
    return t, n + 1


@gluon.jit
def _swiglu7_backward(g, u, t, p, RCP: gl.constexpr):
    """`expert_backward._swiglu7_backward` on the fp32 (g, u) of a slice, for the
    upstream t * p: (a rounded to bf16 and back, dg, du), the same operations in the
    same order (RCP: the reciprocal of `ExpertBackwardConfig.sigmoid_rcp`)."""
    da = t * p[:, None]
    gc = gl.minimum(g, 7.0)
    uc1 = gl.minimum(gl.maximum(u, -7.0), 7.0) + 1.0
    sig = _divide(gl.full_like(gc, 1.0), 1.0 + gl.exp2(-2.4554669595930157 * gc), RCP)
    silu = gc * sig
    a = silu * uc1
    dg = da * uc1 * (sig + 1.702 * silu * (1.0 - sig))
    dg = gl.where(g <= 7.0, dg, 0.0)
    du = da * silu
    du = gl.where((u >= -7.0) & (u <= 7.0), du, 0.0)
    return a.to(gl.bfloat16).to(gl.float32), dg, du


# One 16-byte store per quad-lane thread of four bf16-pair words w0..w3 ($1-$4) that the
# quad holds column-wise: on entry lane q of a quad holds word q of each of the four
# 4-word groups (pair columns 4 jj + q); a transpose within the quad (rotate by q, three
# shuffles, rotate back) leaves lane q all of group q, stored at $5, the group's address.
# The value $0 is a dummy. Checked by a lane-level simulation of this text
# (tests/test_quad_transpose.py) and on the H200 (the panels bitwise equal to the Triton
# split's). A butterfly form (two shfl.bfly stages, ~40 fewer instructions a slice) is in
# commit ee1eab1, passed the simulation, and awaits its GPU test (docs/expert-backward.md).
_QUAD_TRANSPOSE_STORE = gl.constexpr("""{
    .reg .b32 %lane, %q, %quad, %t, %src, %u<4>, %v<4>, %z<4>, %y<4>, %o<4>;
    .reg .pred %p1, %p2;
    mov.u32 %lane, %laneid;
    and.b32 %q, %lane, 3;
    and.b32 %quad, %lane, 28;
    and.b32 %t, %q, 1;
    setp.ne.b32 %p1, %t, 0;
    and.b32 %t, %q, 2;
    setp.ne.b32 %p2, %t, 0;
    selp.b32 %u0, $2, $1, %p1;
    selp.b32 %u1, $3, $2, %p1;
    selp.b32 %u2, $4, $3, %p1;
    selp.b32 %u3, $1, $4, %p1;
    selp.b32 %v0, %u2, %u0, %p2;
    selp.b32 %v1, %u3, %u1, %p2;
    selp.b32 %v2, %u0, %u2, %p2;
    selp.b32 %v3, %u1, %u3, %p2;
    sub.u32 %src, %q, 1;
    and.b32 %src, %src, 3;
    or.b32 %src, %src, %quad;
    shfl.sync.idx.b32 %z1, %v1, %src, 31, -1;
    sub.u32 %src, %q, 2;
    and.b32 %src, %src, 3;
    or.b32 %src, %src, %quad;
    shfl.sync.idx.b32 %z2, %v2, %src, 31, -1;
    sub.u32 %src, %q, 3;
    and.b32 %src, %src, 3;
    or.b32 %src, %src, %quad;
    shfl.sync.idx.b32 %z3, %v3, %src, 31, -1;
    selp.b32 %y0, %z1, %v0, %p1;
    selp.b32 %y1, %v0, %z3, %p1;
    selp.b32 %y2, %z3, %z2, %p1;
    selp.b32 %y3, %z2, %z1, %p1;
    selp.b32 %o0, %y2, %y0, %p2;
    selp.b32 %o1, %y3, %y1, %p2;
    selp.b32 %o2, %y0, %y2, %p2;
    selp.b32 %o3, %y1, %y3, %p2;
    st.global.v4.b32 [$5], {%o0, %o1, %o2, %o3};
    mov.b32 $0, 0;
}""")


@gluon.jit
def _store_bf16(ptr32, at3, v, quads: gl.constexpr):
    """Stores the fp32 [64, 64] v (a t accumulator's layout) rounded to bf16 in 16-byte
    pieces; at3: offsets in 4-byte words (int64), [64 rows, 2 halves, 4 quad lanes] in
    `quads`, lane q of a quad addressing pairs [16 half + 4 q, + 4) of its row.

    In the accumulator layout a thread holds column pairs 8 apart, so a direct store
    writes 4 bytes a thread (a third of what HBM takes, docs/expert-backward.md); here
    each quad of lanes transposes its pairs with shuffles, in registers (Triton's layout
    conversion would take a shared scratch buffer the kernel has no room for).
    Rounding: cvt.rn.bf16x2, round to nearest even as `.to(gl.bfloat16)`."""
    lo, hi = v.reshape([64, 32, 2]).split()
    pairs = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi],
                                      dtype=gl.int32, is_pure=True, pack=1)
    # Pair column 16 half + 4 jj + q -> words w_jj of element (row, half, q).
    e0, e1 = pairs.reshape([64, 2, 4, 4]).permute((0, 1, 3, 2)).reshape([64, 2, 4, 2, 2]).split()
    w0, w2 = e0.split()
    w1, w3 = e1.split()
    gl.inline_asm_elementwise(
        _QUAD_TRANSPOSE_STORE, "=r,r,r,r,r,l",
        [gl.convert_layout(w0, quads), gl.convert_layout(w1, quads),
         gl.convert_layout(w2, quads), gl.convert_layout(w3, quads), ptr32 + at3],
        dtype=gl.int32, is_pure=False, pack=1)


# Four 8-byte stores per lane of eight bf16-pair words $1-$8 of one row (w_jj: pair
# column 4 jj + q on lane q of the quad) by lane pairs: for each pair of groups (2k,
# 2k + 1), the even lane of a pair keeps group 2k's word and takes its odd neighbour's
# (pair columns 8k + q, + 1); the odd lane keeps group 2k + 1's and takes the even
# one's (pair columns 8k + 4 + q - 1, + 1): one select, one shuffle and two selects, no
# lane arithmetic. $9: the lane's parity (q & 1), $10: the address of its first store
# (word (q & 2) + 4 (q & 1) of the row's slice); the others follow 32 bytes apart. The
# value $0 is a dummy. Its own registers are not named %r (LLVM's names for the operands:
# a declaration in the block would shadow one). Checked by tests/test_quad_transpose.py's
# lane-level simulation.
_PAIR_SWAP_STORE = gl.constexpr("""{
    .reg .pred %odd;
    .reg .b32 %s<4>, %x<4>, %lo<4>, %hi<4>;
    setp.ne.b32 %odd, $9, 0;
    selp.b32 %s0, $1, $2, %odd;
    selp.b32 %s1, $3, $4, %odd;
    selp.b32 %s2, $5, $6, %odd;
    selp.b32 %s3, $7, $8, %odd;
    shfl.sync.bfly.b32 %x0, %s0, 1, 31, -1;
    shfl.sync.bfly.b32 %x1, %s1, 1, 31, -1;
    shfl.sync.bfly.b32 %x2, %s2, 1, 31, -1;
    shfl.sync.bfly.b32 %x3, %s3, 1, 31, -1;
    selp.b32 %lo0, %x0, $1, %odd;
    selp.b32 %hi0, $2, %x0, %odd;
    selp.b32 %lo1, %x1, $3, %odd;
    selp.b32 %hi1, $4, %x1, %odd;
    selp.b32 %lo2, %x2, $5, %odd;
    selp.b32 %hi2, $6, %x2, %odd;
    selp.b32 %lo3, %x3, $7, %odd;
    selp.b32 %hi3, $8, %x3, %odd;
    st.global.v2.b32 [$10], {%lo0, %hi0};
    st.global.v2.b32 [$10+32], {%lo1, %hi1};
    st.global.v2.b32 [$10+64], {%lo2, %hi2};
    st.global.v2.b32 [$10+96], {%lo3, %hi3};
    mov.b32 $0, 0;
}""")


@gluon.jit
def _store_bf16_pairs(ptr32, odd, v, rows_q: gl.constexpr):
    """Stores the fp32 [64, 64] v (a t accumulator's layout) rounded to bf16 in 8-byte
    pieces: ptr32, int32 pointers [64 rows, 4 quad lanes] in `rows_q` to each lane's
    first word (see _PAIR_SWAP_STORE); odd: the lane's parity, the same shape. Fewer
    instructions than `_store_bf16`'s transposes (docs/expert-backward.md); each store
    still fills 32-byte sectors. Rounding as `_store_bf16`."""
    lo, hi = v.reshape([64, 32, 2]).split()
    pairs = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi],
                                      dtype=gl.int32, is_pure=True, pack=1)
    # Pair column 4 jj + q -> words w_jj of element (row, q); jj = 4 i0 + 2 i1 + i2.
    w = pairs.reshape([64, 8, 4]).permute((0, 2, 1)).reshape([64, 4, 2, 2, 2])
    even, odd_jj = w.split()
    w04, w26 = even.split()
    w15, w37 = odd_jj.split()
    w0, w4 = w04.split()
    w2, w6 = w26.split()
    w1, w5 = w15.split()
    w3, w7 = w37.split()
    gl.inline_asm_elementwise(
        _PAIR_SWAP_STORE, "=r,r,r,r,r,r,r,r,r,r,l",
        [gl.convert_layout(w0, rows_q), gl.convert_layout(w1, rows_q),
         gl.convert_layout(w2, rows_q), gl.convert_layout(w3, rows_q),
         gl.convert_layout(w4, rows_q), gl.convert_layout(w5, rows_q),
         gl.convert_layout(w6, rows_q), gl.convert_layout(w7, rows_q), odd, ptr32],
        dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _mma_partition(W: gl.constexpr, xs, dys, stages, ready, empty, x_ready, x_empty, turn,
                   tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr, probs_ptr,
                   dprobs_ptr, dgp_ptr, dup_ptr, app_ptr, first_expert,
                   D: gl.constexpr, I: gl.constexpr, NSTAGE: gl.constexpr,
                   RCP: gl.constexpr, STORE_BYTES: gl.constexpr):
    """Rows W*64 .. W*64+63 of every tile of this program: g, u, t, the SwiGLU7
    backward, dprobs and the dg, du, a p panels (RCP, STORE_BYTES: the kernel's)."""
    NI: gl.constexpr = I // 64
    gu_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, t_layout)
    # [64 rows, 2 halves, 4 quad lanes] of a slice's 32 bf16 pairs a row: the rows as in
    # t_layout, the quad's lanes along the last dimension (see _store_bf16).
    quads: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0, 0], [0, 1, 0]],
        lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 2, 4])
    cols_layout: gl.constexpr = gl.SliceLayout(0, quads)
    quad_cols = (16 * gl.arange(0, 2, layout=gl.SliceLayout(1, cols_layout))[:, None]
                 + 4 * gl.arange(0, 4, layout=gl.SliceLayout(0, cols_layout))[None, :])
    # [64 rows, 4 quad lanes] (see _store_bf16_pairs), each lane's parity and the word
    # its first 8-byte store starts at.
    rows_q: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4])
    lane_q = gl.arange(0, 4, layout=gl.SliceLayout(0, rows_q))
    parity = gl.full([64, 4], 0, gl.int32, rows_q) + (lane_q & 1)[None, :]
    pair_word = (lane_q & 2) + 4 * (lane_q & 1)
    dgp32 = dgp_ptr.to(gl.pointer_type(gl.int32))
    dup32 = dup_ptr.to(gl.pointer_type(gl.int32))
    app32 = app_ptr.to(gl.pointer_type(gl.int32))
    xh = xs.index(W)
    dyh = dys.index(W)
    num_tiles = gl.load(ntiles_ptr)
    n = 0  # stages taken from the ring
    blk = 0  # blocks run (turns taken)
    k = 0  # tiles run
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        _, row0, end = _tile_rows0(tile, tile_expert_ptr, tile_first_ptr, offsets_ptr,
                                   first_expert)
        rows = row0 + W * 64 + gl.arange(0, 64, layout=rows_layout)
        row_ok = rows < end
        p = gl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)
        # Row starts only: a [64, 64] tensor of offsets kept across the slices would hold
        # 64 registers a thread.
        prow = ((tile * 128 + W * 64
                 + gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, quads))))
                .to(gl.int64) * (I // 2))
        dprob = gl.zeros([64], gl.float32, rows_layout)
        mbarrier.wait(x_ready.index(W), k & 1)
        # The cp.async writes reach the wgmma (async proxy) through this fence.
        fence_async_shared()
        for j in range(NI):
            # Warpgroup 0 takes the first turn of all (its barrier starts with phase 1
            # complete); then the two alternate.
            mbarrier.wait(turn.index(W), (blk & 1) ^ (1 - W))
            gu = _gate_up_first(xh, stages, ready, n, NSTAGE, gu_layout)
            gu, held = _gate_up_rest(xh, stages, ready, empty, gu, n, D, NSTAGE)
            t, held = _t_product(dyh, stages, ready, empty, held, n + D // 64, t_layout,
                                 NSTAGE)
            mbarrier.arrive(turn.index(1 - W), count=1)
            gu, t = warpgroup_mma_wait(num_outstanding=0, deps=(gu, t))
            _release(empty, held, NSTAGE)
            n += D // 64 + 2
            blk += 1
            if j == NI - 1:
                mbarrier.arrive(x_empty.index(W), count=1)
            # In the accumulator layout a thread holds columns c and c + 64 of gu alike,
            # and the columns c of t: the split stays in registers.
            g, u = gu.reshape([64, 2, 64]).permute((0, 2, 1)).split()
            g = gl.convert_layout(g, t_layout)
            u = gl.convert_layout(u, t_layout)
            a, dg, du = _swiglu7_backward(g, u, t, p, RCP)
            dprob += gl.sum(a * t, axis=1)
            if STORE_BYTES == 8:
                at = gl.convert_layout((prow + j * 32)[:, None], rows_q) + pair_word[None, :]
                _store_bf16_pairs(dgp32 + at, parity, dg, rows_q)
                _store_bf16_pairs(dup32 + at, parity, du, rows_q)
                _store_bf16_pairs(app32 + at, parity, a * p[:, None], rows_q)
            else:
                at = (prow + j * 32)[:, None, None] + quad_cols[None, :, :]
                _store_bf16(dgp32, at, dg, quads)
                _store_bf16(dup32, at, du, quads)
                _store_bf16(app32, at, a * p[:, None], quads)
        gl.store(dprobs_ptr + rows, dprob, mask=row_ok)
        k += 1


@gluon.jit
def _expert_panels_sm90_kernel(
    x_ptr, dy_ptr, H,  # x_heads, grad_y: contiguous [S, H, D]
    gather_ids_ptr, probs_ptr, offsets_ptr,  # the RouteLayout: [R], [R], [H*E + 1]
    tile_expert_ptr, tile_first_ptr, ntiles_ptr,  # the tile map; ntiles: [1] int32
    wg_desc, wu_desc, wd_desc,  # [H*E*D, I], [H*E*D, I], [H*E*I, D]; [64, 64] boxes
    dprobs_ptr,  # fp32 [R]
    xp_desc, dyp_desc,  # the x, dy panels [P, D]; [64, 64] boxes
    dgp_ptr, dup_ptr, app_ptr,  # the dg, du, a p panels: bf16 [P, I]
    E, first_expert,
    D: gl.constexpr, I: gl.constexpr, NSTAGE: gl.constexpr,
    MMA_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
    RCP: gl.constexpr = False, STORE_BYTES: gl.constexpr = 16,
):
    """dprobs and the panels of the tiles of a head group (see the module docstring).

    Launch grid: (programs,), persistent: program q takes tiles q, q + programs, ...
    below ntiles[0]; tile t's rows go to panel rows [128 t, 128 t + 128). 4 warps (the
    default partition is MMA warpgroup 0) plus the workers. NSTAGE: ring stages;
    MMA_REGS, LOAD_REGS: registers a thread of the MMA warpgroups and of the loaders'
    warpgroup (setmaxnreg). RCP, STORE_BYTES: `ExpertBackwardConfig.sigmoid_rcp` and
    `.panel_store_bytes` (8 or 16).
    """
    xy_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D], gl.bfloat16)
    xs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D], xy_layout)
    dys = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D], xy_layout)
    stages = gl.allocate_shared_memory(gl.bfloat16, [NSTAGE, 64, 128],
                                       gl.NVMMASharedLayout.get_default_for([64, 128],
                                                                            gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NSTAGE):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both warpgroups read every stage
    for w in gl.static_range(2):
        mbarrier.init(x_ready.index(w), count=32)  # the x / dy loader warp's 32 threads
        mbarrier.init(x_empty.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    gl.warp_specialize([
        (_mma_partition, (0, xs, dys, stages, ready, empty, x_ready, x_empty, turn,
                          tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr, probs_ptr,
                          dprobs_ptr, dgp_ptr, dup_ptr, app_ptr, first_expert, D, I, NSTAGE,
                          RCP, STORE_BYTES)),
        (_mma_partition, (1, xs, dys, stages, ready, empty, x_ready, x_empty, turn,
                          tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr, probs_ptr,
                          dprobs_ptr, dgp_ptr, dup_ptr, app_ptr, first_expert, D, I, NSTAGE,
                          RCP, STORE_BYTES)),
        # The forward's loader, without clusters (its cluster arguments unused).
        (_w_loader, (wg_desc, wu_desc, wd_desc, stages, ready, empty, empty, tile_expert_ptr,
                     tile_first_ptr, ntiles_ptr, first_expert, 0, D, I, NSTAGE, 1, (0, 0))),
        (_xdy_loader, (x_ptr, dy_ptr, H, gather_ids_ptr, xs, dys, x_ready, x_empty, xp_desc,
                       dyp_desc, tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr,
                       first_expert, E, D)),
        (_idle, (1,)),
    ], [4, 1, 1, 2], [MMA_REGS, LOAD_REGS, LOAD_REGS, LOAD_REGS])


def panels_fit(x_heads: torch.Tensor, grad_y: torch.Tensor, w_gate: torch.Tensor,
               w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether this kernel takes the shapes and dtypes: bf16 throughout, D = 256,
    I a multiple of 64, on an sm_90 GPU."""
    D, I = w_gate.shape[1], w_gate.shape[2]
    return (on_sm90(x_heads)
            and all(t.dtype == torch.bfloat16 for t in (x_heads, grad_y, w_gate, w_up, w_down))
            and D == 256 and I % 64 == 0 and I > 0)


def panel_descriptors(xp: torch.Tensor, dyp: torch.Tensor):
    """Descriptors of the x and dy panels [P, D] with [64, 64] boxes."""
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    return (TensorDescriptor.from_tensor(xp, [64, 64], layout),
            TensorDescriptor.from_tensor(dyp, [64, 64], layout))


def kernel_options(config: PanelsSm90Config, D: int, I: int, rcp: bool = False,
                   store_bytes: int = 16) -> dict:
    """The constexprs of `_expert_panels_sm90_kernel` for these tiles and shapes (rcp,
    store_bytes: `ExpertBackwardConfig.sigmoid_rcp` and `.panel_store_bytes`)."""
    return dict(D=D, I=I, NSTAGE=config.num_stages, MMA_REGS=config.mma_regs,
                LOAD_REGS=config.load_regs, RCP=rcp, STORE_BYTES=store_bytes)


def launch_panels(x_heads, grad_y, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                  dprobs, views, tile_expert, tile_first, num_tiles, *, E: int,
                  first_expert: int, rcp: bool = False, store_bytes: int = 16) -> None:
    """One launch for a head group: dprobs of its routes and its panels `views` (x, dy,
    dg, du, a p of `expert_backward._Panels.views`, tiles of 128 rows), over the tile map
    of 128-row tiles (`expert_forward.tile_map` with its total). Persistent: one program
    an SM, at most one a tile. rcp, store_bytes: `kernel_options`'s."""
    config = panels_sm90_config()
    D, I = w_gate.shape[1], w_gate.shape[2]
    wg_desc, wu_desc, wd_desc = weight_descriptors(w_gate, w_up, w_down, 64)
    xp_desc, dyp_desc = panel_descriptors(views[0], views[1])
    sms = torch.cuda.get_device_properties(x_heads.device).multi_processor_count
    programs = max(1, min(sms, tile_expert.numel()))
    _expert_panels_sm90_kernel[(programs,)](
        x_heads, grad_y, x_heads.shape[1], gather_ids, sorted_probs, offsets, tile_expert,
        tile_first, num_tiles, wg_desc, wu_desc, wd_desc, dprobs, xp_desc, dyp_desc,
        views[2], views[3], views[4], E, first_expert,
        **kernel_options(config, D, I, rcp, store_bytes), num_warps=config.num_warps,
        maxnreg=config.maxnreg)


def sm90_compile_cases() -> list:
    """This kernel as the backward's launcher compiles it (`mhmoe.kernels.CompileCase`;
    MAGI-2's dims)."""
    from triton.runtime.jit import mangle_type

    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase

    config = panels_sm90_config()
    D, I = M.head_dim, M.expert_intermediate_size
    w = torch.empty(2, D, I, dtype=torch.bfloat16)
    descs = weight_descriptors(w, w, torch.empty(2, I, D, dtype=torch.bfloat16), 64)
    p = torch.empty(256, D, dtype=torch.bfloat16)
    panel_descs = panel_descriptors(p, p)
    sig = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "H": "i32", "gather_ids_ptr": "*i32",
           "probs_ptr": "*fp32", "offsets_ptr": "*i64", "tile_expert_ptr": "*i32",
           "tile_first_ptr": "*i32", "ntiles_ptr": "*i32",
           **{k: mangle_type(d) for k, d in zip(("wg_desc", "wu_desc", "wd_desc"), descs,
                                                strict=True)},
           "dprobs_ptr": "*fp32",
           **{k: mangle_type(d) for k, d in zip(("xp_desc", "dyp_desc"), panel_descs,
                                                strict=True)},
           "dgp_ptr": "*bf16", "dup_ptr": "*bf16", "app_ptr": "*bf16", "E": "i32",
           "first_expert": "i32"}
    # The default, and ExpertBackwardConfig.sigmoid_rcp with 8-byte stores.
    return [CompileCase(f"expert panels ws (Gluon){name}", _expert_panels_sm90_kernel, sig,
                        kernel_options(config, D, I, rcp, store_bytes), config.num_warps, 1,
                        (), config.maxnreg)
            for name, rcp, store_bytes in (("", False, 16), (" rcp, 8-byte stores", True, 8))]
