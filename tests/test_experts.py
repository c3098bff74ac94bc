"""swiglu7() and expert_forward() on the PyTorch path against the float64 oracle."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mhmoe
from oracle import layer_from_routes, rel_err, swiglu7_oracle


def test_swiglu7_matches_oracle(rng):
    g = torch.randn(64, 48, generator=rng, dtype=torch.float64) * 6
    u = torch.randn(64, 48, generator=rng, dtype=torch.float64) * 6
    # float64 on both sides: far below any real error (a wrong constant or clamp
    # shows at 1e-3), loose enough for two float64 sigmoid implementations.
    torch.testing.assert_close(mhmoe.swiglu7(g, u), swiglu7_oracle(g, u), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_swiglu7_evaluates_in_fp32_and_returns_the_input_dtype(rng, dtype):
    # The published activation evaluates in fp32 and casts back (docs/contract.md section
    # 4): within half a unit of `dtype` of the float64 value, plus what fp32 arithmetic
    # adds. bf16 or fp16 arithmetic rounds every intermediate and misses that on most
    # inputs. Inputs cover the clamps (|g|, |u| past 7, the bounds themselves), u near -1
    # (a + 1 that cancels) and g far below 0 (results below the fp16 normal range).
    g = torch.cat([torch.randn(4096, generator=rng) * 4, torch.tensor([7.0, -7.0, 9.5, -30.0]),
                   -12 - 4 * torch.rand(64, generator=rng)]).to(dtype)
    u = torch.cat([torch.randn(4096, generator=rng) * 4, torch.tensor([7.0, -7.0, -9.5, 0.5]),
                   -1 + 0.01 * torch.randn(64, generator=rng)]).to(dtype)
    y = mhmoe.swiglu7(g, u)
    assert y.dtype == dtype and y.shape == g.shape
    exact = swiglu7_oracle(g, u)
    info = torch.finfo(dtype)
    rounding = torch.maximum(exact.abs() * info.eps / 2,
                             torch.tensor(info.smallest_normal * info.eps / 2))
    gc, uc = g.double().clamp(max=7), u.double().clamp(-7, 7)
    # fp32 arithmetic: a few ulps of the terms' size; sigmoid(1.702 g) for g << 0 also
    # carries the rounding of its argument, relative 1.702 |g| ulps.
    scale = (gc * torch.sigmoid(1.702 * gc)).abs() * (uc.abs() + 1) * (1 + 1.702 * gc.abs())
    fp32_math = 2.0**-20 * scale
    err = (y.double() - exact).abs()
    assert (err <= rounding + fp32_math).all(), (err - rounding - fp32_math).max()


def test_swiglu7_clamps_by_hand():
    g = torch.tensor([10.0, 7.0, 0.0, -3.0], dtype=torch.float64)
    u = torch.tensor([-10.0, 10.0, 2.0, 0.0], dtype=torch.float64)
    sig = lambda v: 1 / (1 + torch.exp(torch.tensor(-1.702 * v, dtype=torch.float64)))  # noqa: E731
    zero = torch.tensor(0.0, dtype=torch.float64)
    expected = torch.stack([7 * sig(7) * (-6), 7 * sig(7) * 8, zero, -3 * sig(-3) * 1])
    torch.testing.assert_close(mhmoe.swiglu7(g, u), expected)


def make_case(rng, S, H, E, K, D, I, dtype=torch.float64, skew=None):
    """Random x, weights and routes; `skew` forces every route of head 0 onto expert `skew`."""
    x = torch.randn(S, H, D, generator=rng, dtype=torch.float64).to(dtype)
    w_gate = (torch.randn(H * E, D, I, generator=rng, dtype=torch.float64) / D ** 0.5).to(dtype)
    w_up = (torch.randn(H * E, D, I, generator=rng, dtype=torch.float64) / D ** 0.5).to(dtype)
    w_down = (torch.randn(H * E, I, D, generator=rng, dtype=torch.float64) / I ** 0.5).to(dtype)
    logits = torch.randn(H, S, E, generator=rng)
    probs, indices = mhmoe.route(logits, K, route_scale=2.5)
    if skew is not None:
        indices[0, :, 0] = skew
    return x, probs, indices, (w_gate, w_up, w_down)


EDGE_SHAPES = [
    # S, H, E, K, D, I
    (0, 2, 3, 2, 16, 16),     # S = 0
    (1, 1, 1, 1, 8, 8),       # S = 1, one head, one expert, K = 1
    (5, 3, 4, 4, 12, 20),     # K = E; D and I not powers of two
    (7, 2, 9, 2, 17, 33),     # odd D and I; experts left empty
    (11, 4, 6, 3, 32, 48),
]


@pytest.mark.parametrize("S,H,E,K,D,I", EDGE_SHAPES)
def test_expert_forward_float64_matches_oracle(rng, S, H, E, K, D, I):
    x, probs, indices, weights = make_case(rng, S, H, E, K, D, I)
    layout = mhmoe.sort_routes(probs, indices, E)
    y = mhmoe.expert_forward(x, *layout, *weights)
    assert y.shape == (S, H, D) and y.dtype == torch.float64
    ref = layer_from_routes(x, probs, indices, *weights)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)


def test_expert_forward_every_route_on_one_expert(rng):
    # edge: head 0 sends all S tokens' first route to expert 2; other experts of head 0 get less
    x, probs, indices, weights = make_case(rng, 9, 2, 5, 2, 16, 24, skew=2)
    indices[0, :, 1] = 2  # both routes of a token on one expert: a token twice in one expert
    layout = mhmoe.sort_routes(probs, indices, 5)
    assert layout.offsets[3] - layout.offsets[2] == 18
    y = mhmoe.expert_forward(x, *layout, *weights)
    torch.testing.assert_close(y, layer_from_routes(x, probs, indices, *weights), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1.5e-2), (torch.float16, 3e-3),
                                       (torch.float32, 1e-5)])
def test_expert_forward_low_precision_error(rng, dtype, tol):
    S, H, E, K, D, I = 24, 3, 8, 3, 64, 96
    x, probs, indices, weights = make_case(rng, S, H, E, K, D, I, dtype=dtype)
    layout = mhmoe.sort_routes(probs, indices, E)
    y = mhmoe.expert_forward(x, *layout, *weights)
    assert y.dtype == dtype
    # The spec's formula with the activation rounded to the weight dtype: the only
    # rounding the PyTorch path adds is in fp32 accumulation and the final cast.
    exact = layer_from_routes(x, probs, indices, *weights, act_dtype=dtype)
    assert rel_err(y, exact) < {torch.bfloat16: 8e-3, torch.float16: 1e-3,
                                torch.float32: 1e-6}[dtype]
    # Against the un-rounded float64 formula: the bf16 band of docs/contract.md section 4.
    assert rel_err(y, layer_from_routes(x, probs, indices, *weights)) < tol


def test_expert_forward_is_independent_of_token_order(rng):
    S, H, E, K, D, I = 33, 2, 4, 3, 16, 32
    x, probs, indices, weights = make_case(rng, S, H, E, K, D, I, dtype=torch.bfloat16)
    y = mhmoe.expert_forward(x, *mhmoe.sort_routes(probs, indices, E), *weights,
                             deterministic=True)
    perm = torch.randperm(S, generator=rng)
    layout_perm = mhmoe.sort_routes(probs[:, perm], indices[:, perm], E)
    y_perm = mhmoe.expert_forward(x[perm], *layout_perm, *weights, deterministic=True)
    assert torch.equal(y_perm, y[perm])
    again = mhmoe.expert_forward(x, *mhmoe.sort_routes(probs, indices, E), *weights,
                                 deterministic=True)
    assert torch.equal(again, y)


def _gradients(x, probs, indices, weights, dy, E, backend):
    """d x, d probs [H, S, K] and the three weight gradients of one deterministic call."""
    x = x.detach().requires_grad_()
    probs = probs.detach().requires_grad_()
    weights = [w.detach().requires_grad_() for w in weights]
    y = mhmoe.expert_forward(x, *mhmoe.sort_routes(probs, indices, E), *weights,
                             deterministic=True, backend=backend)
    return torch.autograd.grad(y, [x, probs, *weights], dy)


@pytest.mark.parametrize("backend,dtype", [
    ("torch", torch.float32),  # float32 sums that a bf16 result would round away
    # float32: the interpreter's bf16 dots add the panel rows without a rounding that
    # depends on their order, so only float32 data shows a wrong order on the CPU.
    ("triton", torch.float32),
    ("triton", torch.bfloat16),
])
def test_deterministic_gradients_are_independent_of_token_order(rng, backend, dtype):
    # Every gradient, the weight gradients included: they sum each expert's routes in the
    # order of the routes' content, not of the tokens. Kernels: tokens 5 and 6 repeat
    # token 2 (x and dy), with other probabilities (routes that tie on content; by
    # probability) and with the same ones (a full tie, left in token order). Not on the
    # PyTorch path: the CPU's kernels round some values by their place in a tensor (BLAS
    # tails, vectorised elementwise bodies against scalar tails), and equal rows left in
    # token order land at different places; these shapes keep the rest clear of that
    # (docs/expert-backward.md).
    S, H, E, K, D, I = 64, 2, 4, 3, 16, 32
    x, probs, indices, weights = make_case(rng, S, H, E, K, D, I, dtype=dtype)
    dy = torch.randn(S, H, D, generator=rng).to(dtype)
    if backend == "triton":
        for t in (5, 6):
            x[t], dy[t], indices[:, t] = x[2], dy[2], indices[:, 2]
        probs[:, 6] = probs[:, 2]
    first = _gradients(x, probs, indices, weights, dy, E, backend)
    again = _gradients(x, probs, indices, weights, dy, E, backend)
    perm = torch.randperm(S, generator=rng)
    moved = _gradients(x[perm], probs[:, perm], indices[:, perm], weights, dy[perm], E, backend)
    for name, a, b in zip(("dx", "dprobs", "dW_gate", "dW_up", "dW_down"), first, again,
                          strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(moved[0], first[0][perm])
    assert torch.equal(moved[1], first[1][:, perm])
    for name, a, b in zip(("dW_gate", "dW_up", "dW_down"), moved[2:], first[2:], strict=True):
        assert torch.equal(a, b), name
    if backend == "triton":
        # The kernels on the caller's layout: the content order changes the weight
        # gradients' order of addition only, so d x and d probs are bitwise theirs.
        from mhmoe.kernels.expert_backward import triton_expert_backward

        layout = mhmoe.sort_routes(probs, indices, E)
        sorted_probs = layout.sorted_probs.detach().requires_grad_()
        y = mhmoe.expert_forward(x, layout.gather_ids, sorted_probs, layout.offsets, *weights,
                                 deterministic=True, backend=backend)
        op_dprobs = torch.autograd.grad(y, [sorted_probs], dy)[0]
        kernels = triton_expert_backward(dy, x, *layout, *weights, deterministic=True)
        assert torch.equal(op_dprobs, kernels[1]) and torch.equal(first[0], kernels[0])
    # Against the default mode (layout order): the same sums up to rounding.
    x_, w_ = x.detach().requires_grad_(), [w.detach().requires_grad_() for w in weights]
    y = mhmoe.expert_forward(x_, *mhmoe.sort_routes(probs, indices, E), *w_, backend=backend)
    plain = torch.autograd.grad(y, [x_, *w_], dy)
    for a, b in zip(plain[1:], first[2:], strict=True):
        assert rel_err(a, b) < 1e-2


@settings(max_examples=25, deadline=None)
@given(S=st.integers(0, 9), H=st.integers(1, 3), E=st.integers(1, 5), D=st.integers(1, 12),
       I=st.integers(1, 12), k_frac=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
def test_expert_forward_property(S, H, E, D, I, k_frac, seed):
    K = 1 + int(k_frac * (E - 1))
    rng = torch.Generator().manual_seed(seed)
    x, probs, indices, weights = make_case(rng, S, H, E, K, D, I)
    y = mhmoe.expert_forward(x, *mhmoe.sort_routes(probs, indices, E), *weights)
    torch.testing.assert_close(y, layer_from_routes(x, probs, indices, *weights), rtol=1e-10,
                               atol=1e-12)


def test_expert_forward_rejects_bad_input(rng):
    x, probs, indices, (wg, wu, wd) = make_case(rng, 4, 2, 3, 2, 8, 8)
    layout = mhmoe.sort_routes(probs, indices, 3)
    cases = [
        ((x[0], *layout, wg, wu, wd), r"\[S, H, D\]"),
        ((x, *layout, wg, wu[:, :, :4], wd), "w_gate and w_up"),
        ((x, *layout, wg[:5], wu[:5], wd[:5]), "do not split over H=2"),
        ((x, *layout, wg, wu, wd.transpose(1, 2)[:, :4]), "w_down must be"),
        ((x, layout.gather_ids, layout.sorted_probs, layout.offsets[:-1], wg, wu, wd), "offsets"),
        ((x, layout.gather_ids.float(), layout.sorted_probs, layout.offsets, wg, wu, wd), "int32"),
        ((x, *layout, wg, wu.float(), wd), "dtypes differ"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            mhmoe.expert_forward(*args)
    with pytest.raises(ValueError, match="backend"):
        mhmoe.expert_forward(x, *layout, wg, wu, wd, backend="cuda-magic")


# ------------------------------------------------- the fused kernel through the public op

def test_public_triton_path_forward_and_gradients(rng):
    # The fused kernel (in the interpreter here) behind expert_forward(backend="triton"),
    # with autograd through the op. D and I multiples of 16, as the kernel needs.
    S, H, E, K, D, I = 9, 2, 3, 2, 16, 32
    x, probs, indices, weights = make_case(rng, S, H, E, K, D, I, dtype=torch.bfloat16)
    layout = mhmoe.sort_routes(probs, indices, E)
    x = x.requires_grad_()
    y = mhmoe.expert_forward(x, *layout, *weights, backend="triton")
    y_ref = layer_from_routes(x.detach(), probs, indices, *weights)
    assert y.dtype == torch.bfloat16 and rel_err(y, y_ref) < 1e-2
    (dx,) = torch.autograd.grad(y.float().sum(), [x])
    x64 = x.detach().double().requires_grad_()
    (dx_ref,) = torch.autograd.grad(layer_from_routes(x64, probs, indices, *weights).sum(), [x64])
    assert rel_err(dx, dx_ref) < 2e-2
    det = [mhmoe.expert_forward(x.detach(), *layout, *weights, backend="triton",
                                deterministic=True) for _ in range(2)]
    assert torch.equal(det[0], det[1])


def test_triton_path_shape_and_device_errors(rng, monkeypatch):
    x, probs, indices, weights = make_case(rng, 4, 2, 3, 2, 12, 16, dtype=torch.float32)
    layout = mhmoe.sort_routes(probs, indices, 3)
    with pytest.raises(ValueError, match="multiples of 16"):
        mhmoe.expert_forward(x, *layout, *weights, backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        mhmoe.expert_forward(x, *layout, *weights, backend="triton")
    # "auto" on the CPU is the PyTorch path, whatever the shapes
    assert mhmoe.experts.resolve_backend("auto", "cpu") == "torch"


def test_expert_forward_refuses_fp8_weights(rng):
    # fp8 weights without their scales are not the weights (W = W_fp8 * scale): the bf16
    # op used to run them as they were. The fp8 op keeps its own checks.
    from mhmoe.fp8 import quantize_weights

    x, probs, indices, weights = make_case(rng, 4, 2, 3, 2, 16, 64, dtype=torch.bfloat16)
    layout = mhmoe.sort_routes(probs, indices, 3)
    q = quantize_weights(*weights)
    for backend in ("auto", "torch"):
        with pytest.raises(ValueError, match="use expert_forward_fp8 with the scales"):
            mhmoe.expert_forward(x, *layout, *q[:3], backend=backend)
    e5m2 = [w.to(torch.float8_e5m2) for w in weights]
    with pytest.raises(ValueError, match="use expert_forward_fp8 with the scales"):
        mhmoe.expert_forward(x, *layout, *e5m2)
    with pytest.raises(ValueError, match=r"expert_forward_fp8: the weights must be torch\.float8"):
        mhmoe.expert_forward_fp8(x, *layout, *e5m2, *q[3:])
    with pytest.raises(ValueError, match=r"expert_forward_fp8: w_down must be"):
        mhmoe.expert_forward_fp8(x, *layout, *q[:2], q.w_gate, *q[3:])
    assert mhmoe.expert_forward_fp8(x, *layout, *q, backend="torch").shape == x.shape
