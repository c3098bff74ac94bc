"""Top-k selection (kernels/topk.py): the route kernel against mhmoe.reference and
hand-made rows, the packed keys and their margin against the exact rounds, and the
shortlist route kernel (on lists made by the logits kernel's epilogue) against the
exact rounds on whole rows, bitwise.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), on small shapes with big tiles.
"""

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from mhmoe.config import RouterOptions
from mhmoe.kernels import router_logits, topk
from mhmoe.kernels.topk import triton_route
from mhmoe.kernels.tuning import interpreting
from mhmoe.reference import route_reference
from routing_checks import (
    DEVICE,
    FLIP_PAIRS,
    INF,
    NAN,
    TIE_TOL,
    check_route,
    hard_logits,
)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("route_norm", [True, False])
@pytest.mark.parametrize("H,S,E,K", [
    (2, 37, 20, 3),    # E not a power of two; S not a multiple of the tile
    (3, 5, 6, 6),      # K = E, E = 6
    (1, 1, 16, 1),     # one head, S = 1, K = 1
    (2, 33, 256, 6),   # MAGI-2's E and K
])
def test_route_matches_reference(rng, score_func, with_bias, route_norm, H, S, E, K):
    logits = torch.randn(H, S, E, generator=rng) * 3
    bias = torch.randn(H, E, generator=rng) * 0.1 if with_bias else None
    check_route(logits, K, score_func, bias, route_norm)


@pytest.mark.parametrize("H,S,E,K,G,TG", [
    (2, 17, 20, 3, 4, 2),    # groups of 5 (not a power of two)
    (2, 9, 16, 6, 8, 2),     # 4 kept experts < K: experts at 0.0 fill, ascending id
    (1, 11, 8, 2, 8, 3),     # groups of one expert (score = the best alone)
    (2, 7, 12, 4, 3, 3),     # every group kept
])
def test_route_groups_match_reference(rng, H, S, E, K, G, TG):
    logits = torch.randn(H, S, E, generator=rng) * 2
    bias = torch.randn(H * E, generator=rng) * 0.1  # flat [H*E] bias is accepted too
    for score_func in ("sigmoid", "softmax"):
        check_route(logits, K, score_func, bias, num_groups=G, topk_groups=TG)


@pytest.mark.parametrize("block_rows,num_warps,iters", [(1, 1, 1), (2, 1, 3), (4, 4, 2)])
def test_route_tile_choice_does_not_change_results(rng, block_rows, num_warps, iters):
    # tiles smaller than S, several tiles per program, a partial last tile
    logits = torch.randn(2, 13, 24, generator=rng)
    bias = torch.randn(2, 24, generator=rng) * 0.1
    ref = triton_route(logits.to(DEVICE), RouterOptions(5), bias.to(DEVICE))
    out = triton_route(logits.to(DEVICE), RouterOptions(5), bias.to(DEVICE),
                       block_rows=block_rows, num_warps=num_warps, iters=iters)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    check_route(logits, 5, "sigmoid", bias, block_rows=block_rows, num_warps=num_warps,
                 iters=iters)


def test_route_empty_sequence():
    # edge: S = 0 (no launch) and H = 0
    p, i, _ = triton_route(torch.empty(2, 0, 8, device=DEVICE), RouterOptions(3))
    assert p.shape == i.shape == (2, 0, 3)
    p, i, _ = triton_route(torch.empty(0, 4, 8, device=DEVICE), RouterOptions(3))
    assert p.shape == i.shape == (0, 4, 3)


def test_route_ties_go_to_lower_expert():
    # every score equal: the first K experts, equal probabilities
    p, i, _ = triton_route(torch.zeros(2, 3, 8, device=DEVICE), RouterOptions(3, route_scale=2.0))
    assert i.cpu().tolist() == [[[0, 1, 2]] * 3] * 2
    torch.testing.assert_close(p.cpu(), torch.full((2, 3, 3), 2.0 / 3))
    # a tie between experts 5 and 2 at the top: 2 first; then 6
    logits = torch.tensor([[[0.0, 0.0, 3.0, 0.0, 0.0, 3.0, 1.0, 0.0]]], device=DEVICE)
    assert triton_route(logits, RouterOptions(3)).indices.cpu().tolist() == [[[2, 5, 6]]]
    # a tie made by the bias: scores differ, selection scores are equal
    logits = torch.tensor([[[0.0, 2.0, 0.0, 0.0]]], device=DEVICE)
    bias = torch.tensor([[torch.sigmoid(torch.tensor(2.0)).item() - 0.5, 0.0, 0.0, 0.0]],
                        device=DEVICE)
    _, i, _ = triton_route(logits, RouterOptions(2), bias)
    ref_i = route_reference(logits.cpu(), 2, expert_bias=bias.cpu())[1]
    assert torch.equal(i.cpu(), ref_i)


# numpy warns on the interpreter's inf - inf of the all -inf softmax row (NaN, as in torch)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_route_nan_and_inf():
    logits = torch.tensor([[
        [0.5, NAN, 0.1, 0.2],     # one NaN: picked last, only because K = E here
        [NAN, NAN, NAN, NAN],     # all NaN: experts in ascending id, NaN probs
        [0.0, INF, -1.0, 2.0],    # +inf logit: sigmoid 1, selected first
        [-INF, -INF, -INF, 1.0],  # -inf logits: score 0, ties in ascending id
        [1.0, 2.0, 3.0, 4.0],     # an ordinary row beside them
    ]], device=DEVICE)
    for score_func in ("sigmoid", "softmax"):
        p, i, _ = triton_route(logits, RouterOptions(4, score_func))
        ref_p, ref_i = route_reference(logits.cpu(), 4, score_func)
        assert torch.equal(i.cpu(), ref_i)
        torch.testing.assert_close(p.cpu(), ref_p, rtol=TIE_TOL, atol=0, equal_nan=True)
    p, i, _ = triton_route(logits, RouterOptions(4))
    assert i.cpu().tolist()[0] == [[0, 3, 2, 1], [0, 1, 2, 3], [1, 3, 0, 2], [3, 0, 1, 2],
                                   [3, 2, 1, 0]]
    assert torch.isnan(p[0, :2]).all() and torch.isfinite(p[0, 2:]).all()
    # K < E: the NaN expert is never picked, the row stays finite
    p, i, _ = triton_route(logits[:, :1], RouterOptions(3))
    assert i.cpu().tolist() == [[[0, 3, 2]]] and torch.isfinite(p).all()
    # a NaN or -inf bias: that expert loses every selection it can lose
    bias = torch.tensor([[NAN, 0.0, -INF, 0.0]], device=DEVICE)
    _, i, _ = triton_route(torch.zeros(1, 2, 4, device=DEVICE), RouterOptions(4), bias)
    assert i.cpu().tolist() == [[[1, 3, 0, 2]] * 2]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("score_func,groups", [("sigmoid", (1, 1)), ("softmax", (1, 1)),
                                               ("sigmoid", (4, 2))])
@pytest.mark.parametrize("bias_scale", [None, 0.02, 1e4])
@pytest.mark.parametrize("E,K", [(24, 5), (16, 16), (256, 6), (12, 1)])
def test_keyed_top_k_equals_exact_rounds(rng, score_func, groups, bias_scale, E, K):
    # The packed-key rounds (with the approximate sigmoid and its margin) must give the
    # exact rounds' results on every row, near-ties, ties and non-finite rows included:
    # rows they cannot vouch for are redone exactly. Bitwise: probs, indices, counts.
    if groups[0] > 1 and E % groups[0]:
        pytest.skip("groups must divide E")
    H, S = 2, 23
    logits = hard_logits(rng, H, S, E)
    bias = None if bias_scale is None else torch.randn(H, E, generator=rng) * bias_scale
    if bias is not None and score_func == "sigmoid" and groups[0] == 1:
        for a, b in FLIP_PAIRS:  # the flip pairs stay near-tied
            if b < E:
                bias[:, a] = bias[:, b]
        # a bias that exactly cancels a score: selection score 0 beside real zeros
        bias[0, 10 % E] = -torch.sigmoid(logits[0, 0, 10 % E])
    options = RouterOptions(K, score_func, route_scale=4.9, num_groups=groups[0],
                            topk_groups=groups[1])
    args = (logits.to(DEVICE), options, None if bias is None else bias.to(DEVICE))
    for block_rows in (None, 4):
        keyed = triton_route(*args, block_rows=block_rows, count_block_t=4)
        exact = triton_route(*args, block_rows=block_rows, keyed=False, count_block_t=4)
        assert torch.equal(keyed[1], exact[1]) and torch.equal(keyed[2], exact[2])
        assert torch.equal(keyed[0].nan_to_num(7.0), exact[0].nan_to_num(7.0))
    # and the reference agrees wherever its fp32 rounding cannot reorder near-ties
    check_route(logits, K, score_func, bias, num_groups=groups[0], topk_groups=groups[1])


@triton.jit
def _keyed_probe_kernel(v_ptr, i_ptr, unsure_ptr, n, ERROR: tl.constexpr, E: tl.constexpr,
                        TOP_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    rows = tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK_E)
    v = tl.load(v_ptr + rows[:, None] * E + col[None, :],
                mask=(rows < n)[:, None] & (col < E)[None, :], other=0.0)
    i_tile, unsure = topk._top_k_keyed(v, col < E, E, TOP_K, BLOCK_E, BLOCK_K, ERROR)
    kcol = tl.arange(0, BLOCK_K)
    tl.store(i_ptr + rows[:, None] * TOP_K + kcol[None, :], i_tile,
             mask=(rows < n)[:, None] & (kcol < TOP_K)[None, :])
    tl.store(unsure_ptr + rows, unsure.to(tl.int32), mask=rows < n)


def _keyed_probe(v, top_k, error):
    rows, E = v.shape
    i = torch.empty(rows, top_k, dtype=torch.int32, device=DEVICE)
    unsure = torch.empty(rows, dtype=torch.int32, device=DEVICE)
    _keyed_probe_kernel[(1,)](v.to(DEVICE), i, unsure, rows, ERROR=error, E=E, TOP_K=top_k,
                              ROWS=triton.next_power_of_2(rows), BLOCK_E=triton.next_power_of_2(E),
                              BLOCK_K=triton.next_power_of_2(top_k))
    return i.cpu(), unsure.cpu().bool()


def test_keyed_margin_flags_exactly_the_rows_it_must():
    # Hand-made rows of selection scores (E = 12, padded to 16; K = 3), error bound 1e-6:
    # the margin between adjacent top-4 scores must exceed 2 (1e-6 + 2^-22 |v|) plus the
    # bucket (16 ulps here), and the K-th / (K+1)-th pair counts, later pairs do not.
    E, K, err = 12, 3, 1e-6
    base = [0.1 * j for j in range(E)]  # top: 11, 10, 9, 8 by 0.1 gaps
    cases = {
        "clear": (base, False),
        "pair 1-2 within the margin": ([*base[:10], 1.0, 1.0 + 1.5e-6], True),
        "pair 1-2 just outside": ([*base[:10], 1.0, 1.0 + 1e-5], False),
        "K-th and K+1-th within": ([*base[:8], 0.9 - 2e-6, 0.9, 1.0, 1.1], True),
        "K+1-th and K+2-th within (irrelevant)": ([*base[:7], 0.8, 0.8 + 1e-7, 1.0, 1.1, 1.2],
                                                  False),
        "exact tie": ([*base[:10], 1.1, 1.1], True),
        "-inf at K+1": ([*([-INF] * 9), 1.0, 2.0, 3.0], True),
        "+inf on top": ([*base[:11], INF], True),
        "negative scores": ([-1.0 - 0.1 * j for j in range(E)], False),
    }
    v = torch.tensor([c[0] for c in cases.values()], dtype=torch.float32)
    i, unsure = _keyed_probe(v, K, err)
    for (name, (_, want)), got in zip(cases.items(), unsure.tolist(), strict=True):
        assert got == want, name
    # every row vouched for holds the exact top K in order (stable: lower column first)
    order = torch.sort(v, dim=1, descending=True, stable=True).indices[:, :K].int()
    assert torch.equal(i[~unsure], order[~unsure])
    # no error allowed: the rows whose outcome does not depend on where in their buckets
    # the near-tied scores fall (ties and non-finite pairs stay unsure, clear rows clear)
    _, unsure0 = _keyed_probe(v, K, 0.0)
    assert [unsure0.tolist()[j] for j in (0, 2, 4, 5, 6, 7, 8)] == [
        False, False, False, True, True, True, False]


@triton.jit
def _shortlist_probe_kernel(logits_ptr, bias_ptr, short_ptr, S, E: tl.constexpr,
                            TOP_K: tl.constexpr, SHORT: tl.constexpr, BLOCK_S: tl.constexpr,
                            BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ERROR: tl.constexpr,
                            INTERPRET: tl.constexpr, MERGED: tl.constexpr):
    # The logits kernel's shortlist epilogue on a tile read from logits [H, S, E] (so
    # that hand-made logits reach it), written as the logits kernel writes it.
    NSPLIT: tl.constexpr = E // BLOCK_N
    b = tl.program_id(0)
    h = tl.program_id(1) // NSPLIT
    n = tl.program_id(1) % NSPLIT
    rows = b * BLOCK_S + tl.arange(0, BLOCK_S)
    col = n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.load(logits_ptr + (h * S + rows)[:, None] * E + col[None, :],
                  mask=(rows < S)[:, None], other=0.0)
    router_logits._write_shortlist(acc, b * BLOCK_S, h, n, bias_ptr, short_ptr, S, E, TOP_K,
                                   SHORT, BLOCK_S, BLOCK_N, HAS_BIAS, ERROR, INTERPRET, MERGED)


def _shortlists(logits, top_k, bias, block_n, error=None, merged=False):
    """Shortlists of logits [H, S, E] by the logits kernel's epilogue: packed keys, 0 where
    unsure. error: the approximate sigmoid's bound in the lists' margins (default: the real
    one). merged: the lists by sorting networks (`_shortlist_merged`), else by rounds."""
    H, S, E = logits.shape
    short_n = topk.shortlist_size(top_k, block_n)
    logits = logits.to(DEVICE).contiguous()
    short = torch.empty(H, S, (E // block_n) * short_n, dtype=torch.int32, device=DEVICE)
    b = None if bias is None else bias.to(DEVICE).contiguous()
    _shortlist_probe_kernel[(triton.cdiv(S, 32), H * (E // block_n))](
        logits, logits if b is None else b, short, S, E=E, TOP_K=top_k, SHORT=short_n,
        BLOCK_S=32, BLOCK_N=block_n, HAS_BIAS=b is not None,
        ERROR=topk.SIGMOID_APPROX_ERROR.value if error is None else error,
        INTERPRET=interpreting(), MERGED=merged)
    return short


def _route_lists(short, logits, top_k, bias, count_t, block_rows=None, route_error=None):
    """The shortlist route kernel on lists from `_shortlists`: (probs, indices, counts,
    short). route_error: the approximate sigmoid's bound in the route's margins."""
    H, S, E = logits.shape
    logits = logits.to(DEVICE).contiguous()
    b = None if bias is None else bias.to(DEVICE).contiguous()
    probs = torch.empty(H, S, top_k, device=DEVICE)
    indices = torch.empty(H, S, top_k, dtype=torch.int64, device=DEVICE)
    counts = torch.zeros(H, triton.cdiv(S, count_t), E, dtype=torch.int32, device=DEVICE)
    topk.launch_shortlist_route(short, logits, RouterOptions(top_k, route_scale=4.9), b, probs,
                                indices, counts, count_t, block_rows=block_rows,
                                error=route_error)
    return probs, indices, counts, short


def _shortlist_route(logits, top_k, bias, block_n, count_t, block_rows=None, error=None,
                     route_error=None, merged=False):
    """`_shortlists`, then `_route_lists`: (probs, indices, counts, shortlists)."""
    short = _shortlists(logits, top_k, bias, block_n, error, merged)
    return _route_lists(short, logits, top_k, bias, count_t, block_rows, route_error)


# numpy warns on the interpreter's inf - inf of NaN rows (NaN, as in torch)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("bias_scale", [None, 0.02, 1e4])
@pytest.mark.parametrize("E,K,block_n,merged", [
    (256, 6, 128, False),  # MAGI-2: two column blocks of 128, lists of 8
    (256, 6, 128, True),   # the same lists by sorting networks (the sm_90 default)
    (64, 3, 64, True),     # networks: lists of 4, groups of 16
    (64, 5, 64, True),     # networks: lists of 8, groups of 16
    (32, 3, 16, False),    # lists of 4 of 16
    (64, 7, 16, False),    # lists of 8 = K + 1
    (32, 16, 16, False),   # K >= the block: every expert listed, no row unsure
    (16, 1, 16, False),    # one block, K = 1
    (16, 4, 16, False),    # one block, lists of K: no (K + 1)-th key to check
])
def test_shortlist_route_equals_exact_rounds(rng, bias_scale, E, K, block_n, merged):
    # Each column block lists its next_pow2(K) largest keys per row (or marks the row
    # unsure); the route kernel takes the exact top K from the lists (in the keys' order
    # where they prove it, else by the exact rounds on the listed logits: both occur
    # here, and programs mixing them), or routes unsure rows from all their logits. On
    # every row (ties, near-ties, the interpreter's deliberately swapped pairs, inf, NaN)
    # the results must be the exact rounds' on the whole row, bitwise: probs, indices,
    # counts. And the lists of a row not marked unsure hold its exact picks.
    H, S = 2, 23
    logits = hard_logits(rng, H, S, E)
    bias = None if bias_scale is None else torch.randn(H, E, generator=rng) * bias_scale
    if bias is not None:
        for a, c in FLIP_PAIRS:  # the flip pairs stay near-tied
            if c < E:
                bias[:, a] = bias[:, c]
    exact = triton_route(logits.to(DEVICE), RouterOptions(K, route_scale=4.9),
                         None if bias is None else bias.to(DEVICE), keyed=False,
                         count_block_t=4)
    short = _shortlists(logits, K, bias, block_n, merged=merged)
    for block_rows in (None, 2):  # the route's tiles; the lists do not depend on them
        p, i, c, short = _route_lists(short, logits, K, bias, 4, block_rows)
        assert torch.equal(i, exact[1]) and torch.equal(c, exact[2])
        assert torch.equal(p.nan_to_num(7.0), exact[0].nan_to_num(7.0))
    sure = ~(short == 0).any(-1).cpu()
    assert short.shape == (H, S, (E // block_n) * min(triton.next_power_of_2(K), block_n))
    if block_n <= K:
        assert sure.all()
    ids, picks = (E - 1) - (short.cpu().long() & (E - 1)), exact[1].cpu()
    for h, s in sure.nonzero().tolist():
        assert set(picks[h, s].tolist()) <= set(ids[h, s].tolist()), (h, s)


def test_shortlist_margin_is_needed():
    # Rows where the interpreter's approximate sigmoid (columns 0 mod 3 moved down by
    # 2^-20 relative, 2 mod 3 up) ranks column 2 above column 0 though column 0's exact
    # score is a few ulps higher, at x spread over the keys' buckets (E = 16: buckets of
    # 16 ulps, narrower than the swap): with the error bound set to 0, many rows list the
    # swapped column (K = 2, lists of 2) and the route is wrong; with the real bound every
    # row is unsure and the route is exact (whole rows).
    if not interpreting():
        pytest.skip("relies on the interpreter's perturbed sigmoid")
    H, S, E, K = 1, 64, 16, 2
    logits = torch.full((H, S, E), -6.0)
    x = 3.0 + torch.arange(S) * 7.3e-7
    logits[0, :, 1] = 8.0
    logits[0, :, 0] = x + 2.6e-6
    logits[0, :, 2] = x
    exact, i0 = _margin_case(logits, K, None, 16, merged=False)
    assert (exact[1][0, :, 1] == 0).all()
    assert (i0[0, :, 1] == 2).sum() >= S // 4


def _margin_case(logits, K, bias, block_n, merged):
    """The exact route of logits [H, S, E] (whole rows, exact rounds); asserted: the lists'
    route with the real error bound equals it, every list unsure. Returns (exact, the
    indices routed from lists made with the error bound set to 0)."""
    b = None if bias is None else bias.to(DEVICE)
    exact = triton_route(logits.to(DEVICE), RouterOptions(K, route_scale=4.9), b,
                         keyed=False, count_block_t=4)
    p, i, c, short = _shortlist_route(logits, K, bias, block_n, 4, 2, merged=merged)
    assert torch.equal(i, exact[1]) and torch.equal(p, exact[0]) and torch.equal(c, exact[2])
    assert (short == 0).all()
    return exact, _shortlist_route(logits, K, bias, block_n, 4, 2, error=0.0, merged=merged)[1]


def _reversed_group(S):
    """Logits [1, S, 32] and a bias [1, 32] (K = 3, lists of 4, one block of E = 32) where
    the interpreter's approximate sigmoid reverses a near-tied group: columns 0 and 3
    (moved down) have the best exact scores after column 9, columns 2 and 5 (moved up)
    the worst, 1 and 4 in between, all within a few ulps, at x spread over the keys'
    buckets: sigmoids near 0.82 (steps of 1e-6 in x: 2.5 ulps; the swap: 1.6e-6), shifted
    by the bias to ~0.1, where E = 32's buckets (32 ulps) are 2.4e-7 wide."""
    logits = torch.full((1, S, 32), -6.0)
    x = 1.5 + torch.arange(S) * 7.3e-7
    logits[0, :, 9] = 8.0
    logits[0, :, [0, 3]] = (x + 2e-6)[:, None]
    logits[0, :, [1, 4]] = (x + 1e-6)[:, None]
    logits[0, :, [2, 5]] = x[:, None]
    bias = torch.zeros(1, 32)
    bias[:, :6] = -0.72
    return logits, bias


def test_merged_shortlist_margin_is_needed():
    # The sorting networks' lists take their margin between the K-th and the last listed
    # key. On `_reversed_group`'s rows, with the error bound set to 0, many rows list 9, 2,
    # 5, 1, which miss the exact picks 9, 0, 3, and route wrongly; with the real bound
    # every such row is unsure and the route is exact (whole rows).
    if not interpreting():
        pytest.skip("relies on the interpreter's perturbed sigmoid")
    S, K = 64, 3
    logits, bias = _reversed_group(S)
    exact, i0 = _margin_case(logits, K, bias, 32, merged=True)
    assert (exact[1][0].cpu() == torch.tensor([9, 0, 3])).all()
    assert (i0.cpu() != exact[1].cpu()).any(-1).sum() >= S // 4


def test_merged_shortlist_margin_is_at_the_kth_key():
    # The margin is the K-th key's, not an earlier one's: `_reversed_group`'s rows with
    # column 7 second, far above the group, so that the picks are 9, 7, 0 and the keys
    # list 9, 7, 2, 5. A test at the (K - 1)-th key (column 7 against the 4th) would pass
    # and the route would pick 2 from those lists; at the K-th (2 against 5, one value)
    # every list is unsure and the route exact.
    if not interpreting():
        pytest.skip("relies on the interpreter's perturbed sigmoid")
    S, K = 64, 3
    logits, bias = _reversed_group(S)
    logits[0, :, 7] = 6.0
    exact = triton_route(logits.to(DEVICE), RouterOptions(K, route_scale=4.9), bias.to(DEVICE),
                         keyed=False, count_block_t=4)
    assert (exact[1][0].cpu() == torch.tensor([9, 7, 0])).all()
    p, i, c, short = _shortlist_route(logits, K, bias, 32, 4, 2, merged=True)
    assert torch.equal(i, exact[1]) and torch.equal(p, exact[0]) and torch.equal(c, exact[2])
    assert (short == 0).all()


@pytest.mark.parametrize("merged", [False, True])
def test_shortlist_route_takes_both_paths(rng, merged):
    # The route kernel orders a row's picks by its listed keys where they are apart, and
    # runs the exact rounds on its listed logits where they are not (tied rows): at
    # MAGI-2's E, K and column blocks, both kinds of row in one program (the interpreter's
    # 128 rows a program), and the results those of the exact rounds.
    # (`_hard_logits` rows leave a column block unsure here: their other columns tie.)
    H, S, E, K = 2, 23, 256, 6
    logits = torch.randn(H, S, E, generator=rng)
    x = 3.0 + torch.arange(S // 2) * 7.3e-7  # a flip pair among the picks: always tied
    logits[:, :S // 2, 0], logits[:, :S // 2, 2] = x + 3.5e-6, x
    bias = torch.randn(H, E, generator=rng) * 0.02
    bias[:, 0] = bias[:, 2]
    p, i, c, short = _shortlist_route(logits, K, bias, 128, 4, merged=merged)
    tied = topk.shortlist_tied_rows(short, K, E)
    keyed = (short != 0).all(-1).cpu() & ~tied
    assert (tied.sum(1) > 0).all() and (keyed.sum(1) > 0).all(), (tied, keyed)
    exact = triton_route(logits.to(DEVICE), RouterOptions(K, route_scale=4.9), bias.to(DEVICE),
                         keyed=False, count_block_t=4)
    assert torch.equal(i, exact[1]) and torch.equal(c, exact[2])
    assert torch.equal(p.nan_to_num(7.0), exact[0].nan_to_num(7.0))


@pytest.mark.parametrize("E,K,block_n", [(256, 6, 128), (64, 3, 64), (32, 3, 32), (64, 5, 64)])
def test_merged_shortlists_are_the_rounds_lists(rng, E, K, block_n):
    # The sorting networks' lists (`_shortlist_merged`) against the rounds' (`_shortlist`):
    # the same keys in the same order wherever both are sure. Their margin is taken to the
    # SHORT-th key, not the (SHORT + 1)-th: stricter, except where the (SHORT + 1)-th is
    # -inf (row 8's first block keeps only SHORT scores that are not NaN), which the
    # rounds cannot vouch for and the networks rightly can; that is the one place where
    # only the merged lists are sure, and the route from them is exact there too. Random
    # rows, hard rows (ties, near-ties, inf, NaN), and rows whose best keys all sit in one
    # thread's group (columns 0 mod 8 and 1 mod 8: group 0). Those rows' group-0 selection
    # scores (sigmoid + bias) are 0.7 + 0.1 k / n for k < n in a random order, and the
    # other columns far below: no near-tie among their best keys, which random values
    # gave about once in 80 runs of a case and which the merged lists' stricter margin
    # (to the SHORT-th key) rightly leaves unsure.
    H, S = 2, 40
    short = topk.shortlist_size(K, block_n)
    logits = torch.cat([torch.randn(H, 20, E, generator=rng), hard_logits(rng, H, 20, E)], 1)
    bias = torch.randn(H, E, generator=rng) * 0.02
    group0 = torch.arange(E) % 8 < 2
    n0 = int(group0.sum())
    order = torch.argsort(torch.rand(H, 6, n0, generator=rng), dim=-1).float()
    logits[:, :6] = torch.randn(H, 6, E, generator=rng) - 6.0
    logits[:, :6, group0] = torch.logit(0.7 + 0.1 * order / n0 - bias[:, None, group0])
    logits[:, 8, short:block_n] = NAN
    rounds = _shortlists(logits, K, bias, block_n).cpu()
    p, i, c, merged = _shortlist_route(logits, K, bias, block_n, 4, merged=True)
    exact = triton_route(logits.to(DEVICE), RouterOptions(K, route_scale=4.9), bias.to(DEVICE),
                         keyed=False, count_block_t=4)
    assert torch.equal(i, exact[1]) and torch.equal(c, exact[2])
    assert torch.equal(p.nan_to_num(7.0), exact[0].nan_to_num(7.0))
    r = rounds.view(H, S, -1, short)
    m = merged.cpu().view(H, S, -1, short)
    sure_r, sure_m = (r != 0).all(-1), (m != 0).all(-1)
    only_merged = torch.zeros_like(sure_m)
    only_merged[:, 8, 0] = True
    assert torch.equal(sure_m & ~sure_r, only_merged)
    both = sure_m & sure_r
    assert torch.equal(m[both], r[both])
    assert sure_m[:, :20].float().mean() > 0.9  # random rows are sure
    assert sure_m[:, :6].all()  # the one-group rows too: no key lost


@pytest.mark.parametrize("case", ["across_blocks", "within_block"])
def test_shortlist_keyed_order_margin_is_needed(case):
    # Rows whose lists are sure but whose picks hold a pair the interpreter's approximate
    # sigmoid swaps (column 0 or 9, 0 mod 3, moved down; column 2 moved up), the exact
    # scores a few ulps apart and spread over the keys' buckets (E = 16): the route kernel
    # must find them tied and take the exact rounds. With the route's error bound set to
    # 0 it orders many of them by the swapped keys, and routes them wrongly.
    if not interpreting():
        pytest.skip("relies on the interpreter's perturbed sigmoid")
    H, S, E, K = 1, 64, 16, 2
    logits = torch.full((H, S, E), -6.0)
    x = 3.0 + torch.arange(S) * 7.3e-7
    if case == "across_blocks":  # picks 0 and 9; 2 (block 0) near-tied with 9 (block 1)
        logits[0, :, 0], logits[0, :, 8] = 8.0, 1.0
        logits[0, :, 9], logits[0, :, 2] = x + 2.6e-6, x
        wrong = lambda i: i[0, :, 1] == 2  # noqa: E731
    else:  # picks 0 then 2, near-tied, both in block 0; block 1 lists 9 and 8
        logits[0, :, 9], logits[0, :, 8] = 1.0, 0.0
        logits[0, :, 0], logits[0, :, 2] = x + 2.6e-6, x
        wrong = lambda i: i[0, :, 0] == 2  # noqa: E731
    exact = triton_route(logits.to(DEVICE), RouterOptions(K, route_scale=4.9), keyed=False,
                         count_block_t=4)
    assert not wrong(exact[1].cpu()).any()
    p, i, c, short = _shortlist_route(logits, K, None, 8, 4, 16)
    assert (short != 0).all()  # every list sure: these rows reach the keyed rounds
    assert topk.shortlist_tied_rows(short, K, E).all()
    assert torch.equal(i, exact[1]) and torch.equal(p, exact[0]) and torch.equal(c, exact[2])
    _, i0, _, _ = _shortlist_route(logits, K, None, 8, 4, 16, route_error=0.0)
    assert wrong(i0.cpu()).sum() >= S // 4
