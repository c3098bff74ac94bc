"""Fused expert MLP forward for Hopper (sm_90) in Gluon, with explicit warp specialisation.

The same computation, tile map and combine as `expert_forward._expert_forward_kernel`
(see there), scheduled by hand where Triton 3.6 serialises it: in Triton each
warpgroup issues its gate|up wgmma, waits, runs the SwiGLU on the special-function
units and only then issues the down wgmma, so the tensor cores idle for every SwiGLU,
and Triton's own warp specialisation does not apply to that loop on sm_90
(docs/expert-forward.md, "The Gluon kernel (warp-specialised)").

One persistent program an SM walks tiles of 128 routes of one flat expert (the tile map
of `expert_forward.tile_map`). Four partitions:

- two MMA warpgroups, each owning 64 of the tile's 128 rows (its x half in shared
  memory). Per slice j of I (64 columns) a warpgroup runs one "block" of wgmmas:
  acc += a(j-1) @ W_down[j-1] (two N=128 halves of D, a from registers), then
  gu = x @ [W_gate[:, j] | W_up[:, j]] (one N=128 accumulator over four K=64 chunks);
  then its SwiGLU turns gu into a(j). The two warpgroups take turns (a pair of
  mbarriers): one's SwiGLU runs while the other's block keeps the tensor cores busy
  (the ping-pong schedule of CUTLASS's Hopper kernels).
- a weight loader warp: bulk tensor copies (TMA) of [64, 64] boxes into a ring of
  NSTAGE stages of [64, 128] bf16, in the order the blocks consume them (per slice:
  four gate|up chunks, each the gate and up boxes side by side; two down chunks, each
  two boxes of D). Both warpgroups read every stage; it is free when both released it.
- an x loader warp: gathers the next tile's x rows (cp.async, rows past the expert's
  end zero-filled) into a warpgroup's half as soon as that warpgroup's last gate|up
  wgmma of the current tile has retired.
- two idle warps that fill the loaders' warpgroup, whose registers the MMA warpgroups
  take (setmaxnreg works on whole warpgroups); they only join the cluster barriers.

The cluster variant (CLUSTER = 2, `launch_ws(cluster=2)`) runs the programs in clusters
of two CTAs that take consecutive tiles 2u and 2u + 1. Where both tiles belong to one
expert (most pairs at many rows per expert), each CTA's loader copies half of every
stage and multicasts it into both CTAs' rings, so each weight byte leaves L2 once for
the pair; the two loaders tell each other when a slot is free in both rings (a barrier
a slot, signalled across the cluster) before filling it. Gluon has no multicast copy:
those copies and signals are inline PTX (see STAGES_OFF).

Numerics are those of the Triton kernel: every gate, up and down sum is accumulated by
wgmma in the same K order (16 at a time, ascending), the SwiGLU is the same code, the
probability scaling and the combine are the same. So the deterministic mode gives the
same bits as the Triton kernel's deterministic mode.

Shapes it takes (`ws_fits`): bf16 x and weights, D = 256, I a multiple of 64, sm_90.
Tiles (`tuning.ExpertForwardSm90Config`): the code is written for tiles of 128 routes,
slices of I and TMA boxes of 64 and a default partition of 4 warps; the ring depth and
the register budget are the config's.
"""

from __future__ import annotations

import re

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

from .tuning import ExpertForwardSm90Config, expert_forward_sm90_config, on_sm90

# The cluster variant (CLUSTER = 2): two CTAs, on neighbouring SMs, take the two tiles of
# a tile pair; where both tiles belong to one expert each CTA loads half of every stage
# and the bulk copy multicasts it into both CTAs' rings, halving the weight bytes read
# from L2. Gluon (Triton 3.6) has no multicast copy, so those copies, the release of a
# stage to the other CTA's barrier and the cluster barriers are inline PTX, which
# addresses the ring and its barriers by their offsets in shared memory: the ring's at 0
# (the allocator places the largest buffer first), the barriers' read from the compiled
# kernel (`smem_offsets`) and passed back in as constexprs (`_cluster_kernel`).
STAGES_OFF = gl.constexpr(0)


@gluon.jit
def _tile_rows0(t, tile_expert_ptr, tile_first_ptr, offsets_ptr, first_expert):
    """Tile t of the map: (flat expert f, first row of the tile, end of f's rows)."""
    e = gl.load(tile_expert_ptr + t)
    block = t - gl.load(tile_first_ptr + e)
    f = first_expert + e
    end = gl.load(offsets_ptr + f + 1)
    row0 = gl.load(offsets_ptr + f) + block * 128
    return f, row0, end


@gluon.jit
def _cluster_rank(CLUSTER: gl.constexpr):
    """This CTA's rank in its cluster (0 without clusters)."""
    if CLUSTER == 1:
        return 0
    else:
        return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r", [],
                                         dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _cluster_sync(CLUSTER: gl.constexpr):
    """Every thread of the cluster waits for every other (each partition calls it first,
    once this CTA's barriers are initialised, and last, so that no CTA exits while the
    other may still signal its barriers)."""
    if CLUSTER > 1:
        gl.inline_asm_elementwise(
            "barrier.cluster.arrive.release; barrier.cluster.wait.acquire; mov.u32 $0, 0;",
            "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pair_tile(u, rank, num_tiles, tile_expert_ptr, tile_first_ptr, offsets_ptr,
               first_expert, CLUSTER: gl.constexpr):
    """Tile u*CLUSTER + rank of the map: (flat expert, first row, end of its rows). Past
    the last tile, an empty tile (end = first row) of the last tile's expert."""
    t = u * CLUSTER + rank
    f, row0, end = _tile_rows0(gl.minimum(t, num_tiles - 1), tile_expert_ptr, tile_first_ptr,
                               offsets_ptr, first_expert)
    if CLUSTER > 1:
        end = gl.where(t < num_tiles, end, row0)
    return f, row0, end


@gluon.jit
def _multicast_box(tmap, row, col, dst_off, bar_off, mask):
    """One lane: the [64, 64] box at (row, col) of the tensor map at address tmap into
    shared memory at dst_off of every CTA of the cluster in mask, signalling each one's
    barrier at bar_off."""
    gl.inline_asm_elementwise(
        """{
        .reg .pred p; .reg .b32 l, d, b; .reg .b16 m;
        mov.u32 l, %laneid; setp.eq.u32 p, l, 0;
        mov.u32 d, global_smem; add.u32 d, d, $1;
        mov.u32 b, global_smem; add.u32 b, b, $2;
        cvt.u16.u32 m, $3;
        @p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"""
        """.multicast::cluster [d], [$4, {$5, $6}], [b], m;
        mov.u32 $0, 0;
        }""",
        "=r,r,r,r,l,r,r", [dst_off, bar_off, mask, tmap, col, row], dtype=gl.int32,
        is_pure=False, pack=1)


@gluon.jit
def _remote_arrive(bar_off, peer):
    """One lane: an arrival on the barrier at bar_off of the cluster's CTA `peer`."""
    gl.inline_asm_elementwise(
        """{
        .reg .pred p; .reg .b32 l, a, r;
        mov.u32 l, %laneid; setp.eq.u32 p, l, 0;
        mov.u32 a, global_smem; add.u32 a, a, $1;
        mapa.shared::cluster.u32 r, a, $2;
        @p mbarrier.arrive.shared::cluster.b64 _, [r];
        mov.u32 $0, 0;
        }""",
        "=r,r,r", [bar_off, peer], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_stage(desc_a, at_a, desc_b, at_b, stages, ready, empty, n, NSTAGE: gl.constexpr,
                CLUSTER: gl.constexpr = 1, peer_free=None, tmaps=0, ta=0, tb=0, rank=0,
                shared=False, OFFS: gl.constexpr = (0, 0)):
    """Ring stage n (once both warpgroups released its last use): box at_a of desc_a into
    its columns 0-63, box at_b of desc_b into columns 64-127. In a cluster (CLUSTER = 2,
    tensor maps at tmaps + 128*ta and + 128*tb), the stage is also free in the other CTA
    (its loader says so on peer_free, this one on the other's); where both CTAs' tiles
    share the expert, CTA `rank` loads box `rank` into both rings, else both boxes into
    its own."""
    slot = n % NSTAGE
    mbarrier.wait(empty.index(slot), ((n // NSTAGE) & 1) ^ 1)
    if CLUSTER > 1:
        # The other loader's wait below, for this use of the slot, passes on this arrival
        # (none in the first round: the rings start empty).
        # In the first round there is nothing to wait for, and a wait could even see the
        # other loader's arrival of round 1 (if its tile loads alone and runs ahead) and
        # then wait for a phase that needs this loader's own round-1 arrival.
        if n >= NSTAGE:
            _remote_arrive(OFFS[1] + slot * 8, 1 - rank)
            mbarrier.wait(peer_free.index(slot), ((n // NSTAGE) & 1) ^ 1)
    bar = ready.index(slot)
    st = stages.index(slot)
    if CLUSTER == 1:
        mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_a, at_a, bar, st.slice(0, 64, dim=1))
        tma.async_copy_global_to_shared(desc_b, at_b, bar, st.slice(64, 64, dim=1))
    else:
        mbarrier.expect(bar, 2 * 64 * 64 * 2)
        dst = STAGES_OFF + slot * (64 * 128 * 2)
        bar_off = OFFS[0] + slot * 8
        if shared:
            if rank == 0:
                _multicast_box(tmaps + 128 * ta, at_a[0], at_a[1], dst, bar_off, 3)
            else:
                _multicast_box(tmaps + 128 * tb, at_b[0], at_b[1], dst + 64 * 64 * 2, bar_off,
                               3)
        else:
            _multicast_box(tmaps + 128 * ta, at_a[0], at_a[1], dst, bar_off, 1 << rank)
            _multicast_box(tmaps + 128 * tb, at_b[0], at_b[1], dst + 64 * 64 * 2, bar_off,
                           1 << rank)


@gluon.jit
def _w_loader(wg_desc, wu_desc, wd_desc, stages, ready, empty, peer_free, tile_expert_ptr,
              tile_first_ptr, ntiles_ptr, first_expert, tmaps, D: gl.constexpr,
              I: gl.constexpr, NSTAGE: gl.constexpr, CLUSTER: gl.constexpr,
              OFFS: gl.constexpr):
    """The weight chunks of every tile of this program, in consumption order: per
    slice j, gate|up chunks over D (rows c*64 of W_gate[f] and W_up[f], columns
    j*64), then W_down[f]'s rows j*64 in two chunks of 128 columns."""
    _cluster_sync(CLUSTER)
    rank = _cluster_rank(CLUSTER)
    if CLUSTER > 1:
        # The tensor maps were copied into global memory by the host: acquire them for
        # the tensor-map proxy before the first copy reads them.
        for i in gl.static_range(3):
            gl.inline_asm_elementwise(
                "fence.proxy.tensormap::generic.acquire.sys [$1], 128; mov.u32 $0, 0;",
                "=r,l", [tmaps + 128 * i], dtype=gl.int32, is_pure=False, pack=1)
    num_tiles = gl.load(ntiles_ptr)
    n = 0
    for u in range(gl.program_id(0) // CLUSTER, gl.cdiv(num_tiles, CLUSTER),
                   gl.num_programs(0) // CLUSTER):
        t = u * CLUSTER
        f = first_expert + gl.load(tile_expert_ptr + gl.minimum(t + rank, num_tiles - 1))
        # The other CTA's tile shares the expert (always so without a cluster).
        shared = f == first_expert + gl.load(
            tile_expert_ptr + gl.minimum(t + CLUSTER - 1 - rank, num_tiles - 1))
        for j in range(I // 64):
            for c in gl.static_range(D // 64):
                _load_stage(wg_desc, [f * D + c * 64, j * 64], wu_desc,
                            [f * D + c * 64, j * 64], stages, ready, empty, n, NSTAGE,
                            CLUSTER, peer_free, tmaps, 0, 1, rank, shared, OFFS)
                n += 1
            for h in gl.static_range(D // 128):
                _load_stage(wd_desc, [f * I + j * 64, h * 128], wd_desc,
                            [f * I + j * 64, h * 128 + 64], stages, ready, empty, n, NSTAGE,
                            CLUSTER, peer_free, tmaps, 2, 2, rank, shared, OFFS)
                n += 1
    _cluster_sync(CLUSTER)


@gluon.jit
def _x_loader(x_ptr, stride_xs, stride_xh, gather_ids_ptr, xs, x_ready, x_empty,
              tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr, first_expert,
              E, D: gl.constexpr, CLUSTER: gl.constexpr, ROWS8: gl.constexpr = False):
    """x rows of each tile into the warpgroups' halves (cp.async, 16 rows at a time;
    rows past the expert's end zero-filled); with ROWS8, xs is [16, 8, D], groups of 8
    rows (warpgroup w's are w*8 ...), filled one group at a time."""
    _cluster_sync(CLUSTER)
    CH: gl.constexpr = 8 if ROWS8 else 16
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    r = gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    rank = _cluster_rank(CLUSTER)
    num_tiles = gl.load(ntiles_ptr)
    k = 0
    for u in range(gl.program_id(0) // CLUSTER, gl.cdiv(num_tiles, CLUSTER),
                   gl.num_programs(0) // CLUSTER):
        f, row0, end = _pair_tile(u, rank, num_tiles, tile_expert_ptr, tile_first_ptr,
                                  offsets_ptr, first_expert, CLUSTER)
        xh = x_ptr + (f // E) * stride_xh
        for w in gl.static_range(2):
            # The half is free once its warpgroup's last gate|up wgmma of the previous
            # tile retired (mbarriers start with phase 1 complete).
            mbarrier.wait(x_empty.index(w), (k & 1) ^ 1)
            for c in gl.static_range(64 // CH):
                rows = row0 + w * 64 + c * CH + r
                ok = rows < end
                tok = gl.load(gather_ids_ptr + rows, mask=ok, other=0).to(gl.int64)
                if ROWS8:
                    dst = xs.index(w * (64 // CH) + c)
                else:
                    dst = xs.index(w).slice(c * CH, CH, dim=0)
                async_copy.async_copy_global_to_shared(
                    dst, xh + tok[:, None] * stride_xs + d[None, :], mask=ok[:, None])
            async_copy.mbarrier_arrive(x_ready.index(w), increment_count=False)
        k += 1
    _cluster_sync(CLUSTER)


@gluon.jit
def _idle(CLUSTER: gl.constexpr):
    """The two warps that fill the loaders' warpgroup: they only join the cluster barriers."""
    _cluster_sync(CLUSTER)
    _cluster_sync(CLUSTER)


@gluon.jit
def _release(empty, n, NSTAGE: gl.constexpr):
    mbarrier.arrive(empty.index(n % NSTAGE), count=1)


@gluon.jit
def _wait_stage(stages, ready, n, NSTAGE: gl.constexpr):
    slot = n % NSTAGE
    mbarrier.wait(ready.index(slot), (n // NSTAGE) & 1)
    return stages.index(slot)


@gluon.jit
def _gate_up_first(xh, stages, ready, n, NSTAGE: gl.constexpr, gu_layout: gl.constexpr):
    """Issues chunk 0 of gu = x_half @ [W_gate | W_up] from stage n (a fresh accumulator)."""
    st = _wait_stage(stages, ready, n, NSTAGE)
    return warpgroup_mma(xh.slice(0, 64, dim=1), st,
                         gl.zeros([64, 128], gl.float32, gu_layout), use_acc=False,
                         is_async=True)


@gluon.jit
def _down(a, stages, ready, n, acc_lo, acc_hi, NSTAGE: gl.constexpr):
    """Issues acc += a @ W_down slice: its two halves of D from stages n and n + 1."""
    st = _wait_stage(stages, ready, n, NSTAGE)
    acc_lo = warpgroup_mma(a, st, acc_lo, is_async=True)
    st = _wait_stage(stages, ready, n + 1, NSTAGE)
    acc_hi = warpgroup_mma(a, st, acc_hi, is_async=True)
    return acc_lo, acc_hi


@gluon.jit
def _gate_up_rest(xh, stages, ready, empty, gu, n, D: gl.constexpr, NSTAGE: gl.constexpr):
    """Chunks 1 .. D/64 - 1 of gu = x_half @ [W_gate | W_up] from stages n + 1 ... (chunk
    0, from stage n, is in flight). Keeps one wgmma in flight and releases each stage
    once its wgmma retired; returns (gu in flight, its last stage, still held)."""
    for c in gl.static_range(1, D // 64):
        st = _wait_stage(stages, ready, n + c, NSTAGE)
        gu = warpgroup_mma(xh.slice(c * 64, 64, dim=1), st, gu, is_async=True)
        gu = warpgroup_mma_wait(num_outstanding=1, deps=(gu,))
        _release(empty, n + c - 1, NSTAGE)
    return gu, n + D // 64 - 1


@gluon.jit
def _swiglu7_fp32(g, u, RCP: gl.constexpr = False):
    """`expert_forward.swiglu7_tile` in Gluon, the same operations in the same order:
    g * sigmoid(1.702 g) with one ex2 and the fast reciprocal (also the fp8 kernel's;
    RCP: swiglu7_tile's)."""
    g = gl.minimum(g, 7.0)
    u = gl.minimum(gl.maximum(u, -7.0), 7.0)
    return _divide(g, 1.0 + gl.exp2(-2.4554669595930157 * g), RCP) * (u + 1.0)


@gluon.jit
def _divide(num, den, RCP: gl.constexpr):
    """`expert_forward.divide` in Gluon (GPU only: no interpreter)."""
    if RCP:
        return num * gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [den],
                                               dtype=gl.float32, is_pure=True, pack=1)
    else:
        return gl.fdiv(num, den)


@gluon.jit
def _swiglu7(gu, a_layout: gl.constexpr, RCP: gl.constexpr):
    """a = swiglu7(g, u) in bf16, the wgmma A operand of the down product. In the
    accumulator layout a thread holds columns j and j + 64 alike, so the split of the
    [64, 128] gate|up accumulator stays in registers."""
    g, u = gu.reshape([64, 2, 64]).permute((0, 2, 1)).split()
    return gl.convert_layout(_swiglu7_fp32(g, u, RCP).to(gl.bfloat16), a_layout)


@gluon.jit
def _combine_half(ptrs, part, row_ok, DETERMINISTIC: gl.constexpr):
    """Deterministic: a plain store to each route's slot; else fp32 atomic adds, as
    reductions (`red`, nothing returned). gl.atomic_add asks for the old values, which
    ptxas drops (REDG) in the one-CTA kernel but not in the cluster variant, where each
    warp then waits on the round trips of its 64 ATOMGs (docs/expert-forward.md, "The
    combine's adds as reductions"). The accumulator layout gives each thread column pairs
    (2i, 2i + 1) of a row: pack=2 hands them to one 8-byte red."""
    if DETERMINISTIC:
        gl.store(ptrs, part, mask=row_ok[:, None])
    else:
        addr = ptrs.to(gl.int64, bitcast=True)
        ok = gl.broadcast(row_ok[:, None], addr)[0].to(gl.int32)
        gl.inline_asm_elementwise(
            """{
            .reg .pred p;
            setp.ne.b32 p, $6, 0;
            @p red.global.gpu.relaxed.add.v2.f32 [$2], {$4, $5};
            mov.u32 $0, 0;
            mov.u32 $1, 0;
            }""",
            "=r,=r,l,l,f,f,r,r", [addr, part, ok], dtype=gl.int32, is_pure=False, pack=2)


@gluon.jit
def _half_rows(first, end, f, probs_ptr, slot_ptr, gather_ids_ptr, E, first_head, group_heads,
               slot_base, rows_layout: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """The 64 routes first .. first + 63 of expert f (rows_layout): (below end, their
    probabilities, the out row each one's result goes to as `expert_forward.combine_rows`
    places it: its slot in deterministic mode, else its (token, head) row)."""
    rows = first + gl.arange(0, 64, layout=rows_layout)
    row_ok = rows < end
    prob = gl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)
    if DETERMINISTIC:
        dst = gl.load(slot_ptr + rows, mask=row_ok, other=0) - slot_base
    else:
        tok = gl.load(gather_ids_ptr + rows, mask=row_ok, other=0).to(gl.int64)
        dst = tok * group_heads + (f // E - first_head)
    return row_ok, prob, dst


@gluon.jit
def _mma_partition(W: gl.constexpr, xs, stages, ready, empty, x_ready, x_empty, turn,
                   tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr, gather_ids_ptr,
                   probs_ptr, out_ptr, slot_ptr, E, first_expert, first_head, group_heads,
                   slot_base, D: gl.constexpr, I: gl.constexpr, NSTAGE: gl.constexpr,
                   DETERMINISTIC: gl.constexpr, CLUSTER: gl.constexpr, RCP: gl.constexpr):
    """Rows W*64 .. W*64+63 of every tile of this program: the MLP of each route, scaled
    by its probability, combined as `expert_forward.combine_rows` (RCP: the kernel's)."""
    _cluster_sync(CLUSTER)
    NI: gl.constexpr = I // 64
    gu_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, gu_layout)
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, gu_layout))
    xh = xs.index(W)
    rank = _cluster_rank(CLUSTER)
    num_tiles = gl.load(ntiles_ptr)
    n = 0  # stages taken from the ring
    blk = 0  # blocks run (turns taken)
    k = 0  # tiles run
    for u in range(gl.program_id(0) // CLUSTER, gl.cdiv(num_tiles, CLUSTER),
                   gl.num_programs(0) // CLUSTER):
        f, row0, end = _pair_tile(u, rank, num_tiles, tile_expert_ptr, tile_first_ptr,
                                  offsets_ptr, first_expert, CLUSTER)
        mbarrier.wait(x_ready.index(W), k & 1)
        # The cp.async writes reach the wgmma (async proxy) through this fence.
        fence_async_shared()

        # Block 0: gate|up of slice 0. Warpgroup 0 takes the first turn of all (its
        # barrier starts with phase 1 complete); then the two alternate.
        mbarrier.wait(turn.index(W), (blk & 1) ^ (1 - W))
        gu = _gate_up_first(xh, stages, ready, n, NSTAGE, gu_layout)
        gu, held = _gate_up_rest(xh, stages, ready, empty, gu, n, D, NSTAGE)
        n += D // 64
        mbarrier.arrive(turn.index(1 - W), count=1)
        gu = warpgroup_mma_wait(num_outstanding=0, deps=(gu,))
        _release(empty, held, NSTAGE)
        blk += 1
        a = _swiglu7(gu, a_layout, RCP)
        acc_lo = gl.zeros([64, 128], gl.float32, gu_layout)
        acc_hi = gl.zeros([64, 128], gl.float32, gu_layout)

        for j in range(1, NI):
            # Block j: the down product of slice j-1, then gate|up of slice j.
            mbarrier.wait(turn.index(W), (blk & 1) ^ (1 - W))
            acc_lo, acc_hi = _down(a, stages, ready, n, acc_lo, acc_hi, NSTAGE)
            gu = _gate_up_first(xh, stages, ready, n + 2, NSTAGE, gu_layout)
            # The down wgmmas retired (a, their A operand, is free after this).
            acc_lo, acc_hi, a = warpgroup_mma_wait(num_outstanding=1, deps=(acc_lo, acc_hi, a))
            _release(empty, n, NSTAGE)
            _release(empty, n + 1, NSTAGE)
            gu, held = _gate_up_rest(xh, stages, ready, empty, gu, n + 2, D, NSTAGE)
            n += 2 + D // 64
            mbarrier.arrive(turn.index(1 - W), count=1)
            gu, acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(gu, acc_lo, acc_hi))
            _release(empty, held, NSTAGE)
            if j == NI - 1:
                mbarrier.arrive(x_empty.index(W), count=1)
            blk += 1
            a = _swiglu7(gu, a_layout, RCP)
        if NI == 1:
            mbarrier.arrive(x_empty.index(W), count=1)

        # The last block: the down product of the last slice.
        mbarrier.wait(turn.index(W), (blk & 1) ^ (1 - W))
        acc_lo, acc_hi = _down(a, stages, ready, n, acc_lo, acc_hi, NSTAGE)
        mbarrier.arrive(turn.index(1 - W), count=1)
        acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
        _release(empty, n, NSTAGE)
        _release(empty, n + 1, NSTAGE)
        n += 2
        blk += 1
        k += 1

        row_ok, prob, dst = _half_rows(row0 + W * 64, end, f, probs_ptr, slot_ptr,
                                       gather_ids_ptr, E, first_head, group_heads, slot_base,
                                       rows_layout, DETERMINISTIC)
        base = out_ptr + dst[:, None] * D + cols[None, :]
        _combine_half(base, acc_lo * prob[:, None], row_ok, DETERMINISTIC)
        _combine_half(base + 128, acc_hi * prob[:, None], row_ok, DETERMINISTIC)
    _cluster_sync(CLUSTER)


@gluon.jit
def _expert_forward_sm90_kernel(
    x_ptr, stride_xs, stride_xh,  # x_heads [S, H, D], unit stride along D
    gather_ids_ptr, probs_ptr, offsets_ptr,  # the RouteLayout: [R], [R], [H*E + 1]
    tile_expert_ptr, tile_first_ptr, ntiles_ptr,  # the tile map; ntiles: [1] int32
    wg_desc, wu_desc, wd_desc,  # [H*E*D, I], [H*E*D, I], [H*E*I, D]; [64, 64] boxes
    out_ptr, slot_ptr,  # default: fp32 [S, G, D]; deterministic: fp32 [G*S*K, D], slots [R]
    E, first_expert, first_head, group_heads, slot_base,
    tmaps,  # CLUSTER = 2: address of the three weights' tensor maps (128 bytes each)
    D: gl.constexpr, I: gl.constexpr, NSTAGE: gl.constexpr, DETERMINISTIC: gl.constexpr,
    MMA_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, CLUSTER: gl.constexpr = 1,
    READY_OFF: gl.constexpr = 0, PEER_FREE_OFF: gl.constexpr = 0, RCP: gl.constexpr = False,
):
    """Expert MLPs of the tiles of a head group (see the module docstring).

    Launch grid: (programs,), persistent: program p takes tiles p, p + programs, ...
    below ntiles[0] (the tile map's real tiles). With CLUSTER = 2 the programs run in
    clusters of two (`launch_ws`): cluster c = p // 2 takes tile pairs u = c, c + programs
    / 2, ..., its CTA r (= p % 2) tile 2u + r. 4 warps (the default partition is MMA
    warpgroup 0) plus the workers. NSTAGE: stages of the weight ring; MMA_REGS, LOAD_REGS:
    registers a thread of the MMA warpgroups and of the loaders' warpgroup (setmaxnreg).
    READY_OFF, PEER_FREE_OFF (CLUSTER = 2): shared-memory offsets of the first `ready` and
    `peer_free` barriers, for the inline PTX (`_cluster_kernel` finds them). RCP:
    `ExpertForwardConfig.sigmoid_rcp`.
    """
    xs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D],
                                   gl.NVMMASharedLayout.get_default_for([64, D], gl.bfloat16))
    stages = gl.allocate_shared_memory(gl.bfloat16, [NSTAGE, 64, 128],
                                       gl.NVMMASharedLayout.get_default_for([64, 128],
                                                                            gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    peer_free = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NSTAGE):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both warpgroups read every stage
        mbarrier.init(peer_free.index(s), count=1)
    for w in gl.static_range(2):
        mbarrier.init(x_ready.index(w), count=32)  # the x loader warp's 32 threads
        mbarrier.init(x_empty.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    if CLUSTER > 1:
        gl.inline_asm_elementwise("fence.mbarrier_init.release.cluster; mov.u32 $0, 0;", "=r",
                                  [], dtype=gl.int32, is_pure=False, pack=1)
    gl.warp_specialize([
        (_mma_partition, (0, xs, stages, ready, empty, x_ready, x_empty, turn, tile_expert_ptr,
                          tile_first_ptr, offsets_ptr, ntiles_ptr, gather_ids_ptr, probs_ptr,
                          out_ptr, slot_ptr, E, first_expert, first_head, group_heads,
                          slot_base, D, I, NSTAGE, DETERMINISTIC, CLUSTER, RCP)),
        (_mma_partition, (1, xs, stages, ready, empty, x_ready, x_empty, turn, tile_expert_ptr,
                          tile_first_ptr, offsets_ptr, ntiles_ptr, gather_ids_ptr, probs_ptr,
                          out_ptr, slot_ptr, E, first_expert, first_head, group_heads,
                          slot_base, D, I, NSTAGE, DETERMINISTIC, CLUSTER, RCP)),
        (_w_loader, (wg_desc, wu_desc, wd_desc, stages, ready, empty, peer_free, tile_expert_ptr,
                     tile_first_ptr, ntiles_ptr, first_expert, tmaps, D, I, NSTAGE, CLUSTER,
                     (READY_OFF, PEER_FREE_OFF))),
        (_x_loader, (x_ptr, stride_xs, stride_xh, gather_ids_ptr, xs, x_ready, x_empty,
                     tile_expert_ptr, tile_first_ptr, offsets_ptr, ntiles_ptr, first_expert,
                     E, D, CLUSTER)),
        (_idle, (CLUSTER,)),
    ], [4, 1, 1, 2], [MMA_REGS, LOAD_REGS, LOAD_REGS, LOAD_REGS])


def ws_fits(x_heads: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            w_down: torch.Tensor) -> bool:
    """Whether this kernel takes the shapes and dtypes: bf16 throughout, D = 256,
    I a multiple of 64, on an sm_90 GPU."""
    D, I = w_gate.shape[1], w_gate.shape[2]
    return (on_sm90(x_heads)
            and all(t.dtype == torch.bfloat16 for t in (x_heads, w_gate, w_up, w_down))
            and D == 256 and I % 64 == 0 and I > 0)


def weight_descriptors(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                       box: int):
    """Descriptors of W_gate, W_up as [F*D, I] and W_down as [F*I, D] with [box, box] boxes
    (contiguous weights; box: `ExpertForwardSm90Config.block_i`)."""
    layout = gl.NVMMASharedLayout.get_default_for([box, box], gl.bfloat16)
    F, D, I = w_gate.shape

    def desc(t, rows, cols):
        return TensorDescriptor.from_tensor(t.view(rows, cols), [box, box], layout)

    return desc(w_gate, F * D, I), desc(w_up, F * D, I), desc(w_down, F * I, D)


def tensor_maps(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, box: int):
    """The tensor maps of `weight_descriptors` in device memory ([3, 128] uint8), for
    the cluster variant's inline bulk copies (encoded by the driver's
    cuTensorMapEncodeTiled: bf16, [box, box] boxes, 128-byte swizzle, as Triton's)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    F, D, I = w_gate.shape
    maps = (ctypes.c_uint8 * (3 * 128 + 128))()
    base = (ctypes.addressof(maps) + 127) // 128 * 128  # CUtensorMap is 128-byte aligned
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    for i, (t, rows, cols) in enumerate(((w_gate, F * D, I), (w_up, F * D, I),
                                         (w_down, F * I, D))):
        res = cuda.cuTensorMapEncodeTiled(
            ctypes.c_void_p(base + 128 * i), 9, 2, ctypes.c_void_p(t.data_ptr()),
            (u64 * 2)(cols, rows), (u64 * 1)(cols * 2), (u32 * 2)(box, box), (u32 * 2)(1, 1),
            0, 3, 2, 0)  # bf16; no interleave; 128-byte swizzle; L2 promotion 128 B; no fill
        if res != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed ({res}) for weight {i}")
    host = torch.frombuffer(bytearray(ctypes.string_at(base, 3 * 128)), dtype=torch.uint8)
    return host.view(3, 128).to(w_gate.device)


_TENSOR_MAPS: dict = {}
_TENSOR_MAPS_KEPT = 64  # the oldest maps go first (36 layers of MAGI-2 fit)


def cached_tensor_maps(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                       box: int):
    """`tensor_maps`, made once per weights' addresses and shapes and box (all a map
    encodes), so that a forward under CUDA graph capture copies nothing from the host."""
    key = (box, *((t.device, t.data_ptr(), tuple(t.shape)) for t in (w_gate, w_up, w_down)))
    if key not in _TENSOR_MAPS:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "expert_forward: the cluster kernel's weight tensor maps are copied from the "
                "host on the first call with these weights, which a CUDA graph capture cannot "
                "hold; run the forward once outside the capture first (warm-up)")
        if len(_TENSOR_MAPS) >= _TENSOR_MAPS_KEPT:  # weights made anew each step
            del _TENSOR_MAPS[next(iter(_TENSOR_MAPS))]
        _TENSOR_MAPS[key] = tensor_maps(w_gate, w_up, w_down, box)
    return _TENSOR_MAPS[key]


_LLIR_INIT = re.compile(r'mbarrier\.init\.shared::cta\.b64 \[\$1\], (\d+);"'
                        r'.*?@global_smem, i32 (\d+)\)')


def smem_offsets(llir: str) -> tuple[int, int]:
    """(ready, peer_free): shared-memory offsets of the first ready and peer_free barriers
    in the compiled kernel's LLVM IR (the first and third barriers initialised)."""
    inits = [int(o) for _, o in _LLIR_INIT.findall(llir)]
    return inits[0], inits[2]


def kernel_options(config: ExpertForwardSm90Config, D: int, I: int, deterministic: bool,
                   cluster: int, rcp: bool = False) -> dict:
    """The constexprs of `_expert_forward_sm90_kernel` for these tiles and shapes (rcp:
    `ExpertForwardConfig.sigmoid_rcp`)."""
    return dict(D=D, I=I, NSTAGE=config.num_stages, DETERMINISTIC=deterministic,
                MMA_REGS=config.mma_regs, LOAD_REGS=config.load_regs, CLUSTER=cluster,
                RCP=rcp)


_OFFSETS: dict = {}  # (I, deterministic, ring stages) -> the cluster variant's barrier offsets


def _cluster_kernel(args, opts):
    """(compiled kernel, launch options) of the cluster variant for these arguments: its
    barrier offsets found (a first compile shows them; the inline PTX constants do not move
    them, checked) and the launch made a cluster launch. Each specialisation (the JIT
    compiles one per argument alignment) is compiled for one CTA (Gluon's multi-CTA
    layouts do not lower wgmma); the launcher takes the cluster size from the packed
    metadata. After the first launch of a specialisation this is a JIT cache lookup."""
    import triton

    cluster = opts["CLUSTER"]
    key = (opts["I"], opts["DETERMINISTIC"], opts["NSTAGE"])
    offs = _OFFSETS.get(key, (0, 0))
    o = dict(opts, READY_OFF=offs[0], PEER_FREE_OFF=offs[1])
    k = _expert_forward_sm90_kernel.warmup(*args, grid=(1,), **o)
    if getattr(k, "mhmoe_cluster", None) == cluster:
        return k, o
    if "llir" not in k.asm:
        raise RuntimeError("expert_forward_sm90: the compiled kernel has no LLVM IR to read "
                           "its barriers' offsets from")
    found = smem_offsets(k.asm["llir"])
    if found != offs:
        _OFFSETS[key] = offs = found
        o = dict(opts, READY_OFF=offs[0], PEER_FREE_OFF=offs[1])
        k = _expert_forward_sm90_kernel.warmup(*args, grid=(1,), **o)
        if smem_offsets(k.asm["llir"]) != offs:
            raise RuntimeError("expert_forward_sm90: the barriers moved between compiles")
    # The override below relies on Triton 3.6's launcher: metadata (num_warps, num_ctas,
    # shared), a grid of clusters, and no global or profile scratch (sized per CTA of a
    # one-CTA launch, they would be too small).
    meta = k.packed_metadata
    if (len(meta) != 3 or meta[1] != 1 or k.metadata.global_scratch_size
            or k.metadata.profile_scratch_size):
        raise RuntimeError(f"expert_forward_sm90: cannot make a cluster launch of {meta}")
    k._init_handles()
    # (Triton's helper counts 128 threads a CTA, not 384: shared memory limits an SM to
    # one CTA of this kernel either way.)
    fit = triton.runtime.driver.active.utils.cuOccupancyMaxActiveClusters(
        k.function, k.metadata.shared, cluster)
    if fit < 1:
        raise RuntimeError(f"expert_forward_sm90: no cluster of {cluster} CTAs fits")
    k.packed_metadata = (meta[0], cluster, meta[2])
    k.mhmoe_cluster, k.mhmoe_fit = cluster, fit
    return k, o


def launch_ws(x_heads, gather_ids, sorted_probs, offsets, descs, out, slots, tile_expert,
              tile_first, num_tiles, *, config: ExpertForwardSm90Config, E: int,
              first_expert: int, first_head: int, group_heads: int, slot_base: int, I: int,
              deterministic: bool, cluster: int = 1,
              tmaps: torch.Tensor | None = None, rcp: bool = False) -> None:
    """One launch of `_expert_forward_sm90_kernel` for a head group (the launcher of
    expert_forward.py picks `config`, prepares the tile map of config.block_m rows, the
    descriptors (`weight_descriptors`) and `out`). cluster=2: the multicast variant, with
    tmaps from `cached_tensor_maps`. Persistent: one program an SM, or as many clusters
    as fit at once. rcp: `kernel_options`'s."""
    args = (x_heads, x_heads.stride(0), x_heads.stride(1), gather_ids, sorted_probs, offsets,
            tile_expert, tile_first, num_tiles, *descs, out, slots, E, first_expert,
            first_head, group_heads, slot_base, 0 if cluster == 1 else tmaps.data_ptr())
    opts = dict(kernel_options(config, x_heads.shape[2], I, deterministic, cluster, rcp),
                num_warps=config.num_warps, maxnreg=config.maxnreg)
    if cluster > 1:
        k, opts = _cluster_kernel(args, opts)
        programs = max(1, min(k.mhmoe_fit, -(-tile_expert.numel() // cluster)))
    else:
        sms = torch.cuda.get_device_properties(x_heads.device).multi_processor_count
        programs = max(1, min(sms, tile_expert.numel()))
    _expert_forward_sm90_kernel[(programs,)](*args, **opts)


def sm90_signature(config: ExpertForwardSm90Config, D: int, I: int, deterministic: bool,
                   cluster: int = 1, rcp: bool = False):
    """(signature, constexprs) of `_expert_forward_sm90_kernel` as `launch_ws` calls it,
    for compiling it without a GPU (tools/sass_audit.py)."""
    from triton.runtime.jit import mangle_type

    w = torch.empty(2, D, I, dtype=torch.bfloat16)
    descs = weight_descriptors(w, w, torch.empty(2, I, D, dtype=torch.bfloat16), config.block_i)
    sig = {"x_ptr": "*bf16", "stride_xs": "i32", "stride_xh": "i32", "gather_ids_ptr": "*i32",
           "probs_ptr": "*fp32", "offsets_ptr": "*i64", "tile_expert_ptr": "*i32",
           "tile_first_ptr": "*i32", "ntiles_ptr": "*i32",
           **{k: mangle_type(d) for k, d in zip(("wg_desc", "wu_desc", "wd_desc"), descs,
                                                strict=True)},
           "out_ptr": "*fp32", "slot_ptr": "*i64", "E": "i32", "first_expert": "i32",
           "first_head": "i32", "group_heads": "i32", "slot_base": "i32", "tmaps": "i64"}
    return sig, kernel_options(config, D, I, deterministic, cluster, rcp)


def sm90_compile_cases() -> list:
    """This kernel in both modes, one CTA and clusters of two, and with
    `ExpertForwardConfig.sigmoid_rcp` (default mode, both), as the launcher compiles it
    (`mhmoe.kernels.CompileCase`; MAGI-2's dims)."""
    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase
    from .tuning import FORWARD_SM90

    if not any(f.warp_specialized for _, f in FORWARD_SM90):
        return []
    config = expert_forward_sm90_config()
    D, I = M.head_dim, M.expert_intermediate_size
    cases = []
    runs = [(det, cluster, False) for det in (False, True) for cluster in (1, 2)]
    for det, cluster, rcp in [*runs, (False, 1, True), (False, 2, True)]:
        sig, cx = sm90_signature(config, D, I, det, cluster, rcp)
        cases.append(CompileCase(
            f"expert forward ws (Gluon){' deterministic' if det else ''}"
            f"{' cluster 2' if cluster > 1 else ''}{' sigmoid_rcp' if rcp else ''}",
            _expert_forward_sm90_kernel, sig, cx, config.num_warps, 1,
            ("stride_xs", "stride_xh"), config.maxnreg))
    return cases
