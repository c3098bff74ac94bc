"""The router logits' backward on tensor cores (kernels/router_backward.py) against
float64, the PyTorch path it replaces on CUDA, and its fixed summation orders.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py).
"""

import pytest
import torch

pytest.importorskip("triton")

from mhmoe.kernels import tuning
from mhmoe.kernels.router_backward import triton_router_dgate, triton_router_dx
from mhmoe.routing import _router_dgate_op, _router_dx_op, content_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rng, S, H, E, D, spread=False):
    """d logits [H, S, E] fp32, bf16 x [S, H, D], fp32 gate [H, E, D]; with `spread`
    values over 2^-20 .. 2^20, so that every piece of the bf16 splits matters."""
    grad = torch.randn(H, S, E, generator=rng)
    gate = torch.randn(H, E, D, generator=rng) * D**-0.5
    if spread:
        grad = grad * torch.exp2(torch.randint(-20, 21, grad.shape, generator=rng).float())
        gate = gate * torch.exp2(torch.randint(-20, 21, gate.shape, generator=rng).float())
    x = torch.randn(S, H, D, generator=rng).bfloat16()
    return grad.to(DEVICE), x.to(DEVICE), gate.to(DEVICE)


SHAPES = [
    (70, 2, 40, 48, "E and D not multiples of the tiles, several token blocks"),
    (1, 1, 16, 16, "one token, one head"),
    (300, 3, 64, 64, "d gate over several chunks of tokens"),
]


@pytest.mark.parametrize("S,H,E,D,edge", SHAPES)
@pytest.mark.parametrize("spread", [False, True])
def test_dx_against_float64(rng, S, H, E, D, edge, spread):
    # Six cross terms of the pieces leave out less than 2^-21 of each product (the split
    # truncates), and the fp32 sums round once per term added (E + 6 of them a column):
    # within (E + 14) 2^-24 sum |grad| |gate| of float64. With bf16 x the kernel rounds
    # that result to nearest even (by hand in the interpreter, whose cast truncates).
    grad, x, gate = _inputs(rng, S, H, E, D, spread)
    ref = torch.bmm(grad.double(), gate.double()).transpose(0, 1)
    scale = torch.bmm(grad.double().abs(), gate.double().abs()).transpose(0, 1)
    dx32 = triton_router_dx(grad, gate, x.float())
    assert dx32.dtype == torch.float32 and dx32.shape == (S, H, D), edge
    assert ((dx32.double() - ref).abs() <= (E + 14) * 2**-24 * scale + 1e-300).all(), edge
    dx = triton_router_dx(grad, gate, x)
    assert dx.dtype == torch.bfloat16 and torch.equal(dx, dx32.bfloat16()), edge


@pytest.mark.parametrize("S,H,E,D,edge", SHAPES)
@pytest.mark.parametrize("spread", [False, True])
def test_dgate_against_float64(rng, S, H, E, D, edge, spread):
    # Every product grad * x is exact (x is bf16, grad its three bf16 pieces): only the
    # fp32 sums round, S of them at most.
    grad, x, _ = _inputs(rng, S, H, E, D, spread)
    ref = torch.bmm(grad.double().transpose(1, 2), x.double().transpose(0, 1))
    scale = torch.bmm(grad.double().abs().transpose(1, 2), x.double().abs().transpose(0, 1))
    for order in (None, torch.argsort(torch.rand(H, S, generator=rng), dim=1).to(DEVICE)):
        dgate = triton_router_dgate(grad, x, order)
        assert dgate.dtype == torch.float32 and dgate.shape == (H, E, D), edge
        assert ((dgate.double() - ref).abs() <= (S + 2) * 2**-24 * scale + 1e-300).all(), edge


def test_dgate_sums_in_a_fixed_order(rng):
    # Run to run bitwise; with the content order also bitwise under a token permutation
    # (with tokens repeated, whose rows are equal). Without it a permutation changes the
    # fp32 sums: the property is not vacuous. float32 rounding of the sums shows the
    # order in the interpreter too (its dots are fp32 matmuls).
    S, H, E, D = 200, 2, 32, 32
    grad, x, _ = _inputs(rng, S, H, E, D)
    grad[:, 150:] = grad[:, :50]
    x[150:] = x[:50]
    perm = torch.randperm(S, generator=rng).to(DEVICE)
    gp, xp = grad[:, perm], x[perm]

    def ordered(g, xx):
        order = torch.argsort(content_keys(xx, g.transpose(0, 1)), dim=1, stable=True)
        return triton_router_dgate(g, xx, order)

    assert torch.equal(triton_router_dgate(grad, x), triton_router_dgate(grad, x))
    assert torch.equal(ordered(grad, x), ordered(gp, xp))
    assert not torch.equal(triton_router_dgate(grad, x), triton_router_dgate(gp, xp))


def test_dgate_chunks_follow_the_tokens_alone():
    # (P, chunk) from S and the tiles only: whole blocks, P chunks cover S, at most
    # ROUTER_DGATE_MAX_CHUNKS of them.
    gpu, cpu = tuning.router_backward_config(False), tuning.router_backward_config(True)
    assert tuning.router_dgate_chunks(32768, gpu) == (8, 4096)
    assert tuning.router_dgate_chunks(1024, gpu) == (1, 4096)
    assert tuning.router_dgate_chunks(700_000, gpu) == (16, 43776)  # 16 * 43,776 >= S
    assert tuning.router_dgate_chunks(300, cpu) == (5, 64)
    assert tuning.router_dgate_chunks(10_000, cpu) == (16, 640)
    assert tuning.router_dgate_chunks(1, cpu) == (1, 64)
    with pytest.raises(ValueError, match="multiple of block_s"):
        tuning.RouterBackwardConfig(64, 64, 128, 4, 1, dgate_chunk=100)


def test_dgate_of_a_head_does_not_depend_on_the_other_heads(rng):
    # The chunks follow S alone: head 0 of a 3-head launch has the bits of head 0 alone
    # (as a head-parallel rank holding fewer heads computes it), in both orders.
    S, H, E, D = 300, 3, 32, 32
    grad, x, _ = _inputs(rng, S, H, E, D)
    order = torch.argsort(content_keys(x, grad.transpose(0, 1)), dim=1, stable=True)
    for o in (None, order):
        alone = triton_router_dgate(grad[:1], x[:, :1], None if o is None else o[:1])
        assert torch.equal(triton_router_dgate(grad, x, o)[:1], alone)


def test_layer_backward_takes_the_kernels_on_the_triton_path(rng, monkeypatch):
    # RouterLogits on the Triton path (here the interpreter) runs both kernels: its
    # gradients agree with the PyTorch path's (d gate to fp32's rounding, dx to bf16's),
    # and in deterministic mode d gate is bitwise the same under a token permutation. On
    # the PyTorch path the kernels are not called.
    import mhmoe.routing as routing

    calls = []
    for name in ("_router_dx_op", "_router_dgate_op"):
        op = getattr(routing, name)
        monkeypatch.setattr(routing, name,
                            lambda *a, op=op, name=name: calls.append(name) or op(*a))
    S, H, E, D = 90, 2, 32, 32
    grad, x, gate = _inputs(rng, S, H, E, D)

    def grads(xx, g, triton, deterministic=False):
        xx = xx.clone().requires_grad_()
        w = gate.clone().requires_grad_()
        routing.RouterLogits.apply(xx, w, deterministic, triton).backward(g)
        return xx.grad, w.grad

    dx_t, dg_t = grads(x, grad, True)
    assert calls == ["_router_dx_op", "_router_dgate_op"]
    dx_p, dg_p = grads(x, grad, False)
    assert len(calls) == 2
    scale = torch.bmm(grad.abs().transpose(1, 2), x.float().abs().transpose(0, 1))
    assert ((dg_t - dg_p).abs() <= 2 * (S + 2) * 2**-24 * scale + 1e-30).all()
    # the two fp32 results within their errors, then each rounded to bf16 (one step apart
    # at most where the errors straddle a rounding boundary)
    scale_x = torch.bmm(grad.abs(), gate.abs()).transpose(0, 1)
    assert ((dx_t.float() - dx_p.float()).abs()
            <= dx_p.float().abs() * 2**-7 + 2 * (E + 14) * 2**-24 * scale_x).all()
    perm = torch.randperm(S, generator=rng).to(DEVICE)
    _, dg_a = grads(x, grad, True, deterministic=True)
    _, dg_b = grads(x[perm], grad[:, perm], True, deterministic=True)
    assert torch.equal(dg_a, dg_b)


def test_ops_and_empty_shapes(rng):
    grad, x, gate = _inputs(rng, 20, 2, 16, 16)
    torch.library.opcheck(_router_dx_op, (grad, gate, x))
    order = torch.argsort(torch.rand(2, 20, generator=rng), dim=1).to(DEVICE)
    torch.library.opcheck(_router_dgate_op, (grad, x, order))
    torch.library.opcheck(_router_dgate_op, (grad, x, None))
    g0, x0, gate0 = _inputs(rng, 0, 2, 16, 16)
    assert triton_router_dx(g0, gate0, x0).shape == (0, 2, 16)
    assert torch.equal(triton_router_dgate(g0, x0), torch.zeros(2, 16, 16, device=DEVICE))


def test_rejects_bad_input(rng):
    grad, x, gate = _inputs(rng, 8, 2, 16, 16)
    with pytest.raises(ValueError, match="grad must be fp32"):
        triton_router_dx(grad.double(), gate, x)
    with pytest.raises(ValueError, match="d gate takes bf16 x_heads"):
        triton_router_dgate(grad, x.float())
    with pytest.raises(ValueError, match="does not match"):
        triton_router_dgate(grad, x[:4])
    with pytest.raises(ValueError, match="gate must be fp32"):
        triton_router_dx(grad, gate[:, :8], x)
    with pytest.raises(ValueError, match="order must be int64"):
        triton_router_dgate(grad, x, torch.zeros(2, 8, dtype=torch.int32, device=DEVICE))
