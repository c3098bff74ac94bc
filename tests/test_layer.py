"""MultiHeadMoE: parameters, forward against the oracle, env overrides, shapes."""

import pytest
import torch

import mhmoe
from mhmoe import HeadPartition, MultiHeadMoE
from oracle import layer_from_routes, rel_err, route_row

SMALL = mhmoe.MultiHeadMoEConfig(hidden_size=48, num_heads=3, num_experts=6, top_k=2,
                                 expert_intermediate_size=24, params_dtype=torch.float32,
                                 route_scale=4.9)


def randomize(layer, rng):
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=rng).to(p.dtype) * 0.5)


def oracle_forward(layer, x, bias):
    """The whole layer in float64 from the spec: logits, routing row by row, experts."""
    cfg = layer.config
    H, E, D = cfg.num_heads, cfg.num_experts, cfg.head_dim
    xh = x.reshape(-1, H, D).double()
    gate = layer.gate.detach().double().view(H, E, D)
    logits = torch.einsum("shd,hed->hse", xh, gate)
    S = xh.shape[0]
    probs = torch.zeros(H, S, cfg.top_k, dtype=torch.float64)
    indices = torch.zeros(H, S, cfg.top_k, dtype=torch.int64)
    for h in range(H):
        for s in range(S):
            p, i = route_row(logits[h, s], cfg.top_k, cfg.score_func, bias.view(H, E)[h],
                             cfg.route_norm, cfg.norm_eps, cfg.route_scale)
            probs[h, s], indices[h, s] = torch.tensor(p), torch.tensor(i)
    y = layer_from_routes(xh, probs, indices, layer.W_gate.detach(), layer.W_up.detach(),
                          layer.W_down.detach())
    return y.reshape(x.shape), indices


def test_parameter_names_shapes_and_dtypes():
    cfg = mhmoe.MAGI2_PREVIEW.replace(num_experts=4, top_k=2)
    layer = MultiHeadMoE(cfg, device="meta")
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in layer.state_dict().items()}
    assert shapes == {
        "gate": ((48, 256), torch.float32),
        "W_gate": ((48, 256, 1280), torch.bfloat16),
        "W_up": ((48, 256, 1280), torch.bfloat16),
        "W_down": ((48, 1280, 256), torch.bfloat16),
        "router.expert_bias": ((48,), torch.float32),
        "router.expert_bias_ema": ((48,), torch.float32),
    }
    trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trainable == {"gate", "W_gate", "W_up", "W_down"}


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_forward_matches_oracle(rng, score_func):
    cfg = SMALL.replace(score_func=score_func)
    layer = MultiHeadMoE(cfg)
    randomize(layer, rng)
    x = torch.randn(2, 5, cfg.hidden_size, generator=rng)
    y = layer(x)
    ref, _ = oracle_forward(layer, x, layer.router.expert_bias_ema.detach())
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, ref) < 1e-5


def test_bias_source_config_and_env(rng, monkeypatch):
    layer = MultiHeadMoE(SMALL)
    randomize(layer, rng)
    with torch.no_grad():  # the two biases disagree strongly, so the choice shows
        layer.router.expert_bias.copy_(torch.randn(18, generator=rng) * 5)
        layer.router.expert_bias_ema.copy_(torch.randn(18, generator=rng) * 5)
    x = torch.randn(7, 48, generator=rng)
    ref_ema, idx_ema = oracle_forward(layer, x, layer.router.expert_bias_ema.detach())
    ref_main, idx_main = oracle_forward(layer, x, layer.router.expert_bias.detach())
    assert not torch.equal(idx_ema, idx_main)
    assert rel_err(layer(x), ref_ema) < 1e-5
    layer_main = MultiHeadMoE(SMALL.replace(bias_source="main"))
    layer_main.load_state_dict(layer.state_dict())
    assert rel_err(layer_main(x), ref_main) < 1e-5
    monkeypatch.setenv("MAGI2_ROUTER_BIAS_SOURCE", "main")
    assert rel_err(layer(x), ref_main) < 1e-5
    monkeypatch.setenv("MAGI2_ROUTER_BIAS_SOURCE", "ema")
    assert rel_err(layer_main(x), ref_ema) < 1e-5
    monkeypatch.setenv("MAGI2_ROUTER_BIAS_SOURCE", "median")
    with pytest.raises(ValueError, match="MAGI2_ROUTER_BIAS_SOURCE"):
        layer(x)


def test_deterministic_config_and_env(monkeypatch):
    layer = MultiHeadMoE(SMALL)
    assert layer.deterministic is False
    monkeypatch.setenv("MAGI2_DETERMINISTIC", "1")
    assert layer.deterministic is True
    assert MultiHeadMoE(SMALL.replace(deterministic=True)).deterministic is True
    monkeypatch.setenv("MAGI2_DETERMINISTIC", "0")
    assert MultiHeadMoE(SMALL.replace(deterministic=True)).deterministic is False
    monkeypatch.setenv("MAGI2_DETERMINISTIC", "maybe")
    with pytest.raises(ValueError, match="MAGI2_DETERMINISTIC"):
        _ = layer.deterministic


@pytest.mark.parametrize("lead", [(), (0,), (1,), (3, 4), (2, 1, 3)])  # incl. no tokens
def test_any_leading_shape(rng, lead):
    layer = MultiHeadMoE(SMALL)
    x = torch.randn(*lead, 48, generator=rng)
    y = layer(x)
    assert y.shape == x.shape
    flat = layer(x.reshape(-1, 48)).reshape(x.shape)
    assert torch.equal(y, flat)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_dtype_preserved(rng, dtype):
    layer = MultiHeadMoE(SMALL.replace(params_dtype=torch.bfloat16))
    y = layer(torch.randn(4, 48, generator=rng).to(dtype))
    assert y.dtype == dtype


def test_bf16_layer_error_against_oracle(rng):
    cfg = SMALL.replace(params_dtype=torch.bfloat16)
    layer = MultiHeadMoE(cfg, device="cpu")
    layer.reset_parameters(generator=rng)
    x = torch.randn(16, 48, generator=rng).bfloat16()
    ref, _ = oracle_forward(layer, x, layer.router.expert_bias_ema.detach())
    assert 0 < rel_err(layer(x), ref) < 1.5e-2


def test_state_dict_round_trip(rng):
    layer = MultiHeadMoE(SMALL)
    randomize(layer, rng)
    other = MultiHeadMoE(SMALL)
    other.load_state_dict(layer.state_dict())
    x = torch.randn(6, 48, generator=rng)
    assert torch.equal(layer(x), other(x))
    meta = MultiHeadMoE(SMALL, device="meta")
    meta.load_state_dict(layer.state_dict(), assign=True)
    assert torch.equal(meta(x), layer(x))


def test_bad_input():
    layer = MultiHeadMoE(SMALL)
    with pytest.raises(ValueError, match=r"\[\.\.\., 48\]"):
        layer(torch.randn(4, 47))
    with pytest.raises(ValueError, match="floating"):
        layer(torch.ones(4, 48, dtype=torch.int64))
    with pytest.raises(TypeError):
        MultiHeadMoE({"hidden_size": 48})


@pytest.mark.parametrize("world", range(1, 9))
def test_partition_parameters(world):
    cfg = mhmoe.MAGI2_PREVIEW.replace(num_experts=2, top_k=1, expert_intermediate_size=16,
                                      params_dtype=torch.float32)
    local = -(-12 // world)
    for rank in range(world):
        p = HeadPartition(12, world, rank)
        assert (p.local_heads, p.start, p.padded_heads) == (local, rank * local, local * world)
        assert p.real_heads == max(0, min(local, 12 - rank * local))
        layer = MultiHeadMoE(cfg, partition=p)
        assert layer.W_gate.shape == (local * 2, 256, 16)
        real_rows = p.real_heads * 2
        for name, t in layer.state_dict().items():
            assert not t[real_rows:].any(), (world, rank, name)  # padding heads are zeros
        if real_rows:
            assert (layer.W_gate[:real_rows] != 0).float().mean() > 0.99
    with pytest.raises(ValueError):
        HeadPartition(12, 4, 4)


def test_triton_backend_layer_matches_torch_backend(rng):
    # Every op of the layer on its Triton path (the interpreter here), forward and
    # gradients, against the PyTorch path. D = 16 and I = 32: the kernels' multiples.
    cfg = mhmoe.MultiHeadMoEConfig(hidden_size=32, num_heads=2, num_experts=4, top_k=2,
                                   expert_intermediate_size=32, params_dtype=torch.float32,
                                   route_scale=2.0)
    torch_layer = MultiHeadMoE(cfg, backend="torch")
    randomize(torch_layer, rng)
    triton_layer = MultiHeadMoE(cfg, backend="triton")
    triton_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(7, 32, generator=rng)
    grads = {}
    for name, layer in (("torch", torch_layer), ("triton", triton_layer)):
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.square().sum().backward()
        grads[name] = (y.detach(), xx.grad, layer.gate.grad, layer.W_gate.grad, layer.W_down.grad)
    for a, b in zip(grads["triton"], grads["torch"], strict=True):
        assert rel_err(a, b) < 1e-5


def test_fused_router_in_the_layer(rng):
    # bf16 layer on the triton path (the interpreter): route_heads takes the fused logits +
    # route kernel by default; its output and gradients match fused_router=False.
    cfg = mhmoe.MultiHeadMoEConfig(hidden_size=64, num_heads=2, num_experts=16, top_k=3,
                                   expert_intermediate_size=32, params_dtype=torch.bfloat16,
                                   route_scale=4.9)
    layers = {f: MultiHeadMoE(cfg, backend="triton", fused_router=f) for f in (None, False)}
    layers[None].reset_parameters(generator=rng)
    layers[False].load_state_dict(layers[None].state_dict())
    x = torch.randn(5, 64, generator=rng).bfloat16()
    grad_y = torch.randn(5, 64, generator=rng)  # fixed: d probs does not depend on y
    outs = {}
    for f, layer in layers.items():
        xx = x.clone().requires_grad_()
        y = layer(xx)
        (y.float() * grad_y).sum().backward()
        with torch.no_grad():
            probs, indices = layer.route_heads(x.view(5, 2, 32))
        outs[f] = (y.detach(), xx.grad, layer.gate.grad, probs, indices)
    (y_f, gx_f, gg_f, p_f, i_f), (y_u, gx_u, gg_u, p_u, i_u) = outs[None], outs[False]
    assert torch.equal(i_f, i_u)
    torch.testing.assert_close(p_f, p_u, rtol=2e-6, atol=0)
    # probabilities within 2e-6: bf16 output and x gradient agree to their rounding,
    # the fp32 router gradient to fp32 rounding
    assert rel_err(y_f, y_u) < 1e-2 and rel_err(gx_f, gx_u) < 1e-2
    assert rel_err(gg_f, gg_u) < 1e-5
    with pytest.raises(ValueError, match="fused_router"):
        MultiHeadMoE(cfg, fused_router="yes")
    # asked for where it cannot run (the torch path): an error, not a slow path
    with pytest.raises(ValueError, match="fused=True"):
        MultiHeadMoE(cfg, backend="torch", fused_router=True)(x)


def test_autocast_does_not_change_the_numerics(rng):
    # docs/contract.md: router logits in fp32, expert accumulators in fp32. An autocast region
    # around the call (common in diffusion inference) must not turn them into bf16.
    cfg = SMALL.replace(params_dtype=torch.bfloat16)
    layer = MultiHeadMoE(cfg)
    layer.reset_parameters(generator=rng)
    x = torch.randn(12, 48, generator=rng).bfloat16()
    plain = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = layer(x)
        probs, _ = layer.route_heads(x.view(12, 3, 16))
    assert torch.equal(auto, plain)
    assert probs.dtype == torch.float32


def test_deterministic_env_reaches_the_kernel(rng, monkeypatch):
    # On the CPU the PyTorch path is deterministic whatever the flag, so check that
    # MAGI2_DETERMINISTIC=1 arrives at the fused kernel (interpreter) as deterministic=True.
    import mhmoe.kernels.expert_forward as ef

    seen = []
    real = ef.triton_expert_forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ef, "triton_expert_forward", spy)
    cfg = mhmoe.MultiHeadMoEConfig(32, 2, 4, 2, 32, params_dtype=torch.float32)
    layer = MultiHeadMoE(cfg, backend="triton")
    x = torch.randn(3, 32, generator=rng)
    layer(x)
    monkeypatch.setenv("MAGI2_DETERMINISTIC", "1")
    layer(x)
    monkeypatch.setenv("MAGI2_DETERMINISTIC", "0")
    MultiHeadMoE(cfg.replace(deterministic=True), backend="triton")(x)
    assert seen == [False, True, False]


@pytest.mark.parametrize("fused_router", [None, False])
def test_layer_hands_route_counts_to_the_layout(rng, monkeypatch, fused_router):
    # Triton path (the interpreter): the route kernels' block counts reach the layout, which
    # then has no count step; the output equals the PyTorch path's layout and experts.
    import mhmoe.kernels.layout as kr

    seen = []
    real = kr.triton_sort_routes

    def spy(*args, **kwargs):
        seen.append(kwargs.get("block_counts") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(kr, "triton_sort_routes", spy)
    cfg = mhmoe.MultiHeadMoEConfig(hidden_size=64, num_heads=2, num_experts=16, top_k=3,
                                   expert_intermediate_size=32, params_dtype=torch.bfloat16,
                                   route_scale=4.9)
    layer = MultiHeadMoE(cfg, backend="triton", fused_router=fused_router)
    layer.reset_parameters(generator=rng)
    x = torch.randn(9, 64, generator=rng).bfloat16()
    with torch.no_grad():
        y = layer(x)
        probs, indices = layer.route_heads(x.view(9, 2, 32))
        ref = mhmoe.expert_forward(x.view(9, 2, 32), *mhmoe.sort_routes(probs, indices, 16,
                                                                        backend="torch"),
                                   layer.W_gate, layer.W_up, layer.W_down, backend="triton")
    assert seen == [True]
    assert torch.equal(y, ref.reshape(9, 64))


ROUTER = ("gate", "router.expert_bias", "router.expert_bias_ema")
EXPERTS = ("W_gate", "W_up", "W_down")


def _dtypes(layer):
    return {name: p.dtype for name, p in layer.named_parameters()}


def test_dtype_argument_like_other_pytorch_modules(rng):
    # MultiHeadMoE(cfg, dtype=...) was a TypeError. dtype is the experts' dtype: it
    # overrides config.params_dtype (and the config says so); the router stays float32.
    layer = MultiHeadMoE(SMALL, dtype=torch.bfloat16)
    assert layer.config == SMALL.replace(params_dtype=torch.bfloat16)
    assert {_dtypes(layer)[n] for n in EXPERTS} == {torch.bfloat16}
    assert {_dtypes(layer)[n] for n in ROUTER} == {torch.float32}
    assert MultiHeadMoE(SMALL, dtype=torch.float32).config is SMALL  # agrees: unchanged
    assert MultiHeadMoE(SMALL, device="meta", dtype=None).W_up.dtype == torch.float32
    with pytest.raises(TypeError, match="floating"):
        MultiHeadMoE(SMALL, dtype=torch.int32)
    x = torch.randn(5, SMALL.hidden_size, generator=rng).bfloat16()
    with torch.no_grad():
        assert layer(x).dtype == torch.bfloat16


@pytest.mark.parametrize("cast", ["half", "to_fp16", "to_bf16_and_device", "double_then_half"])
def test_casts_keep_the_router_in_fp32_and_the_repr_true(rng, cast):
    layer = MultiHeadMoE(SMALL)
    randomize(layer, rng)
    gate = layer.gate.detach().clone()
    x = torch.randn(4, SMALL.hidden_size, generator=rng)
    layer(x).square().sum().backward()  # grads too: they follow their parameters
    want = torch.bfloat16 if cast == "to_bf16_and_device" else torch.float16
    if cast == "half":
        out = layer.half()
    elif cast == "to_fp16":
        out = layer.to(torch.float16)
    elif cast == "to_bf16_and_device":
        out = layer.to("cpu", torch.bfloat16)
    else:
        assert {_dtypes(layer.double())[n] for n in ROUTER} == {torch.float64}
        out = layer.half()
    assert out is layer
    assert {_dtypes(layer)[n] for n in EXPERTS} == {want}
    assert {_dtypes(layer)[n] for n in ROUTER} == {torch.float32}, _dtypes(layer)
    assert torch.equal(layer.gate.detach(), gate)  # the router was not rounded on the way
    assert layer.gate.grad.dtype == torch.float32 and layer.W_up.grad.dtype == want
    assert not any(p.requires_grad for p in layer.router.parameters())
    assert layer.config.params_dtype == want
    assert f"dtype={want}" in repr(layer) and "router_dtype=torch.float32" in repr(layer)
    assert "bfloat16" not in repr(layer) or want == torch.bfloat16
    with torch.no_grad():
        assert layer(x.to(want)).dtype == want
    # and back: float() makes everything float32 again
    layer.float()
    assert set(_dtypes(layer).values()) == {torch.float32}
    assert layer.config.params_dtype == torch.float32


def test_replicated_input_needs_no_process_group(rng):
    # Rank 1 of 2 over SMALL's 3 heads (head 2, and a padding head), built from a
    # partition without a group: replicated input runs (it needs no communication) and
    # gives the one-rank layer's head 2; a sequence-parallel forward still needs a group.
    E, D = SMALL.num_experts, SMALL.head_dim
    full = MultiHeadMoE(SMALL)
    randomize(full, rng)
    p = HeadPartition(num_heads=3, world_size=2, rank=1)
    layer = MultiHeadMoE(SMALL, partition=p, input_mode="replicated")
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param[:E].copy_(full.get_parameter(name)[2 * E:3 * E])  # local head 0 = head 2
    x = torch.randn(5, SMALL.hidden_size, generator=rng)
    x_local = torch.cat([x[:, 2 * D:], torch.randn(5, D, generator=rng)], dim=1)
    with torch.no_grad():
        y = layer(x_local)
        want = full(x)[:, 2 * D:]
    assert y.shape == x_local.shape
    # float32 to its rounding: the one-head and three-head layers run the same products
    # through matmuls of other shapes (BLAS blocks the sums differently); 1e-6 failed one
    # element in 80 at 2.2e-6 for one seed.
    torch.testing.assert_close(y[:, :D], want, rtol=1e-5, atol=1e-5)
    assert not y[:, D:].any()  # the padding head
    sequence = MultiHeadMoE(SMALL, partition=p)
    with pytest.raises(ValueError, match="pass group="):
        sequence(x)


def test_replicated_input_refuses_token_counts(rng):
    # token_counts feeds the sequence mode's all-to-all; replicated input has none to feed,
    # and silently ignoring the argument would hide a wrong call
    for p in (None, HeadPartition(num_heads=3, world_size=2, rank=0)):
        layer = MultiHeadMoE(SMALL, partition=p, input_mode="replicated")
        x = torch.randn(4, layer.local_heads * SMALL.head_dim, generator=rng)
        with pytest.raises(ValueError, match="token_counts is for input_mode 'sequence'"):
            layer(x, token_counts=[4] * layer.partition.world_size)
        assert layer(x).shape == x.shape


@pytest.mark.parametrize("backend,dtype", [
    ("torch", torch.float32),
    ("triton", torch.float32),   # the unfused router, float32 expert kernels (interpreter)
    ("triton", torch.bfloat16),  # the fused router kernel, as on the GPU
])
def test_deterministic_gradients_are_independent_of_token_order(rng, backend, dtype):
    # Training in deterministic mode: permuting the tokens permutes d x and leaves every
    # parameter gradient bitwise unchanged (the router's d gate and the experts' weight
    # gradients sum tokens in the order of their content). Kernels: tokens 3 and 4 repeat
    # token 1 (a full tie). Not on the PyTorch path, whose CPU kernels round some values
    # by their place in a tensor; these shapes (48 tokens, 16 experts) keep the rest clear
    # of that, which tiny ones do not (docs/expert-backward.md).
    cfg = mhmoe.MultiHeadMoEConfig(hidden_size=64, num_heads=2, num_experts=16, top_k=3,
                                   expert_intermediate_size=32, params_dtype=dtype,
                                   deterministic=True)
    layer = MultiHeadMoE(cfg, backend=backend)
    randomize(layer, rng)
    S = 48
    x = torch.randn(S, 64, generator=rng).to(dtype)
    dy = torch.randn(S, 64, generator=rng).to(dtype)
    if backend == "triton":
        x[3:5], dy[3:5] = x[1], dy[1]
    params = [p for p in layer.parameters() if p.requires_grad]

    def grads(xs, dys):
        xs = xs.clone().requires_grad_()
        return torch.autograd.grad(layer(xs), [xs, *params], dys)

    first, again = grads(x, dy), grads(x, dy)
    perm = torch.randperm(S, generator=rng)
    moved = grads(x[perm], dy[perm])
    names = ["x"] + [n for n, p in layer.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, first, again, strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(moved[0], first[0][perm])
    for name, a, b in zip(names[1:], moved[1:], first[1:], strict=True):
        assert a.abs().sum() > 0 and torch.equal(a, b), name
