"""Top-k selection: the route kernels (docs/contract.md section 2, steps 2-6).

    out = triton_route(logits, options, expert_bias)   # out.probs, out.indices [H, S, K]

`_route_kernel`, grid (cdiv(S, BLOCK_ROWS * ITERS), H): program (b, h) owns BLOCK_ROWS
tokens of head h at a time. It loads their [BLOCK_ROWS, E] logits once and selects in
registers on packed keys (each selection score's ordered encoding with the expert id in
its low bits; for sigmoid without groups, from an approximate sigmoid). A program with
a row the keys cannot vouch for (near-ties, ties, non-finite scores: the margin of
`_top_k_keyed`) redoes its tile with the exact rounds (row maximum, lowest expert id
attaining it, mark it taken). Either way the picks are the exact rounds', bitwise, and
the probabilities come exactly from the picked logits. With a count block T, each pick
is also added to counts[h, s // T, e], the layout's per-block expert counts.

`_shortlist_route_kernel`, grid (cdiv(S, BLOCK_ROWS), H): program (b, h) owns BLOCK_ROWS
tokens of head h and routes them from the shortlists the logits kernel wrote
(kernels/router_logits.py): the same results, bitwise, from K or a few listed logits a
row instead of E.

The selection helpers here (scores, packed keys, rounds, shortlists) are the logits
kernel's too. Why the keys, the margin and the shortlists give the exact picks:
docs/routing.md. Scores are bitwise torch's on CUDA (libdevice's expf and a correctly
rounded division); softmax sums in another order than torch (its last bits may differ);
under TRITON_INTERPRET=1 numpy's exp stands in for libdevice's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..config import RouterOptions
from . import tuning
from .tuning import interpreting


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
    (docs/contract.md section 2), zero outside the best groups when group-limited."""
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
    on the current one (`tuning.route_tiles` takes ITERS = 1; the loop stays for
    tuning on other parts). COUNT_T > 0:
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


# ----------------------------------------------------------------------------- launchers


class RouteOutput(NamedTuple):
    """What `triton_route` returns, whatever it was asked for.

    probs:        [H, S, K] float32, in selection order (descending biased score).
    indices:      [H, S, K] int64 in [0, E).
    block_counts: [H, cdiv(S, T), E] int32, the picks of each expert per block of T =
                  count_block_t tokens of a head; None without count_block_t.
    """

    probs: torch.Tensor
    indices: torch.Tensor
    block_counts: torch.Tensor | None


def bias_arg(expert_bias: torch.Tensor | None, H: int, E: int,
             placeholder: torch.Tensor) -> torch.Tensor:
    """expert_bias as the kernels read it ([H, E] fp32, contiguous, on placeholder's
    device), or placeholder (a pointer the kernel never reads) when there is none."""
    if expert_bias is None:
        return placeholder
    return expert_bias.reshape(H, E).to(device=placeholder.device,
                                        dtype=torch.float32).contiguous()


def check_power_of_two(op: str, name: str, value: int) -> None:
    """Raise ValueError (naming `op` and `name`) unless value is a power of two."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{op}: {name} must be a power of two, got {value!r}")


def new_block_counts(op: str, H: int, S: int, E: int, block_t: int, device,
                     zeroed: bool) -> torch.Tensor:
    """The [H, cdiv(S, block_t), E] int32 per-block expert counts a route launch fills
    (zeroed here, or left for the kernel to zero)."""
    check_power_of_two(op, "count_block_t", block_t)
    return (torch.zeros if zeroed else torch.empty)(H, triton.cdiv(S, block_t), E,
                                                    device=device, dtype=torch.int32)


def shortlist_size(top_k: int, block_n: int) -> int:
    """Experts listed per row and column block of block_n experts: next_pow2(top_k),
    at most the block (then every expert is listed)."""
    return min(triton.next_power_of_2(top_k), block_n)


def shortlist_tied_rows(short: torch.Tensor, top_k: int, num_experts: int,
                        error: float | None = None) -> torch.Tensor:
    """The rows of shortlists short [..., C] (`router_logits._write_shortlist`'s packed keys) that
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


def launch_route(logits: torch.Tensor, options: RouterOptions,
                 expert_bias: torch.Tensor | None, probs: torch.Tensor, indices: torch.Tensor,
                 counts: torch.Tensor | None = None, count_block_t: int = 0, *,
                 block_rows: int | None = None, num_warps: int | None = None,
                 iters: int | None = None, keyed: bool = True) -> None:
    """One launch of `_route_kernel`: fp32 logits [H, S, E] (H, S > 0; any strides)
    routed into probs [H, S, K] float32 and indices [H, S, K] int64 (contiguous).

    counts: [H, cdiv(S, count_block_t), E] int32, zeroed by the caller, into which the
    picks are added (with count_block_t > 0), or None. block_rows, num_warps and iters
    override `tuning.route_tiles`; keyed=False takes the exact rounds for every row.
    No checks: `triton_route` is the checked entry point.
    """
    H, S, E = logits.shape
    tiles = tuning.route_tiles(S, E, interpreting(), block_rows=block_rows,
                               num_warps=num_warps, iters=iters)
    bias = bias_arg(expert_bias, H, E, logits)
    top_k = options.top_k
    _route_kernel[(triton.cdiv(S, tiles.block_rows * tiles.iters), H)](
        logits, *logits.stride(), bias, probs, indices,
        probs if counts is None else counts,  # a placeholder pointer when not counting
        S, 0 if counts is None else counts.shape[1], max(E // options.num_groups, 1),
        float(options.norm_eps), float(options.route_scale),
        E=E, TOP_K=top_k, SOFTMAX=options.score_func == "softmax",
        HAS_BIAS=expert_bias is not None, ROUTE_NORM=bool(options.route_norm),
        NUM_GROUPS=options.num_groups, TOPK_GROUPS=options.topk_groups,
        BLOCK_ROWS=tiles.block_rows, BLOCK_E=triton.next_power_of_2(max(E, 1)),
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_G=triton.next_power_of_2(options.num_groups), ITERS=tiles.iters,
        INTERPRET=interpreting(), COUNT_T=count_block_t if counts is not None else 0,
        KEYED=bool(keyed), num_warps=tiles.num_warps,
    )


def launch_shortlist_route(short: torch.Tensor, logits: torch.Tensor, options: RouterOptions,
                           expert_bias: torch.Tensor | None, probs: torch.Tensor,
                           indices: torch.Tensor, counts: torch.Tensor | None = None,
                           count_block_t: int = 0, *, block_rows: int | None = None,
                           num_warps: int | None = None, error: float | None = None) -> None:
    """One launch of `_shortlist_route_kernel`: the rows of fp32 logits [H, S, E]
    (contiguous, E a power of two; H, S > 0) routed from their shortlists short
    [H, S, C] int32 (the logits kernel's packed keys, 0 where a list is unsure) into
    probs and indices, and counts, as `launch_route`.

    Sigmoid scores without groups only (what the shortlists are made for). block_rows
    and num_warps override `tuning.shortlist_route_tiles`; error overrides the margin's
    bound (tests show it is needed). No other checks.
    """
    if options.score_func != "sigmoid" or options.num_groups != 1:
        raise ValueError("launch_shortlist_route: shortlists route sigmoid scores without "
                         f"groups, got {options}")
    H, S, E = logits.shape
    C = short.shape[2]
    tiles = tuning.shortlist_route_tiles(S, interpreting(), block_rows=block_rows,
                                         num_warps=num_warps)
    bias = bias_arg(expert_bias, H, E, logits)
    _shortlist_route_kernel[(triton.cdiv(S, tiles.block_rows), H)](
        short, logits, bias, probs, indices,
        probs if counts is None else counts,  # a placeholder pointer when not counting
        S, 0 if counts is None else counts.shape[1], float(options.norm_eps),
        float(options.route_scale),
        E=E, TOP_K=options.top_k, HAS_BIAS=expert_bias is not None,
        ROUTE_NORM=bool(options.route_norm), C=C, BLOCK_ROWS=tiles.block_rows,
        BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(options.top_k),
        FALLBACK_ROWS=tiles.fallback_rows, INTERPRET=interpreting(),
        COUNT_T=count_block_t if counts is not None else 0,
        ERROR=SIGMOID_APPROX_ERROR.value if error is None else error,
        num_warps=tiles.num_warps,
    )


def triton_route(
    logits: torch.Tensor,
    options: RouterOptions,
    expert_bias: torch.Tensor | None = None,
    *,
    count_block_t: int | None = None,
    block_rows: int | None = None,
    num_warps: int | None = None,
    iters: int | None = None,
    keyed: bool = True,
) -> RouteOutput:
    """Triton twin of `reference.route_reference` (one launch, no host sync).

    logits: [H, S, E] float32 (any strides; float16/bfloat16 are upcast)
    expert_bias: [H, E] or [H*E] or None, selection only
    returns RouteOutput(probs [H, S, K] float32, indices [H, S, K] int64, block_counts).

    Same semantics as the reference, NaN included: a NaN selection score counts as
    -inf, indices always lie in [0, E), other rows are untouched. options must fit E
    (`RouterOptions.check`, run here); the bias is assumed valid (`routing.route`
    checks it). block_rows, num_warps and iters override the tiles (tests, tuning);
    keyed=False takes the exact top-k rounds for every row instead of the packed keys
    (`_top_k_keyed`): the same results, bitwise, more instructions.

    count_block_t (a power of two, usually `layout.layout_block_t(top_k)`): block_counts
    [H, cdiv(S, count_block_t), E] int32, the routes of each expert per block of
    count_block_t tokens of a head, counted by the kernel as it picks (atomic integer
    adds: deterministic), for `triton_sort_routes(..., block_counts=, block_t=)`, which
    then skips its count step. One memset more (a zeroed buffer).
    """
    if logits.dim() != 3:
        raise ValueError(f"triton_route: logits must be [H, S, E], got {tuple(logits.shape)}")
    if logits.dtype == torch.float64 or not logits.dtype.is_floating_point:
        raise ValueError(f"triton_route: logits must be float32 (float16/bfloat16 are upcast; "
                         f"float64 belongs to the reference path), got {logits.dtype}")
    H, S, E = logits.shape
    options.check(E, "triton_route")
    logits = logits.float()
    device = logits.device
    probs = torch.empty(H, S, options.top_k, device=device, dtype=torch.float32)
    indices = torch.empty(H, S, options.top_k, device=device, dtype=torch.int64)
    counts = None
    if count_block_t is not None:
        counts = new_block_counts("triton_route", H, S, E, count_block_t, device, zeroed=True)
    if H and S:
        launch_route(logits, options, expert_bias, probs, indices, counts, count_block_t or 0,
                     block_rows=block_rows, num_warps=num_warps, iters=iters, keyed=keyed)
    return RouteOutput(probs, indices, counts)
