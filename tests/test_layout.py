"""The route layout (kernels/layout.py): the counting sort against
mhmoe.reference.sort_routes_reference, bitwise, both ways of ranking, with and without
the route kernels' block counts, and its behaviour on invalid input.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), on small shapes with big tiles.
"""

import pytest
import torch

pytest.importorskip("triton")

from mhmoe.config import RouterOptions
from mhmoe.kernels import layout as layout_kernels
from mhmoe.kernels.layout import layout_block_t, triton_sort_routes
from mhmoe.kernels.topk import triton_route
from mhmoe.kernels.tuning import LayoutScanTiles
from mhmoe.reference import route_reference, sort_routes_reference
from routing_checks import (
    DEVICE,
    INF,
    NAN,
    block_counts,
    check_route,
    same_layout,
)


def _check_layout(probs, indices, num_experts, **tile):
    # both ways of ranking (the default, "scatter", and "count", whose sub_t the tiles set)
    ref = sort_routes_reference(probs.float(), indices, num_experts)
    for ranks in (None, "count"):
        out = triton_sort_routes(probs.to(DEVICE), indices.to(DEVICE), num_experts,
                                 ranks=ranks, **tile)
        assert out.positions is None  # not asked for
        for got, want in zip(out[:3], ref, strict=True):
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


@pytest.mark.parametrize("block_t,sub_t", [(1, 1), (2, 2), (4, 4), (16, 16),
                                           (16, 4), (8, 1), (32, 2)])
def test_layout_block_size_does_not_change_results(rng, block_t, sub_t):
    # many blocks, a partial last block, sub-blocks of the counts (a running histogram),
    # repeated experts within a token (never made by route(), allowed by sort_routes),
    # int32 indices
    probs = torch.rand(2, 23, 4, generator=rng)
    indices = torch.randint(0, 7, (2, 23, 4), generator=rng)
    _check_layout(probs, indices, 7, block_t=block_t, sub_t=sub_t)
    _check_layout(probs, indices.to(torch.int32), 7, block_t=block_t, sub_t=sub_t)


def test_layout_one_expert_takes_every_route(rng):
    # every route of head 0 on expert 3 (K = 1), head 1 spread; empty experts around
    S = 40
    indices = torch.stack([torch.full((S, 1), 3), torch.randint(0, 5, (S, 1), generator=rng)])
    probs = torch.rand(2, S, 1, generator=rng)
    gather_ids, _, offsets, _ = _check_layout(probs, indices, 5, block_t=8)
    _check_layout(probs, indices, 5, block_t=16, sub_t=2)  # 80 routes of one expert in a block
    assert offsets.cpu().tolist()[:6] == [0, 0, 0, 0, S, S]
    assert gather_ids[:S].cpu().tolist() == list(range(S))


def test_layout_empty():
    # edge: S = 0 and H = 0: no routes, offsets all zero
    for H, S in ((2, 0), (0, 3)):
        gather_ids, sorted_probs, offsets, _ = triton_sort_routes(
            torch.empty(H, S, 2, device=DEVICE), torch.empty(H, S, 2, device=DEVICE,
                                                             dtype=torch.int64), 4)
        assert gather_ids.numel() == sorted_probs.numel() == 0
        assert offsets.dtype == torch.int64 and offsets.cpu().tolist() == [0] * (H * 4 + 1)


def test_layout_ignores_out_of_range_indices(rng):
    # invalid input: the routes of bad ids are left out, nothing is written out of bounds
    probs = torch.rand(1, 6, 2, generator=rng)
    indices = torch.tensor([[[0, 1], [2, 9], [1, -1], [2**40, 0], [1, 2], [0, 2]]])
    gather_ids, sorted_probs, offsets, _ = triton_sort_routes(probs.to(DEVICE),
                                                           indices.to(DEVICE), 3)
    valid = (indices >= 0) & (indices < 3)
    ref = sort_routes_reference(probs[valid].view(1, -1, 1), indices[valid].view(1, -1, 1), 3)
    n = int(valid.sum())
    assert offsets.cpu().tolist() == ref[2].tolist()
    assert sorted_probs[:n].cpu().tolist() == ref[1].tolist()
    tokens = valid.nonzero()[:, 1]
    assert gather_ids[:n].cpu().tolist() == tokens[ref[0].long()].tolist()


# numpy warns on the interpreter's inf - inf of the all -inf softmax row (NaN, as in torch)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("block_t,chunk", [(2, 4), (4, 8), (16, 32), (64, 512), (None, None)])
def test_route_counts_give_the_reference_layout(rng, block_t, chunk):
    # The route kernel counts its picks per block of tokens; the layout built from those
    # counts (no count step) is the reference's, bitwise. Rows of NaN and inf logits among
    # them, several blocks, a partial last block, chunks smaller and larger than a block.
    H, S, E, K = 3, 29, 24, 5
    logits = torch.randn(H, S, E, generator=rng) * 2
    logits[0, 3] = NAN                 # every logit NaN: experts 0..K-1, NaN probabilities
    logits[1, 7, 2] = NAN              # one NaN expert: never picked
    logits[2, 9, :4] = INF             # +inf logits: picked first
    logits[2, 10, :] = -INF            # all -inf: ascending ids
    bias = torch.randn(H, E, generator=rng) * 0.1
    options = RouterOptions(K, route_scale=4.9)
    plain = triton_route(logits.to(DEVICE), options, bias.to(DEVICE))
    assert plain.block_counts is None  # not asked for
    T = block_t or layout_block_t(K)
    p, i, counts = triton_route(logits.to(DEVICE), options, bias.to(DEVICE), count_block_t=T)
    # counting changes no probability or index bit
    assert torch.equal(p.nan_to_num(7.0), plain[0].nan_to_num(7.0)) and torch.equal(i, plain[1])
    assert counts.dtype == torch.int32 and torch.equal(counts.cpu(), block_counts(i, E, T))
    want = sort_routes_reference(p.cpu(), i.cpu(), E)
    same_layout(triton_sort_routes(p, i, E, block_counts=counts, block_t=block_t,
                                    chunk=chunk), want)
    # ranks="scatter" without counts: its own count step (counts only), same layout
    same_layout(triton_sort_routes(p, i, E, ranks="scatter", block_t=block_t, chunk=chunk),
                 want)
    # the positions output: sorted_probs[positions] == probs, the backward's gather
    _, sp, _, pos = triton_sort_routes(p, i, E, block_counts=counts, block_t=block_t,
                                       chunk=chunk, return_positions=True)
    assert torch.equal(sp[pos.long()].view(H, S, K).nan_to_num(7.0), p.nan_to_num(7.0))


def test_route_counts_with_groups_and_softmax(rng):
    # the counts come from the picks whatever the selection rule
    logits = torch.randn(2, 19, 16, generator=rng)
    for score_func in ("sigmoid", "softmax"):
        p, i, counts = triton_route(logits.to(DEVICE),
                                    RouterOptions(4, score_func, num_groups=4, topk_groups=2),
                                    count_block_t=8)
        assert torch.equal(counts.cpu(), block_counts(i, 16, 8))
        same_layout(triton_sort_routes(p, i, 16, block_counts=counts, block_t=8),
                     sort_routes_reference(p.cpu(), i.cpu(), 16))


def test_route_counts_one_expert_takes_every_token(rng):
    # expert 3 wins every token of head 0 (its logit far above the rest): all S routes of
    # one expert in every block; K = 1 (the whole head on one expert) and K = 4
    S, E = 70, 8
    logits = torch.randn(2, S, E, generator=rng)
    logits[0, :, 3] = 30.0
    for K in (1, 4):
        p, i, counts = triton_route(logits.to(DEVICE), RouterOptions(K), count_block_t=16)
        assert (i[0, :, 0] == 3).all()
        assert (counts[0, :, 3].cpu() == torch.tensor([16, 16, 16, 16, 6])).all()
        layout = triton_sort_routes(p, i, E, block_counts=counts, block_t=16, chunk=8)
        same_layout(layout, sort_routes_reference(p.cpu(), i.cpu(), E))
        if K == 1:
            assert layout[2].cpu().tolist()[:E + 1] == [0, 0, 0, 0, S, S, S, S, S]
            assert layout[0][:S].cpu().tolist() == list(range(S))


def test_layout_ranks_scatter_without_counts(rng):
    # ranks="scatter" on arbitrary indices: repeated experts within a token (never made by
    # route(), allowed by sort_routes), int32 indices, K = 1, one expert for a whole head
    probs = torch.rand(2, 23, 4, generator=rng)
    indices = torch.randint(0, 7, (2, 23, 4), generator=rng)
    for idx, block_t, chunk in ((indices, 1, 1), (indices, 4, 2), (indices, 32, 64),
                                (indices.to(torch.int32), 8, 32)):
        same_layout(triton_sort_routes(probs, idx.to(DEVICE), 7, ranks="scatter",
                                        block_t=block_t, chunk=chunk),
                     sort_routes_reference(probs, idx, 7))
    skew = torch.full((2, 30, 1), 2)
    skew[1] = torch.randint(0, 3, (30, 1), generator=rng)
    probs = torch.rand(2, 30, 1, generator=rng)
    same_layout(triton_sort_routes(probs, skew.to(DEVICE), 3, ranks="scatter", block_t=16,
                                    chunk=4),
                 sort_routes_reference(probs, skew, 3))


def test_layout_ranks_scatter_ignores_out_of_range_indices(rng):
    # invalid input, as test_layout_ignores_out_of_range_indices: the same outcome
    probs = torch.rand(1, 6, 2, generator=rng)
    indices = torch.tensor([[[0, 1], [2, 9], [1, -1], [2**40, 0], [1, 2], [0, 2]]])
    count = triton_sort_routes(probs.to(DEVICE), indices.to(DEVICE), 3, ranks="count")
    scatter = triton_sort_routes(probs.to(DEVICE), indices.to(DEVICE), 3, ranks="scatter",
                                 block_t=2, chunk=2)
    n = int(((indices >= 0) & (indices < 3)).sum())
    assert torch.equal(scatter[2], count[2])
    assert torch.equal(scatter[0][:n], count[0][:n]) and torch.equal(scatter[1][:n],
                                                                     count[1][:n])


def test_layout_with_wrong_counts_writes_only_its_head(rng):
    # counts that are not those of the indices (here negative ones for head 1) give a wrong
    # layout for that head, but its writes stay in its slice: head 0 is still the reference
    H, S, E, K = 2, 12, 6, 2
    p, i, counts = triton_route(torch.randn(H, S, E, generator=rng).to(DEVICE),
                                RouterOptions(K), count_block_t=4)
    bad = counts.clone()
    bad[1, :, 0] = -1000
    gather_ids, sorted_probs, _, _ = triton_sort_routes(p, i, E, block_counts=bad, block_t=4)
    want = sort_routes_reference(p.cpu(), i.cpu(), E)
    assert torch.equal(gather_ids[:S * K].cpu(), want[0][:S * K])
    assert torch.equal(sorted_probs[:S * K].cpu(), want[1][:S * K])


def test_layout_refuses_counts_it_cannot_use(rng):
    p, i, counts = triton_route(torch.randn(2, 10, 8, generator=rng).to(DEVICE),
                                RouterOptions(2), count_block_t=4)
    with pytest.raises(ValueError, match="block_counts"):
        triton_sort_routes(p, i, 8, block_counts=counts, block_t=8)  # other blocks
    with pytest.raises(ValueError, match="block_counts"):
        triton_sort_routes(p, i, 8, block_counts=counts.long(), block_t=4)
    with pytest.raises(ValueError, match="ranks"):
        triton_sort_routes(p, i, 8, block_counts=counts, block_t=4, ranks="count")
    with pytest.raises(ValueError, match="ranks"):
        triton_sort_routes(p, i, 8, ranks="sort")
    with pytest.raises(ValueError, match="power of two"):
        triton_route(torch.randn(2, 10, 8, device=DEVICE), RouterOptions(2), count_block_t=6)
    # past int32 route indices: refused before anything is allocated (stride-0 views)
    huge = (1, 2**29, 4)
    with pytest.raises(ValueError, match="int32"):
        triton_sort_routes(torch.zeros(1, 1, 1).expand(huge),
                           torch.zeros(1, 1, 1, dtype=torch.int64).expand(huge), 8)
    # edge: S = 0, counts [H, 0, E]; the layout of no routes
    p, i, counts = triton_route(torch.empty(2, 0, 8, device=DEVICE), RouterOptions(2),
                                count_block_t=4)
    assert counts.shape == (2, 0, 8)
    assert triton_sort_routes(p, i, 8, block_counts=counts, block_t=4).offsets.cpu().tolist() \
        == [0] * 17


def test_layout_steps_one_by_one(rng):
    # The per-step launchers the benchmarks time, chained by hand: both ways give the
    # reference's layout, with the default scan tiles and with other ones; several blocks,
    # a partial last one, sub-blocks of the count step.
    H, S, E, K, T = 2, 21, 8, 3, 4
    probs = torch.rand(H, S, K, generator=rng).to(DEVICE)
    indices = torch.stack([torch.randperm(E, generator=rng)[:K] for _ in range(H * S)])
    indices = indices.view(H, S, K).to(DEVICE)
    want = sort_routes_reference(probs.cpu(), indices.cpu(), E)
    R = H * S * K

    def outputs():
        return (torch.empty(R, dtype=torch.int32, device=DEVICE),
                torch.empty(R, device=DEVICE), torch.empty(R, dtype=torch.int32, device=DEVICE))

    # "count": counts and in-block ranks, scan, offsets, scatter
    hist, rank = layout_kernels.layout_count(indices, E, T, 2)
    assert torch.equal(hist.cpu(), block_counts(indices, E, T))
    base, totals = layout_kernels.layout_scan(hist)
    offsets = layout_kernels.layout_offsets(totals, S, K)
    gather_ids, sorted_probs, positions = outputs()
    layout_kernels.layout_scatter(indices, probs, rank, base, offsets, gather_ids, sorted_probs,
                                  positions, T)
    same_layout((gather_ids, sorted_probs, offsets), want)
    assert torch.equal(sorted_probs[positions.long()].view(H, S, K), probs)
    # "scatter": counts only, the scan on other tiles, the ranking scatter (no positions)
    hist = layout_kernels.layout_hist(indices, E, T)
    assert torch.equal(hist.cpu(), block_counts(indices, E, T))
    base2, totals2 = layout_kernels.layout_scan(hist, LayoutScanTiles(2, 4, 1))
    assert torch.equal(base2, base) and torch.equal(totals2, totals)
    offsets = torch.empty(H * E + 1, dtype=torch.int64, device=DEVICE)
    gather_ids, sorted_probs, _ = outputs()
    layout_kernels.layout_rank_scatter(indices, probs, base2, totals2, offsets, gather_ids,
                                       sorted_probs, None, T, 4)
    same_layout((gather_ids, sorted_probs, offsets), want)


def test_route_then_layout_end_to_end(rng):
    # the MAGI-2 preset's routing arguments, several heads, full chain
    H, S, E, K = 3, 29, 64, 6
    logits = torch.randn(H, S, E, generator=rng)
    bias = torch.randn(H, E, generator=rng) * 0.05
    p, i = check_route(logits, K, "sigmoid", bias, True, 4.9)
    _check_layout(p, i, E)
