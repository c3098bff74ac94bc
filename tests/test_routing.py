"""route() and sort_routes() against the row-by-row float64 oracle."""

import pytest
import torch

import mhmoe
from mhmoe.config import RouterOptions
from oracle import route_row


def _check_route(logits, top_k, bias=None, **kw):
    """Compare route() with the oracle on every row, indices and probabilities.

    Random normal logits make a selection gap below fp32 rounding very unlikely
    at these sizes; a failure here on a near-tie would show as an index swap."""
    H, S, E = logits.shape
    probs, indices = mhmoe.route(logits, top_k, expert_bias=bias, **kw)
    assert probs.shape == indices.shape == (H, S, top_k)
    assert probs.dtype == torch.float32 and indices.dtype == torch.int64
    for h in range(H):
        for s in range(S):
            bias_row = bias.view(H, E)[h] if bias is not None else None
            ref_p, ref_i = route_row(logits[h, s], top_k, bias_row=bias_row, **kw)
            assert indices[h, s].tolist() == ref_i, (h, s)
            ref = torch.tensor(ref_p, dtype=torch.float64)
            torch.testing.assert_close(probs[h, s].double(), ref, rtol=1e-6, atol=1e-7)
    return probs, indices


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("route_norm", [True, False])
@pytest.mark.parametrize("H,S,E,K", [
    (1, 1, 1, 1),      # one head, one token, one expert
    (2, 7, 8, 3),
    (3, 5, 6, 6),      # K = E
    (1, 4, 16, 1),     # K = 1
])
def test_route_matches_oracle(rng, score_func, route_norm, H, S, E, K):
    logits = torch.randn(H, S, E, generator=rng) * 3
    bias = torch.randn(H * E, generator=rng) * 0.1
    _check_route(logits, K, bias=bias, score_func=score_func, route_norm=route_norm,
                 route_scale=4.9)


def test_route_s_zero():
    # edge: S = 0 tokens
    probs, indices = mhmoe.route(torch.empty(2, 0, 4), 2)
    assert probs.shape == indices.shape == (2, 0, 2)


def test_route_ties_go_to_lower_expert():
    # every score equal: the first K experts in ascending id, equal probabilities
    logits = torch.zeros(2, 3, 8)
    probs, indices = mhmoe.route(logits, 3, route_scale=2.0)
    assert indices.tolist() == [[[0, 1, 2]] * 3] * 2
    torch.testing.assert_close(probs, torch.full((2, 3, 3), 2.0 / 3))
    # a tie between experts 5 and 2 at the top: 2 comes first
    logits = torch.tensor([[[0.0, 0.0, 3.0, 0.0, 0.0, 3.0, 1.0, 0.0]]])
    _, indices = mhmoe.route(logits, 3)
    assert indices.tolist() == [[[2, 5, 6]]]


def test_bias_moves_selection_not_probabilities():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # pushes expert 3 to the top
    probs, indices = mhmoe.route(logits, 2, expert_bias=bias, route_norm=False)
    assert indices.tolist() == [[[3, 0]]]
    expected = torch.sigmoid(torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(probs[0, 0], expected)
    # [H, E] bias shape is accepted too
    probs2, indices2 = mhmoe.route(logits, 2, expert_bias=bias.view(1, 4), route_norm=False)
    assert torch.equal(probs, probs2) and torch.equal(indices, indices2)


def test_normalisation_values_by_hand():
    logits = torch.logit(torch.tensor([[[0.5, 0.25, 0.125, 0.0625]]], dtype=torch.float64)).float()
    probs, indices = mhmoe.route(logits, 2, route_scale=4.9)
    assert indices.tolist() == [[[0, 1]]]
    torch.testing.assert_close(probs[0, 0], torch.tensor([4.9 * 2 / 3, 4.9 / 3]))


def test_norm_eps_floor():
    # scores underflow to 0 -> the denominator is eps, probabilities stay 0, not NaN
    logits = torch.full((1, 1, 4), -200.0)
    probs, _ = mhmoe.route(logits, 2)
    assert torch.equal(probs, torch.zeros(1, 1, 2))


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_group_limited_routing(rng, score_func):
    H, S, E, K = 2, 9, 16, 4
    logits = torch.randn(H, S, E, generator=rng) * 2
    bias = torch.randn(H * E, generator=rng) * 0.2
    for groups, keep in ((4, 1), (4, 2), (8, 3), (16, 4), (2, 2)):
        _check_route(logits, K, bias=bias, score_func=score_func, num_groups=groups,
                     topk_groups=keep, route_scale=1.5)


def test_groups_fill_with_zero_not_minus_inf():
    # One group of 2 kept but K = 3: the third pick comes from the zeroed experts
    # (selection 0.0, lowest id first), and its probability is its unbiased score.
    logits = torch.tensor([[[5.0, 4.0, -3.0, -2.0]]])
    bias = torch.tensor([0.0, 0.0, -10.0, -10.0])
    probs, indices = mhmoe.route(logits, 3, expert_bias=bias, route_norm=False, num_groups=2,
                                 topk_groups=1)
    assert indices.tolist() == [[[0, 1, 2]]]
    torch.testing.assert_close(probs[0, 0], torch.sigmoid(torch.tensor([5.0, 4.0, -3.0])))


def test_nan_logits_stay_in_their_row(rng):
    H, S, E, K = 2, 6, 8, 3
    logits = torch.randn(H, S, E, generator=rng)
    clean_probs, clean_idx = mhmoe.route(logits.clone(), K)
    logits[0, 1, 3] = float("nan")           # one NaN expert: never picked, row still finite
    logits[1, 4, :] = float("nan")           # a whole NaN row
    logits[1, 2, :E - 2] = float("nan")      # fewer finite experts than K
    probs, indices = mhmoe.route(logits, K)
    assert ((indices >= 0) & (indices < E)).all()
    assert 3 not in indices[0, 1].tolist() and torch.isfinite(probs[0, 1]).all()
    finite_first = indices[1, 2].tolist()[:2]
    assert finite_first == sorted(finite_first, key=lambda e: -logits[1, 2, e])
    assert set(indices[1, 2].tolist()[:2]) == {E - 2, E - 1}
    assert torch.isnan(probs[1, 4]).all() and torch.isnan(probs[1, 2]).all()
    untouched = torch.ones(H, S, dtype=torch.bool)
    untouched[0, 1] = untouched[1, 4] = untouched[1, 2] = False
    assert torch.equal(indices[untouched], clean_idx[untouched])
    assert torch.equal(probs[untouched], clean_probs[untouched])


def test_infinite_logits():
    logits = torch.tensor([[[float("inf"), 0.0, float("-inf"), 1.0]]])
    probs, indices = mhmoe.route(logits, 2, route_norm=False)
    assert indices.tolist() == [[[0, 3]]]
    torch.testing.assert_close(probs[0, 0], torch.tensor([1.0, torch.sigmoid(torch.tensor(1.0))]))


@pytest.mark.parametrize("bad", [
    dict(top_k=0), dict(top_k=9), dict(score_func="relu"), dict(num_groups=3),
    dict(num_groups=2, topk_groups=3), dict(expert_bias=torch.zeros(7)), dict(norm_eps=0.0),
])
def test_route_rejects_bad_arguments(bad):
    args = dict(top_k=2)
    args.update(bad)
    with pytest.raises(ValueError):
        mhmoe.route(torch.randn(2, 3, 8), **args)


def test_route_rejects_bad_logits():
    with pytest.raises(ValueError, match=r"\[H, S, E\]"):
        mhmoe.route(torch.randn(3, 8), 2)
    with pytest.raises(ValueError, match="floating"):
        mhmoe.route(torch.ones(1, 3, 8, dtype=torch.int64), 2)


# ---------------------------------------------------------------- RouterOptions


@pytest.mark.parametrize("bad", [
    dict(top_k=0), dict(top_k=True), dict(top_k=2.0), dict(score_func="relu"),
    dict(route_norm=1), dict(norm_eps=0.0), dict(norm_eps=float("nan")),
    dict(route_scale="4.9"), dict(num_groups=0), dict(topk_groups=0),
])
def test_router_options_rejects_bad_fields(bad):
    # checked once, when built; the message names the field
    args = dict(top_k=2)
    args.update(bad)
    with pytest.raises(ValueError, match=f"RouterOptions.{next(iter(bad))}"):
        RouterOptions(**args)
    with pytest.raises(ValueError, match="topk_groups"):
        RouterOptions(2, num_groups=2, topk_groups=3)


def test_router_options_check_needs_the_experts():
    # the rules that need E: top_k <= E (edge: K = E passes), groups dividing E
    RouterOptions(8).check(8)
    with pytest.raises(ValueError, match=r"route: top_k must be an int in \[1, E=8\]"):
        RouterOptions(9).check(8, "route")
    with pytest.raises(ValueError, match="must divide"):
        RouterOptions(2, num_groups=3).check(8)
    RouterOptions(2, num_groups=4, topk_groups=2).check(8)


def test_router_options_cross_the_op_boundary_as_flat_scalars():
    options = RouterOptions(6, "softmax", False, 1e-9, 4.9, 4, 2)
    flat = options.op_args()
    assert flat == (6, "softmax", False, 1e-9, 4.9, 4, 2)
    assert RouterOptions(*flat) == options
    names = ("top_k", "score_func", "route_norm", "norm_eps", "route_scale", "num_groups",
             "topk_groups")
    inputs = {"logits": None, "with_counts": True, **dict(zip(names, flat, strict=True))}
    assert RouterOptions.from_op_args(inputs) == options
    # the layer's config hands its routing fields over as one object
    assert mhmoe.MAGI2_PREVIEW.router_options == RouterOptions(6, route_scale=4.9)


def test_routing_returns_named_tuples():
    # one return type whatever the flags: route -> Routes, route_tokens -> TokenRoutes
    logits = torch.randn(2, 3, 8)
    routes = mhmoe.route(logits, 2)
    assert isinstance(routes, mhmoe.routing.Routes) and routes.indices.shape == (2, 3, 2)
    x, gate = torch.randn(3, 2, 16), torch.randn(2, 8, 16)
    for block_counts in (False, True):
        out = mhmoe.routing.route_tokens(x, gate, RouterOptions(2), block_counts=block_counts)
        assert isinstance(out, mhmoe.routing.TokenRoutes)
        assert out.block_counts is None  # the PyTorch path counts nothing


# ---------------------------------------------------------------- sort_routes

def _csr_oracle(probs, indices, E):
    """Bucket the routes by flat expert in (h, s, k) order: the stable-sort contract."""
    H, S, K = indices.shape
    buckets = [[] for _ in range(H * E)]
    for h in range(H):
        for s in range(S):
            for k in range(K):
                buckets[h * E + int(indices[h, s, k])].append((s, float(probs[h, s, k])))
    gather = [s for b in buckets for s, _ in b]
    sp = [p for b in buckets for _, p in b]
    offsets = [0]
    for b in buckets:
        offsets.append(offsets[-1] + len(b))
    return gather, sp, offsets


@pytest.mark.parametrize("H,S,E,K", [
    (1, 1, 1, 1),     # one of everything
    (2, 9, 5, 2),
    (3, 4, 4, 4),     # K = E
    (2, 0, 3, 2),     # S = 0
    (1, 17, 64, 3),   # most experts empty
])
def test_sort_routes_matches_oracle(rng, H, S, E, K):
    logits = torch.randn(H, S, E, generator=rng)
    probs, indices = mhmoe.route(logits, K)
    gather_ids, sorted_probs, offsets = mhmoe.sort_routes(probs, indices, E)
    assert gather_ids.dtype == torch.int32 and sorted_probs.dtype == torch.float32
    assert offsets.dtype == torch.int64 and offsets.shape == (H * E + 1,)
    ref_g, ref_p, ref_o = _csr_oracle(probs, indices, E)
    assert gather_ids.tolist() == ref_g
    assert sorted_probs.tolist() == ref_p
    assert offsets.tolist() == ref_o


def test_sort_routes_every_token_on_one_expert():
    # edge: one expert takes every route of head 1, all others of that head are empty
    H, S, E = 2, 6, 4
    indices = torch.zeros(H, S, 1, dtype=torch.int64)
    indices[1] = 3
    probs = torch.rand(H, S, 1)
    gather_ids, sorted_probs, offsets = mhmoe.sort_routes(probs, indices, E)
    assert offsets.tolist() == [0, 6, 6, 6, 6, 6, 6, 6, 12]
    assert gather_ids.tolist() == list(range(6)) * 2
    assert torch.equal(sorted_probs, probs.reshape(-1))


@pytest.mark.parametrize("H,S,E,K,dtype", [
    (2, 9, 5, 2, torch.float32),
    (1, 17, 64, 3, torch.float32),    # one head; most experts empty
    (2, 0, 3, 2, torch.float32),      # S = 0
    (2, 11, 4, 3, torch.float64),     # float64 probabilities (the PyTorch path's gradchecks)
])
def test_content_route_order_by_hand(rng, H, S, E, K, dtype):
    # Within each expert: ascending (key of the route's token in its head, probability
    # bits); across experts: the layout's segments untouched. Keys drawn from few values,
    # so that ties on the key fall back to the probability.
    probs, indices = mhmoe.route(torch.randn(H, S, E, generator=rng, dtype=dtype), K)
    layout = mhmoe.sort_routes(probs, indices, E)
    keys = torch.randint(0, 3, (H, S), generator=rng)
    order = mhmoe.routing.content_route_order(layout, keys)
    assert sorted(order.tolist()) == list(range(H * S * K))
    bounds = layout.offsets.tolist()
    bits = {4: torch.int32, 8: torch.int64}[layout.sorted_probs.element_size()]
    for f in range(H * E):
        seg = order[bounds[f]:bounds[f + 1]].tolist()
        assert all(bounds[f] <= i < bounds[f + 1] for i in seg)
        want = sorted(range(bounds[f], bounds[f + 1]), key=lambda i, h=f // E: (
            int(keys[h, layout.gather_ids[i]]), int(layout.sorted_probs[i:i + 1].view(bits))))
        got = [(int(keys[f // E, layout.gather_ids[i]]),
                int(layout.sorted_probs[i:i + 1].view(bits))) for i in seg]
        assert got == [(int(keys[f // E, layout.gather_ids[i]]),
                        int(layout.sorted_probs[i:i + 1].view(bits))) for i in want]


def test_content_route_order_follows_tokens_not_places(rng):
    # Under a token permutation the reordered layout lists the same tokens (mapped back)
    # with the same probabilities: what makes the weight gradients' sums bitwise equal.
    H, S, E, K = 2, 30, 6, 3
    probs, indices = mhmoe.route(torch.randn(H, S, E, generator=rng), K)
    keys = torch.randperm(H * S, generator=rng).view(H, S)  # distinct keys
    perm = torch.randperm(S, generator=rng)
    runs = []
    for p in (torch.arange(S), perm):
        layout = mhmoe.sort_routes(probs[:, p], indices[:, p], E)
        order = mhmoe.routing.content_route_order(layout, keys[:, p])
        runs.append((p[layout.gather_ids[order].long()], layout.sorted_probs[order]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    plain = mhmoe.sort_routes(probs[:, perm], indices[:, perm], E)
    assert not torch.equal(perm[plain.gather_ids.long()], runs[0][0])  # token order differs


def test_sort_routes_result_is_a_named_layout():
    probs, indices = mhmoe.route(torch.randn(1, 3, 2), 1)
    layout = mhmoe.sort_routes(probs, indices, 2)
    assert isinstance(layout, mhmoe.RouteLayout)
    assert layout.offsets[-1].item() == 3


def test_sort_routes_rejects_bad_input():
    probs = torch.rand(1, 2, 2)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        mhmoe.sort_routes(probs, torch.tensor([[[0, 4], [1, 2]]]), 4)
    with pytest.raises(ValueError, match=r"\[H, S, K\]"):
        mhmoe.sort_routes(probs, torch.zeros(1, 2, 3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="integers"):
        mhmoe.sort_routes(probs, torch.zeros(1, 2, 2), 4)


# ------------------------------------- the Triton routing path through the public functions


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("route_norm", [True, False])
def test_route_probs_backward_matches_autograd(rng, score_func, route_norm):
    # The hand-written backward the Triton op registers, against autograd of the
    # float64 reference formula.
    from mhmoe.reference import route_probs_backward, route_reference

    logits = (torch.randn(2, 5, 8, generator=rng, dtype=torch.float64) * 2).requires_grad_()
    probs, indices = route_reference(logits, 3, score_func, route_norm=route_norm,
                                     route_scale=2.5)
    grad = torch.randn(probs.shape, generator=rng, dtype=torch.float64)
    (expected,) = torch.autograd.grad(probs, logits, grad)
    got = route_probs_backward(logits.detach(), indices, grad, score_func, route_norm, 1e-12, 2.5)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_triton_route_and_layout_equal_torch_with_gradients(rng, score_func):
    H, S, E, K = 3, 11, 12, 4
    logits = (torch.randn(H, S, E, generator=rng) * 2).requires_grad_()
    bias = torch.randn(H * E, generator=rng) * 0.1
    outs = {}
    for backend in ("torch", "triton"):
        lg = logits.detach().clone().requires_grad_()
        probs, indices = mhmoe.route(lg, K, score_func, bias, route_scale=4.9, backend=backend)
        layout = mhmoe.sort_routes(probs, indices, E, backend=backend)
        w = torch.arange(layout.sorted_probs.numel(), dtype=torch.float32)
        (grad,) = torch.autograd.grad((layout.sorted_probs * w).sum(), lg)
        outs[backend] = (probs.detach(), indices, layout, grad)
    (p_t, i_t, l_t, g_t), (p_k, i_k, l_k, g_k) = outs["torch"], outs["triton"]
    assert torch.equal(i_t, i_k)
    torch.testing.assert_close(p_k, p_t, rtol=1e-6, atol=1e-7)
    assert torch.equal(l_t.gather_ids, l_k.gather_ids) and torch.equal(l_t.offsets, l_k.offsets)
    torch.testing.assert_close(l_k.sorted_probs, l_t.sorted_probs, rtol=1e-6, atol=1e-7)
    # softmax spreads the gradient over every expert: compare as a whole (fp32 sums)
    assert ((g_k - g_t).norm() / g_t.norm()).item() < 1e-5


def test_triton_routing_ops_registration(rng):
    from mhmoe.routing import _route_triton_op, _sort_routes_triton_op

    logits = torch.randn(2, 4, 8, generator=rng).requires_grad_()
    torch.library.opcheck(_route_triton_op,
                          (logits, None, *RouterOptions(3, route_scale=2.0).op_args()))
    probs, indices = mhmoe.route(logits.detach(), 3)
    torch.library.opcheck(_sort_routes_triton_op, (probs.requires_grad_(), indices, 8))


def test_triton_layout_writes_positions_only_for_a_gradient(rng, monkeypatch):
    # The Triton layout's positions (the backward's gather) are written only when probs
    # needs a gradient: the op returns an empty tensor without, H*S*K places with; the
    # layout is the reference's either way, and the gradient through sorted_probs too.
    from mhmoe.routing import _sort_routes_triton_op

    H, S, E, K = 2, 7, 8, 3
    probs, indices = mhmoe.route(torch.randn(H, S, E, generator=rng), K)
    ref = mhmoe.sort_routes(probs, indices, E, backend="torch")
    for with_positions in (False, True):
        sp, gi, off, pos = _sort_routes_triton_op(probs, indices, E, None, with_positions)
        assert pos.numel() == (H * S * K if with_positions else 0)
        assert torch.equal(gi, ref.gather_ids) and torch.equal(off, ref.offsets)
        assert torch.equal(sp, ref.sorted_probs)
    assert torch.equal(sp[pos.long()], probs.flatten())
    p = probs.clone().requires_grad_()
    g = torch.randn(H * S * K, generator=rng)
    (mhmoe.sort_routes(p, indices, E, backend="triton").sorted_probs * g).sum().backward()
    p_ref = probs.clone().requires_grad_()
    (mhmoe.sort_routes(p_ref, indices, E, backend="torch").sorted_probs * g).sum().backward()
    assert torch.equal(p.grad, p_ref.grad)
    # sort_routes asks for positions exactly when probs needs a gradient
    import mhmoe.kernels.layout as kr

    asked = _record_kwarg(monkeypatch, kr, "triton_sort_routes", "return_positions")
    mhmoe.sort_routes(probs, indices, E, backend="triton")
    mhmoe.sort_routes(probs.clone().requires_grad_(), indices, E, backend="triton")
    with torch.no_grad():
        mhmoe.sort_routes(probs.clone().requires_grad_(), indices, E, backend="triton")
    monkeypatch.undo()
    assert asked == [False, True, False]
    # a graph built without positions cannot run backward: a clear error, not garbage
    sp, *_ = _sort_routes_triton_op(probs.clone().requires_grad_(), indices, E, None, False)
    with pytest.raises(RuntimeError, match="without positions"):
        sp.sum().backward()


def test_triton_routing_refuses_float64():
    with pytest.raises(ValueError, match="float32"):
        mhmoe.route(torch.randn(1, 2, 4, dtype=torch.float64), 2, backend="triton")
    # auto keeps float64 on the PyTorch path (the CPU here: always the PyTorch path)
    probs, _ = mhmoe.route(torch.randn(1, 2, 4, dtype=torch.float64), 2)
    assert probs.dtype == torch.float64


# ------------------------------- route_tokens: router logits and routing, fused or unfused


def _record_kwarg(monkeypatch, module, name: str, kwarg: str) -> list:
    """A list to which every later call of module.name appends its keyword argument
    `kwarg`; the calls run as before."""
    seen, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(kwargs[kwarg])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


def _token_inputs(rng, S=9, H=2, E=16, D=32, dtype=torch.bfloat16):
    x = torch.randn(S, H, D, generator=rng).to(dtype)
    gate = torch.randn(H, E, D, generator=rng) * D**-0.5
    bias = torch.randn(H, E, generator=rng) * 0.02
    return x, gate, bias


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_route_tokens_fused_matches_unfused_with_gradients(rng, score_func):
    # The fused kernel (the interpreter here) against the fp32 GEMM + route path:
    # the same routes, and gradients into x and gate through the probabilities.
    from oracle import rel_err

    x, gate, bias = _token_inputs(rng)
    grad_p = torch.randn(2, 9, 4, generator=rng)
    out = {}
    for fused in (True, False):
        xx, gg = x.clone().requires_grad_(), gate.clone().requires_grad_()
        probs, indices, _ = mhmoe.routing.route_tokens(
            xx, gg, RouterOptions(4, score_func, route_scale=4.9), bias, backend="triton",
            fused=fused)
        (probs * grad_p).sum().backward()
        out[fused] = (probs.detach(), indices, xx.grad, gg.grad)
    (p_f, i_f, gx_f, gg_f), (p_u, i_u, gx_u, gg_u) = out[True], out[False]
    assert torch.equal(i_f, i_u)  # random data: no near-tie at this size
    torch.testing.assert_close(p_f, p_u, rtol=2e-6, atol=0)
    assert gx_f.dtype == torch.bfloat16 and gg_f.dtype == torch.float32
    assert rel_err(gg_f, gg_u) < 1e-5
    assert rel_err(gx_f, gx_u) < 1e-3  # bf16 gradient: a rounding may flip


def test_route_tokens_saves_logits_only_for_a_backward(rng, monkeypatch):
    # No-grad calls (inference) write no logits for a backward; grad calls do.
    import mhmoe.kernels.router_logits as kr

    seen = _record_kwarg(monkeypatch, kr, "triton_logits_route", "return_logits")
    x, gate, bias = _token_inputs(rng)
    call = lambda xx, gg: mhmoe.routing.route_tokens(xx, gg, RouterOptions(3),  # noqa: E731
                                                     bias, backend="triton")
    probs = call(x, gate).probs
    assert probs.grad_fn is None
    with torch.no_grad():
        probs = call(x.requires_grad_(), gate.requires_grad_()).probs
    assert probs.grad_fn is None
    probs = call(x, gate).probs
    assert probs.grad_fn is not None
    assert seen == [False, False, True]


def test_route_tokens_path_choice(rng, monkeypatch):
    import mhmoe.kernels.router_logits as kr

    calls = []
    real = kr.triton_logits_route
    monkeypatch.setattr(kr, "triton_logits_route",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    x, gate, _ = _token_inputs(rng)
    route_tokens = mhmoe.routing.route_tokens
    k3 = RouterOptions(3)
    # the fused kernel is the default on the triton path with bf16 x ...
    route_tokens(x, gate, k3, backend="triton")
    assert calls == [1]
    # ... and never taken elsewhere: fp32 x, the torch path, fused=False
    route_tokens(x.float(), gate, k3, backend="triton")
    route_tokens(x, gate, k3, backend="torch")
    route_tokens(x, gate, k3, backend="triton", fused=False)
    assert calls == [1]
    # asked for explicitly where it cannot run: an error that says why, no slow path
    with pytest.raises(ValueError, match="bfloat16"):
        route_tokens(x.float(), gate, k3, backend="triton", fused=True)
    with pytest.raises(ValueError, match="PyTorch path"):
        route_tokens(x, gate, k3, backend="torch", fused=True)
    with pytest.raises(ValueError, match="power of two"):
        route_tokens(x, gate[:, :12], k3, backend="triton", fused=True)
    # the argument checks of route()
    with pytest.raises(ValueError, match="top_k"):
        route_tokens(x, gate, RouterOptions(17), backend="triton")
    with pytest.raises(ValueError, match="expert_bias"):
        route_tokens(x, gate, k3, expert_bias=torch.zeros(5), backend="triton")
    with pytest.raises(ValueError, match=r"\[H=2, E, D=32\]"):
        route_tokens(x, gate[:1], k3)
    with pytest.raises(ValueError, match="RouterOptions"):
        route_tokens(x, gate, 3)
    # the unfused path of a float64 router keeps float64 (gradient checks)
    probs = route_tokens(x.double(), gate.double(), k3).probs
    assert probs.dtype == torch.float64


def test_fused_routing_op_registration(rng):
    from mhmoe.routing import _logits_route_triton_op

    x, gate, bias = _token_inputs(rng, S=5)
    for save_logits in (True, False):
        args = (x.requires_grad_(save_logits), gate.requires_grad_(save_logits), bias,
                *RouterOptions(3, route_scale=2.0).op_args(), save_logits)
        torch.library.opcheck(_logits_route_triton_op, args)


def test_fused_routing_under_torch_compile(rng):
    # fullgraph: the op's fake implementation, the grad-mode decision and the backward
    x, gate, bias = _token_inputs(rng, S=7)

    options = RouterOptions(3, route_scale=4.9)

    def f(xx, gg):
        probs, indices, _ = mhmoe.routing.route_tokens(xx, gg, options, bias, backend="triton")
        return probs, indices

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (f, compiled):
        xx, gg = x.clone().requires_grad_(), gate.clone().requires_grad_()
        probs, indices = fn(xx, gg)
        probs.square().sum().backward()
        grads.append((probs.detach(), indices, xx.grad, gg.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


# ------------------------------- the routing-to-layout hand-off: block counts from the route


@pytest.mark.parametrize("backend,fused", [("triton", None), ("triton", False), ("torch", None)])
def test_route_tokens_block_counts_to_sort_routes(rng, backend, fused):
    # Triton paths (the logits kernel, or the GEMM + route kernel) count the picks per
    # block; the layout from those counts equals the layout without them. The PyTorch
    # path makes none (None), and sort_routes then counts itself.
    x, gate, bias = _token_inputs(rng, S=21, E=16)
    options = RouterOptions(3, route_scale=4.9)
    probs, indices, counts = mhmoe.routing.route_tokens(
        x, gate, options, bias, backend=backend, fused=fused, block_counts=True)
    p2, i2, none = mhmoe.routing.route_tokens(x, gate, options, bias, backend=backend,
                                              fused=fused)
    assert torch.equal(probs, p2) and torch.equal(indices, i2) and none is None
    if backend == "torch":
        assert counts is None
    else:
        assert counts.dtype == torch.int32 and counts.shape[0] == 2 and counts.shape[2] == 16
        assert counts.sum().item() == indices.numel()
    with_counts = mhmoe.sort_routes(probs, indices, 16, backend=backend, block_counts=counts)
    plain = mhmoe.sort_routes(probs, indices, 16, backend=backend)
    for a, b in zip(with_counts, plain, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="block_counts"):
        mhmoe.sort_routes(probs, indices, 16, block_counts=[1, 2])


def test_routing_ops_registration_with_counts(rng):
    from mhmoe.routing import _logits_route_triton_op, _route_triton_op, _sort_routes_triton_op

    logits = torch.randn(2, 4, 8, generator=rng).requires_grad_()
    op_args = RouterOptions(3, route_scale=2.0).op_args()
    torch.library.opcheck(_route_triton_op, (logits, None, *op_args, True))
    x, gate, bias = _token_inputs(rng, S=5)
    torch.library.opcheck(_logits_route_triton_op, (x, gate, bias, *op_args, False, True))
    probs, indices, counts = _route_triton_op(logits.detach(), None, *op_args, True)
    torch.library.opcheck(_sort_routes_triton_op, (probs.requires_grad_(), indices, 8, counts))


def test_route_and_layout_with_counts_under_torch_compile(rng):
    # fullgraph: the counts go from one op's output to the other's input, on the device,
    # with fake shapes computed from S and K alone
    x, gate, bias = _token_inputs(rng, S=7)
    options = RouterOptions(3, route_scale=4.9)

    def f(xx, gg):
        probs, indices, counts = mhmoe.routing.route_tokens(
            xx, gg, options, bias, backend="triton", block_counts=True)
        layout = mhmoe.sort_routes(probs, indices, 16, backend="triton", block_counts=counts)
        return probs, *layout

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    outs = []
    for fn in (f, compiled):
        xx, gg = x.clone().requires_grad_(), gate.clone().requires_grad_()
        probs, gather_ids, sorted_probs, offsets = fn(xx, gg)
        sorted_probs.square().sum().backward()
        outs.append((probs.detach(), gather_ids, sorted_probs.detach(), offsets, xx.grad,
                     gg.grad))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
