"""Routing and route-layout kernels (SPEC sections 2 and 3) for CUDA tensors.

Three launchers, each the Triton twin of a function of `mhmoe.reference` (or
of two in a row):

    probs, indices = triton_route(logits, top_k, ...)           # route_reference
    probs, indices, _ = triton_logits_route(x_heads, gate, top_k, ...)
                                     # route_reference(fp32 logits of x_heads and gate)
    gather_ids, sorted_probs, offsets = triton_sort_routes(probs, indices, E)
                                                                 # sort_routes_reference

and the hand-off the layer uses: the route kernels count their picks for the
layout, which then skips its count step (same layout, bitwise):

    probs, indices, counts = triton_route(logits, top_k, count_block_t=T)
    layout = triton_sort_routes(probs, indices, E, block_counts=counts, block_t=T)

Routing. One program owns BLOCK_ROWS tokens of one head: it loads their
[BLOCK_ROWS, E] logits once and selects in registers, on packed keys
(`_top_k_keyed`): each selection score's fp32 encoding in an order-preserving
unsigned integer whose low log2(E) bits carry the expert id, so that one
unsigned minimum a score a round finds the next key (for sigmoid without
groups the keys come from an approximate sigmoid, ~4 instructions, within
SIGMOID_APPROX_ERROR of torch's). A row whose top K + 1 keys are not
separated by more than the keys' resolution and the approximation's error
(near-ties, ties, non-finite scores) is unsure, and a program with an unsure
row redoes its tile exactly: exact selection scores (bitwise torch's), then
top_k rounds of "row maximum, lowest expert id attaining it, mark it taken"
(`_top_k_rounds`). Lowest id among equal maxima is exactly the tie order of
the reference's stable descending sort. A taken expert is marked with NaN:
the maximum ignores NaN, and `ms == max` is false for NaN, so taken experts
drop out of both steps, while a real -inf (a NaN score is selected as -inf)
still ties with other -inf experts in ascending id. Either way the picks are
those of the exact rounds, bitwise. The probabilities are then computed
exactly from the picked logits (one gather). With a count block T, each pick
is also added to counts[h, s // T, e] (an integer atomic add: the sums do not
depend on the order of the adds).

Fused logits + route. `triton_logits_route` computes the [BLOCK_S, E] logits
tile of BLOCK_S tokens on tensor cores (the fp32 router weight split exactly
into three bf16 parts, see `_logits_route_kernel`) and routes it in registers
with the same code (`_route_rows`): no fp32 GEMM on CUDA cores, and the
logits reach memory only when wanted (the backward, or the gather).

Shortlists (the sm_90 default for sigmoid scores without groups, K <= 16). The
split logits kernel computes [BLOCK_S, BLOCK_N] tiles (a block of the experts),
stores them, and lists for each row the next_pow2(K) largest packed keys (the
route kernel's keys, expert ids in their low bits): by SHORT + 1 rounds over the
tile's keys (`_shortlist`), or, the sm_90 default where K < next_pow2(K), by
sorting networks in each thread's registers and merges between threads
(`_shortlist_merged`). Where the keys' K-th and (next_pow2(K) + 1)-th values (the
merged lists: the K-th and the next_pow2(K)-th) are apart by more than the margin,
every expert left out has K experts of its block with a strictly greater exact
selection score, so the row's exact top K lies in its blocks' lists, and
`_shortlist_route_kernel` picks it from them: by the listed keys where they order
the picks beyond doubt (then only the K picked logits are read), else with exact
scores and the exact rounds on the listed logits (2 x 8 at MAGI-2's dims): bitwise
the whole-row results either way. Rows whose lists cannot vouch for their top K
are routed from their whole logits.

Layout (a stable counting sort, no host synchronisation) over blocks of
BLOCK_T tokens of a head, in one of two ways (`ranks`):

"count" (without counts from the routing, on request):
1. count: per (head, block), the routes of each expert (hist [H, NB, E], a
   histogram) and each route's rank among the earlier routes of the same
   expert inside the block (rank [H, S, K]: pairwise comparisons within
   sub-blocks of 64 route slots, plus a running histogram of the block's
   earlier sub-blocks);
2. scan: per (head, expert), an exclusive prefix over the blocks (base
   [H, NB, E]) and the total (totals [H, E]);
3. offsets: per head, an exclusive prefix of the totals over experts, plus
   h * S * K (every route of head h lands in head h's experts);
4. scatter: route (h, s, k) of expert f = h * E + e goes to
   offsets[f] + base[h, block(s), e] + rank[h, s, k].

"scatter" (the default; the layer's, with counts from the routing):
1. counts: from the route kernels (no launch of the layout), or without them
   from a count kernel that only counts (hist, no ranks);
2. the scan, as above;
3. one program per (head, block) walks the block's routes (64 at a time on two
   warps on the GPU) with a cursor per expert (its offset in the head plus base[h, b, e]):
   a route goes to the cursor of its expert plus its rank among the step's
   earlier routes of that expert (pairwise), then the step's histogram moves
   the cursors on; the programs of block 0 write the offsets. No rank array
   goes through memory, no offsets launch.
Positions depend only on the data, so the layout is identical on every run.
See benchmarks/NOTES.md for the cost model and the measurements.

Precision. Scores are fp32 and are bitwise those of torch on CUDA: sigmoid
is `1 / (1 + exp(-x))` with libdevice's expf (what CUDA's `std::exp` calls)
and a correctly rounded division, as torch's kernel computes; softmax uses
the same exp and division, but sums in a different order than torch, so its
probabilities differ in the last bits. Under TRITON_INTERPRET=1 numpy's exp
replaces libdevice (unavailable there). The fused kernel's logits are fp32
dot products like cuBLAS's, accumulated in another order: its routes equal
those of the unfused path except where selection scores are within ~1e-6
(relative) of each other, its probabilities agree to ~1e-6 relative.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

from . import configs
from .configs import LogitsRouteConfig


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
def _nan_as_neg_inf(v, INTERPRET: tl.constexpr):
    """v with NaN replaced by -inf: on the GPU one max (fmax returns the non-NaN operand)."""
    if INTERPRET:
        return tl.where(v != v, float("-inf"), v)
    else:
        return tl.maximum(v, float("-inf"))


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
def _take_best(ms, x, x_sel, i_tile, k, E: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_K: tl.constexpr, FROM_TILE: tl.constexpr, INTERPRET: tl.constexpr):
    """One top-k round: the best untaken expert of every row goes to column k of
    i_tile (and, FROM_TILE, its logit to column k of x_sel)."""
    col = tl.arange(0, BLOCK_E)
    kcol = tl.arange(0, BLOCK_K)
    m = tl.max(_nan_to_neg_inf(ms, INTERPRET), 1)
    idx = tl.min(tl.where(ms == m[:, None], col[None, :], BLOCK_E), 1)
    # Unreachable (an untaken expert always remains since K <= E), but an index
    # must never leave [0, E), whatever the data.
    idx = tl.minimum(idx, E - 1)
    picked = col[None, :] == idx[:, None]
    ms = tl.where(picked, float("nan"), ms)
    if FROM_TILE:
        # A masked sum over the logits tile: exact (one term and zeros).
        x_k = tl.sum(tl.where(picked, x, 0.0), 1)
        x_sel = tl.where(kcol[None, :] == k, x_k[:, None], x_sel)
    i_tile = tl.where(kcol[None, :] == k, idx[:, None], i_tile)
    return ms, x_sel, i_tile


@triton.jit
def _top_k_rounds(ms, x, x_sel, i_tile, E: tl.constexpr, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, FROM_TILE: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """TOP_K rounds of `_take_best` on ms (selection scores, NaN where not selectable):
    the exact top-k, returned as (x_sel, i_tile)."""
    if TOP_K <= 16:
        # Unrolled: the tile updates become compile-time selects.
        for k in tl.static_range(TOP_K):
            ms, x_sel, i_tile = _take_best(ms, x, x_sel, i_tile, k, E, BLOCK_E, BLOCK_K,
                                           FROM_TILE, INTERPRET)
    else:
        for k in range(TOP_K):
            ms, x_sel, i_tile = _take_best(ms, x, x_sel, i_tile, k, E, BLOCK_E, BLOCK_K,
                                           FROM_TILE, INTERPRET)
    return x_sel, i_tile


# Bound on |approximate sigmoid - torch's fp32 sigmoid| (absolute), with a
# margin: the approximation's own error is below ~2.5e-7 (ex2.approx and
# rcp.approx, relative errors <= 2^-22; the rounding of x * log2(e) costs at most
# s (1 - s) |x| 2^-24 ln 2 <= 1.3e-8), torch's is half an ulp of a value <= 1.
SIGMOID_APPROX_ERROR = tl.constexpr(2.0 ** -19)


@triton.jit
def _sigmoid_approx(x, col, INTERPRET: tl.constexpr):
    """1 / (1 + exp(-x)) within SIGMOID_APPROX_ERROR, in four instructions (two of
    them MUFU). NaN stays NaN, -inf gives 0, +inf 1.

    The interpreter has no PTX: there it is numpy's sigmoid moved by 2^-20
    relative, down in columns 0 mod 3, up in columns 2 mod 3, so that the tests
    meet the swaps the margin must catch."""
    if INTERPRET:
        s = 1.0 / (1.0 + tl.exp(-x))
        return s + s * (((col % 3) - 1).to(tl.float32) * 2.0 ** -20)[None, :]
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 e; mul.ftz.f32 e, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e;"
            " add.ftz.f32 e, e, 0f3F800000; rcp.approx.ftz.f32 $0, e; }",
            "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _selection(x, row_max, row_den, bias, col, E: tl.constexpr, group_size,
               SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr,
               TOPK_GROUPS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_G: tl.constexpr, INTERPRET: tl.constexpr):
    """The exact selection scores of logits tile x: score (+ bias), NaN as -inf
    (SPEC), zero outside the best groups when group-limited."""
    sel = _score(x, row_max[:, None], row_den[:, None], SOFTMAX, INTERPRET)
    if HAS_BIAS:
        sel = sel + bias[None, :]
    sel = _nan_as_neg_inf(sel, INTERPRET)
    if NUM_GROUPS > 1:
        sel = _keep_best_groups(sel, col, E, group_size, NUM_GROUPS, TOPK_GROUPS,
                                BLOCK_ROWS, BLOCK_E, BLOCK_G, INTERPRET)
    return sel


@triton.jit
def _key_value(key, LOW: tl.constexpr, FILL: tl.constexpr):
    """The fp32 value whose ordered encoding is key with its low bits set to FILL's:
    the bottom (FILL=False) or top (FILL=True) of the key's bucket."""
    k = key.to(tl.int32, bitcast=True)
    if FILL:
        k = k | LOW
    else:
        k = k & ~LOW
    # Inverse of the map in `_top_k_keyed`: sign bit set (k < 0) was a non-negative float.
    return tl.where(k < 0, k ^ (-2147483647 - 1), ~k).to(tl.float32, bitcast=True)


@triton.jit
def _keys(v, col, LOW: tl.constexpr):
    """The packed keys of `_top_k_keyed`: v [rows, n] fp32 (no NaN) of columns col [n]
    (< LOW + 1, LOW + 1 a power of two) -> uint32 keys, v's order, ties to lower col."""
    bits = v.to(tl.int32, bitcast=True)
    # Negative: all bits flipped; otherwise the sign bit set (INT_MIN as an int32 mask).
    ordered = bits ^ ((bits >> 31) | (-2147483647 - 1))
    return ((ordered | LOW) ^ col[None, :]).to(tl.uint32, bitcast=True)


@triton.jit
def _next_key(prev, key):
    """The largest of each row's keys [rows, n] (uint32) below prev [rows]: with
    t = prev - 1, the least t - key in wrapping arithmetic (keys >= prev wrap past
    every key below it)."""
    t = prev - 1
    return t - tl.min(t[:, None] - key, 1)


@triton.jit
def _keys_apart(upper, lower, LOW: tl.constexpr, ERROR: tl.constexpr):
    """Whether the least value of upper's bucket exceeds the greatest of lower's by
    more than `_top_k_keyed`'s margin (twice the most an exact selection score can
    differ from its approximation). NaN gaps (inf, -inf, NaN buckets): False."""
    lo = _key_value(upper, LOW, False)
    hi = _key_value(lower, LOW, True)
    margin = 2.0 * (ERROR + 2.0 ** -22 * tl.maximum(tl.abs(lo), tl.abs(hi)))
    return lo - hi > margin


@triton.jit
def _top_k_keyed(v, col_ok, E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, ERROR: tl.constexpr):
    """Top-k of every row of v ([rows, BLOCK_E] fp32, no NaN) on packed keys.

    v is the selection score, or one within ERROR (absolute) of it before the
    bias is added. Returns (i_tile [rows, BLOCK_K] int32, unsure [rows] bool):
    where unsure is false, i_tile is exactly what `_top_k_rounds` gives on the
    exact selection scores; where true, it may not be.

    A key is v's fp32 encoding mapped to an unsigned integer of the same order,
    with its low log2(BLOCK_E) bits replaced by BLOCK_E - 1 - column: keys are
    distinct, carry their column, and order like (v, then lower column) except
    inside a bucket (keys equal but for those low bits), where the column
    decides. Round k takes the largest key below the previous round's: with
    t = previous - 1, the minimum of t - key in wrapping unsigned arithmetic
    (keys at or above the previous one wrap past every key below it). One or two
    instructions a score a round, against about six for `_take_best`.

    Exactness. Let a_1 > ... > a_{K+1} be a row's top K + 1 keys (top K when
    K = E), L(a) and U(a) the least and greatest values of a's bucket, and D the
    most an exact selection score can differ from its v: ERROR plus the
    roundings of the bias additions (bounded by 2^-22 |value|, see below). If
    L(a_r) - U(a_{r+1}) > 2 D for every r, then the exact scores of a_1 .. a_K
    are in strictly decreasing order, and every other column, whose key is below
    a_{K+1}, has an exact score below a_K's: the top K, and its order, are the
    exact ones, with no tie for the reference's tie order to break. (A column's
    v and exact score, fl(s~ + b) and fl(s + b), differ by at most ERROR plus
    2^-24 (|v| + |exact|); that bound grows with the value, so the worst column
    under a_{K+1} sits at the top of a_{K+1}'s bucket. The margin allows twice
    what the roundings need, which also covers the rounding of lo - hi itself.) Otherwise
    (near-ties, equal scores, -inf or inf among the top, whose buckets decode to
    NaN) the row is unsure. Padding columns get key 0, below every real key (-inf
    maps above BLOCK_E), and are never reached while K <= E. The scores are never
    -0.0 (sigmoid, softmax, their sums with a bias and the groups' zeros are
    +0.0 or nonzero), whose key would differ from +0.0's though they are equal.
    """
    LOW: tl.constexpr = BLOCK_E - 1
    col = tl.arange(0, BLOCK_E)
    key = tl.where(col_ok[None, :], _keys(v, col, LOW), 0)
    return _top_k_of_keys(key, E, TOP_K, BLOCK_K, LOW, ERROR)


@triton.jit
def _top_k_of_keys(key, N: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                   LOW: tl.constexpr, ERROR: tl.constexpr):
    """The rounds of `_top_k_keyed` on packed keys [rows, n] (uint32, distinct within a
    row, N of them real, the rest 0): (ids [rows, BLOCK_K] int32 of the TOP_K largest
    keys, largest first; unsure [rows] bool, the margin not met between two of the
    TOP_K + 1 largest, the (TOP_K + 1)-th only when TOP_K < N)."""
    kcol = tl.arange(0, BLOCK_K)[None, :]
    prev = tl.max(key, 1)
    # this_keys[:, k] = a_{k+1}, next_keys[:, k] = a_{k+2}: the pairs to check.
    this_keys = tl.where(kcol == 0, prev[:, None], 0)
    next_keys = this_keys
    PEEK: tl.constexpr = 1 if TOP_K < N else 0
    for k in tl.static_range(1, TOP_K + PEEK):
        prev = _next_key(prev, key)
        if k < TOP_K:
            this_keys = tl.where(kcol == k, prev[:, None], this_keys)
        next_keys = tl.where(kcol == k - 1, prev[:, None], next_keys)
    i_tile = (LOW - (this_keys & LOW)).to(tl.int32)
    bad = (kcol < TOP_K + PEEK - 1) & ~_keys_apart(this_keys, next_keys, LOW, ERROR)
    return i_tile, tl.max(bad.to(tl.int32), 1) > 0


@triton.jit
def _shortlist(acc, coln, bias, scol, E: tl.constexpr, TOP_K: tl.constexpr,
               SHORT: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
               ERROR: tl.constexpr, INTERPRET: tl.constexpr):
    """A shortlist of SHORT experts per row that holds the row's exact top TOP_K.

    acc: [rows, BLOCK_N] fp32 logits of experts coln (BLOCK_N of the E, a power of two;
    sigmoid scores, bias for selection, no groups); scol: [1, SHORT], 0 .. SHORT - 1 (in
    the layout the caller wants the keys in: the Gluon kernel has to say). Returns (keys
    [rows, SHORT] uint32, the SHORT best keys, best first, each with its expert's id in
    its low bits as `_top_k_keyed` packs them; unsure [rows] bool).

    The keys are `_top_k_keyed`'s, from the approximate sigmoid, with the global expert
    id in their low bits; SHORT + 1 rounds find a_1 > ... > a_{SHORT+1}. Where
    L(a_K) - U(a_{SHORT+1}) exceeds `_top_k_keyed`'s margin, every expert outside the
    shortlist has K experts of this tile with a strictly greater exact selection score
    (the argument of `_top_k_keyed`, applied to a_K and a_{SHORT+1}): it is in no exact
    top K of the whole row, whatever the other tiles of the row hold. The shortlists of
    a row's tiles then contain its exact top K, which `_shortlist_route_kernel` picks
    from them exactly. Elsewhere the row is unsure (near-ties, ties, non-finite scores
    at a_K or a_{SHORT+1}). SHORT >= BLOCK_N: every expert is listed and no row is
    unsure.
    """
    LOW: tl.constexpr = E - 1
    v = _sigmoid_approx(acc, coln, INTERPRET)
    if HAS_BIAS:
        v = v + bias[None, :]
    key = _keys(_nan_as_neg_inf(v, INTERPRET), coln, LOW)
    prev = tl.max(key, 1)
    keys = tl.where(scol == 0, prev[:, None], 0)
    kth = prev
    PEEK: tl.constexpr = 1 if SHORT < BLOCK_N else 0
    for k in tl.static_range(1, SHORT + PEEK):
        prev = _next_key(prev, key)
        if k < SHORT:
            keys = tl.where(scol == k, prev[:, None], keys)
        if k == TOP_K - 1:
            kth = prev
    if PEEK:
        unsure = ~_keys_apart(kth, prev, LOW, ERROR)
    else:
        unsure = tl.zeros([acc.shape[0]], tl.int1)
    return keys, unsure


@triton.jit
def _shortlist_merged(acc, coln, bias, E: tl.constexpr, TOP_K: tl.constexpr,
                      SHORT: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                      ERROR: tl.constexpr, INTERPRET: tl.constexpr):
    """`_shortlist` by sorting networks (SHORT < BLOCK_N // 4): (keys [rows, 4, SHORT]
    uint32, the row's SHORT best keys, best first, the same in each of the 4 groups;
    unsure [rows, 4] bool, the same in each group).

    The same keys as `_shortlist`; the difference is how the best ones are found. Column
    c = 8 j + 2 q + i goes to group q: in the wgmma accumulator layout the thread with
    lane % 4 == q holds exactly group q of each of its rows. Each group's best SHORT come
    from a bitonic top-k on the thread's own registers (`tl.topk`: compare-exchanges that
    are one unsigned min or max each, no shuffle), then two butterfly steps merge the
    groups: a group takes its partner's sorted list (a shuffle a key), keeps the larger of
    its i-th and the partner's (SHORT - 1 - i)-th key (the SHORT best of both, as a bitonic
    sequence) and sorts that with a bitonic merge. `_shortlist`'s rounds instead scan all
    of the row's keys once a pick: nine scans of BLOCK_N keys for SHORT = 8.

    Margin. Without a (SHORT + 1)-th key the test is L(a_K) - U(a_SHORT) > margin:
    every expert left out has a key below a_SHORT, so its bucket's top is at most
    U(a_SHORT), and `_shortlist`'s argument holds with a_SHORT in place of a_{SHORT+1}.
    a_SHORT itself is listed, a candidate more than the K needed. Where a_{SHORT+1} is
    finite this test is the stricter one (a row it passes, `_shortlist`'s passes too);
    where a_{SHORT+1} is -inf (a block with at most SHORT scores that are not NaN),
    `_shortlist`'s test fails on its bucket (which decodes to NaN) and this one may
    pass, rightly: the argument above holds either way.
    """
    LOW: tl.constexpr = E - 1
    G: tl.constexpr = 4
    M: tl.constexpr = BLOCK_N // G
    tl.static_assert(SHORT < M, "each group must hold more keys than the list")
    tl.static_assert(TOP_K < SHORT, "the margin needs a listed key past the K-th")
    R: tl.constexpr = acc.shape[0]
    v = _sigmoid_approx(acc, coln, INTERPRET)
    if HAS_BIAS:
        v = v + bias[None, :]
    key = _keys(_nan_as_neg_inf(v, INTERPRET), coln, LOW)
    # [R, BLOCK_N] -> [R, j, q, i] -> [R, q, j, i] -> [R, G, M]: group q's keys, in-thread.
    key = tl.permute(tl.reshape(key, (R, BLOCK_N // 8, G, 2)), (0, 2, 1, 3))
    top = tl.topk(tl.reshape(key, (R, G, M)), SHORT)  # [R, G, SHORT], best first
    top = _merge_partners(top, R, 2, 1, SHORT)  # groups q and q ^ 1
    top = _merge_partners(top, R, 1, 2, SHORT)  # then q and q ^ 2
    scol = tl.arange(0, SHORT)[None, None, :]
    # Register picks (a max over one thread's keys, all zero but one).
    kth = tl.max(tl.where(scol == TOP_K - 1, top, 0), 2)
    last = tl.max(tl.where(scol == SHORT - 1, top, 0), 2)
    # Every group holds the same list, so each tests the row's: no shuffle.
    return top, ~_keys_apart(kth, last, LOW, ERROR)


@triton.jit
def _merge_partners(top, R: tl.constexpr, OUTER: tl.constexpr, STEP: tl.constexpr,
                    SHORT: tl.constexpr):
    """top [R, 2 * OUTER * STEP, SHORT] (each group's keys, best first) -> the SHORT best of
    groups g and g ^ STEP in both, best first (`_shortlist_merged`)."""
    t = tl.reshape(top, (R, OUTER, 2, STEP, SHORT))
    partner = t ^ tl.xor_sum(t, 2, keep_dims=True)
    t = tl.maximum(t, tl.flip(partner, 4))  # bitonic: falls, then rises
    return tl.reshape(tl.bitonic_merge(t, descending=True), (R, 2 * OUTER * STEP, SHORT))


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
    # row takes a warp reduction (sm_90 compile-only, 64 routes on 2 warps: 64 REDUX
    # and 12 barriers an iteration of the count loop, against none and 7).
    same = (key[:, None] == key[None, :]) & (r[:, None] < r[None, :])
    return tl.sum(same.to(tl.int32), 0)


@triton.jit
def _logits_tile(row_base, ok, col, col_ok, stride_le):
    """The [rows, BLOCK_E] logits at row_base[r] + col * stride_le: rows not ok read
    0.0 (no NaN arithmetic on them), padding columns -inf (a score of 0 under either
    score function)."""
    x = tl.load(row_base[:, None] + col[None, :] * stride_le,
                mask=ok[:, None] & col_ok[None, :], other=0.0)
    return tl.where(col_ok[None, :], x, float("-inf"))


@triton.jit
def _top_k_exact(x, row_max, row_den, bias, x_sel, i_tile, col, col_ok, E: tl.constexpr,
                 group_size, TOP_K: tl.constexpr, SOFTMAX: tl.constexpr,
                 HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_G: tl.constexpr, FROM_TILE: tl.constexpr, INTERPRET: tl.constexpr):
    """The exact selection scores of x, then TOP_K exact rounds: (x_sel, i_tile)."""
    sel = _selection(x, row_max, row_den, bias, col, E, group_size, SOFTMAX, HAS_BIAS,
                     NUM_GROUPS, TOPK_GROUPS, BLOCK_ROWS, BLOCK_E, BLOCK_G, INTERPRET)
    # NaN marks "not selectable": padding columns now, taken experts later.
    ms = tl.where(col_ok[None, :], sel, float("nan"))
    return _top_k_rounds(ms, x, x_sel, i_tile, E, TOP_K, BLOCK_E, BLOCK_K, FROM_TILE,
                         INTERPRET)


@triton.jit
def _route_rows(
    x, rows, row_base, h, bias_ptr, probs_ptr, indices_ptr, counts_ptr,
    S, NB, group_size, norm_eps, route_scale, stride_le,
    E: tl.constexpr, TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROUTE_NORM: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, COUNT_T: tl.constexpr, FROM_TILE: tl.constexpr,
    INTERPRET: tl.constexpr, KEYED: tl.constexpr = True,
):
    """Scores, selection and probabilities of one [BLOCK_ROWS, BLOCK_E] logits tile.

    The probability of a picked expert is the score of its logit, read back from
    `row_base + e * stride_le` (the logits in memory), or with FROM_TILE from the
    tile x itself, which then stays live in registers through the top-k rounds.

    COUNT_T > 0: also adds each pick to counts[h, s // COUNT_T, e] ([H, NB, E]
    int32, zeroed before the launch): the layout's per-block expert counts, so
    that `triton_sort_routes` can skip its count step. Integer atomic adds
    commute, so the counts do not depend on the order programs run in.
    """
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
    bias = tl.zeros([BLOCK_E], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h * E + col, mask=col_ok, other=0.0)

    x_sel = tl.zeros([BLOCK_ROWS, BLOCK_K], tl.float32)
    i_tile = tl.zeros([BLOCK_ROWS, BLOCK_K], tl.int32)
    if KEYED and not FROM_TILE and TOP_K <= 16:
        # Rounds on packed keys, a few instructions a score; a program with a row
        # they cannot vouch for redoes its tile with the exact rounds.
        if not SOFTMAX and NUM_GROUPS == 1:
            # Sigmoid: the keys come from an approximate score (a margin in
            # `_top_k_keyed` covers its error); the exact one is computed for the
            # K picks only, below, as it always was.
            v = _sigmoid_approx(x, col, INTERPRET)
            if HAS_BIAS:
                v = v + bias[None, :]
            i_tile, unsure = _top_k_keyed(_nan_as_neg_inf(v, INTERPRET), col_ok, E, TOP_K,
                                          BLOCK_E, BLOCK_K, SIGMOID_APPROX_ERROR)
        else:
            sel = _selection(x, row_max, row_den, bias, col, E, group_size, SOFTMAX,
                             HAS_BIAS, NUM_GROUPS, TOPK_GROUPS, BLOCK_ROWS, BLOCK_E, BLOCK_G,
                             INTERPRET)
            i_tile, unsure = _top_k_keyed(sel, col_ok, E, TOP_K, BLOCK_E, BLOCK_K, 0.0)
        # Rows past S (read as zeros: tied scores) need no exact redo.
        if tl.max((unsure & row_ok).to(tl.int32), 0) > 0:
            # The logits again (L1/L2-hot), rather than keeping the tile live in
            # registers through the rounds for this rare branch.
            x = _logits_tile(row_base, row_ok, col, col_ok, stride_le)
            x_sel, i_tile = _top_k_exact(x, row_max, row_den, bias, x_sel, i_tile, col, col_ok,
                                         E, group_size, TOP_K, SOFTMAX, HAS_BIAS, NUM_GROUPS,
                                         TOPK_GROUPS, BLOCK_ROWS, BLOCK_E, BLOCK_K, BLOCK_G,
                                         FROM_TILE, INTERPRET)
    else:
        x_sel, i_tile = _top_k_exact(x, row_max, row_den, bias, x_sel, i_tile, col, col_ok, E,
                                     group_size, TOP_K, SOFTMAX, HAS_BIAS, NUM_GROUPS,
                                     TOPK_GROUPS, BLOCK_ROWS, BLOCK_E, BLOCK_K, BLOCK_G,
                                     FROM_TILE, INTERPRET)

    # The probabilities come from the unbiased scores: recompute them from the
    # picked logits, gathered once for all K (L1/L2-cached loads) unless FROM_TILE.
    if not FROM_TILE:
        out_ok = row_ok[:, None] & (kcol < TOP_K)[None, :]
        x_sel = tl.load(row_base[:, None] + i_tile * stride_le, mask=out_ok, other=0.0)
    _route_output(x_sel, i_tile, rows, h, row_max, row_den, probs_ptr, indices_ptr, counts_ptr,
                  S, NB, norm_eps, route_scale, E, TOP_K, SOFTMAX, ROUTE_NORM, BLOCK_ROWS,
                  BLOCK_K, COUNT_T, INTERPRET)


@triton.jit
def _route_output(x_sel, i_tile, rows, h, row_max, row_den, probs_ptr, indices_ptr,
                  counts_ptr, S, NB, norm_eps, route_scale, E: tl.constexpr,
                  TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, ROUTE_NORM: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, COUNT_T: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Probabilities of the picks (logits x_sel, experts i_tile: [BLOCK_ROWS, BLOCK_K],
    selection order), normalised and scaled, stored with the indices; with COUNT_T > 0
    each pick is also added to counts[h, s // COUNT_T, e] (see `_route_rows`)."""
    kcol = tl.arange(0, BLOCK_K)
    row_ok = rows < S
    out_ok = row_ok[:, None] & (kcol < TOP_K)[None, :]
    p_tile = _score(x_sel, row_max[:, None], row_den[:, None], SOFTMAX, INTERPRET)
    # Left to right in selection order, as the reference sums (column k alone: exact).
    total = tl.zeros([BLOCK_ROWS], tl.float32)
    if TOP_K <= 16:
        for k in tl.static_range(TOP_K):
            total = total + tl.sum(tl.where(kcol[None, :] == k, p_tile, 0.0), 1)
    else:
        for k in range(TOP_K):
            total = total + tl.sum(tl.where(kcol[None, :] == k, p_tile, 0.0), 1)

    if ROUTE_NORM:
        # clamp_min that keeps NaN (tl.maximum would turn a NaN total into eps).
        denom = tl.where(total < norm_eps, norm_eps, total)
        p_tile = tl.math.div_rn(p_tile, denom[:, None])
    p_tile = p_tile * route_scale

    out_off = (h.to(tl.int64) * S + rows.to(tl.int64))[:, None] * TOP_K + kcol[None, :]
    tl.store(probs_ptr + out_off, p_tile, mask=out_ok)
    tl.store(indices_ptr + out_off, i_tile.to(tl.int64), mask=out_ok)
    if COUNT_T > 0:
        # i_tile lies in [0, E) whatever the logits (NaN and inf rows included, see
        # `_take_best`), and rows past S are masked: every add lands inside counts.
        blk = (h * NB + rows // COUNT_T).to(tl.int64)
        tl.atomic_add(counts_ptr + blk[:, None] * E + i_tile,
                      tl.full([BLOCK_ROWS, BLOCK_K], 1, tl.int32), mask=out_ok, sem="relaxed")


@triton.jit
def _route_kernel(
    logits_ptr, stride_lh, stride_ls, stride_le,  # logits [H, S, E] fp32
    bias_ptr,  # [H, E] fp32 contiguous (unused unless HAS_BIAS)
    probs_ptr, indices_ptr,  # outputs [H, S, K] fp32, int64, contiguous
    counts_ptr,  # [H, NB, E] int32, zeroed, added into (unused unless COUNT_T > 0)
    S, NB, group_size, norm_eps, route_scale,
    E: tl.constexpr, TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROUTE_NORM: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, ITERS: tl.constexpr, INTERPRET: tl.constexpr,
    COUNT_T: tl.constexpr = 0, KEYED: tl.constexpr = True,
):
    """Top-k routing of ITERS blocks of BLOCK_ROWS tokens of one head.

    Launch grid: (cdiv(S, BLOCK_ROWS * ITERS), H). Program (b, h) owns tokens
    [b * BLOCK_ROWS * ITERS, (b + 1) * BLOCK_ROWS * ITERS) of head h: it reads
    their logits once and writes their probs and indices ([rows, K] each).
    It walks them BLOCK_ROWS at a time, loading the next tile before working
    on the current one (ITERS > 1 measured no faster on an H200: the launcher
    uses ITERS = 1; the loop stays for tuning on other parts). COUNT_T > 0:
    it also counts its picks per block of COUNT_T tokens (see `_route_rows`).

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
    x = _logits_tile(row_base, rows < S, col, col_ok, stride_le)
    for it in range(ITERS):
        next_rows = rows + BLOCK_ROWS
        next_base = head_base + next_rows.to(tl.int64) * stride_ls
        next_ok = (next_rows < S) & (it + 1 < ITERS)
        x_next = _logits_tile(next_base, next_ok, col, col_ok, stride_le)
        _route_rows(x, rows, row_base, h, bias_ptr, probs_ptr, indices_ptr, counts_ptr,
                    S, NB, group_size, norm_eps, route_scale, stride_le,
                    E, TOP_K, SOFTMAX, HAS_BIAS, ROUTE_NORM, NUM_GROUPS, TOPK_GROUPS,
                    BLOCK_ROWS, BLOCK_E, BLOCK_K, BLOCK_G, COUNT_T, False, INTERPRET, KEYED)
        x = x_next
        rows = next_rows
        row_base = next_base


@triton.jit
def _shortlist_route_kernel(
    short_ptr,  # [H, S, C] int32: the logits kernel's shortlists, packed keys (0: unsure)
    logits_ptr,  # [H, S, E] fp32 contiguous
    bias_ptr,  # [H, E] fp32 contiguous (unused unless HAS_BIAS)
    probs_ptr, indices_ptr,  # outputs [H, S, K] fp32, int64, contiguous
    counts_ptr,  # [H, NB, E] int32, zeroed, added into (unused unless COUNT_T > 0)
    S, NB, norm_eps, route_scale,
    E: tl.constexpr, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_NORM: tl.constexpr,
    C: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    FALLBACK_ROWS: tl.constexpr, INTERPRET: tl.constexpr, COUNT_T: tl.constexpr = 0,
    ERROR: tl.constexpr = SIGMOID_APPROX_ERROR,
):
    """Sigmoid routing (no groups) of BLOCK_ROWS tokens of one head from their shortlists.

    Launch grid: (cdiv(S, BLOCK_ROWS), H). Each row's C candidates (the shortlists of
    its column blocks, see `_shortlist`) hold its exact top K, and come as the logits
    kernel's packed keys (`_route_listed`): the picks, order and probabilities of
    `_route_rows` on the whole row, bitwise, reading K logits a row where the keys
    order the picks, C where they do not, instead of E. A program with an unsure row
    (a column block's keys 0) walks its rows FALLBACK_ROWS at a time, and routes those
    with an unsure row among them from their whole logits with the exact rounds
    (`_route_rows`). ERROR: the approximate sigmoid's bound, as in `_shortlist` (tests
    lower it to show the margin is needed). E is a power of two (the keys' low bits).
    """
    tl.static_assert((E & (E - 1)) == 0, "shortlist keys need a power-of-two E")
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = b * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    ccol = tl.arange(0, C)
    hs = h.to(tl.int64) * S + rows.to(tl.int64)
    # Rows past S read keys of 1 (not 0, the unsure mark): computed with the others,
    # their loads and outputs masked.
    keys = tl.load(short_ptr + hs[:, None] * C + ccol[None, :], mask=(rows < S)[:, None],
                   other=1).to(tl.uint32, bitcast=True)
    if tl.max(tl.max((keys == 0).to(tl.int32), 1), 0) > 0:
        # FALLBACK_ROWS rows at a time: the whole logits only for those with an unsure row.
        col = tl.arange(0, BLOCK_E)
        col_ok = col < E
        for r0 in range(0, BLOCK_ROWS, FALLBACK_ROWS):
            fr = b * BLOCK_ROWS + r0 + tl.arange(0, FALLBACK_ROWS)
            fhs = h.to(tl.int64) * S + fr.to(tl.int64)
            fkeys = tl.load(short_ptr + fhs[:, None] * C + ccol[None, :],
                            mask=(fr < S)[:, None], other=1).to(tl.uint32, bitcast=True)
            if tl.max(tl.max((fkeys == 0).to(tl.int32), 1), 0) > 0:
                fbase = logits_ptr + fhs * E
                x = _logits_tile(fbase, fr < S, col, col_ok, 1)
                _route_rows(x, fr, fbase, h, bias_ptr, probs_ptr, indices_ptr, counts_ptr,
                            S, NB, E, norm_eps, route_scale, 1,
                            E, TOP_K, False, HAS_BIAS, ROUTE_NORM, 1, 1,
                            FALLBACK_ROWS, BLOCK_E, BLOCK_K, 1, COUNT_T, False, INTERPRET, False)
            else:
                _route_listed(fkeys, fr, h, logits_ptr, bias_ptr, probs_ptr, indices_ptr,
                              counts_ptr, S, NB, norm_eps, route_scale, E, TOP_K, HAS_BIAS,
                              ROUTE_NORM, C, FALLBACK_ROWS, BLOCK_K, COUNT_T, ERROR, INTERPRET)
    else:
        _route_listed(keys, rows, h, logits_ptr, bias_ptr, probs_ptr, indices_ptr,
                      counts_ptr, S, NB, norm_eps, route_scale, E, TOP_K, HAS_BIAS, ROUTE_NORM,
                      C, BLOCK_ROWS, BLOCK_K, COUNT_T, ERROR, INTERPRET)


@triton.jit
def _route_listed(keys, rows, h, logits_ptr, bias_ptr, probs_ptr, indices_ptr, counts_ptr,
                  S, NB, norm_eps, route_scale, E: tl.constexpr, TOP_K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, ROUTE_NORM: tl.constexpr, C: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, COUNT_T: tl.constexpr,
                  ERROR: tl.constexpr, INTERPRET: tl.constexpr):
    """Sigmoid routing of rows from their C listed experts, given as packed keys [rows, C]
    (uint32; no list unsure, rows past S masked).

    The rounds of `_top_k_keyed` on the keys first: where they show the K + 1 largest
    keys apart by the margin, the K largest are the exact picks in the exact order (the
    lists hold the row's exact top K, `_shortlist`; `_top_k_keyed`'s argument within
    them), and only their K logits are read. Rows where they do not (near-ties among the
    picks) read all C listed logits and take the exact rounds among them
    (`_listed_picks`). Either way the picks are those of the exact rounds on the whole
    row, and the probabilities come from the picked logits.
    """
    LOW: tl.constexpr = E - 1
    row_ok = rows < S
    kcol = tl.arange(0, BLOCK_K)[None, :]
    hs = h.to(tl.int64) * S + rows.to(tl.int64)
    i_tile, tied = _top_k_of_keys(keys, C, TOP_K, BLOCK_K, LOW, ERROR)
    tied = tied & row_ok  # (rows past S: equal keys, never apart)
    x_sel = tl.load(logits_ptr + hs[:, None] * E + i_tile,
                    mask=(row_ok & ~tied)[:, None] & (kcol < TOP_K), other=0.0)
    if tl.max(tied.to(tl.int32), 0) > 0:
        ids = (LOW - (keys & LOW)).to(tl.int32)
        i_ex, x_ex = _listed_picks(ids, hs, h, logits_ptr, bias_ptr, row_ok & tied, E, TOP_K,
                                   HAS_BIAS, BLOCK_ROWS, BLOCK_K, INTERPRET)
        i_tile = tl.where(tied[:, None], i_ex, i_tile)
        x_sel = tl.where(tied[:, None], x_ex, x_sel)
    zero = tl.zeros([BLOCK_ROWS], tl.float32)
    _route_output(x_sel, i_tile, rows, h, zero, zero, probs_ptr, indices_ptr, counts_ptr,
                  S, NB, norm_eps, route_scale, E, TOP_K, False, ROUTE_NORM, BLOCK_ROWS,
                  BLOCK_K, COUNT_T, INTERPRET)


@triton.jit
def _listed_picks(ids, hs, h, logits_ptr, bias_ptr, load, E: tl.constexpr,
                  TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                  BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """The exact rounds of `_take_best` among the listed experts ids [rows, C] (distinct
    within a row) of rows hs (h * S + s), their logits read where load [rows]: exact
    selection scores, ties to the lowest expert id, NaN marking a taken one. Returns
    (picks [rows, BLOCK_K] int32, their logits), meaningful where load."""
    kcol = tl.arange(0, BLOCK_K)
    xc = tl.load(logits_ptr + hs[:, None] * E + ids, mask=load[:, None], other=0.0)
    sel = _score(xc, 0.0, 0.0, False, INTERPRET)
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + h * E + ids)
    ms = _nan_as_neg_inf(sel, INTERPRET)
    x_sel = tl.zeros([BLOCK_ROWS, BLOCK_K], tl.float32)
    i_tile = tl.zeros([BLOCK_ROWS, BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):
        m = tl.max(_nan_to_neg_inf(ms, INTERPRET), 1)
        idx = tl.minimum(tl.min(tl.where(ms == m[:, None], ids, E), 1), E - 1)
        picked = ids == idx[:, None]
        ms = tl.where(picked, float("nan"), ms)
        x_sel = tl.where(kcol[None, :] == k, tl.sum(tl.where(picked, xc, 0.0), 1)[:, None],
                         x_sel)
        i_tile = tl.where(kcol[None, :] == k, idx[:, None], i_tile)
    return i_tile, x_sel


@triton.jit
def _truncate_to_bf16(v):
    """v with the low 16 bits of its fp32 encoding cleared: the top 8 significant
    bits, exactly representable in bfloat16 (rounded toward zero)."""
    return (v.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _split_weight_kernel(w_ptr, parts_ptr, N, BLOCK: tl.constexpr):
    """parts[0] + parts[1] + parts[2] == w exactly, each part bfloat16.

    Launch grid: (cdiv(N, BLOCK),); program i owns elements [i * BLOCK, (i + 1) * BLOCK)
    of w [N] fp32 and writes them to parts [3, N] bf16. A finite fp32 w has a
    24-bit significand; w1 keeps its top 8 bits (truncation: never rounds up to
    inf), the residual w - w1 is exact (Sterbenz: same sign and binade) and has
    at most 16 significant bits, w2 keeps its top 8, and w3 = the rest has at
    most 8, so every step is exact and every part converts to bf16 exactly
    (whatever rounding the conversion uses). Exact as long as the residuals stay
    in fp32's normal range (|w| >= 2^-110); below, they lose bits under 2^-133.
    Non-finite w: w1 = w, w2 = w3 = 0, so inf and NaN weights give the logits
    x * w would give. (An infinite x gives NaN where a part is 0, inf * 0, where
    fp32 gives +-inf: that row's logits are not finite either way.)
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    finite = tl.abs(w) < float("inf")  # false for NaN too
    w1 = tl.where(finite, _truncate_to_bf16(w), w)
    r = tl.where(finite, w - w1, 0.0)
    w2 = _truncate_to_bf16(r)
    w3 = r - w2
    tl.store(parts_ptr + offs, w1.to(tl.bfloat16), mask=ok)
    tl.store(parts_ptr + N + offs, w2.to(tl.bfloat16), mask=ok)
    tl.store(parts_ptr + 2 * N + offs, w3.to(tl.bfloat16), mask=ok)


@triton.jit
def _dot_exact(x, w, acc, INTERPRET: tl.constexpr):
    """acc + x @ w for bf16 x and w: products exact in fp32, fp32 accumulation.

    On the GPU a bf16 tensor-core dot (wgmma / mma with fp32 accumulators). The
    interpreter's bf16 arithmetic is wrong: there both go up to fp32 first, and
    an fp32 "ieee" dot gives the same exact products.
    """
    if INTERPRET:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(x, w, acc)


@triton.jit
def _write_shortlist(acc, s0, h, n, bias_ptr, short_ptr, S, E: tl.constexpr,
                     TOP_K: tl.constexpr, SHORT: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ERROR: tl.constexpr,
                     INTERPRET: tl.constexpr, MERGED: tl.constexpr = False):
    """short[h, s, n * SHORT + j] (int32): the packed keys of the shortlist (`_shortlist`,
    or `_shortlist_merged` if MERGED) of row s of the logits tile acc (tokens
    [s0, s0 + BLOCK_S) of head h, column block n), best first, or 0 throughout where the
    row is unsure (0 is no expert's key)."""
    tl.static_assert((E & (E - 1)) == 0, "shortlist keys need a power-of-two E")
    coln = n * BLOCK_N + tl.arange(0, BLOCK_N)
    bias_n = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias_n = tl.load(bias_ptr + h * E + coln)
    NSPLIT: tl.constexpr = E // BLOCK_N
    if MERGED:
        keys, unsure = _shortlist_merged(acc, coln, bias_n, E, TOP_K, SHORT, BLOCK_N,
                                         HAS_BIAS, ERROR, INTERPRET)
        # Every group holds the list: group 0 stores it.
        rows = s0 + tl.arange(0, BLOCK_S)[:, None, None]
        group = tl.arange(0, 4)[None, :, None]
        so = ((h.to(tl.int64) * S + rows) * NSPLIT + n) * SHORT + \
            tl.arange(0, SHORT)[None, None, :]
        tl.store(short_ptr + tl.broadcast_to(so, (BLOCK_S, 4, SHORT)),
                 tl.where(unsure[:, :, None], 0, keys).to(tl.int32, bitcast=True),
                 mask=(rows < S) & (group == 0))
    else:
        scol = tl.arange(0, SHORT)[None, :]
        keys, unsure = _shortlist(acc, coln, bias_n, scol, E, TOP_K, SHORT, BLOCK_N,
                                  HAS_BIAS, ERROR, INTERPRET)
        # Rows from a fresh arange: in the layout of the keys, not of acc's rows (sm_90: the
        # latter took ~50 registers more in a version that also read logits back here).
        rows = s0 + tl.arange(0, BLOCK_S)
        so = ((h.to(tl.int64) * S + rows) * NSPLIT + n)[:, None] * SHORT + scol
        tl.store(short_ptr + so,
                 tl.where(unsure[:, None], 0, keys).to(tl.int32, bitcast=True),
                 mask=(rows < S)[:, None])


@triton.jit
def _logits_route_kernel(
    x_desc,  # x_heads as [S, H * D] bf16: a tensor descriptor, blocks [BLOCK_S, BLOCK_D]
    w_desc,  # router weight parts [3 * H * E, D] bf16 (w1, w2, w3): blocks [BLOCK_N, BLOCK_D]
    logits_ptr,  # output [H, S, E] fp32 contiguous (written if WRITE_LOGITS)
    bias_ptr,  # [H, E] fp32 contiguous (unused unless HAS_BIAS)
    probs_ptr, indices_ptr,  # outputs [H, S, K] fp32, int64, contiguous
    counts_ptr,  # [H, NB, E] int32 (unused unless COUNT_T > 0)
    S, H, NB, group_size, norm_eps, route_scale,
    E: tl.constexpr, D: tl.constexpr, TOP_K: tl.constexpr, SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr, ROUTE_NORM: tl.constexpr, NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, WRITE_LOGITS: tl.constexpr,
    FROM_TILE: tl.constexpr, INTERPRET: tl.constexpr, ROUTE: tl.constexpr = True,
    COUNT_T: tl.constexpr = 0, HALF_STORES: tl.constexpr = False, BLOCK_N: tl.constexpr = 0,
    l_desc=None, short_ptr=None, SHORT: tl.constexpr = 0, MERGED: tl.constexpr = False,
):
    """Router logits and top-k routing of BLOCK_S tokens of one head, in one pass.

    ROUTE=False: the logits alone (written; probs, indices untouched), for
    `_route_kernel` to route afterwards (LogitsRouteConfig.split); with
    COUNT_T > 0 it also zeroes the rows of counts [H, NB, E] of the blocks of
    COUNT_T tokens that start in its tile, which `_route_kernel` then adds
    into (no memset launch). ROUTE=True with COUNT_T > 0: the program adds its
    picks to counts itself (zeroed by the launcher), see `_route_rows`. ROUTE=False
    with SHORT > 0: the tile's shortlists too (`_write_shortlist`; MERGED picks the
    sorting networks' `_shortlist_merged` over `_shortlist`'s rounds).

    Launch grid: (cdiv(S, BLOCK_S), H * (E // BLOCK_N)); BLOCK_N (a power of two
    dividing E) is E unless ROUTE=False. Program (b, h) (BLOCK_N = E) owns tokens
    [b * BLOCK_S, (b + 1) * BLOCK_S) of head h: it computes their [BLOCK_S, E]
    logits tile logits[s, e] = sum_d x[s, h, d] * w[h*E + e, d] on tensor cores,
    keeps it in registers, and routes it with the same code as `_route_kernel`
    (`_route_rows`), writing probs and indices ([BLOCK_S, K] each) and, with
    WRITE_LOGITS, the fp32 logits tile (for the backward, and to gather the
    picked logits from unless FROM_TILE). Bulk (TMA) copies bring the x and
    weight slices: no per-element addresses in registers, and rows past S read
    as zeros (logits 0, no NaN arithmetic, nothing stored for them).

    Precision (SPEC section 2, "computed in fp32, x upcast to fp32"): the fp32
    weight is split exactly into three bf16 parts (`_split_weight_kernel`), so
    w = w1 + w2 + w3 with no rounding; x is bf16, so every product x * w_i is
    exact in fp32 (8 x 8 significant bits), and the logit is an fp32 sum of the
    exact products x_d * w_d, each split into three terms. That is the fp32 dot
    product of the upcast x and w: only the order of the fp32 accumulation (and
    the tensor cores' rounding of its additions, which truncate) differs from
    cuBLAS's fp32 GEMM. So the logits are not bitwise cuBLAS's, but neither are
    cuBLAS's own across GPUs and library versions (its kernel, hence its
    summation order, is chosen per shape). The small parts go first (all of
    x @ w3 and x @ w2 over D, then x @ w1): their rounding errors are at 2^-8 of
    the logits' scale, so the result carries the rounding of one fp32 pass over
    D, as a plain fp32 dot product does (the interpreter: within D * 2^-24 *
    sum |x w| of the exact value, checked by the tests). What issue 4 asks, and
    the tests and benchmarks/bench_routing.py check against `route_reference`
    on torch's fp32 logits and on float64 logits: the same indices wherever the
    selection scores of adjacent picks (top K + 1) differ by more than 1e-6
    relative, probabilities within 1e-6 relative (for softmax, and the smallest
    sigmoid probabilities of K = E rows, within twice torch's own fp32 error).

    E is a power of two (the tile has no padding columns); BLOCK_D divides D.
    """
    b = tl.program_id(0)
    # ROUTE=False may split the experts: program (b, h * (E // BLOCK_N) + n) owns columns
    # [n * BLOCK_N, (n + 1) * BLOCK_N) of the tile. Routing needs whole rows: BLOCK_N == E.
    tl.static_assert(BLOCK_N > 0, "BLOCK_N must be passed (E, or a share of E when split)")
    NSPLIT: tl.constexpr = E // BLOCK_N
    h = tl.program_id(1) // NSPLIT
    n0 = (tl.program_id(1) % NSPLIT) * BLOCK_N
    s0 = b * BLOCK_S
    acc = tl.zeros([BLOCK_S, BLOCK_N], dtype=tl.float32)
    # x arrives as a 2D [BLOCK_S, BLOCK_D] box of [S, H * D], so both wgmma operands are
    # read from shared memory. A [BLOCK_S, 1, BLOCK_D] box of [S, H, D] needed a reshape,
    # after which Triton 3.6 kept x in registers as the A operand, and its pipelined loop
    # loaded the next x into those registers while the previous step's second wgmma was
    # still reading them (undefined in PTX): on an H200, wrong logits in about one call in
    # three at S = 32768 with 3 stages (NOTES.md, routing v8).
    for d0 in range(0, D, BLOCK_D):
        xt = x_desc.load([s0, h * D + d0])
        acc = _dot_exact(xt, w_desc.load([(2 * H + h) * E + n0, d0]).T, acc, INTERPRET)
        acc = _dot_exact(xt, w_desc.load([(H + h) * E + n0, d0]).T, acc, INTERPRET)
    for d0 in range(0, D, BLOCK_D):
        xt = x_desc.load([s0, h * D + d0])
        acc = _dot_exact(xt, w_desc.load([h * E + n0, d0]).T, acc, INTERPRET)

    rows = s0 + tl.arange(0, BLOCK_S)
    row_ok = rows < S
    # int64: H * S * E passes 2**31 at long sequences.
    row_base = logits_ptr + (h.to(tl.int64) * S + rows.to(tl.int64)) * E + n0
    if not ROUTE:
        if l_desc is not None:
            # Bulk (TMA) stores from shared memory: the warps hand the tile over and go
            # on, instead of holding their registers until each st.global has read them.
            # l_desc is logits [H, S, E] in [1, BLOCK_S, N] boxes: rows past S are clipped.
            if HALF_STORES and BLOCK_N >= 32:
                lo, hi = acc.reshape(BLOCK_S, 2, BLOCK_N // 2).permute(0, 2, 1).split()
                l_desc.store([h, s0, n0], lo.reshape(1, BLOCK_S, BLOCK_N // 2))
                l_desc.store([h, s0, n0 + BLOCK_N // 2], hi.reshape(1, BLOCK_S, BLOCK_N // 2))
            else:
                l_desc.store([h, s0, n0], acc.reshape(1, BLOCK_S, BLOCK_N))
        elif HALF_STORES and BLOCK_N >= 32:
            # Two stores of half the columns: the layout change before each store goes
            # through half the shared memory (in the wgmma layout a thread holds columns
            # of both halves, so the split itself moves nothing).
            lo, hi = acc.reshape(BLOCK_S, 2, BLOCK_N // 2).permute(0, 2, 1).split()
            half = tl.arange(0, BLOCK_N // 2)
            tl.store(row_base[:, None] + half[None, :], lo, mask=row_ok[:, None])
            tl.store(row_base[:, None] + (BLOCK_N // 2 + half)[None, :], hi,
                     mask=row_ok[:, None])
        else:
            tl.store(row_base[:, None] + tl.arange(0, BLOCK_N)[None, :], acc,
                     mask=row_ok[:, None])
        if COUNT_T > 0:
            # Block j of the counts is cleared by the programs whose tiles hold token
            # j * COUNT_T, each its own columns.
            NJ: tl.constexpr = (BLOCK_S + COUNT_T - 1) // COUNT_T  # powers of two: >= 1
            first = s0 + tl.arange(0, NJ) * COUNT_T
            clear = (first % COUNT_T == 0) & (first < S)
            row = (h * NB + first // COUNT_T).to(tl.int64)
            tl.store(counts_ptr + row[:, None] * E + n0 + tl.arange(0, BLOCK_N)[None, :],
                     tl.zeros([NJ, BLOCK_N], tl.int32), mask=clear[:, None])
        if SHORT > 0:
            _write_shortlist(acc, s0, h, tl.program_id(1) % NSPLIT, bias_ptr, short_ptr, S, E,
                             TOP_K, SHORT, BLOCK_S, BLOCK_N, HAS_BIAS, SIGMOID_APPROX_ERROR,
                             INTERPRET, MERGED)
    else:
        tl.static_assert(BLOCK_N == E, "routing needs whole rows")
        if WRITE_LOGITS:
            tl.store(row_base[:, None] + tl.arange(0, E)[None, :], acc, mask=row_ok[:, None])
            if not FROM_TILE:
                # The gathers of `_take_best` read logits that other threads wrote.
                tl.debug_barrier()
        _route_rows(acc, rows, row_base, h, bias_ptr, probs_ptr, indices_ptr, counts_ptr,
                    S, NB, group_size, norm_eps, route_scale, 1,
                    E, TOP_K, SOFTMAX, HAS_BIAS, ROUTE_NORM, NUM_GROUPS, TOPK_GROUPS,
                    BLOCK_S, E, BLOCK_K, BLOCK_G, COUNT_T, FROM_TILE, INTERPRET)


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
    # A loop, not unrolled: one sub-block's registers (64 for 64 slots, against 222
    # unrolled on sm_90), so many programs share an SM and hide each other's load latency.
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


def _route_config(S: int, E: int, block_rows: int | None, num_warps: int | None,
                  iters: int | None):
    """(BLOCK_ROWS, BLOCK_E, num_warps, ITERS) of the routing kernel.

    A warp covers 128 fp32 columns (32 lanes x 16-byte loads); a wider row
    would be split across warps, so E > 128 gets one warp per program. About
    16 scores per thread: few registers, many programs per SM (2 rows of
    256 on packed keys: 56 registers, 0.20 ms at S=32768 on an H200, against
    0.21-0.46 ms for 4 or 8 rows and 0.25 for 1; the exact rounds: 0.34).
    ITERS = 1: 2 or 4 tiles a program, the next one loaded first, measured no
    faster (0.197-0.201 ms; NOTES.md routing v9).
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
    count_block_t: int | None = None,
    block_rows: int | None = None,
    num_warps: int | None = None,
    iters: int | None = None,
    keyed: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Triton twin of `reference.route_reference` (one launch, no host sync).

    logits: [H, S, E] float32 (any strides; float16/bfloat16 are upcast)
    expert_bias: [H, E] or [H*E] or None, selection only
    returns probs [H, S, K] float32, indices [H, S, K] int64.

    Same semantics as the reference, NaN included: a NaN selection score
    counts as -inf, indices always lie in [0, E), other rows are untouched.
    Arguments are otherwise assumed valid (`routing.route` checks them);
    block_rows, num_warps and iters override the tile choice (tests, tuning);
    keyed=False takes the exact top-k rounds for every row instead of the packed
    keys (`_top_k_keyed`): the same results, bitwise, more instructions.

    count_block_t (a power of two, usually `layout_block_t(top_k)`): also return
    counts [H, cdiv(S, count_block_t), E] int32, the routes of each expert per
    block of count_block_t tokens of a head, counted by the kernel as it picks
    (atomic integer adds: deterministic), for
    `triton_sort_routes(..., block_counts=counts, block_t=count_block_t)`, which
    then skips its count step. One memset more (a zeroed buffer).
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
    counts = None
    if count_block_t is not None:
        counts = _new_block_counts("triton_route", H, S, E, count_block_t, device, zeroed=True)
    if H and S:
        _launch_route(logits, top_k, score_func, expert_bias, route_norm, norm_eps, route_scale,
                      num_groups, topk_groups, probs, indices, counts, count_block_t or 0,
                      block_rows, num_warps, iters, keyed)
    return (probs, indices) if counts is None else (probs, indices, counts)


def _launch_route(logits, top_k, score_func, expert_bias, route_norm, norm_eps, route_scale,
                  num_groups, topk_groups, probs, indices, counts, count_t,
                  block_rows=None, num_warps=None, iters=None, keyed=True) -> None:
    """`_route_kernel` on fp32 logits [H, S, E] into probs and indices (and, count_t > 0,
    adding into counts [H, cdiv(S, count_t), E], zeroed by the caller)."""
    H, S, E = logits.shape
    BLOCK_ROWS, BLOCK_E, warps, ITERS = _route_config(S, E, block_rows, num_warps, iters)
    bias = _bias_arg(expert_bias, H, E, logits)
    _route_kernel[(triton.cdiv(S, BLOCK_ROWS * ITERS), H)](
        logits, *logits.stride(), bias, probs, indices,
        probs if counts is None else counts,  # a placeholder pointer when not counting
        S, 0 if counts is None else counts.shape[1], max(E // num_groups, 1),
        float(norm_eps), float(route_scale),
        E=E, TOP_K=top_k, SOFTMAX=score_func == "softmax", HAS_BIAS=expert_bias is not None,
        ROUTE_NORM=bool(route_norm), NUM_GROUPS=num_groups, TOPK_GROUPS=topk_groups,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_E=BLOCK_E, BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_G=triton.next_power_of_2(num_groups), ITERS=ITERS, INTERPRET=_interpreting(),
        COUNT_T=count_t if counts is not None else 0, KEYED=bool(keyed), num_warps=warps,
    )


def _bias_arg(expert_bias, H: int, E: int, placeholder: torch.Tensor) -> torch.Tensor:
    """expert_bias as the kernels read it ([H, E] fp32, contiguous, on placeholder's
    device), or placeholder (a pointer the kernel never reads) when there is none."""
    if expert_bias is None:
        return placeholder
    return expert_bias.reshape(H, E).to(device=placeholder.device,
                                        dtype=torch.float32).contiguous()


def shortlist_size(top_k: int, block_n: int) -> int:
    """Experts listed per row and column block of block_n experts: next_pow2(top_k),
    at most the block (then every expert is listed)."""
    return min(triton.next_power_of_2(top_k), block_n)


def merged_lists(cfg: LogitsRouteConfig, top_k: int, short_n: int, block_n: int) -> bool:
    """Whether the logits kernel makes its shortlists by sorting networks
    (`_shortlist_merged`): asked by cfg.merged_lists, and possible (lists of short_n >
    top_k keys, fewer than a quarter of the block_n columns; short_n = 0: no lists)."""
    return cfg.merged_lists and top_k < short_n < block_n // 4


def shortlist_tied_rows(short: torch.Tensor, top_k: int, num_experts: int,
                        error: float | None = None) -> torch.Tensor:
    """The rows of shortlists short [..., C] (`_write_shortlist`'s packed keys) that
    `_shortlist_route_kernel` finds tied: no list unsure, but the top_k + 1 largest
    listed keys not all apart by `_keys_apart`'s margin (then it reads all C listed
    logits). Bool [...], on the CPU; the kernel's check redone on the host (tests and
    benchmarks). error: the bound in the margin (default SIGMOID_APPROX_ERROR)."""
    error = SIGMOID_APPROX_ERROR.value if error is None else error
    low = num_experts - 1
    short = short.cpu()
    keys = short.long() & 0xFFFFFFFF  # the uint32 keys
    top = keys.sort(-1, descending=True).values[..., :top_k + 1]

    def value(key):  # `_key_value`: the fp32 value of an ordered encoding
        bits = torch.where(key >= 2**31, key ^ 0x80000000, ~key & 0xFFFFFFFF)
        bits = torch.where(bits >= 2**31, bits - 2**32, bits)
        return bits.to(torch.int32).view(torch.float32)

    lo, hi = value(top[..., :-1] & ~low), value(top[..., 1:] | low)
    margin = 2.0 * (error + 2.0**-22 * torch.maximum(lo.abs(), hi.abs()))
    return ~(lo - hi > margin).all(-1) & (short != 0).all(-1)


def _launch_shortlist_route(short, logits, top_k, expert_bias, route_norm, norm_eps,
                            route_scale, probs, indices, counts, count_t,
                            block_rows=None, num_warps=None, error=None) -> None:
    """`_shortlist_route_kernel` on the shortlists short [H, S, C] of fp32 logits [H, S, E]
    (sigmoid, no groups) into probs and indices (and counts, as `_launch_route`); error
    overrides the margin's bound (tests)."""
    H, S, E = logits.shape
    C = short.shape[2]
    # GPU: 16 rows on one warp (routing v13: 61 us against 69 for 32 rows on two warps in
    # graph replays of route + layout at MAGI-2's S = 32768, the same bits).
    if block_rows is None:
        block_rows = 128 if _interpreting() else 16
    block_rows = min(block_rows, triton.next_power_of_2(max(S, 1)))
    if num_warps is None:
        num_warps = 1
    bias = _bias_arg(expert_bias, H, E, logits)
    _shortlist_route_kernel[(triton.cdiv(S, block_rows), H)](
        short, logits, bias, probs, indices,
        probs if counts is None else counts,  # a placeholder pointer when not counting
        S, 0 if counts is None else counts.shape[1], float(norm_eps), float(route_scale),
        E=E, TOP_K=top_k, HAS_BIAS=expert_bias is not None, ROUTE_NORM=bool(route_norm),
        C=C, BLOCK_ROWS=block_rows, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_K=triton.next_power_of_2(top_k), FALLBACK_ROWS=min(2, block_rows),
        INTERPRET=_interpreting(), COUNT_T=count_t if counts is not None else 0,
        ERROR=SIGMOID_APPROX_ERROR.value if error is None else error, num_warps=num_warps,
    )


def _new_block_counts(op: str, H: int, S: int, E: int, block_t: int, device,
                      zeroed: bool) -> torch.Tensor:
    """The [H, cdiv(S, block_t), E] int32 per-block expert counts a route launch fills
    (zeroed here, or left for the kernel to zero)."""
    _check_power_of_two(op, "count_block_t", block_t)
    return (torch.zeros if zeroed else torch.empty)(H, triton.cdiv(S, block_t), E,
                                                    device=device, dtype=torch.int32)


def _check_power_of_two(op: str, name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{op}: {name} must be a power of two, got {value!r}")


def layout_block_t(top_k: int) -> int:
    """Tokens per block of the layout's counts by default (and of the counts the route
    kernels make for it): 64 on the GPU, counts of [H, S/64, E] (6 MB at MAGI-2's
    S = 32768 against 50 MB for 8-token blocks); the interpreter's cost is per program,
    so bigger blocks there. A function of top_k alone, not of S: the routing op and the
    layout op agree on it, and a compiled graph's fake shapes can compute it."""
    if _interpreting():
        return max(1, 1024 // triton.next_power_of_2(top_k))
    return 64


def logits_route_config(device: torch.device) -> LogitsRouteConfig:
    """The default tiles of the logits (+ route) kernel on `device` (configs.py)."""
    return configs.logits_route_config(device, _interpreting())


FUSED_MAX_EXPERTS = 256  # the [block_s, E] register tile; larger E routes unfused


def fused_unsupported(x_heads: torch.Tensor, gate: torch.Tensor) -> str | None:
    """Why `triton_logits_route` cannot take these inputs, or None if it can.

    x_heads: [S, H, D] bfloat16 (its products with bf16 weight parts are exact in
    fp32; fp16 or fp32 x would not be); gate: [H, E, D] float32 with E a power of
    two in [16, 256] (the tile's columns, no padding; tl.dot needs N >= 16) and D
    a multiple of 16 (tl.dot needs K >= 16).
    """
    if x_heads.dim() != 3 or gate.dim() != 3:
        return (f"x_heads must be [S, H, D] and gate [H, E, D], got {tuple(x_heads.shape)} "
                f"and {tuple(gate.shape)}")
    _, H, D = x_heads.shape
    if gate.shape[0] != H or gate.shape[2] != D:
        return f"gate {tuple(gate.shape)} does not match x_heads {tuple(x_heads.shape)}"
    if x_heads.dtype != torch.bfloat16:
        return f"x must be bfloat16, got {x_heads.dtype}"
    if gate.dtype != torch.float32:
        return f"the router weight must be float32, got {gate.dtype}"
    E = gate.shape[1]
    if E < 16 or E > FUSED_MAX_EXPERTS or E & (E - 1):
        return f"E must be a power of two in [16, {FUSED_MAX_EXPERTS}], got {E}"
    if D < 16 or D % 16:
        return f"D must be a multiple of 16, got {D}"
    if x_heads.device != gate.device:
        return f"x_heads on {x_heads.device}, gate on {gate.device}"
    return None


def split_router_weight(gate: torch.Tensor) -> torch.Tensor:
    """gate: [..., D] float32 -> parts [3, gate.numel()] bfloat16, one launch.

    parts[0] + parts[1] + parts[2] == gate.flatten() exactly (see
    `_split_weight_kernel`): 3 x 8 significant bits hold fp32's 24, and bf16 has
    fp32's exponent range. 3072 x 256 weights: 3 MB read, 4.7 MB written.
    """
    w = gate.detach().contiguous().view(-1)
    parts = torch.empty(3, w.numel(), device=w.device, dtype=torch.bfloat16)
    if w.numel():
        BLOCK = 1024
        _split_weight_kernel[(triton.cdiv(w.numel(), BLOCK),)](w, parts, w.numel(),
                                                                BLOCK=BLOCK, num_warps=4)
    return parts


def triton_logits_route(
    x_heads: torch.Tensor,
    gate: torch.Tensor,
    top_k: int,
    score_func: str = "sigmoid",
    expert_bias: torch.Tensor | None = None,
    route_norm: bool = True,
    norm_eps: float = 1e-12,
    route_scale: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
    *,
    return_logits: bool = False,
    count_block_t: int | None = None,
    config: LogitsRouteConfig | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Router logits and routing: the weight split, then one kernel for both (fused), or,
    with `config.split` (the sm_90 default), a logits kernel and `_route_kernel`.

    x_heads: [S, H, D] bfloat16 (unit stride along D, else copied)
    gate: [H, E, D] float32, the router weight (logits = x_heads[s, h] . gate[h, e])
    expert_bias: [H, E] or [H*E] or None, selection only
    returns probs [H, S, K] float32, indices [H, S, K] int64, and the fp32 logits
    [H, S, E] if return_logits (else None): the same as
    `triton_route(fp32 logits of x_heads and gate, ...)`, up to the order of the
    logits' fp32 accumulation (see `_logits_route_kernel`). No host sync.
    Inputs `fused_unsupported` refuses raise ValueError; the routing arguments
    are otherwise assumed valid (`routing.route_tokens` checks them). config
    overrides the tiles (tests, tuning).

    count_block_t: a fourth output, the layout's block counts, as `triton_route`'s
    (split: the logits kernel zeroes them, the route kernel adds; fused: a memset,
    then the kernel adds).
    """
    reason = fused_unsupported(x_heads, gate)
    if reason is not None:
        raise ValueError(f"triton_logits_route: {reason}")
    S, H, D = x_heads.shape
    E = gate.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"triton_logits_route: top_k must lie in [1, E={E}], got {top_k}")
    device = x_heads.device
    cfg = config or logits_route_config(device)
    write_logits = return_logits or not cfg.from_tile or cfg.split
    probs = torch.empty(H, S, top_k, device=device, dtype=torch.float32)
    indices = torch.empty(H, S, top_k, device=device, dtype=torch.int64)
    logits = torch.empty(H, S, E, device=device, dtype=torch.float32) if write_logits \
        else probs  # a placeholder pointer, never written
    counts = None
    if count_block_t is not None:
        # split: zeroed by the logits kernel (one launch less); fused: the kernel adds.
        counts = _new_block_counts("triton_logits_route", H, S, E, count_block_t, device,
                                   zeroed=not (cfg.split and H and S))
    out = (probs, indices, logits if return_logits else None)
    out = out if counts is None else (*out, counts)
    if H == 0 or S == 0:
        return out
    parts = split_router_weight(gate)
    bias = _bias_arg(expert_bias, H, E, probs)
    block_d = min(cfg.block_d, D & -D)  # the largest power of two dividing D (>= 16)
    if x_heads.stride(2) != 1 or (H > 1 and x_heads.stride(1) != D) or \
            (x_heads.stride(0) * 2) % 16 or x_heads.data_ptr() % 16:
        # Viewed as [S, H * D] (see the kernel), with the 16-byte aligned row stride and
        # base that bulk copies need.
        x_heads = x_heads.contiguous()
    x_desc = TensorDescriptor.from_tensor(x_heads.view(S, H * D), [cfg.block_s, block_d])
    block_n = min(cfg.block_e or E, E) if cfg.split else E
    w_desc = TensorDescriptor.from_tensor(parts.view(3 * H * E, D), [block_n, block_d])
    count_t = count_block_t if counts is not None else 0
    short, short_n = None, 0
    if cfg.split and cfg.shortlist and score_func == "sigmoid" and num_groups == 1 and \
            top_k <= 16:
        short_n = shortlist_size(top_k, block_n)
        short = torch.empty(H, S, (E // block_n) * short_n, device=device, dtype=torch.int32)
    l_desc = None
    if cfg.split and cfg.tma_store:
        half = cfg.half_stores and block_n >= 32
        l_desc = TensorDescriptor.from_tensor(
            logits, [1, cfg.block_s, block_n // 2 if half else block_n])
    _logits_route_kernel[(triton.cdiv(S, cfg.block_s), H * (E // block_n))](
        x_desc, w_desc, logits, bias, probs, indices,
        probs if counts is None else counts,  # a placeholder pointer when not counting
        S, H, 0 if counts is None else counts.shape[1], max(E // num_groups, 1),
        float(norm_eps), float(route_scale),
        E=E, D=D, TOP_K=top_k, SOFTMAX=score_func == "softmax",
        HAS_BIAS=expert_bias is not None, ROUTE_NORM=bool(route_norm), NUM_GROUPS=num_groups,
        TOPK_GROUPS=topk_groups, BLOCK_S=cfg.block_s, BLOCK_D=block_d,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_G=triton.next_power_of_2(num_groups),
        WRITE_LOGITS=write_logits, FROM_TILE=cfg.from_tile, INTERPRET=_interpreting(),
        ROUTE=not cfg.split, COUNT_T=count_t, HALF_STORES=cfg.half_stores, BLOCK_N=block_n,
        l_desc=l_desc, short_ptr=short, SHORT=short_n,
        MERGED=merged_lists(cfg, top_k, short_n, block_n),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if short is not None:
        _launch_shortlist_route(short, logits, top_k, expert_bias, route_norm, norm_eps,
                                route_scale, probs, indices, counts, count_t)
    elif cfg.split:
        _launch_route(logits, top_k, score_func, expert_bias, route_norm, norm_eps, route_scale,
                      num_groups, topk_groups, probs, indices, counts, count_t)
    return out


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
) -> tuple[torch.Tensor, ...]:
    """Triton twin of `reference.sort_routes_reference` (no host sync).

    probs: [H, S, K] float (stored as float32); indices: [H, S, K] int in [0, E)
    returns gather_ids [H*S*K] int32, sorted_probs [H*S*K] float32,
            offsets [H*E + 1] int64 -- identical to the reference.

    block_counts: [H, cdiv(S, block_t), E] int32, the routes of each expert per
    block of block_t tokens of `indices` (what `triton_route` or
    `triton_logits_route` return with count_block_t = block_t; both default to
    `layout_block_t(K)`): the count step is skipped, two launches are left
    (the scan, then the scatter ranks each block itself; see the module
    docstring). They must be the counts of these indices: other counts give a
    wrong layout (offsets past H*S*K, slots left unwritten) that must not reach
    `expert_forward`, though every write of this function stays in bounds.
    Without block_counts, `ranks` picks the
    steps: "scatter" (the default: a count kernel without ranks, scan, the ranking
    scatter; three launches) or "count" (count kernel with ranks, scan, offsets,
    scatter; four). Both give the same layout.

    Out-of-range indices (invalid input; `routing.sort_routes` checks CPU
    tensors only) are left out of the counts and not written: every write
    stays in bounds, and the slots at the end of their head are left unwritten.
    block_t, sub_t and chunk (powers of two) override the tokens per block, the
    tokens per sub-block of the "count" count step and the routes per step of
    the ranking scatter (tests, tuning). return_positions adds a fourth output,
    positions [H*S*K] int32: the place of route (h, s, k) in the layout
    (sorted_probs[positions] == probs.flatten()), which the backward of
    sorted_probs needs (out-of-range routes: unwritten); without it no positions
    are written.
    """
    if indices.dim() != 3 or probs.shape != indices.shape:
        raise ValueError(f"triton_sort_routes: probs and indices must both be [H, S, K], got "
                         f"{tuple(probs.shape)} and {tuple(indices.shape)}")
    H, S, K = indices.shape
    E = num_experts
    if ranks is None:
        # Without counts too: the scatter's count-only step, scan and ranking scatter
        # measured 0.057 / 0.057 / 0.063 / 0.103 ms at S = 1K / 4K / 16K / 32K against
        # 0.075 / 0.076 / 0.087 / 0.158 for "count" (H200, MAGI-2 dims, NOTES.md routing v7;
        # the v6 run had "count" ahead at 16K).
        ranks = "scatter"
    if ranks not in ("count", "scatter") or (block_counts is not None and ranks != "scatter"):
        raise ValueError(f"triton_sort_routes: ranks must be 'count' or 'scatter' ('scatter' "
                         f"with block_counts), got {ranks!r}")
    if block_t is None:
        block_t = layout_block_t(K)
    _check_power_of_two("triton_sort_routes", "block_t", block_t)
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
    extra = (positions,) if return_positions else ()
    if H == 0 or S == 0:
        # No routes: every offset is 0, nothing to launch.
        return (gather_ids, sorted_probs,
                torch.zeros(H * E + 1, device=device, dtype=torch.int64), *extra)
    indices = indices.contiguous()
    probs = probs.to(torch.float32).contiguous()
    # A block longer than S is one block either way (the same NB): launch it at S's size.
    block_t = min(block_t, triton.next_power_of_2(S))
    if ranks == "scatter":
        if chunk is None:
            # 64 routes a step on 2 warps: measured on an H200 at S=32768 (NOTES.md,
            # routing v6) 0.076 ms for the rank scatter against 0.092 for 32 routes on
            # one warp (sm_90 compile-only: 9 SASS instructions a route to rank and place
            # it on one warp, 13 on two; the "count" count step alone: 17). The
            # interpreter takes the block whole.
            chunk = triton.next_power_of_2(block_t * K) if _interpreting() else 64
        _check_power_of_two("triton_sort_routes", "chunk", chunk)
        hist = block_counts.contiguous() if block_counts is not None else \
            _layout_hist(indices, E, block_t)
        base, totals = _layout_scan(hist)
        offsets = torch.empty(H * E + 1, device=device, dtype=torch.int64)
        _layout_rank_scatter(indices, probs, base, totals, offsets, gather_ids, sorted_probs,
                             positions, block_t, chunk)
        return (gather_ids, sorted_probs, offsets, *extra)
    if sub_t is None:
        # The pairwise rank tile is [SUB_T * BLOCK_K]^2: 64 route slots (measured best of
        # 32/64/128 on an H200 as whole blocks); the interpreter takes the block whole.
        sub_t = block_t if _interpreting() else max(1, 64 // triton.next_power_of_2(K))
    _check_power_of_two("triton_sort_routes", "sub_t", sub_t)
    sub_t = min(sub_t, block_t)
    hist, rank = _layout_count(indices, E, block_t, sub_t)
    base, totals = _layout_scan(hist)
    offsets = _layout_offsets(totals, S, K)
    _layout_scatter(indices, probs, rank, base, offsets, gather_ids, sorted_probs, positions,
                    block_t)
    return (gather_ids, sorted_probs, offsets, *extra)


# The four steps of triton_sort_routes, separate so that benchmarks can time each.


def _layout_count(indices, E, block_t, sub_t, num_warps=None):
    H, S, K = indices.shape
    NB = triton.cdiv(S, block_t)
    hist = torch.empty(H, NB, E, device=indices.device, dtype=torch.int32)
    rank = torch.empty(H, S, K, device=indices.device, dtype=torch.int32)
    if num_warps is None:
        # sm_90 compile-only, 64 slots a sub-block, a loop over sub-blocks: 56 registers at
        # 2 warps, 72 at 4, 80 at 8 (91, 204, 97 before `_block_ranks` summed down the
        # columns): 2 warps keep many programs an SM to hide each sub-block's loads.
        num_warps = 4 if sub_t == block_t else 2
    _layout_count_kernel[(NB, H)](indices, hist, rank, S, NB, E=E, TOP_K=K, BLOCK_T=block_t,
                                  SUB_T=sub_t, BLOCK_K=triton.next_power_of_2(K),
                                  BLOCK_E=triton.next_power_of_2(E), num_warps=num_warps)
    return hist, rank


def _layout_scan(hist, block_ec=8, block_b=512, num_warps=4):
    H, NB, E = hist.shape
    base = torch.empty_like(hist)
    totals = torch.empty(H, E, device=hist.device, dtype=torch.int32)
    BLOCK_EC = min(triton.next_power_of_2(E), block_ec)
    # block_b: blocks a step of a program's loop. 512 (was 128): S = 32768 in one step,
    # 16 KB of loads in flight a program rather than four dependent 4 KB steps (the
    # v5 scan ran at 0.66 TB/s with 384 programs, 3 an SM: latency, not bandwidth).
    _layout_scan_kernel[(triton.cdiv(E, BLOCK_EC), H)](
        hist, base, totals, NB, E=E, BLOCK_B=min(block_b, triton.next_power_of_2(NB)),
        BLOCK_EC=BLOCK_EC, num_warps=num_warps)
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
        indices, probs, rank, base, offsets, gather_ids, sorted_probs,
        gather_ids if positions is None else positions,  # a placeholder when not written
        S, NB, E=E, TOP_K=K, BLOCK_T=block_t, BLOCK_K=triton.next_power_of_2(K),
        WRITE_POS=positions is not None, num_warps=4)


def _layout_hist(indices, E, block_t, num_warps=4):
    H, S, K = indices.shape
    NB = triton.cdiv(S, block_t)
    hist = torch.empty(H, NB, E, device=indices.device, dtype=torch.int32)
    # The block's routes in one step (384 at K = 6, 64 tokens), up to 1024 a step.
    BLOCK_R = min(triton.next_power_of_2(block_t * K), 1024)
    _layout_hist_kernel[(NB, H)](indices, hist, S, NB, E=E, TOP_K=K, BLOCK_T=block_t,
                                 BLOCK_R=BLOCK_R, BLOCK_E=triton.next_power_of_2(E),
                                 num_warps=num_warps)
    return hist


def _layout_rank_scatter(indices, probs, base, totals, offsets, gather_ids, sorted_probs,
                         positions, block_t, chunk, num_warps=None):
    H, S, K = indices.shape
    NB, E = base.shape[1:]
    if num_warps is None:
        num_warps = max(1, min(4, chunk // 32))  # a warp's lane a route of the step
    _layout_rank_scatter_kernel[(NB, H)](
        indices, probs, base, totals, offsets, gather_ids, sorted_probs,
        gather_ids if positions is None else positions,  # a placeholder when not written
        S, NB, E=E, TOP_K=K, BLOCK_T=block_t, BLOCK_R=chunk,
        BLOCK_E=triton.next_power_of_2(E), WRITE_POS=positions is not None,
        num_warps=num_warps)
