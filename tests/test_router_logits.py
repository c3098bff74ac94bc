"""Router logits on tensor cores (kernels/router_logits.py): the exact split of the
router weight, and the logits (+ route) kernel, fused or split, with and without
shortlists, against mhmoe.reference on torch's fp32 logits and on float64 logits.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), on small shapes with big tiles.
"""

import pytest
import torch

pytest.importorskip("triton")

from mhmoe.config import RouterOptions
from mhmoe.kernels import router_logits
from mhmoe.kernels.layout import triton_sort_routes
from mhmoe.kernels.router_logits import split_router_weight, triton_logits_route
from mhmoe.kernels.topk import triton_route
from mhmoe.kernels.tuning import LogitsRouteConfig
from mhmoe.reference import route_reference, sort_routes_reference
from oracle import route_row
from routing_checks import (
    DEVICE,
    TIE_TOL,
    block_counts,
    near_ties,
    same_layout,
)


# numpy warns on the interpreter's inf - inf (computed, then discarded by a where)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_split_router_weight_is_exact(rng):
    # w == w1 + w2 + w3 exactly, over fp32's whole normal range and at its edges
    # sign * [1, 2) * 2^e with e down to -100: the split is exact while its residuals stay
    # in fp32's normal range (|w| >= 2^-110, far below any router weight)
    w = (torch.rand(4096, generator=rng, dtype=torch.float64) + 1) * torch.pow(
        2.0, torch.randint(-100, 127, (4096,), generator=rng).double())
    w = torch.where(torch.rand(4096, generator=rng) < 0.5, -w, w)
    edges = torch.tensor([0.0, -0.0, 1.0, -1.5, 2.0**-100, 3.4028234663852886e38,
                          -3.4028234663852886e38, 1.0 + 2.0**-23, 0.1], dtype=torch.float64)
    w = torch.cat([w, edges]).float()
    parts = split_router_weight(w.to(DEVICE)).cpu()
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, w.numel())
    total = parts.double().sum(0)  # three terms of at most 8 bits: exact in float64
    assert torch.equal(total, w.double())
    # non-finite weights: w1 carries them, the other parts are 0 (logits = x * w as in fp32)
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    parts = split_router_weight(special.to(DEVICE)).cpu().float()
    assert parts[0, :2].tolist() == [float("inf"), -float("inf")] and parts[0, 2].isnan()
    assert not parts[1:].any()


def _fused_inputs(rng, H, S, E, D):
    """x [S, H, D] bf16, gate [H, E, D] fp32 scaled as a trained router: logits ~ N(0, 1)."""
    x = torch.randn(S, H, D, generator=rng).bfloat16()
    gate = torch.randn(H, E, D, generator=rng) * D**-0.5
    return x, gate


def _probs_tol(logits32, logits64, top_k, score_func, args):
    """The contract's 1e-6 relative, or twice PyTorch's own fp32 error against float64 where
    that is larger: softmax probabilities move by about twice the logits' error, and small
    sigmoid probabilities (the tail of a K = E row) by about the logits' error, which for
    fp32 logits alone (torch's GEMM included) reaches ~1e-6."""
    p32, i32 = route_reference(logits32, top_k, score_func, *args)
    p64, i64 = route_reference(logits64, top_k, score_func, *args)
    same = (i32 == i64).all(-1)
    torch_err = ((p32 - p64).abs() / p64.abs())[same].max().item() if same.any() else 0.0
    return max(TIE_TOL, 2 * torch_err)


def _check_fused(x, gate, top_k, score_func="sigmoid", bias=None, route_norm=True,
                 route_scale=4.9, num_groups=1, topk_groups=1, config=None):
    """The library's promise (docs/contract.md section 2): indices equal wherever adjacent
    selection scores differ by more than 1e-6 relative, probabilities within 1e-6 relative,
    against route_reference on torch's fp32 logits and against the float64 oracle
    (oracle.route_row)."""
    S, H, D = x.shape
    E = gate.shape[1]
    args = (bias, route_norm, 1e-12, route_scale, num_groups, topk_groups)
    options = RouterOptions(top_k, score_func, route_norm, 1e-12, route_scale, num_groups,
                            topk_groups)
    bias_d = None if bias is None else bias.to(DEVICE)
    p, i, logits, counts = triton_logits_route(x.to(DEVICE), gate.to(DEVICE), options, bias_d,
                                               return_logits=True, config=config)
    assert counts is None  # not asked for
    p, i, logits = p.cpu(), i.cpu(), logits.cpu()
    assert p.shape == i.shape == (H, S, top_k) and logits.shape == (H, S, E)
    assert p.dtype == torch.float32 and i.dtype == torch.int64 and logits.dtype == torch.float32
    assert ((i >= 0) & (i < E)).all()
    # The routing of the kernel's own logits is exactly the unfused kernel's.
    p2, i2, _ = triton_route(logits.to(DEVICE), options, bias_d)
    assert torch.equal(i, i2.cpu()) and torch.equal(p, p2.cpu())

    logits32 = torch.bmm(x.transpose(0, 1).float(), gate.transpose(1, 2))
    logits64 = torch.einsum("shd,hed->hse", x.double(), gate.double())
    # fp32 accumulation of exact products: the usual bound of an fp32 dot product
    bound = D * 2.0**-24 * torch.einsum("shd,hed->hse", x.double().abs(), gate.double().abs())
    assert ((logits.double() - logits64).abs() <= bound).all()
    rtol = _probs_tol(logits32, logits64, top_k, score_func, args)

    ref_p, ref_i = route_reference(logits32, top_k, score_func, *args)
    ok = ~near_ties(logits32, top_k, score_func, bias, num_groups, topk_groups)
    assert torch.equal(i[ok], ref_i[ok])
    torch.testing.assert_close(p[ok], ref_p[ok], rtol=rtol, atol=0)

    ok = ~near_ties(logits64, top_k, score_func, None if bias is None else bias.double(),
                     num_groups, topk_groups)
    for h in range(H):
        for s in range(S):
            if not ok[h, s]:
                continue
            ref_p, ref_i = route_row(logits64[h, s], top_k, score_func,
                                     None if bias is None else bias.view(H, E)[h], route_norm,
                                     1e-12, route_scale, num_groups, topk_groups)
            assert i[h, s].tolist() == ref_i, (h, s)
            torch.testing.assert_close(p[h, s].double(), torch.tensor(ref_p, dtype=torch.float64),
                                       rtol=rtol, atol=0)
    return p, i, logits


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("H,S,E,D,K", [
    (2, 37, 16, 32, 3),    # S not a multiple of the tile
    (1, 1, 32, 16, 1),     # one head, S = 1, K = 1, D = 16 (one dot step)
    (3, 5, 16, 48, 16),    # K = E; D = 48, not a power of two
    (2, 24, 256, 64, 6),   # MAGI-2's E and K
])
def test_fused_route_matches_reference(rng, score_func, with_bias, H, S, E, D, K):
    x, gate = _fused_inputs(rng, H, S, E, D)
    bias = torch.randn(H, E, generator=rng) * 0.02 if with_bias else None
    _check_fused(x, gate, K, score_func, bias)


def test_fused_route_strided_x_heads(rng):
    # The kernel reads x as [S, H * D] rows: a slice of heads (rows longer than H * D) is
    # read in place, heads that are not adjacent (every other head) are copied first. Both
    # route as a contiguous copy does, bitwise, and the logits stay in their heads.
    full, gate4 = _fused_inputs(rng, 4, 21, 32, 32)
    bias = torch.randn(4, 32, generator=rng) * 0.02
    for heads in (slice(1, 3), slice(0, 4, 2)):
        x, gate, b = full[:, heads], gate4[heads], bias[heads]
        assert not x.is_contiguous()
        outs = [triton_logits_route(v.to(DEVICE), gate.to(DEVICE),
                                    RouterOptions(3, route_scale=4.9), b.to(DEVICE),
                                    return_logits=True)[:3]
                for v in (x, x.contiguous())]
        for a, c in zip(*outs, strict=True):
            assert torch.equal(a.cpu(), c.cpu())
        _check_fused(x, gate, 3, "sigmoid", b)


def test_fused_route_groups_and_no_norm(rng):
    x, gate = _fused_inputs(rng, 2, 19, 32, 32)
    bias = torch.randn(2 * 32, generator=rng) * 0.05  # flat [H*E] bias is accepted too
    for score_func in ("sigmoid", "softmax"):
        _check_fused(x, gate, 4, score_func, bias, num_groups=8, topk_groups=3)
        _check_fused(x, gate, 4, score_func, bias, route_norm=False, route_scale=1.0)


@pytest.mark.parametrize("config", [
    LogitsRouteConfig(block_s=16, block_d=16, num_warps=4, num_stages=1, from_tile=False),
    LogitsRouteConfig(block_s=32, block_d=16, num_warps=4, num_stages=2, from_tile=True),
    LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=3, from_tile=False),
])
def test_fused_tile_choice_does_not_change_results(rng, config):
    # several tiles, a partial last tile, both ways of gathering the picked logits
    x, gate = _fused_inputs(rng, 2, 45, 64, 64)
    bias = torch.randn(2, 64, generator=rng) * 0.02
    k6 = RouterOptions(6, route_scale=4.9)
    p, i, _ = _check_fused(x, gate, 6, "sigmoid", bias, config=config)
    # the gather only moves where a value comes from: bitwise the same
    other = LogitsRouteConfig(config.block_s, config.block_d, config.num_warps, 1,
                              not config.from_tile)
    p2, i2, _, _ = triton_logits_route(x.to(DEVICE), gate.to(DEVICE), k6,
                                    bias.to(DEVICE), config=other)
    assert torch.equal(p2.cpu(), p) and torch.equal(i2.cpu(), i)
    # split: the same logits written by the kernel, then routed by `_route_kernel`
    split = LogitsRouteConfig(config.block_s, config.block_d, config.num_warps, 1, False,
                              split=True)
    p3, i3, logits3, _ = triton_logits_route(x.to(DEVICE), gate.to(DEVICE), k6,
                                          bias.to(DEVICE), config=split,
                                          return_logits=True)
    assert torch.equal(p3.cpu(), p) and torch.equal(i3.cpu(), i)
    _, _, logits, _ = triton_logits_route(x.to(DEVICE), gate.to(DEVICE), k6,
                                       bias.to(DEVICE), config=config,
                                       return_logits=True)
    assert torch.equal(logits3, logits)
    # split with the logits stored in two column halves: the same values, in place
    half = LogitsRouteConfig(config.block_s, config.block_d, config.num_warps, 1, False,
                             split=True, half_stores=True)
    p4, i4, logits4, _ = triton_logits_route(x.to(DEVICE), gate.to(DEVICE), k6,
                                          bias.to(DEVICE), config=half,
                                          return_logits=True)
    assert torch.equal(logits4, logits)
    assert torch.equal(p4.cpu(), p) and torch.equal(i4.cpu(), i)
    # split, a program computing a quarter or half of the experts, whole or in halves:
    # the same dot products, each logit written once, in place
    # (and the same with bulk stores: S = 45 is not a multiple of the tile, so the last
    # tile's rows past S must be clipped, not written into the next head's rows)
    # (and shortlists: the route kernel routes from each column block's shortlist)
    for block_e, halves, tma, short in (
            (16, False, False, False), (32, True, False, False), (128, True, False, False),
            (32, True, True, False), (16, False, True, False), (128, False, True, False),
            (16, False, True, True), (32, True, False, True), (128, False, True, True),
            (128, False, True, "merged")):
        part = LogitsRouteConfig(config.block_s, config.block_d, config.num_warps, 1, False,
                                 split=True, half_stores=halves, block_e=block_e,
                                 tma_store=tma, shortlist=bool(short),
                                 merged_lists=short == "merged")
        p5, i5, logits5, _ = triton_logits_route(x.to(DEVICE), gate.to(DEVICE), k6,
                                              bias.to(DEVICE), config=part,
                                              return_logits=True)
        assert torch.equal(logits5, logits)
        assert torch.equal(p5.cpu(), p) and torch.equal(i5.cpu(), i)


# numpy warns on the interpreter's inf - inf of NaN rows (NaN, as in torch)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_fused_route_nan_and_inf(rng):
    H, S, E, D = 2, 6, 16, 32
    x, gate = _fused_inputs(rng, H, S, E, D)
    x[1, 0, 3] = float("nan")   # token 1, head 0: every logit NaN
    x[2, 1, 0] = float("inf")   # token 2, head 1: logits +-inf (or NaN where w = 0)
    gate[0, 5, 7] = float("inf")  # expert 5 of head 0: its logits +-inf for every token
    for score_func in ("sigmoid", "softmax"):
        p, i, logits, _ = triton_logits_route(x.to(DEVICE), gate.to(DEVICE),
                                              RouterOptions(4, score_func, route_scale=2.0),
                                              return_logits=True)
        p, i, logits = p.cpu(), i.cpu(), logits.cpu()
        ref_logits = torch.bmm(x.transpose(0, 1).float(), gate.transpose(1, 2))
        finite = torch.isfinite(ref_logits)
        # the same logits are non-finite as with torch's fp32 GEMM, and the same are NaN,
        # except that an infinite x times a zero weight part is NaN (fp32: inf * w = +-inf)
        assert torch.equal(finite, torch.isfinite(logits))
        inf_x = torch.isinf(x.transpose(0, 1)).any(-1, keepdim=True).expand_as(logits)
        assert torch.equal(logits[~finite & ~inf_x].isnan(), ref_logits[~finite & ~inf_x].isnan())
        ref_p, ref_i = route_reference(logits, 4, score_func, route_scale=2.0)
        assert torch.equal(i, ref_i)
        torch.testing.assert_close(p, ref_p, rtol=TIE_TOL, atol=0, equal_nan=True)
        assert torch.isnan(p[0, 1]).all() and ((i >= 0) & (i < E)).all()
        # rows without a non-finite input are untouched: finite probabilities
        clean = torch.isfinite(x.transpose(0, 1)).all(-1) & torch.isfinite(ref_logits).all(-1)
        assert torch.isfinite(p[clean]).all()


# numpy warns on the interpreter's inf - inf of NaN rows (NaN, as in torch)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("config,count_t", [
    (LogitsRouteConfig(block_s=32, block_d=32, num_warps=4, num_stages=1, from_tile=True), 16),
    (LogitsRouteConfig(block_s=16, block_d=32, num_warps=4, num_stages=1, from_tile=False), 64),
    # split: the logits kernel zeroes the count blocks that start in its tile (several a
    # tile, or one every few tiles), then the route kernel adds
    (LogitsRouteConfig(block_s=32, block_d=32, num_warps=4, num_stages=1, from_tile=False,
                       split=True), 8),
    (LogitsRouteConfig(block_s=16, block_d=32, num_warps=4, num_stages=1, from_tile=False,
                       split=True), 64),
    # split over the experts too: each program zeroes its own columns of the count rows
    (LogitsRouteConfig(block_s=32, block_d=32, num_warps=4, num_stages=1, from_tile=False,
                       split=True, half_stores=True, block_e=16), 8),
    # shortlists of column blocks, bulk stores
    (LogitsRouteConfig(block_s=16, block_d=32, num_warps=4, num_stages=1, from_tile=False,
                       split=True, block_e=16, tma_store=True, shortlist=True), 8),
])
def test_fused_route_counts(rng, config, count_t, monkeypatch):
    # logits + route with counts, fused or split: the picks and probabilities of the exact
    # rounds on the kernel's own logits, the same with counts as without, counts of them,
    # and the layout from them is the reference's; NaN and inf inputs among the rows.
    # A buffer the kernels are to zero comes filled with garbage (the CPU's empty is zeroed).
    new_counts = router_logits.new_block_counts

    def garbage_counts(*args, zeroed):
        counts = new_counts(*args, zeroed=zeroed)
        return counts if zeroed else counts.fill_(12345)

    monkeypatch.setattr(router_logits, "new_block_counts", garbage_counts)
    H, S, E, D, K = 2, 45, 32, 32, 6
    x, gate = _fused_inputs(rng, H, S, E, D)
    x[4, 0, 1] = float("nan")    # token 4, head 0: every logit NaN
    x[9, 1, 0] = float("inf")    # token 9, head 1: logits +-inf
    bias = torch.randn(H, E, generator=rng) * 0.02
    options = RouterOptions(K, route_scale=4.9)
    args = (x.to(DEVICE), gate.to(DEVICE), options, bias.to(DEVICE))
    p, i, logits, _ = triton_logits_route(*args, config=config, return_logits=True)
    # the picks and probabilities of the exact rounds on the kernel's own logits
    exact = triton_route(logits, options, bias.to(DEVICE), keyed=False)
    assert torch.equal(i, exact[1]) and torch.equal(p.nan_to_num(7.0), exact[0].nan_to_num(7.0))
    p2, i2, _, counts = triton_logits_route(*args, config=config, count_block_t=count_t)
    assert torch.equal(i2, i) and torch.equal(p2.nan_to_num(7.0), p.nan_to_num(7.0))
    assert torch.equal(counts.cpu(), block_counts(i, E, count_t))
    same_layout(triton_sort_routes(p2, i2, E, block_counts=counts, block_t=count_t),
                 sort_routes_reference(p2.cpu(), i2.cpu(), E))


def test_fused_route_rejects_what_it_cannot_compute(rng):
    x, gate = _fused_inputs(rng, 2, 4, 16, 32)
    bad = [
        (x.half(), gate, "bfloat16"),          # fp16 x: products with bf16 parts not exact
        (x.float(), gate, "bfloat16"),         # fp32 x: likewise
        (x, gate.double(), "float32"),         # a float64 router
        (x, gate[:, :12], "power of two"),     # E = 12
        (x, torch.randn(2, 512, 32), "power of two"),  # E = 512: over the register tile
        (x[..., :24], gate[..., :24], "multiple of 16"),  # D = 24
    ]
    for xx, gg, match in bad:
        with pytest.raises(ValueError, match=match):
            triton_logits_route(xx.to(DEVICE), gg.to(DEVICE), RouterOptions(2))
    with pytest.raises(ValueError, match="top_k"):
        triton_logits_route(x.to(DEVICE), gate.to(DEVICE), RouterOptions(17))


def test_logits_route_config_rejects_bad_tiles():
    with pytest.raises(ValueError, match="block_s must be a power of two"):
        LogitsRouteConfig(block_s=48, block_d=32, num_warps=4, num_stages=1, from_tile=False)
    with pytest.raises(ValueError, match="block_e must be a power of two"):
        LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=1, from_tile=False,
                          split=True, block_e=24)
    with pytest.raises(ValueError, match="block_e needs split"):
        LogitsRouteConfig(block_s=64, block_d=32, num_warps=4, num_stages=1, from_tile=False,
                          block_e=64)


def test_fused_route_empty():
    # edge: S = 0 and H = 0, nothing to launch
    gate = torch.randn(2, 16, 16, device=DEVICE)
    p, i, logits, _ = triton_logits_route(torch.empty(0, 2, 16, device=DEVICE,
                                                      dtype=torch.bfloat16), gate,
                                          RouterOptions(3), return_logits=True)
    assert p.shape == i.shape == (2, 0, 3) and logits.shape == (2, 0, 16)
    p, i, logits, _ = triton_logits_route(torch.empty(4, 0, 16, device=DEVICE,
                                                      dtype=torch.bfloat16),
                                          torch.empty(0, 16, 16, device=DEVICE),
                                          RouterOptions(3))
    assert p.shape == i.shape == (0, 4, 3) and logits is None
