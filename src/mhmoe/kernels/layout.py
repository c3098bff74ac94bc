"""The route layout: a stable counting sort of the routes by flat expert
(docs/contract.md section 3), with no host synchronisation.

    out = triton_sort_routes(probs, indices, E)
    # out.gather_ids [H*S*K], out.sorted_probs [H*S*K], out.offsets [H*E + 1]; out.positions

The routes of a head are taken in blocks of BLOCK_T tokens, in one of two ways:

- "scatter" (the default): per-block expert counts (from the route kernels, or
  `_layout_hist_kernel`), the scan, then `_layout_rank_scatter_kernel`, which ranks and
  places each block's routes itself and writes the offsets;
- "count": `_layout_count_kernel` (per-block counts and in-block ranks), the scan,
  `_layout_offsets_kernel`, `_layout_scatter_kernel`.

Grids: (NB, H) for the count, count-only and scatter kernels, program (b, h) owning the
routes of tokens [b * BLOCK_T, (b + 1) * BLOCK_T) of head h; (cdiv(E, BLOCK_EC), H) for
the scan, program (c, h) owning BLOCK_EC experts of head h over all its blocks; (H,)
for the offsets. Each step has a public launcher (`layout_count`, `layout_scan`,
`layout_offsets`, `layout_scatter`, `layout_hist`, `layout_rank_scatter`) so that
benchmarks can time it alone. Positions depend only on the data: the layout is the
same on every run, and the same as `reference.sort_routes_reference`. The cost model
and the measurements behind the two ways: docs/layout.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import tuning
from .topk import check_power_of_two
from .tuning import LayoutScanTiles, interpreting


@triton.jit
def _block_ranks(e, valid, R: tl.constexpr):
    """rank[r] = routes r' < r of the block with the same expert (stable order).

    e, valid: [R], routes in (token, k) order. Pairwise, R^2 work: cheaper than
    an [tokens, E] count tile for the small blocks used here, and exact with
    repeated experts too.
    """
    r = tl.arange(0, R)
    key = tl.where(valid, e, -1 - r)  # distinct negative keys never match
    # Row r' (earlier route), column r: the sum runs down the columns. Summed along
    # the rows instead, Triton spreads each row over the lanes of a warp, and every
    # row takes a warp reduction (docs/layout.md, "What the code does").
    same = (key[:, None] == key[None, :]) & (r[:, None] < r[None, :])
    return tl.sum(same.to(tl.int32), 0)


@triton.jit
def _layout_count_kernel(
    indices_ptr,  # [H, S, K] int, contiguous
    hist_ptr, rank_ptr,  # outputs [H, NB, E] int32, [H, S, K] int32
    S, NB,
    E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, SUB_T: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Layout step 1: per-block expert counts and in-block ranks.

    Launch grid: (NB, H), NB = cdiv(S, BLOCK_T). Program (b, h) owns the
    BLOCK_T * K routes of tokens [b * BLOCK_T, (b + 1) * BLOCK_T) of head h,
    walked SUB_T tokens at a time. rank of route (s, k) = earlier routes of the
    block, in (s, k) order, with the same expert (the reference's stable
    order): those of its sub-block by pairwise comparison (SUB_T * BLOCK_K
    slots, squared), plus those of the earlier sub-blocks, read from a running
    histogram. Large blocks keep the [H, NB, E] counts (written here, read and
    rewritten by the scan) small; small sub-blocks keep the pairwise work small.
    Out-of-range expert ids are not counted (their routes are left out of the
    layout).
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    R: tl.constexpr = SUB_T * BLOCK_K
    r = tl.arange(0, R)
    col = tl.arange(0, BLOCK_E)
    running = tl.zeros([BLOCK_E], tl.int32)
    # A loop, not unrolled: one sub-block's registers rather than the whole block's, so
    # many programs share an SM and hide each other's load latency.
    for t0 in range(0, BLOCK_T, SUB_T):
        t = b * BLOCK_T + t0 + r // BLOCK_K
        k = r % BLOCK_K
        ok = (t < S) & (k < TOP_K)
        route = (h.to(tl.int64) * S + t.to(tl.int64)) * TOP_K + k
        e = tl.load(indices_ptr + route, mask=ok, other=-1)
        # Range check before narrowing: a huge int64 must not wrap into [0, E).
        ok = ok & (e >= 0) & (e < E)
        e = tl.where(ok, e, 0).to(tl.int32)
        rank = _block_ranks(e, ok, R)
        if BLOCK_T > SUB_T:  # plus the routes of the block's earlier sub-blocks
            rank += tl.gather(running, e, 0)
        tl.store(rank_ptr + route, rank, mask=ok)
        running += tl.histogram(e, BLOCK_E, mask=ok)
    tl.store(hist_ptr + (h * NB + b).to(tl.int64) * E + col, running, mask=col < E)


@triton.jit
def _layout_scan_kernel(
    hist_ptr, base_ptr, totals_ptr,  # [H, NB, E] int32 in; [H, NB, E], [H, E] int32 out
    NB,
    E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_EC: tl.constexpr,
):
    """Layout step 2: exclusive prefix of the block counts over the blocks.

    Launch grid: (cdiv(E, BLOCK_EC), H). Program (c, h) owns experts
    [c * BLOCK_EC, (c + 1) * BLOCK_EC) of head h, all NB blocks, walked in
    chunks of BLOCK_B blocks with a running carry.
    """
    c = tl.program_id(0)
    h = tl.program_id(1)
    ec = c * BLOCK_EC + tl.arange(0, BLOCK_EC)
    ec_ok = ec < E
    rb = tl.arange(0, BLOCK_B)
    carry = tl.zeros([BLOCK_EC], tl.int32)
    # A while loop: the interpreter cannot take a runtime scalar as a range() bound.
    b0 = 0
    while b0 < NB:
        blk = b0 + rb
        ok = (blk < NB)[:, None] & ec_ok[None, :]
        off = (h * NB + blk).to(tl.int64)[:, None] * E + ec[None, :]
        counts = tl.load(hist_ptr + off, mask=ok, other=0)
        tl.store(base_ptr + off, carry[None, :] + tl.cumsum(counts, 0) - counts, mask=ok)
        carry += tl.sum(counts, 0)
        b0 += BLOCK_B
    tl.store(totals_ptr + h * E + ec, carry, mask=ec_ok)


@triton.jit
def _layout_offsets_kernel(
    totals_ptr, offsets_ptr,  # [H, E] int32 in; [H*E + 1] int64 out
    S, H,
    E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Layout step 3: offsets[h*E + e] = h*S*K + routes of head h's experts below e.

    Launch grid: (H,). Program h owns offsets[h*E : (h+1)*E]; the last one
    also writes offsets[H*E].
    """
    h = tl.program_id(0)
    col = tl.arange(0, BLOCK_E)
    totals = tl.load(totals_ptr + h * E + col, mask=col < E, other=0).to(tl.int64)
    head_start = h.to(tl.int64) * S * TOP_K
    tl.store(offsets_ptr + h * E + col, head_start + tl.cumsum(totals, 0) - totals, mask=col < E)
    tl.store(offsets_ptr + H * E + col, head_start + tl.sum(totals, 0),
             mask=(col == 0) & (h == H - 1))


@triton.jit
def _layout_scatter_kernel(
    indices_ptr, probs_ptr, rank_ptr,  # [H, S, K] int, fp32, int32; contiguous
    base_ptr, offsets_ptr,  # [H, NB, E] int32, [H*E + 1] int64
    gather_ids_ptr, sorted_probs_ptr,  # outputs [H*S*K] int32, fp32
    positions_ptr,  # output [H*S*K] int32 (if WRITE_POS): the place of route (h, s, k)
    S, NB,
    E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    WRITE_POS: tl.constexpr = True,
):
    """Layout step 4: write every route at its place in the CSR layout.

    Launch grid: (NB, H). Program (b, h) owns the routes of tokens
    [b * BLOCK_T, (b + 1) * BLOCK_T) of head h (same blocks as step 1).
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    kcol = tl.arange(0, BLOCK_K)
    ok = (t < S)[:, None] & (kcol < TOP_K)[None, :]
    route = (h.to(tl.int64) * S + t.to(tl.int64))[:, None] * TOP_K + kcol[None, :]
    e = tl.load(indices_ptr + route, mask=ok, other=-1)
    ok = ok & (e >= 0) & (e < E)
    e = tl.where(ok, e, 0).to(tl.int32)
    rank = tl.load(rank_ptr + route, mask=ok, other=0)
    p = tl.load(probs_ptr + route, mask=ok, other=0.0)
    pos = tl.load(offsets_ptr + h * E + e, mask=ok, other=0)
    pos += tl.load(base_ptr + (h * NB + b).to(tl.int64) * E + e, mask=ok, other=0)
    pos += rank
    tokens = tl.broadcast_to(t[:, None], [BLOCK_T, BLOCK_K])
    tl.store(gather_ids_ptr + pos, tokens, mask=ok)
    tl.store(sorted_probs_ptr + pos, p, mask=ok)
    if WRITE_POS:
        # The inverse permutation: the backward of sorted_probs is a gather by it.
        tl.store(positions_ptr + route, pos.to(tl.int32), mask=ok)


@triton.jit
def _layout_hist_kernel(
    indices_ptr,  # [H, S, K] int, contiguous
    hist_ptr,  # output [H, NB, E] int32
    S, NB,
    E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """The count step of ranks="scatter" when no counts come from the routing: counts only.

    Launch grid: (NB, H), NB = cdiv(S, BLOCK_T). Program (b, h) owns the routes
    of tokens [b * BLOCK_T, (b + 1) * BLOCK_T) of head h, a contiguous run of
    indices, read BLOCK_R at a time, and writes hist[h, b, :], the routes of each
    expert (what the route kernel's COUNT_T adds up). Out-of-range expert ids are
    not counted.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    head = indices_ptr + h.to(tl.int64) * S * TOP_K
    end = tl.minimum((b + 1) * BLOCK_T, S) * TOP_K  # routes of the head up to the block's end
    counts = tl.zeros([BLOCK_E], tl.int32)
    for r0 in range(0, BLOCK_T * TOP_K, BLOCK_R):
        rr = b * (BLOCK_T * TOP_K) + r0 + tl.arange(0, BLOCK_R)
        e = tl.load(head + rr, mask=rr < end, other=-1)
        ok = (rr < end) & (e >= 0) & (e < E)
        counts += tl.histogram(tl.where(ok, e, 0).to(tl.int32), BLOCK_E, mask=ok)
    col = tl.arange(0, BLOCK_E)
    tl.store(hist_ptr + (h * NB + b).to(tl.int64) * E + col, counts, mask=col < E)


@triton.jit
def _layout_rank_scatter_kernel(
    indices_ptr, probs_ptr,  # [H, S, K] int, fp32; contiguous
    base_ptr, totals_ptr,  # the scan's [H, NB, E] and [H, E] int32
    offsets_ptr,  # output [H*E + 1] int64 (written by the programs of block 0)
    gather_ids_ptr, sorted_probs_ptr,  # outputs [H*S*K] int32, fp32
    positions_ptr,  # output [H*S*K] int32 (if WRITE_POS): the place of route (h, s, k)
    S, NB,
    E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr, WRITE_POS: tl.constexpr = True,
):
    """The last step of ranks="scatter": rank, then place, every route of a block.

    Launch grid: (NB, H). Program (b, h) owns the routes of tokens
    [b * BLOCK_T, (b + 1) * BLOCK_T) of head h: a contiguous run of routes in
    (s, k) order, walked BLOCK_R routes at a time. It keeps cursor[e], the next
    free place of expert e for the block (the offset of expert e in the head,
    the exclusive prefix of the totals, plus base[h, b, e]); a route goes to
    cursor[e] plus its rank among the chunk's earlier routes of expert e
    (pairwise), then the chunk's histogram moves the cursors on. So no rank
    array goes through memory, and no count kernel runs when the counts came
    from the routing. The programs of block 0 also write their head's offsets.

    Every write stays inside head h's slice of the outputs, whatever the counts
    held (counts that are not those of `indices` give a wrong layout, never a
    write out of bounds); routes of out-of-range expert ids are left out.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    col = tl.arange(0, BLOCK_E)
    col_ok = col < E
    routes = S * TOP_K  # of one head; int32 as `positions` (R < 2**31)
    head_start = h.to(tl.int64) * routes
    totals = tl.load(totals_ptr + h * E + col, mask=col_ok, other=0)
    start = tl.cumsum(totals, 0) - totals  # expert e's first place within the head
    if b == 0:
        tl.store(offsets_ptr + h * E + col, head_start + start.to(tl.int64), mask=col_ok)
        tl.store(offsets_ptr + tl.num_programs(1) * E + col,
                 head_start + tl.sum(totals, 0).to(tl.int64),
                 mask=(col == 0) & (h == tl.num_programs(1) - 1))
    cursor = start + tl.load(base_ptr + (h * NB + b).to(tl.int64) * E + col, mask=col_ok,
                             other=0)

    r = tl.arange(0, BLOCK_R)
    first = b * (BLOCK_T * TOP_K)  # the block's first route within the head
    end = tl.minimum((b + 1) * BLOCK_T, S) * TOP_K
    # The next chunk's ids load while the current one is ranked (the loads are the
    # latency of each step; this loop carries a dependence through cursor).
    e_next = tl.load(indices_ptr + head_start + first + r, mask=first + r < end, other=-1)
    for r0 in range(0, BLOCK_T * TOP_K, BLOCK_R):
        rr = first + r0 + r
        ok = rr < end
        e = e_next
        e_next = tl.load(indices_ptr + head_start + rr + BLOCK_R, mask=rr + BLOCK_R < end,
                         other=-1)
        p = tl.load(probs_ptr + head_start + rr, mask=ok, other=0.0)
        # Range check before narrowing: a huge int64 must not wrap into [0, E).
        ok = ok & (e >= 0) & (e < E)
        e = tl.where(ok, e, 0).to(tl.int32)
        pos = tl.gather(cursor, e, 0) + _block_ranks(e, ok, BLOCK_R)
        write = ok & (pos >= 0) & (pos < routes)
        tl.store(gather_ids_ptr + head_start + pos, rr // TOP_K, mask=write)
        tl.store(sorted_probs_ptr + head_start + pos, p, mask=write)
        if WRITE_POS:
            # The inverse permutation: the backward of sorted_probs is a gather by it.
            tl.store(positions_ptr + head_start + rr, (head_start + pos).to(tl.int32),
                     mask=write)
        cursor += tl.histogram(e, BLOCK_E, mask=ok)


# ----------------------------------------------------------------------------- launchers


class SortedRoutes(NamedTuple):
    """What `triton_sort_routes` returns, whatever it was asked for: the layout of
    `mhmoe.RouteLayout` (its first three fields), and the positions of the routes.

    gather_ids:   [H*S*K] int32, token of each route, grouped by flat expert.
    sorted_probs: [H*S*K] float32, aligned with gather_ids.
    offsets:      [H*E + 1] int64, flat expert f owns offsets[f]:offsets[f+1].
    positions:    [H*S*K] int32, the place of route (h, s, k) in the layout
                  (sorted_probs[positions] == probs.flatten()); None unless asked.
    """

    gather_ids: torch.Tensor
    sorted_probs: torch.Tensor
    offsets: torch.Tensor
    positions: torch.Tensor | None


def layout_block_t(top_k: int) -> int:
    """Tokens a block of the layout's counts by default, here (`tuning.layout_block_t`):
    the count_block_t the route kernels count in for `triton_sort_routes`."""
    return tuning.layout_block_t(top_k, interpreting())


def layout_count(indices: torch.Tensor, E: int, block_t: int, sub_t: int,
                 num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of ranks="count": (hist [H, NB, E] int32, the routes of each expert per block
    of block_t tokens; rank [H, S, K] int32, each route's rank among the earlier routes of
    its expert in its block), sub_t tokens at a time. indices: [H, S, K] int, contiguous."""
    H, S, K = indices.shape
    NB = triton.cdiv(S, block_t)
    hist = torch.empty(H, NB, E, device=indices.device, dtype=torch.int32)
    rank = torch.empty(H, S, K, device=indices.device, dtype=torch.int32)
    if num_warps is None:
        num_warps = tuning.layout_count_warps(block_t, sub_t)
    _layout_count_kernel[(NB, H)](indices, hist, rank, S, NB, E=E, TOP_K=K, BLOCK_T=block_t,
                                  SUB_T=sub_t, BLOCK_K=triton.next_power_of_2(K),
                                  BLOCK_E=triton.next_power_of_2(E), num_warps=num_warps)
    return hist, rank


def layout_scan(hist: torch.Tensor, tiles: LayoutScanTiles | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2: (base [H, NB, E] int32, the exclusive prefix of hist [H, NB, E] over the
    blocks; totals [H, E] int32, each expert's routes in its head). tiles override
    `tuning.LAYOUT_SCAN_TILES`."""
    tiles = tiles or tuning.LAYOUT_SCAN_TILES
    H, NB, E = hist.shape
    base = torch.empty_like(hist)
    totals = torch.empty(H, E, device=hist.device, dtype=torch.int32)
    BLOCK_EC = min(triton.next_power_of_2(E), tiles.block_ec)
    _layout_scan_kernel[(triton.cdiv(E, BLOCK_EC), H)](
        hist, base, totals, NB, E=E, BLOCK_B=min(tiles.block_b, triton.next_power_of_2(NB)),
        BLOCK_EC=BLOCK_EC, num_warps=tiles.num_warps)
    return base, totals


def layout_offsets(totals: torch.Tensor, S: int, K: int) -> torch.Tensor:
    """Step 3 of ranks="count": offsets [H*E + 1] int64 from totals [H, E] (S tokens and
    K routes a token a head)."""
    H, E = totals.shape
    offsets = torch.empty(H * E + 1, device=totals.device, dtype=torch.int64)
    _layout_offsets_kernel[(H,)](totals, offsets, S, H, E=E, TOP_K=K,
                                 BLOCK_E=triton.next_power_of_2(E),
                                 num_warps=tuning.LAYOUT_NUM_WARPS)
    return offsets


def layout_scatter(indices: torch.Tensor, probs: torch.Tensor, rank: torch.Tensor,
                   base: torch.Tensor, offsets: torch.Tensor, gather_ids: torch.Tensor,
                   sorted_probs: torch.Tensor, positions: torch.Tensor | None,
                   block_t: int) -> None:
    """Step 4 of ranks="count": every route written at offsets + base + rank into
    gather_ids and sorted_probs ([H*S*K] each), and its place into positions (or None).
    probs: [H, S, K] float32, contiguous; rank, base as `layout_count`, `layout_scan`."""
    H, S, K = indices.shape
    NB, E = base.shape[1:]
    _layout_scatter_kernel[(NB, H)](
        indices, probs, rank, base, offsets, gather_ids, sorted_probs,
        gather_ids if positions is None else positions,  # a placeholder when not written
        S, NB, E=E, TOP_K=K, BLOCK_T=block_t, BLOCK_K=triton.next_power_of_2(K),
        WRITE_POS=positions is not None, num_warps=tuning.LAYOUT_NUM_WARPS)


def layout_hist(indices: torch.Tensor, E: int, block_t: int,
                num_warps: int | None = None) -> torch.Tensor:
    """Step 1 of ranks="scatter" without counts from the routing: hist [H, NB, E] int32,
    the routes of each expert per block of block_t tokens (no ranks)."""
    H, S, K = indices.shape
    NB = triton.cdiv(S, block_t)
    hist = torch.empty(H, NB, E, device=indices.device, dtype=torch.int32)
    if num_warps is None:
        num_warps = tuning.LAYOUT_NUM_WARPS
    _layout_hist_kernel[(NB, H)](indices, hist, S, NB, E=E, TOP_K=K, BLOCK_T=block_t,
                                 BLOCK_R=tuning.layout_hist_block_r(block_t, K),
                                 BLOCK_E=triton.next_power_of_2(E), num_warps=num_warps)
    return hist


def layout_rank_scatter(indices: torch.Tensor, probs: torch.Tensor, base: torch.Tensor,
                        totals: torch.Tensor, offsets: torch.Tensor, gather_ids: torch.Tensor,
                        sorted_probs: torch.Tensor, positions: torch.Tensor | None,
                        block_t: int, chunk: int, num_warps: int | None = None) -> None:
    """The last step of ranks="scatter": every route of each block of block_t tokens
    ranked (chunk routes a step) and written into gather_ids, sorted_probs and positions
    (or None); the programs of block 0 write offsets [H*E + 1]. base, totals: the scan's
    of the counts of these indices."""
    H, S, K = indices.shape
    NB, E = base.shape[1:]
    if num_warps is None:
        num_warps = tuning.layout_rank_scatter_warps(chunk)
    _layout_rank_scatter_kernel[(NB, H)](
        indices, probs, base, totals, offsets, gather_ids, sorted_probs,
        gather_ids if positions is None else positions,  # a placeholder when not written
        S, NB, E=E, TOP_K=K, BLOCK_T=block_t, BLOCK_R=chunk,
        BLOCK_E=triton.next_power_of_2(E), WRITE_POS=positions is not None,
        num_warps=num_warps)


def triton_sort_routes(
    probs: torch.Tensor,
    indices: torch.Tensor,
    num_experts: int,
    *,
    block_counts: torch.Tensor | None = None,
    ranks: str | None = None,
    block_t: int | None = None,
    sub_t: int | None = None,
    chunk: int | None = None,
    return_positions: bool = False,
) -> SortedRoutes:
    """Triton twin of `reference.sort_routes_reference` (no host sync).

    probs: [H, S, K] float (stored as float32); indices: [H, S, K] int in [0, E)
    returns SortedRoutes(gather_ids [H*S*K] int32, sorted_probs [H*S*K] float32,
            offsets [H*E + 1] int64 -- identical to the reference -- and positions).

    block_counts: [H, cdiv(S, block_t), E] int32, the routes of each expert per
    block of block_t tokens of `indices` (what `triton_route` or
    `triton_logits_route` return with count_block_t = block_t; both default to
    `layout_block_t(K)`): the count step is skipped, two launches are left
    (the scan, then the scatter ranks each block itself). They must be the counts
    of these indices: other counts give a wrong layout (offsets past H*S*K, slots
    left unwritten) that must not reach `expert_forward`, though every write of this
    function stays in bounds. Without block_counts, `ranks` picks the steps:
    "scatter" (the default: a count kernel without ranks, scan, the ranking scatter;
    three launches) or "count" (count kernel with ranks, scan, offsets, scatter;
    four). Both give the same layout.

    Out-of-range indices (invalid input; `routing.sort_routes` checks CPU
    tensors only) are left out of the counts and not written: every write
    stays in bounds, and the slots at the end of their head are left unwritten.
    block_t, sub_t and chunk (powers of two) override the tokens per block, the
    tokens per sub-block of the "count" count step and the routes per step of
    the ranking scatter (tests, tuning). return_positions: positions [H*S*K] int32,
    the place of route (h, s, k) in the layout, which the backward of sorted_probs
    needs (out-of-range routes: unwritten); without it none are written (None).
    """
    if indices.dim() != 3 or probs.shape != indices.shape:
        raise ValueError(f"triton_sort_routes: probs and indices must both be [H, S, K], got "
                         f"{tuple(probs.shape)} and {tuple(indices.shape)}")
    H, S, K = indices.shape
    E = num_experts
    if ranks is None:
        # Also without counts: the count-only step, the scan and the ranking scatter
        # measured faster than "count" (docs/layout.md, "History and measurements (S = 32,768)").
        ranks = "scatter"
    if ranks not in ("count", "scatter") or (block_counts is not None and ranks != "scatter"):
        raise ValueError(f"triton_sort_routes: ranks must be 'count' or 'scatter' ('scatter' "
                         f"with block_counts), got {ranks!r}")
    if block_t is None:
        block_t = layout_block_t(K)
    check_power_of_two("triton_sort_routes", "block_t", block_t)
    if block_counts is not None and (
            tuple(block_counts.shape) != (H, triton.cdiv(S, block_t), E) or
            block_counts.dtype != torch.int32 or block_counts.device != indices.device):
        raise ValueError(f"triton_sort_routes: block_counts must be [H, cdiv(S, {block_t}), E] "
                         f"= {[H, triton.cdiv(S, block_t), E]} int32 on {indices.device}, got "
                         f"{list(block_counts.shape)} {block_counts.dtype} on "
                         f"{block_counts.device}")
    if H * S * K >= 2**31:
        raise ValueError(f"triton_sort_routes: H*S*K = {H * S * K} routes; the layout "
                         f"indexes routes in int32 (at most 2**31 - 1)")
    device = indices.device
    gather_ids = torch.empty(H * S * K, device=device, dtype=torch.int32)
    sorted_probs = torch.empty(H * S * K, device=device, dtype=torch.float32)
    positions = torch.empty(H * S * K, device=device, dtype=torch.int32) \
        if return_positions else None
    if H == 0 or S == 0:
        # No routes: every offset is 0, nothing to launch.
        return SortedRoutes(gather_ids, sorted_probs,
                            torch.zeros(H * E + 1, device=device, dtype=torch.int64), positions)
    indices = indices.contiguous()
    probs = probs.to(torch.float32).contiguous()
    # A block longer than S is one block either way (the same NB): launch it at S's size.
    block_t = min(block_t, triton.next_power_of_2(S))
    if ranks == "scatter":
        if chunk is None:
            chunk = tuning.layout_chunk(block_t, K, interpreting())
        check_power_of_two("triton_sort_routes", "chunk", chunk)
        hist = block_counts.contiguous() if block_counts is not None else \
            layout_hist(indices, E, block_t)
        base, totals = layout_scan(hist)
        offsets = torch.empty(H * E + 1, device=device, dtype=torch.int64)
        layout_rank_scatter(indices, probs, base, totals, offsets, gather_ids, sorted_probs,
                            positions, block_t, chunk)
        return SortedRoutes(gather_ids, sorted_probs, offsets, positions)
    if sub_t is None:
        sub_t = tuning.layout_sub_t(block_t, K, interpreting())
    check_power_of_two("triton_sort_routes", "sub_t", sub_t)
    sub_t = min(sub_t, block_t)
    hist, rank = layout_count(indices, E, block_t, sub_t)
    base, totals = layout_scan(hist)
    offsets = layout_offsets(totals, S, K)
    layout_scatter(indices, probs, rank, base, offsets, gather_ids, sorted_probs, positions,
                   block_t)
    return SortedRoutes(gather_ids, sorted_probs, offsets, positions)
