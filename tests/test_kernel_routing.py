"""Triton routing and layout kernels against mhmoe.reference and hand-written cases.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), on small shapes with big tiles.
"""

import pytest
import torch

pytest.importorskip("triton")

from mhmoe.kernels.routing import triton_route, triton_sort_routes
from mhmoe.reference import route_reference, sort_routes_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TIE_TOL = 1e-6  # selection scores closer than this (relative) may come in either order
NAN = float("nan")
INF = float("inf")


def _near_ties(logits, top_k, score_func, bias, num_groups, topk_groups):
    """[H, S] rows whose reference selection has adjacent scores within TIE_TOL.

    Our exp (numpy's in the interpreter) may differ from torch's by an ulp, so
    such rows may legitimately order their experts differently.
    """
    H, S, E = logits.shape
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, -1)
    sel = scores if bias is None else scores + bias.reshape(H, 1, E)
    sel = torch.where(torch.isnan(sel), -INF, sel)

    def close(values, n):
        top = torch.sort(values, dim=-1, descending=True).values[..., :n + 1]
        if top.shape[-1] < 2:
            return torch.zeros(top.shape[:-1], dtype=torch.bool)
        gap = (top[..., :-1] - top[..., 1:]).abs()
        return (gap <= TIE_TOL * top[..., :-1].abs()).any(-1)

    ties = close(sel, top_k)
    if num_groups > 1:
        grouped = torch.sort(sel.reshape(H, S, num_groups, -1), -1, descending=True).values
        group_scores = grouped[..., :2].sum(-1) if grouped.shape[-1] > 1 else grouped[..., 0]
        group_scores = torch.where(torch.isnan(group_scores), -INF, group_scores)
        ties |= close(group_scores, topk_groups) | close(grouped.reshape(H, S, E), E)
    return ties


def _check_route(logits, top_k, score_func="sigmoid", bias=None, route_norm=True,
                 route_scale=4.9, num_groups=1, topk_groups=1, **tile):
    args = (top_k, score_func, bias, route_norm, 1e-12, route_scale, num_groups, topk_groups)
    ref_p, ref_i = route_reference(logits, *args)
    p, i = triton_route(logits.to(DEVICE), *args[:2],
                        None if bias is None else bias.to(DEVICE), *args[3:], **tile)
    p, i = p.cpu(), i.cpu()
    assert p.dtype == torch.float32 and i.dtype == torch.int64
    assert p.shape == i.shape == ref_p.shape
    assert ((i >= 0) & (i < logits.shape[-1])).all()
    ok = ~_near_ties(logits, top_k, score_func, bias, num_groups, topk_groups)
    assert torch.equal(i[ok], ref_i[ok])
    torch.testing.assert_close(p[ok], ref_p[ok], rtol=TIE_TOL, atol=0, equal_nan=True)
    return p, i


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
    _check_route(logits, K, score_func, bias, route_norm)


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
        _check_route(logits, K, score_func, bias, num_groups=G, topk_groups=TG)


@pytest.mark.parametrize("block_rows,num_warps,iters", [(1, 1, 1), (2, 1, 3), (4, 4, 2)])
def test_route_tile_choice_does_not_change_results(rng, block_rows, num_warps, iters):
    # tiles smaller than S, several tiles per program, a partial last tile
    logits = torch.randn(2, 13, 24, generator=rng)
    bias = torch.randn(2, 24, generator=rng) * 0.1
    ref = triton_route(logits.to(DEVICE), 5, "sigmoid", bias.to(DEVICE))
    out = triton_route(logits.to(DEVICE), 5, "sigmoid", bias.to(DEVICE),
                       block_rows=block_rows, num_warps=num_warps, iters=iters)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    _check_route(logits, 5, "sigmoid", bias, block_rows=block_rows, num_warps=num_warps,
                 iters=iters)


def test_route_empty_sequence():
    # edge: S = 0 (no launch) and H = 0
    p, i = triton_route(torch.empty(2, 0, 8, device=DEVICE), 3)
    assert p.shape == i.shape == (2, 0, 3)
    p, i = triton_route(torch.empty(0, 4, 8, device=DEVICE), 3)
    assert p.shape == i.shape == (0, 4, 3)


def test_route_ties_go_to_lower_expert():
    # every score equal: the first K experts, equal probabilities
    p, i = triton_route(torch.zeros(2, 3, 8, device=DEVICE), 3, route_scale=2.0)
    assert i.cpu().tolist() == [[[0, 1, 2]] * 3] * 2
    torch.testing.assert_close(p.cpu(), torch.full((2, 3, 3), 2.0 / 3))
    # a tie between experts 5 and 2 at the top: 2 first; then 6
    logits = torch.tensor([[[0.0, 0.0, 3.0, 0.0, 0.0, 3.0, 1.0, 0.0]]], device=DEVICE)
    assert triton_route(logits, 3)[1].cpu().tolist() == [[[2, 5, 6]]]
    # a tie made by the bias: scores differ, selection scores are equal
    logits = torch.tensor([[[0.0, 2.0, 0.0, 0.0]]], device=DEVICE)
    bias = torch.tensor([[torch.sigmoid(torch.tensor(2.0)).item() - 0.5, 0.0, 0.0, 0.0]],
                        device=DEVICE)
    _, i = triton_route(logits, 2, expert_bias=bias)
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
        p, i = triton_route(logits, 4, score_func)
        ref_p, ref_i = route_reference(logits.cpu(), 4, score_func)
        assert torch.equal(i.cpu(), ref_i)
        torch.testing.assert_close(p.cpu(), ref_p, rtol=TIE_TOL, atol=0, equal_nan=True)
    p, i = triton_route(logits, 4, "sigmoid")
    assert i.cpu().tolist()[0] == [[0, 3, 2, 1], [0, 1, 2, 3], [1, 3, 0, 2], [3, 0, 1, 2],
                                   [3, 2, 1, 0]]
    assert torch.isnan(p[0, :2]).all() and torch.isfinite(p[0, 2:]).all()
    # K < E: the NaN expert is never picked, the row stays finite
    p, i = triton_route(logits[:, :1], 3)
    assert i.cpu().tolist() == [[[0, 3, 2]]] and torch.isfinite(p).all()
    # a NaN or -inf bias: that expert loses every selection it can lose
    bias = torch.tensor([[NAN, 0.0, -INF, 0.0]], device=DEVICE)
    _, i = triton_route(torch.zeros(1, 2, 4, device=DEVICE), 4, expert_bias=bias)
    assert i.cpu().tolist() == [[[1, 3, 0, 2]] * 2]


def _check_layout(probs, indices, num_experts, **tile):
    out = triton_sort_routes(probs.to(DEVICE), indices.to(DEVICE), num_experts, **tile)
    ref = sort_routes_reference(probs.float(), indices, num_experts)
    for got, want in zip(out, ref, strict=True):
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
    return out


@pytest.mark.parametrize("H,S,E,K", [
    (2, 37, 20, 3),    # E not a power of two
    (3, 5, 6, 6),      # K = E: every expert once per token
    (1, 1, 16, 1),     # one head, S = 1, K = 1
    (2, 33, 256, 6),   # MAGI-2's E and K: most experts empty
])
def test_layout_of_routes_matches_reference(rng, H, S, E, K):
    logits = torch.randn(H, S, E, generator=rng)
    probs, indices = route_reference(logits, K, route_scale=4.9)
    _check_layout(probs, indices, E)


@pytest.mark.parametrize("block_t", [1, 2, 4, 16])
def test_layout_block_size_does_not_change_results(rng, block_t):
    # many blocks, a partial last block, repeated experts within a token
    # (never made by route(), allowed by sort_routes), int32 indices
    probs = torch.rand(2, 23, 4, generator=rng)
    indices = torch.randint(0, 7, (2, 23, 4), generator=rng)
    _check_layout(probs, indices, 7, block_t=block_t)
    _check_layout(probs, indices.to(torch.int32), 7, block_t=block_t)


def test_layout_one_expert_takes_every_route(rng):
    # every route of head 0 on expert 3 (K = 1), head 1 spread; empty experts around
    S = 40
    indices = torch.stack([torch.full((S, 1), 3), torch.randint(0, 5, (S, 1), generator=rng)])
    probs = torch.rand(2, S, 1, generator=rng)
    gather_ids, _, offsets = _check_layout(probs, indices, 5, block_t=8)
    assert offsets.cpu().tolist()[:6] == [0, 0, 0, 0, S, S]
    assert gather_ids[:S].cpu().tolist() == list(range(S))


def test_layout_empty():
    # edge: S = 0 and H = 0: no routes, offsets all zero
    for H, S in ((2, 0), (0, 3)):
        gather_ids, sorted_probs, offsets = triton_sort_routes(
            torch.empty(H, S, 2, device=DEVICE), torch.empty(H, S, 2, device=DEVICE,
                                                             dtype=torch.int64), 4)
        assert gather_ids.numel() == sorted_probs.numel() == 0
        assert offsets.dtype == torch.int64 and offsets.cpu().tolist() == [0] * (H * 4 + 1)


def test_layout_ignores_out_of_range_indices(rng):
    # invalid input: the routes of bad ids are left out, nothing is written out of bounds
    probs = torch.rand(1, 6, 2, generator=rng)
    indices = torch.tensor([[[0, 1], [2, 9], [1, -1], [2**40, 0], [1, 2], [0, 2]]])
    gather_ids, sorted_probs, offsets = triton_sort_routes(probs.to(DEVICE),
                                                           indices.to(DEVICE), 3)
    valid = (indices >= 0) & (indices < 3)
    ref = sort_routes_reference(probs[valid].view(1, -1, 1), indices[valid].view(1, -1, 1), 3)
    n = int(valid.sum())
    assert offsets.cpu().tolist() == ref[2].tolist()
    assert sorted_probs[:n].cpu().tolist() == ref[1].tolist()
    tokens = valid.nonzero()[:, 1]
    assert gather_ids[:n].cpu().tolist() == tokens[ref[0].long()].tolist()


def test_route_then_layout_end_to_end(rng):
    # the MAGI-2 preset's routing arguments, several heads, full chain
    H, S, E, K = 3, 29, 64, 6
    logits = torch.randn(H, S, E, generator=rng)
    bias = torch.randn(H, E, generator=rng) * 0.05
    p, i = _check_route(logits, K, "sigmoid", bias, True, 4.9)
    _check_layout(p, i, E)
