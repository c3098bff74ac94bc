"""What the routing kernels' tests share (tests/test_topk.py, test_layout.py,
test_router_logits.py): the device, the near-tie rule, the reference check of the route
kernel, logits built to defeat packed keys, and layout comparisons.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), on small shapes with big tiles.
"""

import torch

from mhmoe.config import RouterOptions
from mhmoe.kernels.topk import triton_route
from mhmoe.reference import route_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TIE_TOL = 1e-6  # selection scores closer than this (relative) may come in either order
NAN = float("nan")
INF = float("inf")


def near_ties(logits, top_k, score_func, bias, num_groups, topk_groups):
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


def check_route(logits, top_k, score_func="sigmoid", bias=None, route_norm=True,
                 route_scale=4.9, num_groups=1, topk_groups=1, **tile):
    """`triton_route` against `route_reference` on every row that is not a near-tie:
    indices equal, probabilities within TIE_TOL. tile: `triton_route`'s tile overrides."""
    args = (top_k, score_func, bias, route_norm, 1e-12, route_scale, num_groups, topk_groups)
    ref_p, ref_i = route_reference(logits, *args)
    options = RouterOptions(top_k, score_func, route_norm, 1e-12, route_scale, num_groups,
                            topk_groups)
    p, i, _ = triton_route(logits.to(DEVICE), options,
                           None if bias is None else bias.to(DEVICE), **tile)
    p, i = p.cpu(), i.cpu()
    assert p.dtype == torch.float32 and i.dtype == torch.int64
    assert p.shape == i.shape == ref_p.shape
    assert ((i >= 0) & (i < logits.shape[-1])).all()
    ok = ~near_ties(logits, top_k, score_func, bias, num_groups, topk_groups)
    assert torch.equal(i[ok], ref_i[ok])
    torch.testing.assert_close(p[ok], ref_p[ok], rtol=TIE_TOL, atol=0, equal_nan=True)
    return p, i


FLIP_PAIRS = ((0, 2), (3, 5), (6, 8))


def hard_logits(rng, H, S, E):
    """Random rows, then rows built to defeat packed keys: exact ties, ties after
    rounding, near-ties across bucket edges, saturated sigmoids, inf, -inf, NaN."""
    logits = torch.randn(H, S, E, generator=rng) * 2
    r = iter(range(S))
    row = next(r)
    logits[:, row, [1, 4, E - 1]] = 5.0                   # exact ties at the top
    row = next(r)
    x = torch.tensor(1.5)
    logits[:, row, :4] = torch.stack([x, torch.nextafter(x, torch.tensor(9.0)),
                                      x.nextafter(torch.tensor(-9.0)), x])  # ulp apart
    row = next(r)
    logits[:, row] = 30.0 + torch.arange(E) * 1e-3        # sigmoids all round to 1.0
    row = next(r)
    logits[:, row] = torch.linspace(3.0, 3.0 + 4e-6 * E, E)  # a ladder of near-ties
    row = next(r)
    logits[:, row, 2] = INF
    logits[:, row, E // 2] = INF                           # two +inf: tied at 1.0
    row = next(r)
    logits[:, row] = -INF                                   # every score 0: ascending ids
    row = next(r)
    logits[:, row] = NAN                                    # every selection score -inf
    row = next(r)
    logits[:, row, :E // 2] = NAN                           # half NaN
    # Pairs whose order the interpreter's approximate sigmoid swaps (columns 0 mod 3 moved
    # down by 2^-20 relative, 2 mod 3 up, see `_sigmoid_approx`): exact scores ~half the
    # swap apart, so the swapped values often lie in different buckets, and only the
    # margin check catches them. Three pairs at three levels, the rest far below.
    for row in (next(r), next(r)):
        logits[:, row] = -6.0
        levels = ((1.0, 3.5e-6), (0.0, 1.9e-6), (-1.0, 1.3e-6))
        for (a, b), (x, dx) in zip(FLIP_PAIRS, levels, strict=True):
            if b < E:
                logits[:, row, a], logits[:, row, b] = x + dx, x
    # a flip pair at the top of a row: at the K boundary for K = 1, among the picks for more
    logits[:, row, :3] = torch.tensor([1.0 + 3.5e-6, 0.5, 1.0])
    return logits


def block_counts(indices, num_experts, block_t):
    """[H, cdiv(S, block_t), E] int32: routes of each expert per block of block_t tokens."""
    H, S, K = indices.shape
    NB = -(-S // block_t)
    blocks = (torch.arange(S) // block_t).view(1, S, 1).expand(H, S, K)
    flat = (torch.arange(H).view(H, 1, 1) * NB + blocks) * num_experts + indices.cpu()
    return torch.bincount(flat.reshape(-1), minlength=H * NB * num_experts).view(
        H, NB, num_experts).to(torch.int32)


def same_layout(got, want):
    """Bitwise equal layouts: got (a `triton_sort_routes` result) against want
    (gather_ids, sorted_probs, offsets); NaN probabilities of NaN rows compare equal."""
    for a, b in zip(got[:3], want, strict=True):
        a = a.cpu()
        assert a.dtype == b.dtype
        assert torch.equal(a, b) or (a.is_floating_point() and
                                     torch.equal(a.isnan(), b.isnan()) and
                                     torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
