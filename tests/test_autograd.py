"""Gradients: the hand-written backward of expert_forward, the module through
routing, the torch.library registration and torch.compile."""

import pytest
import torch
from torch.autograd import gradcheck

import mhmoe
from mhmoe.experts import _expert_forward_op
from oracle import layer_from_routes, rel_err


def make_inputs(rng, S, H, E, K, D, I, dtype=torch.float64):
    x = torch.randn(S, H, D, generator=rng, dtype=torch.float64).to(dtype)
    weights = [(torch.randn(shape, generator=rng, dtype=torch.float64) / shape[1] ** 0.5)
               .to(dtype) for shape in ((H * E, D, I), (H * E, D, I), (H * E, I, D))]
    probs, indices = mhmoe.route(torch.randn(H, S, E, generator=rng, dtype=torch.float64) * 2,
                                 K, route_scale=2.0)
    return x, probs, indices, weights


@pytest.mark.parametrize("S,H,E,K,D,I", [
    (5, 2, 3, 2, 4, 6),
    (1, 1, 1, 1, 3, 5),    # one token, head and expert
    (6, 3, 4, 4, 5, 3),    # K = E, odd D and I
])
def test_expert_forward_gradcheck(rng, S, H, E, K, D, I):
    x, probs, indices, weights = make_inputs(rng, S, H, E, K, D, I)
    gather_ids, sorted_probs, offsets = mhmoe.sort_routes(probs, indices, E)
    # Scale up so the clamps at +-7 are crossed by some routes (both branches checked).
    x = (x * 4).requires_grad_()
    sorted_probs = sorted_probs.clone().requires_grad_()
    weights = [w.clone().requires_grad_() for w in weights]
    assert gradcheck(lambda xx, pp, wg, wu, wd: mhmoe.expert_forward(
        xx, gather_ids, pp, offsets, wg, wu, wd), (x, sorted_probs, *weights))


def test_backward_matches_autograd_of_oracle(rng):
    S, H, E, K, D, I = 7, 2, 4, 2, 16, 24
    x, probs, indices, weights = make_inputs(rng, S, H, E, K, D, I)
    x = (x * 3).requires_grad_()
    probs = probs.clone().requires_grad_()
    weights = [w.clone().requires_grad_() for w in weights]
    grad_y = torch.randn(S, H, D, generator=rng, dtype=torch.float64)
    ref = torch.autograd.grad((layer_from_routes(x, probs, indices, *weights) * grad_y).sum(),
                              [x, probs, *weights])
    y = mhmoe.expert_forward(x, *mhmoe.sort_routes(probs, indices, E), *weights)
    got = torch.autograd.grad((y * grad_y).sum(), [x, probs, *weights])
    for name, a, b in zip(("dx", "dprobs", "dW_gate", "dW_up", "dW_down"), got, ref, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_bf16_gradients_against_float64(rng):
    S, H, E, K, D, I = 16, 2, 4, 2, 32, 48
    x, probs, indices, weights = make_inputs(rng, S, H, E, K, D, I)
    grad_y = torch.randn(S, H, D, generator=rng, dtype=torch.float64)
    leaves64 = [x.requires_grad_(), probs.requires_grad_(), *[w.requires_grad_() for w in weights]]
    ref = torch.autograd.grad((layer_from_routes(x, probs, indices, *weights) * grad_y).sum(),
                              leaves64)
    x16 = x.detach().bfloat16().requires_grad_()
    p32 = probs.detach().float().requires_grad_()
    w16 = [w.detach().bfloat16().requires_grad_() for w in weights]
    y = mhmoe.expert_forward(x16, *mhmoe.sort_routes(p32, indices, E), *w16)
    got = torch.autograd.grad((y.double() * grad_y).sum(), [x16, p32, *w16])
    dtypes = (torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16)
    for name, a, b, dtype in zip(("dx", "dprobs", "dW_gate", "dW_up", "dW_down"), got, ref,
                                 dtypes, strict=False):
        assert a.dtype == dtype, name
        assert rel_err(a, b) < 2e-2, name


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("route_norm", [True, False])
def test_module_gradcheck_through_routing(rng, score_func, route_norm):
    cfg = mhmoe.MultiHeadMoEConfig(12, 3, 4, 2, 5, params_dtype=torch.float64, route_scale=2.0,
                                   score_func=score_func, route_norm=route_norm)
    layer = mhmoe.MultiHeadMoE(cfg)
    layer.reset_parameters(generator=rng)
    x = torch.randn(4, 12, generator=rng, dtype=torch.float64, requires_grad=True)
    names = ("gate", "W_gate", "W_up", "W_down")
    params = [getattr(layer, n).detach().clone().requires_grad_() for n in names]

    def f(x, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps, strict=False)), (x,))

    assert gradcheck(f, (x, *params))
    # the selection biases are frozen
    assert not layer.router.expert_bias.requires_grad
    assert not layer.router.expert_bias_ema.requires_grad


def test_opcheck_registration(rng):
    x, probs, indices, weights = make_inputs(rng, 5, 2, 3, 2, 8, 8, dtype=torch.float32)
    args = (x.requires_grad_(), *mhmoe.sort_routes(probs.float(), indices, 3), *weights,
            False, "auto")
    torch.library.opcheck(_expert_forward_op, args)


@pytest.mark.parametrize("compiler,deterministic", [("aot_eager", False), ("inductor", False),
                                                    ("inductor", True)])
def test_torch_compile_fullgraph_forward_and_backward(rng, compiler, deterministic):
    # deterministic: the router's backward sorts tokens by content keys inside the graph
    cfg = mhmoe.MultiHeadMoEConfig(32, 2, 4, 2, 16, params_dtype=torch.float32, route_scale=3.0,
                                   deterministic=deterministic)
    layer = mhmoe.MultiHeadMoE(cfg)
    layer.reset_parameters(generator=rng)
    compiled = torch.compile(layer, fullgraph=True, backend=compiler)
    x = torch.randn(2, 6, 32, generator=rng, requires_grad=True)
    y_eager = layer(x)
    y_comp = compiled(x)
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-6, atol=1e-6)
    g_eager = torch.autograd.grad(y_eager.square().sum(), [x, layer.W_down, layer.gate])
    g_comp = torch.autograd.grad(y_comp.square().sum(), [x, layer.W_down, layer.gate])
    for a, b in zip(g_comp, g_eager, strict=False):
        # inductor fuses the fp32 router math differently: fp32 rounding, not a bug
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_compile_with_the_triton_ops(rng, deterministic):
    # Every op on its Triton path (the interpreter here) inside one compiled graph:
    # the fake implementations and the registered backwards of all three ops.
    cfg = mhmoe.MultiHeadMoEConfig(32, 2, 4, 2, 32, params_dtype=torch.float32, route_scale=3.0,
                                   deterministic=deterministic)
    layer = mhmoe.MultiHeadMoE(cfg, backend="triton")
    layer.reset_parameters(generator=rng)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 32, generator=rng, requires_grad=True)
    y_eager, y_comp = layer(x), compiled(x)
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-5, atol=1e-6)
    g_eager = torch.autograd.grad(y_eager.square().sum(), [x, layer.gate, layer.W_up])
    g_comp = torch.autograd.grad(y_comp.square().sum(), [x, layer.gate, layer.W_up])
    for a, b in zip(g_comp, g_eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
