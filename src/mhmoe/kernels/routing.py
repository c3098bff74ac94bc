"""Routing and route-layout kernels (SPEC sections 2 and 3) for CUDA tensors.

Two launchers, each the Triton twin of a function of `mhmoe.reference`:

    probs, indices = triton_route(logits, top_k, ...)           # route_reference
    gather_ids, sorted_probs, offsets = triton_sort_routes(probs, indices, E)
                                                                 # sort_routes_reference

Routing. One program owns BLOCK_ROWS tokens of one head: it loads their
[BLOCK_ROWS, E] logits once, computes the scores and the biased selection
scores in registers, then runs top_k rounds of "row maximum, lowest expert id
attaining it, mark it taken". Lowest id among equal maxima is exactly the
tie order of the reference's stable descending sort. A taken expert is
marked with NaN: the maximum ignores NaN, and `ms == max` is false for NaN,
so taken experts drop out of both steps, while a real -inf (a NaN score is
selected as -inf) still ties with other -inf experts in ascending id.

Layout (a stable counting sort, no host synchronisation, no atomics):

1. count: per (head, block of BLOCK_T tokens), the routes of each expert
   (hist [H, NB, E], a histogram) and each route's rank among the earlier
   routes of the same expert inside the block (rank [H, S, K], pairwise
   comparisons of the block's 64 route slots);
2. scan: per (head, expert), an exclusive prefix over the blocks (base
   [H, NB, E]) and the total (totals [H, E]);
3. offsets: per head, an exclusive prefix of the totals over experts, plus
   h * S * K (every route of head h lands in head h's experts);
4. scatter: route (h, s, k) of expert f = h * E + e goes to
   offsets[f] + base[h, block(s), e] + rank[h, s, k].

Positions depend only on the data, so the layout is identical on every run.
See benchmarks/NOTES.md for the cost model and the measurements.

Precision. Scores are fp32 and are bitwise those of torch on CUDA: sigmoid
is `1 / (1 + exp(-x))` with libdevice's expf (what CUDA's `std::exp` calls)
and a correctly rounded division, as torch's kernel computes; softmax uses
the same exp and division, but sums in a different order than torch, so its
probabilities differ in the last bits. Under TRITON_INTERPRET=1 numpy's exp
replaces libdevice (unavailable there).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    """expf, bitwise as CUDA's std::exp on the GPU (tl.exp is ex2.approx based)."""
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _score(x, row_max, row_den, SOFTMAX: tl.constexpr, INTERPRET: tl.constexpr):
    """Score of logits x: sigmoid, or softmax given the row's max and denominator."""
    if SOFTMAX:
        return tl.math.div_rn(_exp(x - row_max, INTERPRET), row_den)
    else:
        # torch: one / (one + std::exp(-a)); same operations, same rounding.
        return tl.math.div_rn(1.0, 1.0 + _exp(-x, INTERPRET))


@triton.jit
def _nan_to_neg_inf(v, INTERPRET: tl.constexpr):
    """For max reductions only: the GPU's max already skips NaN, numpy's does not."""
    if INTERPRET:
        return tl.where(v != v, float("-inf"), v)
    else:
        return v


@triton.jit
def _keep_best_groups(sel, col, E, group_size,
                      NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                      BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """Group-limited routing: zero the selection scores outside the best groups.

    sel: [BLOCK_ROWS, BLOCK_E] fp32 without NaN. A group's score is the sum of
    its two best selection scores (one if the group has one expert); NaN sums
    (inf + -inf) count as -inf; the best TOPK_GROUPS groups are kept, ties to
    the lower group id, as `reference._limit_to_groups` does.
    """
    gid = col // group_size  # padding columns get gid >= NUM_GROUPS
    gcol = tl.arange(0, BLOCK_G)
    gscore = tl.full([BLOCK_ROWS, BLOCK_G], float("nan"), tl.float32)
    for g in range(NUM_GROUPS):
        in_group = (gid == g)[None, :] & (col < E)[None, :]
        v = tl.where(in_group, sel, float("-inf"))
        best1 = tl.max(v, 1)
        first = tl.min(tl.where(in_group & (v == best1[:, None]), col[None, :], BLOCK_E), 1)
        # The second best excludes one occurrence of the best (a duplicate max counts twice).
        best2 = tl.max(tl.where(col[None, :] == first[:, None], float("-inf"), v), 1)
        score = tl.where(group_size > 1, best1 + best2, best1)
        score = tl.where(score != score, float("-inf"), score)
        gscore = tl.where((gcol == g)[None, :], score[:, None], gscore)
    keep = tl.zeros([BLOCK_ROWS, BLOCK_E], tl.int1)
    for _ in range(TOPK_GROUPS):
        m = tl.max(_nan_to_neg_inf(gscore, INTERPRET), 1)
        pick = tl.min(tl.where(gscore == m[:, None], gcol[None, :], BLOCK_G), 1)
        gscore = tl.where(gcol[None, :] == pick[:, None], float("nan"), gscore)
        keep = keep | (gid[None, :] == pick[:, None])
    return tl.where(keep, sel, 0.0)


@triton.jit
def _take_best(ms, row_base, row_ok, row_max, row_den, total, p_tile, i_tile, k,
               stride_le, E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
               SOFTMAX: tl.constexpr, INTERPRET: tl.constexpr):
    """One top-k round: the best untaken expert of every row, its probability."""
    col = tl.arange(0, BLOCK_E)
    kcol = tl.arange(0, BLOCK_K)
    m = tl.max(_nan_to_neg_inf(ms, INTERPRET), 1)
    idx = tl.min(tl.where(ms == m[:, None], col[None, :], BLOCK_E), 1)
    # Unreachable (an untaken expert always remains since K <= E), but an index
    # must never leave [0, E), whatever the data.
    idx = tl.minimum(idx, E - 1)
    ms = tl.where(col[None, :] == idx[:, None], float("nan"), ms)
    # The probability is gathered from the unbiased score: recompute it from the
    # logit (an L1-cached load) rather than a masked sum over the tile.
    x_k = tl.load(row_base + idx * stride_le, mask=row_ok, other=0.0)
    p = _score(x_k, row_max, row_den, SOFTMAX, INTERPRET)
    total = total + p  # left to right in selection order, as the reference sums
    p_tile = tl.where(kcol[None, :] == k, p[:, None], p_tile)
    i_tile = tl.where(kcol[None, :] == k, idx[:, None], i_tile)
    return ms, total, p_tile, i_tile


@triton.jit
def _block_ranks(e, valid, R: tl.constexpr):
    """rank[r] = routes r' < r of the block with the same expert (stable order).

    e, valid: [R], routes in (token, k) order. Pairwise, R^2 work: cheaper than
    an [tokens, E] count tile for the small blocks used here, and exact with
    repeated experts too.
    """
    r = tl.arange(0, R)
    key = tl.where(valid, e, -1 - r)  # distinct negative keys never match
    same = (key[:, None] == key[None, :]) & (r[None, :] < r[:, None])
    return tl.sum(same.to(tl.int32), 1)


@triton.jit
def _route_rows(
    x, rows, row_base, h, bias_ptr, probs_ptr, indices_ptr,
    S, group_size, norm_eps, route_scale, stride_le,
    E: tl.constexpr, TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROUTE_NORM: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Scores, selection and probabilities of one [BLOCK_ROWS, BLOCK_E] logits tile."""
    row_ok = rows < S
    col = tl.arange(0, BLOCK_E)
    col_ok = col < E
    kcol = tl.arange(0, BLOCK_K)
    if SOFTMAX:
        row_max = tl.max(_nan_to_neg_inf(x, INTERPRET), 1)
        # Padding columns hold -inf: exp(-inf - max) = 0 (NaN only in an all -inf
        # row, where every real score is NaN too, as in torch).
        row_den = tl.sum(tl.where(col_ok[None, :], _exp(x - row_max[:, None], INTERPRET), 0.0), 1)
    else:
        row_max = tl.zeros([BLOCK_ROWS], tl.float32)
        row_den = tl.zeros([BLOCK_ROWS], tl.float32)
    scores = _score(x, row_max[:, None], row_den[:, None], SOFTMAX, INTERPRET)

    sel = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h * E + col, mask=col_ok, other=0.0)
        sel = scores + bias[None, :]
    # SPEC: a NaN selection score counts as -inf.
    sel = tl.where(sel != sel, float("-inf"), sel)
    if NUM_GROUPS > 1:
        sel = _keep_best_groups(sel, col, E, group_size, NUM_GROUPS, TOPK_GROUPS,
                                BLOCK_ROWS, BLOCK_E, BLOCK_G, INTERPRET)
    # NaN marks "not selectable": padding columns now, taken experts later.
    ms = tl.where(col_ok[None, :], sel, float("nan"))

    total = tl.zeros([BLOCK_ROWS], tl.float32)
    p_tile = tl.zeros([BLOCK_ROWS, BLOCK_K], tl.float32)
    i_tile = tl.zeros([BLOCK_ROWS, BLOCK_K], tl.int32)
    if TOP_K <= 16:
        # Unrolled: the tile updates become compile-time selects.
        for k in tl.static_range(TOP_K):
            ms, total, p_tile, i_tile = _take_best(
                ms, row_base, row_ok, row_max, row_den, total, p_tile, i_tile, k, stride_le,
                E, BLOCK_E, BLOCK_K, SOFTMAX, INTERPRET)
    else:
        for k in range(TOP_K):
            ms, total, p_tile, i_tile = _take_best(
                ms, row_base, row_ok, row_max, row_den, total, p_tile, i_tile, k, stride_le,
                E, BLOCK_E, BLOCK_K, SOFTMAX, INTERPRET)

    if ROUTE_NORM:
        # clamp_min that keeps NaN (tl.maximum would turn a NaN total into eps).
        denom = tl.where(total < norm_eps, norm_eps, total)
        p_tile = tl.math.div_rn(p_tile, denom[:, None])
    p_tile = p_tile * route_scale

    out_off = (h.to(tl.int64) * S + rows.to(tl.int64))[:, None] * TOP_K + kcol[None, :]
    out_ok = row_ok[:, None] & (kcol < TOP_K)[None, :]
    tl.store(probs_ptr + out_off, p_tile, mask=out_ok)
    tl.store(indices_ptr + out_off, i_tile.to(tl.int64), mask=out_ok)


@triton.jit
def _route_kernel(
    logits_ptr, stride_lh, stride_ls, stride_le,  # logits [H, S, E] fp32
    bias_ptr,  # [H, E] fp32 contiguous (unused unless HAS_BIAS)
    probs_ptr, indices_ptr,  # outputs [H, S, K] fp32, int64, contiguous
    S, group_size, norm_eps, route_scale,
    E: tl.constexpr, TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROUTE_NORM: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, ITERS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Top-k routing of ITERS blocks of BLOCK_ROWS tokens of one head.

    Launch grid: (cdiv(S, BLOCK_ROWS * ITERS), H). Program (b, h) owns tokens
    [b * BLOCK_ROWS * ITERS, (b + 1) * BLOCK_ROWS * ITERS) of head h: it reads
    their logits once and writes their probs and indices ([rows, K] each).
    It walks them BLOCK_ROWS at a time, loading the next tile before working
    on the current one (ITERS > 1 measured no faster on an H200: the launcher
    uses ITERS = 1; the loop stays for tuning on other parts).

    E is a compile-time constant: with E == BLOCK_E the column mask folds away
    and the loads are 16 bytes wide. A warp then covers 128 columns of a row;
    the launcher keeps every row inside one warp (one warp per program when
    E > 128), so the 2 * K row reductions are warp shuffles, not shared-memory
    round trips with a barrier each.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    col = tl.arange(0, BLOCK_E)
    col_ok = col < E
    rows = b * (BLOCK_ROWS * ITERS) + tl.arange(0, BLOCK_ROWS)
    # int64 row offsets: H * S * E can pass 2**31 at long sequences.
    head_base = logits_ptr + h.to(tl.int64) * stride_lh
    row_base = head_base + rows.to(tl.int64) * stride_ls
    # Rows past S read 0.0 (no NaN arithmetic on them); padding columns hold
    # -inf, which scores 0 under either score function.
    x = tl.load(row_base[:, None] + col[None, :] * stride_le,
                mask=(rows < S)[:, None] & col_ok[None, :], other=0.0)
    x = tl.where(col_ok[None, :], x, float("-inf"))
    for it in range(ITERS):
        next_rows = rows + BLOCK_ROWS
        next_base = head_base + next_rows.to(tl.int64) * stride_ls
        next_ok = (next_rows < S) & (it + 1 < ITERS)
        x_next = tl.load(next_base[:, None] + col[None, :] * stride_le,
                         mask=next_ok[:, None] & col_ok[None, :], other=0.0)
        x_next = tl.where(col_ok[None, :], x_next, float("-inf"))
        _route_rows(x, rows, row_base, h, bias_ptr, probs_ptr, indices_ptr,
                    S, group_size, norm_eps, route_scale, stride_le,
                    E, TOP_K, SOFTMAX, HAS_BIAS, ROUTE_NORM, NUM_GROUPS, TOPK_GROUPS,
                    BLOCK_ROWS, BLOCK_E, BLOCK_K, BLOCK_G, INTERPRET)
        x = x_next
        rows = next_rows
        row_base = next_base


@triton.jit
def _layout_count_kernel(
    indices_ptr,  # [H, S, K] int, contiguous
    hist_ptr, rank_ptr,  # outputs [H, NB, E] int32, [H, S, K] int32
    S, NB,
    E: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Layout step 1: per-block expert counts and in-block ranks.

    Launch grid: (NB, H), NB = cdiv(S, BLOCK_T). Program (b, h) owns the
    BLOCK_T * K routes of tokens [b * BLOCK_T, (b + 1) * BLOCK_T) of head h.
    rank of route (s, k) = earlier routes of the block, in (s, k) order, with
    the same expert (the reference's stable order). Out-of-range expert ids
    are not counted (their routes are left out of the layout).
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    R: tl.constexpr = BLOCK_T * BLOCK_K
    r = tl.arange(0, R)
    t = b * BLOCK_T + r // BLOCK_K
    k = r % BLOCK_K
    ok = (t < S) & (k < TOP_K)
    route = (h.to(tl.int64) * S + t.to(tl.int64)) * TOP_K + k
    e = tl.load(indices_ptr + route, mask=ok, other=-1)
    # Range check before narrowing: a huge int64 must not wrap into [0, E).
    ok = ok & (e >= 0) & (e < E)
    e = tl.where(ok, e, 0).to(tl.int32)
    col = tl.arange(0, BLOCK_E)
    tl.store(hist_ptr + (h * NB + b).to(tl.int64) * E + col,
             tl.histogram(e, BLOCK_E, mask=ok), mask=col < E)
    tl.store(rank_ptr + route, _block_ranks(e, ok, R), mask=ok)


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
    positions_ptr,  # output [H*S*K] int32: the place of route (h, s, k) in the layout
    S, NB,
    E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
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
    # The inverse permutation: the backward of sorted_probs is a gather by it.
    tl.store(positions_ptr + route, pos.to(tl.int32), mask=ok)


# ----------------------------------------------------------------------------- launchers


def _route_config(S: int, E: int, block_rows: int | None, num_warps: int | None,
                  iters: int | None):
    """(BLOCK_ROWS, BLOCK_E, num_warps, ITERS) of the routing kernel.

    A warp covers 128 fp32 columns (32 lanes x 16-byte loads); a wider row
    would be split across warps, so E > 128 gets one warp per program. About
    16 scores per thread: few registers, many programs per SM (2 rows of
    256: 79 registers, 0.36 ms at S=32768 on an H200, against 0.37-0.60 ms for
    4, 8 or 16 rows). ITERS = 1: prefetching the next tile in a loop measured
    slower (0.38-0.42 ms for 4-8 tiles a program), the kernel is issue-bound.
    """
    BLOCK_E = triton.next_power_of_2(max(E, 1))
    if num_warps is None:
        num_warps = 1 if BLOCK_E > 128 else 4
    if block_rows is None:
        block_rows = max(1, min(64, 16 * 32 * num_warps // BLOCK_E))
        if _interpreting():
            # The interpreter's cost is per program: take many rows.
            block_rows = max(1, min(128, 16384 // BLOCK_E))
        block_rows = min(block_rows, triton.next_power_of_2(max(S, 1)))
    if iters is None:
        iters = 1
    return block_rows, BLOCK_E, num_warps, iters


def triton_route(
    logits: torch.Tensor,
    top_k: int,
    score_func: str = "sigmoid",
    expert_bias: torch.Tensor | None = None,
    route_norm: bool = True,
    norm_eps: float = 1e-12,
    route_scale: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
    iters: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `reference.route_reference` (one launch, no host sync).

    logits: [H, S, E] float32 (any strides; float16/bfloat16 are upcast)
    expert_bias: [H, E] or [H*E] or None, selection only
    returns probs [H, S, K] float32, indices [H, S, K] int64.

    Same semantics as the reference, NaN included: a NaN selection score
    counts as -inf, indices always lie in [0, E), other rows are untouched.
    Arguments are otherwise assumed valid (`routing.route` checks them);
    block_rows, num_warps and iters override the tile choice (tests, tuning).
    """
    if logits.dim() != 3:
        raise ValueError(f"triton_route: logits must be [H, S, E], got {tuple(logits.shape)}")
    if logits.dtype == torch.float64 or not logits.dtype.is_floating_point:
        raise ValueError(f"triton_route: logits must be float32 (float16/bfloat16 are upcast; "
                         f"float64 belongs to the reference path), got {logits.dtype}")
    H, S, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"triton_route: top_k must lie in [1, E={E}], got {top_k}")
    logits = logits.float()
    device = logits.device
    probs = torch.empty(H, S, top_k, device=device, dtype=torch.float32)
    indices = torch.empty(H, S, top_k, device=device, dtype=torch.int64)
    if H == 0 or S == 0:
        return probs, indices
    BLOCK_ROWS, BLOCK_E, warps, ITERS = _route_config(S, E, block_rows, num_warps, iters)
    bias = logits  # a placeholder pointer when there is no bias
    if expert_bias is not None:
        bias = expert_bias.reshape(H, E).to(device=device, dtype=torch.float32).contiguous()
    _route_kernel[(triton.cdiv(S, BLOCK_ROWS * ITERS), H)](
        logits, *logits.stride(), bias, probs, indices,
        S, max(E // num_groups, 1), float(norm_eps), float(route_scale),
        E=E, TOP_K=top_k, SOFTMAX=score_func == "softmax", HAS_BIAS=expert_bias is not None,
        ROUTE_NORM=bool(route_norm), NUM_GROUPS=num_groups, TOPK_GROUPS=topk_groups,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_E=BLOCK_E, BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_G=triton.next_power_of_2(num_groups), ITERS=ITERS, INTERPRET=_interpreting(),
        num_warps=warps,
    )
    return probs, indices


def triton_sort_routes(
    probs: torch.Tensor,
    indices: torch.Tensor,
    num_experts: int,
    *,
    block_t: int | None = None,
    return_positions: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Triton twin of `reference.sort_routes_reference` (four launches, no host sync).

    probs: [H, S, K] float (stored as float32); indices: [H, S, K] int in [0, E)
    returns gather_ids [H*S*K] int32, sorted_probs [H*S*K] float32,
            offsets [H*E + 1] int64 -- identical to the reference.

    Out-of-range indices (invalid input; `routing.sort_routes` checks CPU
    tensors only) are left out of the counts and not written: every write
    stays in bounds, and the slots at the end of their head are left unwritten.
    block_t (a power of two) overrides the tokens per block. return_positions
    adds a fourth output, positions [H*S*K] int32: the place of route (h, s, k)
    in the layout (sorted_probs[positions] == probs.flatten()), which the
    backward of sorted_probs needs (out-of-range routes: unwritten).
    """
    if indices.dim() != 3 or probs.shape != indices.shape:
        raise ValueError(f"triton_sort_routes: probs and indices must both be [H, S, K], got "
                         f"{tuple(probs.shape)} and {tuple(indices.shape)}")
    H, S, K = indices.shape
    E = num_experts
    device = indices.device
    gather_ids = torch.empty(H * S * K, device=device, dtype=torch.int32)
    sorted_probs = torch.empty(H * S * K, device=device, dtype=torch.float32)
    positions = torch.empty(H * S * K, device=device, dtype=torch.int32)
    extra = (positions,) if return_positions else ()
    if H == 0 or S == 0:
        # No routes: every offset is 0, nothing to launch.
        return (gather_ids, sorted_probs,
                torch.zeros(H * E + 1, device=device, dtype=torch.int64), *extra)
    indices = indices.contiguous()
    probs = probs.to(torch.float32).contiguous()
    BLOCK_K = triton.next_power_of_2(K)
    if block_t is None:
        # The pairwise rank tile is [BLOCK_T * BLOCK_K]^2: 64 route slots a block
        # (measured best of 32/64/128 on an H200; more under the interpreter,
        # whose cost is per program).
        block_t = max(1, (1024 if _interpreting() else 64) // BLOCK_K)
        block_t = min(block_t, triton.next_power_of_2(S))
    hist, rank = _layout_count(indices, E, block_t)
    base, totals = _layout_scan(hist)
    offsets = _layout_offsets(totals, S, K)
    _layout_scatter(indices, probs, rank, base, offsets, gather_ids, sorted_probs, positions,
                    block_t)
    return (gather_ids, sorted_probs, offsets, *extra)


# The four steps of triton_sort_routes, separate so that benchmarks can time each.


def _layout_count(indices, E, block_t):
    H, S, K = indices.shape
    NB = triton.cdiv(S, block_t)
    hist = torch.empty(H, NB, E, device=indices.device, dtype=torch.int32)
    rank = torch.empty(H, S, K, device=indices.device, dtype=torch.int32)
    _layout_count_kernel[(NB, H)](indices, hist, rank, S, NB, E=E, TOP_K=K, BLOCK_T=block_t,
                                  BLOCK_K=triton.next_power_of_2(K),
                                  BLOCK_E=triton.next_power_of_2(E), num_warps=4)
    return hist, rank


def _layout_scan(hist, block_ec=8):
    H, NB, E = hist.shape
    base = torch.empty_like(hist)
    totals = torch.empty(H, E, device=hist.device, dtype=torch.int32)
    BLOCK_EC = min(triton.next_power_of_2(E), block_ec)
    _layout_scan_kernel[(triton.cdiv(E, BLOCK_EC), H)](
        hist, base, totals, NB, E=E, BLOCK_B=min(128, triton.next_power_of_2(NB)),
        BLOCK_EC=BLOCK_EC, num_warps=4)
    return base, totals


def _layout_offsets(totals, S, K):
    H, E = totals.shape
    offsets = torch.empty(H * E + 1, device=totals.device, dtype=torch.int64)
    _layout_offsets_kernel[(H,)](totals, offsets, S, H, E=E, TOP_K=K,
                                 BLOCK_E=triton.next_power_of_2(E), num_warps=4)
    return offsets


def _layout_scatter(indices, probs, rank, base, offsets, gather_ids, sorted_probs, positions,
                    block_t):
    H, S, K = indices.shape
    NB, E = base.shape[1:]
    _layout_scatter_kernel[(NB, H)](
        indices, probs, rank, base, offsets, gather_ids, sorted_probs, positions, S, NB,
        E=E, TOP_K=K, BLOCK_T=block_t, BLOCK_K=triton.next_power_of_2(K), num_warps=4)
