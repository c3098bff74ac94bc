"""Fused expert MLP forward with fp8 (e4m3) weights for Hopper (sm_90), in Gluon, with
explicit warp specialisation.

The computation of `expert_forward_fp8._expert_forward_fp8_kernel` (see there: x
quantized per route row, the SwiGLU7 output per row and per slice of 64 columns of I, the
down accumulator kept in units of the current slice's scale), scheduled as the bf16
kernel of `expert_forward_sm90.py` (see there) schedules the bf16 one: one persistent
program an SM walks tiles of 128 routes of one flat expert; two MMA warpgroups, each
owning 64 of a tile's rows, take turns (a pair of mbarriers) so that one's SwiGLU,
quantization and accumulator rescale run under the other's wgmmas; a loader warp streams
the weights by TMA into a ring; another gathers x rows by cp.async. In the Triton kernel
every one of those steps sits between two wgmmas of a single warpgroup (docs/fp8.md, "Why
prediction and result differ").

What differs from the bf16 kernel:

- Hopper's fp8 wgmma reads both operands K-major from shared memory (or A from
  registers), so the ring holds the weights as stored (`W_gate`, `W_up` as [F, I, D],
  `W_down` as [F, D, I], K contiguous) and the products take transposed views. A stage
  is 16 KB: for gate|up, [128, 128] e4m3 (64 rows of W_gate^T over 128 of D, then the
  same of W_up^T: gate|up is one N = 128 accumulator, as in bf16); for the down product,
  the same bytes read as [256, 64] (all of D over the slice's 64 columns of I). A slice
  of I takes D / 128 + 1 = 3 stages, half the bf16 kernel's bytes.
- The gate and up channel scales of a slice (64 + 64 fp32) ride in a small slot beside
  the slice's last gate|up stage, loaded by TMA on the same barrier, so the SwiGLU reads
  them from shared memory instead of waiting on global loads; the down scales (D fp32)
  are loaded once a tile, early in its last block.
- The x loader gathers bf16 rows as in the bf16 kernel; the MMA warpgroup quantizes its
  64 rows (per-row amax and scale) into an e4m3 copy that its gate|up wgmmas read, and
  keeps the row scales in registers. The bf16 half is free once that is done. With
  CHUNKED (`Fp8ForwardConfig.chunked_x`) the quantization is a run-time loop over groups
  of 8 rows, on x tiles laid out for it (`_quantize_x_rows`): a short body where the
  unrolled one would be fetched afresh each tile.
- The SwiGLU output is quantized in registers (row amax over the slice's 64 columns) and
  stored to a 4 KB shared tile, the down wgmma's A operand (Triton 3.6 cannot keep an
  8-bit register operand alive across a wgmma wait, as the bf16 kernel keeps its bf16
  `a`); the [64, 256] fp32 down accumulator is rescaled by s_prev / s_a while the other
  warpgroup's wgmmas run.

Numerics are those of the Triton kernel: the same quantization code, every product
accumulated by wgmma in the same K order (32 at a time, ascending), the same scaling
order, the same epilogue and combine; so the deterministic modes should agree bitwise
(tests/test_gpu.py checks it).

Shapes it takes (`fp8_ws_fits`): bf16 x, e4m3 K-major weights, D = 256, I a multiple of
64, sm_90. Tiles: `tuning.Fp8ForwardSm90Config` (128 routes, slices of 64; the ring
depth and the register budget are the config's).
"""

from __future__ import annotations

import torch
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

from .expert_forward_sm90 import (
    _combine_half,
    _divide,
    _half_rows,
    _idle,
    _release,
    _swiglu7_fp32,
    _tile_rows0,
    _wait_stage,
    _x_loader,
)
from .tuning import Fp8ForwardSm90Config, fp8_forward_sm90_config, on_sm90

# The same constants as expert_forward_fp8's (mhmoe.fp8's FP8_MAX and AMAX_FLOOR).
_FP8_MAX = gl.constexpr(448.0)
_AMAX_FLOOR = gl.constexpr(2.0 ** -64)


@gluon.jit
def _down_view(stages, slot):
    """Ring stage `slot` as the down product's [D = 256, 64] e4m3 tile (64-byte rows)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([256, 64], gl.float8e4nv)
    return stages.index(slot)._reinterpret(gl.float8e4nv, [256, 64], layout)


@gluon.jit
def _w_loader(wg_desc, wu_desc, wd_desc, sg_desc, su_desc, stages, scales, ready, empty,
              tile_expert_ptr, ntiles_ptr, first_expert, D: gl.constexpr, I: gl.constexpr,
              NSTAGE: gl.constexpr):
    """The weight stages of every tile of this program, in consumption order: per slice j
    of I, gate|up chunks c over D (64 rows j*64.. of W_gate^T[f] and W_up^T[f], columns
    c*128..), the last with the slice's gate and up scales; then W_down^T[f]'s columns
    j*64.. over all of D."""
    num_tiles = gl.load(ntiles_ptr)
    n = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        f = first_expert + gl.load(tile_expert_ptr + t)
        for j in range(I // 64):
            for c in gl.static_range(D // 128):
                slot = n % NSTAGE
                mbarrier.wait(empty.index(slot), ((n // NSTAGE) & 1) ^ 1)
                bar = ready.index(slot)
                st = stages.index(slot)
                if c == D // 128 - 1:
                    mbarrier.expect(bar, 2 * wg_desc.block_type.nbytes
                                    + 2 * sg_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(sg_desc, [f * (I // 64) + j, 0], bar,
                                                    scales.index(2 * slot))
                    tma.async_copy_global_to_shared(su_desc, [f * (I // 64) + j, 0], bar,
                                                    scales.index(2 * slot + 1))
                else:
                    mbarrier.expect(bar, 2 * wg_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(wg_desc, [f * I + j * 64, c * 128], bar,
                                                st.slice(0, 64, dim=0))
                tma.async_copy_global_to_shared(wu_desc, [f * I + j * 64, c * 128], bar,
                                                st.slice(64, 64, dim=0))
                n += 1
            slot = n % NSTAGE
            mbarrier.wait(empty.index(slot), ((n // NSTAGE) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, wd_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(wd_desc, [f * D, j * 64], bar,
                                            _down_view(stages, slot))
            n += 1


@gluon.jit
def _quantize_x(xs, xq, g_layout: gl.constexpr, RCP: gl.constexpr):
    """The warpgroup's 64 bf16 x rows (xs) as e4m3 in xq, each row scaled by its own
    s_x = max(amax, floor) / 448; returns s_x (rows of g_layout)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    x = xs.load(layout).to(gl.float32)
    s_x = gl.maximum(gl.max(gl.abs(x), axis=1), _AMAX_FLOOR) / _FP8_MAX
    xq.store(_divide(x, s_x[:, None], RCP).to(gl.float8e4nv))
    # Generic-proxy stores, read next by wgmma (the async proxy).
    fence_async_shared()
    return gl.convert_layout(s_x, gl.SliceLayout(1, g_layout))


@gluon.jit
def _quantize_x_rows(xs, xq, sxs, W: gl.constexpr, g_layout: gl.constexpr,
                     RCP: gl.constexpr):
    """`_quantize_x` as a run-time loop over groups of 8 rows (CHUNKED), so that a tile's
    start runs a short body 8 times instead of fetching the unrolled whole afresh (docs/fp8.md,
    "Where the time goes"). xs: the bf16 x rows as [16, 8, D] (warpgroup W's are groups
    W*8 ...); xq: the e4m3 copies as [2 * D/128, 64, 128] (warpgroup W's 128-column
    slabs are W*D/128 ...); sxs: [16, 1, 8] fp32 for the row scales, which come back in the
    rows of g_layout. The same values as `_quantize_x`: a row's amax is the max of its two
    halves' (max is exact). D = 256."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    s_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
    gl.static_assert(xq.shape[0] == 4, "D = 256: two 128-column slabs a warpgroup")
    xq8 = xq._reinterpret(gl.float8e4nv, [xq.shape[0] * 8, 8, 128],
                          gl.NVMMASharedLayout.get_default_for([8, 128], gl.float8e4nv))
    for r in range(8):
        rows = xs.index(W * 8 + r)
        x0 = rows.slice(0, 128, dim=1).load(layout).to(gl.float32)
        x1 = rows.slice(128, 128, dim=1).load(layout).to(gl.float32)
        amax = gl.maximum(gl.max(gl.abs(x0), axis=1), gl.max(gl.abs(x1), axis=1))
        s = gl.maximum(amax, _AMAX_FLOOR) / _FP8_MAX
        xq8.index((W * 2) * 8 + r).store(_divide(x0, s[:, None], RCP).to(gl.float8e4nv))
        xq8.index((W * 2 + 1) * 8 + r).store(_divide(x1, s[:, None], RCP).to(gl.float8e4nv))
        sxs.index(W * 8 + r).store(gl.convert_layout(s, gl.SliceLayout(0, s_layout))[None, :])
    # Generic-proxy stores, read next by wgmma (the async proxy); the row scales, read
    # back in another layout, by other threads of the warpgroup.
    fence_async_shared()
    gl.thread_barrier()
    flat: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                              rank=2)
    s_x = sxs._reinterpret(gl.float32, [2, 1, 64], flat).index(W).load(s_layout)
    # [1, 64] -> [64] (the max of one value is that value), in g_layout's rows
    return gl.convert_layout(gl.max(s_x, axis=0), gl.SliceLayout(1, g_layout))


@gluon.jit
def _x_slab(xq, c: gl.constexpr, CHUNKED: gl.constexpr, W: gl.constexpr):
    """Columns c*128 .. c*128+127 of warpgroup W's e4m3 x: slab W*2 + c of
    [4, 64, 128] (CHUNKED, D = 256) or a slice of its [64, D]."""
    if CHUNKED:
        return xq.index(W * 2 + c)
    else:
        return xq.slice(c * 128, 128, dim=1)


@gluon.jit
def _gate_up_first(xq, stages, ready, n, NSTAGE: gl.constexpr, gu_layout: gl.constexpr,
                   CHUNKED: gl.constexpr, W: gl.constexpr):
    """Issues chunk 0 of gu = xq @ [W_gate | W_up] from stage n (a fresh accumulator)."""
    st = _wait_stage(stages, ready, n, NSTAGE)
    return warpgroup_mma(_x_slab(xq, 0, CHUNKED, W), st.permute((1, 0)),
                         gl.zeros([64, 128], gl.float32, gu_layout), use_acc=False,
                         is_async=True)


@gluon.jit
def _gate_up_rest(xq, stages, ready, empty, gu, n, D: gl.constexpr, NSTAGE: gl.constexpr,
                  CHUNKED: gl.constexpr, W: gl.constexpr):
    """Chunks 1 .. D/128 - 1 of gu from stages n + 1 ... (chunk 0, from stage n, is in
    flight); one wgmma kept in flight, each stage released once its wgmma retired.
    Returns (gu in flight, its last stage, still held: it carries the scales)."""
    for c in gl.static_range(1, D // 128):
        st = _wait_stage(stages, ready, n + c, NSTAGE)
        gu = warpgroup_mma(_x_slab(xq, c, CHUNKED, W), st.permute((1, 0)), gu, is_async=True)
        gu = warpgroup_mma_wait(num_outstanding=1, deps=(gu,))
        _release(empty, n + c - 1, NSTAGE)
    return gu, n + D // 128 - 1


@gluon.jit
def _down(aq, stages, ready, n, acc, NSTAGE: gl.constexpr):
    """Issues acc += aq @ W_down slice (aq in shared memory, W_down from stage n, all of
    D)."""
    _wait_stage(stages, ready, n, NSTAGE)
    return warpgroup_mma(aq, _down_view(stages, n % NSTAGE).permute((1, 0)), acc,
                         is_async=True)


@gluon.jit
def _activation(gu, s_x, scales, empty, held, aq, acc, s_prev, NSTAGE: gl.constexpr,
                g_layout: gl.constexpr, RCP: gl.constexpr):
    """The slice's SwiGLU7 output from the gate|up accumulator, quantized per row into aq
    (shared memory, the A operand of the next down wgmma), with the gate and up channel
    scales from the slot of stage `held`, which is then released; the down accumulator
    (retired) rescaled to the slice's scale. Returns (acc, s_a)."""
    g, u = gu.reshape([64, 2, 64]).permute((0, 2, 1)).split()
    g = gl.convert_layout(g, g_layout)
    u = gl.convert_layout(u, g_layout)
    slot = held % NSTAGE
    sg = scales.index(2 * slot).load(g_layout)  # [1, 64]
    su = scales.index(2 * slot + 1).load(g_layout)
    a = _swiglu7_fp32(g * s_x[:, None] * sg, u * s_x[:, None] * su, RCP)
    s_a = gl.maximum(gl.max(gl.abs(a), axis=1), _AMAX_FLOOR) / _FP8_MAX
    aq.store(_divide(a, s_a[:, None], RCP).to(gl.float8e4nv))
    fence_async_shared()
    _release(empty, held, NSTAGE)
    s_a = gl.convert_layout(s_a, s_prev.type.layout)
    return acc * _divide(s_prev, s_a, RCP)[:, None], s_a


@gluon.jit
def _skip_half(W: gl.constexpr, stages, ready, empty, x_ready, x_empty, turn, n, blk, k,
               D: gl.constexpr, I: gl.constexpr, NSTAGE: gl.constexpr):
    """Half W of tile k when it holds no row (`Fp8ForwardConfig.skip_empty_halves`): no
    wgmma, no SwiGLU, no combine; it hands its x buffer back and takes its turns and its
    arrivals on the ring as `_mma_partition` would, each stage waited for before it is
    released, as there (warpgroup 0 has waited for the block's stages before it passes
    the turn, so the wait costs nothing; it keeps each arrival tied to the fill it
    answers whatever the other warpgroup does). Returns (stages taken, turns taken)
    past the tile."""
    NI: gl.constexpr = I // 64
    NC: gl.constexpr = D // 128
    mbarrier.wait(x_ready.index(W), k & 1)
    mbarrier.arrive(x_empty.index(W), count=1)
    # Block 0 takes the gate|up stages of slice 0, blocks 1 .. NI-1 the down stage of
    # the slice before and the gate|up stages of their own, the last block a down stage.
    for b in range(NI + 1):
        mbarrier.wait(turn.index(W), (blk & 1) ^ (1 - W))
        taken = NC if b == 0 else (1 if b == NI else NC + 1)
        for c in range(taken):
            _wait_stage(stages, ready, n + c, NSTAGE)
            _release(empty, n + c, NSTAGE)
        n += taken
        mbarrier.arrive(turn.index(1 - W), count=1)
        blk += 1
    return n, blk


@gluon.jit
def _mma_partition(W: gl.constexpr, xs, xq, aqs, stages, scales, ready, empty, x_ready, x_empty,
                   turn, tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr,
                   gather_ids_ptr, probs_ptr, sd_ptr, out_ptr, slot_ptr, E, first_expert,
                   first_head, group_heads, slot_base, D: gl.constexpr, I: gl.constexpr,
                   NSTAGE: gl.constexpr, DETERMINISTIC: gl.constexpr, RCP: gl.constexpr,
                   SKIP: gl.constexpr, CHUNKED: gl.constexpr, sxs):
    """Rows W*64 .. W*64+63 of every tile of this program: the fp8 MLP of each route,
    scaled by its probability, combined as `expert_forward.combine_rows` (RCP, SKIP,
    CHUNKED: the kernel's; with SKIP, warpgroup 1 runs `_skip_half` where its half holds
    no row; with CHUNKED, x's quantization is `_quantize_x_rows`, on the kernel's chunked
    tiles xs, xq and sxs)."""
    NI: gl.constexpr = I // 64
    NC: gl.constexpr = D // 128
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 32])
    gu_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, acc_layout))
    if CHUNKED:
        xqh = xq  # [2 * D/128, 64, 128]: this warpgroup's slabs are W*D/128 ...
    else:
        xh = xs.index(W)
        xqh = xq.index(W)
    aq = aqs.index(W)
    num_tiles = gl.load(ntiles_ptr)
    n = 0  # stages taken from the ring
    blk = 0  # blocks run (turns taken)
    k = 0  # tiles run
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        f, row0, end = _tile_rows0(t, tile_expert_ptr, tile_first_ptr, offsets_ptr,
                                   first_expert)
        if SKIP and W == 1 and row0 + 64 >= end:
            n, blk = _skip_half(W, stages, ready, empty, x_ready, x_empty, turn, n, blk, k, D,
                                I, NSTAGE)
            k += 1
        else:
            mbarrier.wait(x_ready.index(W), k & 1)
            if CHUNKED:
                s_x = _quantize_x_rows(xs, xq, sxs, W, g_layout, RCP)
            else:
                s_x = _quantize_x(xh, xqh, g_layout, RCP)
            s_prev = gl.full([64], 1.0, gl.float32, rows_layout)
            acc = gl.zeros([64, 256], gl.float32, acc_layout)

            # Block 0: gate|up of slice 0. Warpgroup 0 takes the first turn of all (its
            # barrier starts with phase 1 complete); then the two alternate.
            mbarrier.wait(turn.index(W), (blk & 1) ^ (1 - W))
            gu = _gate_up_first(xqh, stages, ready, n, NSTAGE, gu_layout, CHUNKED, W)
            gu, held = _gate_up_rest(xqh, stages, ready, empty, gu, n, D, NSTAGE, CHUNKED, W)
            n += NC
            mbarrier.arrive(turn.index(1 - W), count=1)
            gu = warpgroup_mma_wait(num_outstanding=0, deps=(gu,))
            # Every thread of the warpgroup read its bf16 half before the wgmmas above.
            mbarrier.arrive(x_empty.index(W), count=1)
            acc, s_prev = _activation(gu, s_x, scales, empty, held, aq, acc, s_prev, NSTAGE,
                                      g_layout, RCP)
            blk += 1

            for _j in range(1, NI):
                # Block j: the down product of slice j-1, then gate|up of slice j.
                mbarrier.wait(turn.index(W), (blk & 1) ^ (1 - W))
                acc = _down(aq, stages, ready, n, acc, NSTAGE)
                gu = _gate_up_first(xqh, stages, ready, n + 1, NSTAGE, gu_layout, CHUNKED, W)
                # The down wgmma retired (aq, its A operand, is free after this).
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                _release(empty, n, NSTAGE)
                gu, held = _gate_up_rest(xqh, stages, ready, empty, gu, n + 1, D, NSTAGE,
                                         CHUNKED, W)
                n += 1 + NC
                mbarrier.arrive(turn.index(1 - W), count=1)
                gu, acc = warpgroup_mma_wait(num_outstanding=0, deps=(gu, acc))
                acc, s_prev = _activation(gu, s_x, scales, empty, held, aq, acc, s_prev, NSTAGE,
                                          g_layout, RCP)
                blk += 1

            # The last block: the down product of the last slice.
            mbarrier.wait(turn.index(W), (blk & 1) ^ (1 - W))
            acc = _down(aq, stages, ready, n, acc, NSTAGE)
            mbarrier.arrive(turn.index(1 - W), count=1)
            sd = gl.load(sd_ptr + f * D + cols)
            row_ok, prob, dst = _half_rows(row0 + W * 64, end, f, probs_ptr, slot_ptr,
                                           gather_ids_ptr, E, first_head, group_heads, slot_base,
                                           rows_layout, DETERMINISTIC)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release(empty, n, NSTAGE)
            n += 1
            blk += 1
            k += 1

            acc = acc * s_prev[:, None]
            acc = acc * sd[None, :] * prob[:, None]
            _combine_half(out_ptr + dst[:, None] * D + cols[None, :], acc, row_ok, DETERMINISTIC)


@gluon.jit
def _expert_forward_fp8_sm90_kernel(
    x_ptr, stride_xs, stride_xh,  # x_heads [S, H, D] bf16, unit stride along D
    gather_ids_ptr, probs_ptr, offsets_ptr,  # the RouteLayout: [R], [R], [H*E + 1]
    tile_expert_ptr, tile_first_ptr, ntiles_ptr,  # the tile map; ntiles: [1] int32
    wg_desc, wu_desc, wd_desc,  # e4m3 [F*I, D], [F*I, D] ([64, 128] boxes), [F*D, I] ([256, 64])
    sg_desc, su_desc, sd_ptr,  # fp32 scales: [F*I/64, 64] ([1, 64] boxes), [F*I/64, 64], [F, D]
    out_ptr, slot_ptr,  # default: fp32 [S, G, D]; deterministic: fp32 [G*S*K, D], slots [R]
    E, first_expert, first_head, group_heads, slot_base,
    D: gl.constexpr, I: gl.constexpr, NSTAGE: gl.constexpr, DETERMINISTIC: gl.constexpr,
    MMA_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, RCP: gl.constexpr = False,
    SKIP: gl.constexpr = False, CHUNKED: gl.constexpr = False,
):
    """Expert MLPs of the tiles of a head group, fp8 weights (see the module docstring).

    Launch grid: (programs,), persistent: program p takes tiles p, p + programs, ...
    below ntiles[0]. 4 warps (the default partition is MMA warpgroup 0) plus the
    workers. NSTAGE: stages of the weight ring; MMA_REGS, LOAD_REGS: registers a thread
    of the MMA warpgroups and of the loaders' warpgroup (setmaxnreg). RCP, SKIP,
    CHUNKED: `Fp8ForwardConfig.reciprocals`, `.skip_empty_halves`, `.chunked_x`.
    """
    if CHUNKED:
        # x in groups of 8 rows (the x loader fills them so), its e4m3 copy in
        # 128-column slabs, and the row scales (`_quantize_x_rows`).
        xs = gl.allocate_shared_memory(gl.bfloat16, [16, 8, D],
                                       gl.NVMMASharedLayout.get_default_for([8, D],
                                                                            gl.bfloat16))
        xq = gl.allocate_shared_memory(gl.float8e4nv, [2 * (D // 128), 64, 128],
                                       gl.NVMMASharedLayout.get_default_for([64, 128],
                                                                            gl.float8e4nv))
        sxs = gl.allocate_shared_memory(gl.float32, [16, 1, 8], gl.NVMMASharedLayout(
            swizzle_byte_width=0, element_bitwidth=32, rank=2))
    else:
        xs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D],
                                       gl.NVMMASharedLayout.get_default_for([64, D],
                                                                            gl.bfloat16))
        xq = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, D],
                                       gl.NVMMASharedLayout.get_default_for([64, D],
                                                                            gl.float8e4nv))
        sxs = xq  # unused
    aqs = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 64],
                                    gl.NVMMASharedLayout.get_default_for([64, 64],
                                                                         gl.float8e4nv))
    stages = gl.allocate_shared_memory(gl.float8e4nv, [NSTAGE, 128, 128],
                                       gl.NVMMASharedLayout.get_default_for([128, 128],
                                                                            gl.float8e4nv))
    scales = gl.allocate_shared_memory(gl.float32, [2 * NSTAGE, 1, 64], gl.NVMMASharedLayout(
        swizzle_byte_width=0, element_bitwidth=32, rank=2))
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NSTAGE):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both warpgroups read every stage
    for w in gl.static_range(2):
        mbarrier.init(x_ready.index(w), count=32)  # the x loader warp's 32 threads
        mbarrier.init(x_empty.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    gl.warp_specialize([
        (_mma_partition, (0, xs, xq, aqs, stages, scales, ready, empty, x_ready, x_empty, turn,
                          tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr,
                          gather_ids_ptr, probs_ptr, sd_ptr, out_ptr, slot_ptr, E,
                          first_expert, first_head, group_heads, slot_base, D, I, NSTAGE,
                          DETERMINISTIC, RCP, SKIP, CHUNKED, sxs)),
        (_mma_partition, (1, xs, xq, aqs, stages, scales, ready, empty, x_ready, x_empty, turn,
                          tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr,
                          gather_ids_ptr, probs_ptr, sd_ptr, out_ptr, slot_ptr, E,
                          first_expert, first_head, group_heads, slot_base, D, I, NSTAGE,
                          DETERMINISTIC, RCP, SKIP, CHUNKED, sxs)),
        (_w_loader, (wg_desc, wu_desc, wd_desc, sg_desc, su_desc, stages, scales, ready, empty,
                     tile_expert_ptr, ntiles_ptr, first_expert, D, I, NSTAGE)),
        (_x_loader, (x_ptr, stride_xs, stride_xh, gather_ids_ptr, xs, x_ready, x_empty,
                     tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr, first_expert,
                     E, D, 1, CHUNKED)),
        (_idle, (1,)),
    ], [4, 1, 1, 2], [MMA_REGS, LOAD_REGS, LOAD_REGS, LOAD_REGS])


def fp8_ws_fits(x_heads: torch.Tensor, wg_t: torch.Tensor, wd_t: torch.Tensor) -> bool:
    """Whether this kernel takes the shapes and dtypes: bf16 x, e4m3 weights (wg_t
    [F, I, D], wd_t [F, D, I]), D = 256, I a multiple of 64, on an sm_90 GPU."""
    I, D = wg_t.shape[1], wg_t.shape[2]
    return (on_sm90(x_heads)
            and x_heads.dtype == torch.bfloat16
            and wg_t.dtype == wd_t.dtype == torch.float8_e4m3fn
            and D == 256 and I % 64 == 0 and I > 0)


def descriptors(wg_t: torch.Tensor, wu_t: torch.Tensor, wd_t: torch.Tensor,
                gate_scale: torch.Tensor, up_scale: torch.Tensor) -> tuple:
    """The kernel's TMA descriptors: W_gate^T and W_up^T as [F*I, D] in [64, 128] boxes,
    W_down^T as [F*D, I] in [256, 64] boxes (contiguous K-major weights), the
    gate and up scales as [F*I/64, 64] in [1, 64] boxes."""
    F, I, D = wg_t.shape
    wg_t, wu_t, wd_t = wg_t.contiguous(), wu_t.contiguous(), wd_t.contiguous()
    gate_scale, up_scale = gate_scale.contiguous(), up_scale.contiguous()
    fp8 = gl.float8e4nv
    gu = gl.NVMMASharedLayout.get_default_for([64, 128], fp8)
    down = gl.NVMMASharedLayout.get_default_for([256, 64], fp8)
    scale = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return (TensorDescriptor.from_tensor(wg_t.view(F * I, D), [64, 128], gu),
            TensorDescriptor.from_tensor(wu_t.view(F * I, D), [64, 128], gu),
            TensorDescriptor.from_tensor(wd_t.view(F * D, I), [256, 64], down),
            TensorDescriptor.from_tensor(gate_scale.view(F * I // 64, 64), [1, 64], scale),
            TensorDescriptor.from_tensor(up_scale.view(F * I // 64, 64), [1, 64], scale))


# `Fp8ForwardConfig`'s options of this kernel -> its constexprs, and how a compile case
# names them.
OPTIONS = {"reciprocals": ("RCP", "reciprocals"),
           "skip_empty_halves": ("SKIP", "skip empty halves"),
           "chunked_x": ("CHUNKED", "chunked x")}


def config_options(config) -> dict:
    """This kernel's options as an `Fp8ForwardConfig` sets them."""
    return {name: getattr(config, name) for name in OPTIONS}


def kernel_options(config: Fp8ForwardSm90Config, D: int, I: int, deterministic: bool,
                   **options: bool) -> dict:
    """The constexprs of `_expert_forward_fp8_sm90_kernel` for these tiles and shapes, with
    `OPTIONS` (`Fp8ForwardConfig`'s, off where not given)."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"kernel_options: no option {sorted(unknown)}")
    return dict(D=D, I=I, NSTAGE=config.num_stages, DETERMINISTIC=deterministic,
                MMA_REGS=config.mma_regs, LOAD_REGS=config.load_regs,
                **{cx: bool(options.get(name, False)) for name, (cx, _) in OPTIONS.items()})


def launch_fp8_ws(x_heads, gather_ids, sorted_probs, offsets, descs, down_scale, out, slots,
                  tile_expert, tile_first, num_tiles, *, config: Fp8ForwardSm90Config, E: int,
                  first_expert: int, first_head: int, group_heads: int, slot_base: int,
                  I: int, deterministic: bool, **options: bool) -> None:
    """One launch of `_expert_forward_fp8_sm90_kernel` for a head group (the launcher of
    expert_forward_fp8.py prepares the tile map of config.block_m rows, `descriptors` and
    `out`; options: `kernel_options`'). Persistent: one program an SM."""
    sms = torch.cuda.get_device_properties(x_heads.device).multi_processor_count
    programs = max(1, min(sms, tile_expert.numel()))
    _expert_forward_fp8_sm90_kernel[(programs,)](
        x_heads, x_heads.stride(0), x_heads.stride(1), gather_ids, sorted_probs, offsets,
        tile_expert, tile_first, num_tiles, *descs, down_scale, out, slots, E, first_expert,
        first_head, group_heads, slot_base,
        **kernel_options(config, x_heads.shape[2], I, deterministic, **options),
        num_warps=config.num_warps, maxnreg=config.maxnreg)


def sm90_signature(config: Fp8ForwardSm90Config, D: int, I: int, deterministic: bool,
                   **options: bool):
    """(signature, constexprs) of `_expert_forward_fp8_sm90_kernel` as `launch_fp8_ws`
    calls it, for compiling it without a GPU (tools/sass_audit.py)."""
    from triton.runtime.jit import mangle_type

    fp8 = torch.float8_e4m3fn
    descs = descriptors(torch.empty(2, I, D, dtype=fp8), torch.empty(2, I, D, dtype=fp8),
                        torch.empty(2, D, I, dtype=fp8), torch.empty(2, I), torch.empty(2, I))
    sig = {"x_ptr": "*bf16", "stride_xs": "i32", "stride_xh": "i32", "gather_ids_ptr": "*i32",
           "probs_ptr": "*fp32", "offsets_ptr": "*i64", "tile_expert_ptr": "*i32",
           "tile_first_ptr": "*i32", "ntiles_ptr": "*i32",
           **{k: mangle_type(d) for k, d in zip(("wg_desc", "wu_desc", "wd_desc", "sg_desc",
                                                 "su_desc"), descs, strict=True)},
           "sd_ptr": "*fp32", "out_ptr": "*fp32", "slot_ptr": "*i64", "E": "i32",
           "first_expert": "i32", "first_head": "i32", "group_heads": "i32",
           "slot_base": "i32"}
    return sig, kernel_options(config, D, I, deterministic, **options)


# The compile cases: (deterministic, options on).
_CASES = ((False, ()), (True, ()), (False, ("reciprocals",)), (False, ("skip_empty_halves",)),
          (False, ("reciprocals", "chunked_x")), (True, ("reciprocals", "chunked_x")),
          (False, ("reciprocals", "skip_empty_halves")))


def sm90_compile_cases() -> list:
    """This kernel in both modes, with `Fp8ForwardConfig.reciprocals`, with
    `.skip_empty_halves`, and as the table runs it (the reciprocals with `.chunked_x` in
    both modes, with `.skip_empty_halves`), as the launcher compiles it
    (`mhmoe.kernels.CompileCase`; MAGI-2's dims)."""
    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase

    config = fp8_forward_sm90_config()
    D, I = M.head_dim, M.expert_intermediate_size
    cases = []
    for det, on in _CASES:
        sig, cx = sm90_signature(config, D, I, det, **{name: True for name in on})
        cases.append(CompileCase(
            f"expert forward fp8 ws (Gluon){' deterministic' if det else ''}"
            + "".join(f" {OPTIONS[name][1]}" for name in on),
            _expert_forward_fp8_sm90_kernel, sig, cx, config.num_warps, 1,
            ("stride_xs", "stride_xh"), config.maxnreg))
    return cases
