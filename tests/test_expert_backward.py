"""kernels/expert_backward.py against an independent float64 autograd oracle.

Runs in the Triton interpreter on machines without a GPU (tests/conftest.py
sets TRITON_INTERPRET=1), so shapes are small and tiles large. The oracle is
autograd through a float64 forward written here from docs/contract.md section 4, looped
over (head, k) from the [H, S, K] routing: no CSR, no tiles, no hand-written
derivative. The kernel is also held against `expert_backward_reference` (the
same math in fp32), whose error against the oracle sets the bar.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")

import mhmoe.kernels.expert_backward as eb  # noqa: E402
import mhmoe.kernels.expert_forward as ef  # noqa: E402
import mhmoe.kernels.tuning as tuning  # noqa: E402
from mhmoe.kernels.tuning import (  # noqa: E402
    ExpertBackwardConfig,
    ExpertForwardConfig,
    PanelDxConfig,
    PanelGemmConfig,
    expert_backward_config,
)
from mhmoe.reference import expert_backward_reference, sort_routes_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The weight gradients from panels (the default) or by recomputation (panel=None).
BIG = ExpertBackwardConfig(dx=ExpertForwardConfig(32, 32, 4, 1),
                           dw=ExpertForwardConfig(32, 32, 4, 1),
                           panel=PanelGemmConfig(32, 32, 32, 4, 1))
RECOMPUTE = ExpertBackwardConfig(dx=BIG.dx, dw=BIG.dw)
SMALL = ExpertBackwardConfig(dx=ExpertForwardConfig(16, 16, 4, 1, tma=False),
                             dw=ExpertForwardConfig(16, 16, 4, 1),
                             panel=PanelGemmConfig(16, 16, 16, 4, 1, tma=False))
# dx from the panels in a GEMM of its own (the dx kernel leaves its products out).
SPLIT = ExpertBackwardConfig(dx=BIG.dx, dw=BIG.dw, panel=BIG.panel,
                             panel_dx=PanelDxConfig(32, 4, 1))
PATHS = {"panels": BIG, "recompute": RECOMPUTE, "split": SPLIT}
NAMES = ("dx", "dprobs", "d_gate", "d_up", "d_down")
# Relative error (vs float64) no gradient may exceed, by dtype of x and weights.
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


def oracle(x, probs, indices, wg, wu, wd, dy):
    """float64 autograd of y[s, h] = sum_k p * MLP_{h*E + e}(x[s, h]) (contract section 4).

    The cast of the activation to the weight dtype is a rounding that passes
    gradients straight through. Returns dx [S, H, D], dprobs [H, S, K] and the
    three weight gradients, all float64.
    """
    S, H, D = x.shape
    E = wg.shape[0] // H
    K = indices.shape[2]
    leaves = [t.detach().double().requires_grad_() for t in (x, probs, wg, wu, wd)]
    x64, p64, wg64, wu64, wd64 = leaves
    y = torch.zeros(S, H, D, dtype=torch.float64)
    for h in range(H):
        for k in range(K):
            f = h * E + indices[h, :, k]  # [S] flat expert of each token's k-th route
            g = torch.einsum("sd,sdi->si", x64[:, h], wg64[f]).clamp(max=7.0)
            u = torch.einsum("sd,sdi->si", x64[:, h], wu64[f]).clamp(-7.0, 7.0)
            a = g * torch.sigmoid(1.702 * g) * (u + 1.0)
            a = a + (a.detach().to(wd.dtype).double() - a.detach())
            o = torch.einsum("si,sid->sd", a, wd64[f]) * p64[h, :, k, None]
            y = y + torch.nn.functional.pad(o[:, None], (0, 0, h, H - h - 1))
    (y * dy.double()).sum().backward()
    return [t.grad for t in leaves]


def make_problem(gen, S, H, E, K, D, I, dtype=torch.bfloat16, experts=None, wdtype=None):
    """Random inputs; `experts` (allowed expert ids) restricts the routing.

    The gate weights are scaled so that some g and u land past the clamps at 7.
    """
    wdtype = wdtype or dtype
    x = torch.randn(S, H, D, generator=gen).to(dtype)
    dy = torch.randn(S, H, D, generator=gen).to(dtype)
    wg = (torch.randn(H * E, D, I, generator=gen) * 3 * D**-0.5).to(wdtype)
    wu = (torch.randn(H * E, D, I, generator=gen) * 3 * D**-0.5).to(wdtype)
    wd = (torch.randn(H * E, I, D, generator=gen) * I**-0.5).to(wdtype)
    allowed = torch.tensor(experts if experts is not None else list(range(E)))
    picks = [allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(H * S)]
    indices = torch.stack(picks).view(H, S, K) if picks else torch.zeros(H, S, K, dtype=torch.long)
    probs = torch.rand(H, S, K, generator=gen) + 0.05
    return x, probs, indices, wg, wu, wd, dy


def route_order(indices, E):
    """CSR position -> (h, s, k) flat index: a stable sort of the flat expert ids."""
    H = indices.shape[0]
    flat = indices + torch.arange(H).view(H, 1, 1) * E
    return torch.sort(flat.reshape(-1), stable=True).indices


def run(x, probs, indices, wg, wu, wd, dy, **kw):
    """The kernel's gradients, dprobs mapped back to [H, S, K]."""
    E = wg.shape[0] // x.shape[1]
    layout = sort_routes_reference(probs, indices, E)
    args = [t.to(DEVICE) for t in (dy, x, *layout, wg, wu, wd)]
    out = [t.cpu() for t in eb.triton_expert_backward(*args, **kw)]
    dprobs = torch.empty(probs.numel(), dtype=out[1].dtype)
    dprobs[route_order(indices, E)] = out[1]
    return out[0], dprobs.view(probs.shape), *out[2:]


def rel_err(out, ref):
    denom = ref.double().norm().item()
    return (out.double() - ref.double()).norm().item() / (denom if denom > 0 else 1.0)


def check(gen, S, H, E, K, D, I, dtype=torch.bfloat16, experts=None, config=BIG, wdtype=None,
          **kw):
    problem = make_problem(gen, S, H, E, K, D, I, dtype, experts, wdtype)
    x, probs, indices, wg, wu, wd, dy = problem
    grads = run(*problem, config=config, **kw)
    shapes = [x.shape, probs.shape, wg.shape, wu.shape, wd.shape]
    dtypes = [x.dtype, torch.float32, wg.dtype, wu.dtype, wd.dtype]
    for name, grad, shape, dt in zip(NAMES, grads, shapes, dtypes, strict=True):
        assert grad.shape == shape and grad.dtype == dt, (name, grad.shape, grad.dtype)
        assert torch.isfinite(grad).all(), name
    ref = oracle(*problem)
    torch_grads = expert_backward_reference(dy, x, *sort_routes_reference(probs, indices, E),
                                            wg, wu, wd)
    torch_grads = list(torch_grads)
    dp = torch.empty(probs.numel())
    dp[route_order(indices, E)] = torch_grads[1]
    torch_grads[1] = dp.view(probs.shape)
    for name, grad, r, t in zip(NAMES, grads, ref, torch_grads, strict=True):
        floor = max(FLOOR[grad.dtype], FLOOR[dtype])  # a gradient is as precise as its dtype
        if name in ("dprobs", "d_down"):
            # These multiply the activation rounded to the weight dtype: an fp32
            # difference in g or u can move that rounding by one 16-bit step.
            floor = max(floor, FLOOR[wg.dtype])
        # The kernel rounds dg, du and a * p to 16 bits for the tensor cores (the
        # fp32 reference does not): one extra rounding of unit 2^-9 on each of two
        # operands, so up to 2^-8 more error than the reference, never past the floor.
        err, torch_err = rel_err(grad, r), rel_err(t, r)
        extra = 2.0**-8 if wg.dtype in (torch.bfloat16, torch.float16) else floor / 10
        assert err <= torch_err + extra, (name, err, torch_err)
        assert err <= floor, (name, err)
    return grads


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
    "S,H,E,K,D,I",
    [
        (7, 2, 4, 2, 32, 32),  # several heads; TMA path (D a power of two)
        (5, 1, 3, 2, 48, 32),  # D = 48, not a power of two: masked pointer path
        (6, 2, 3, 2, 32, 48),  # I = 48: the last slice of I is partial
        (1, 3, 4, 3, 16, 16),  # S = 1, the smallest D and I
        (40, 1, 2, 1, 16, 32),  # K = 1, S larger than a tile: several row blocks per expert
        (4, 2, 3, 3, 16, 16),  # K = E: every expert of a head gets every token
    ],
)
@pytest.mark.parametrize("path", PATHS)
def test_matches_oracle(rng, deterministic, S, H, E, K, D, I, path):
    check(rng, S, H, E, K, D, I, deterministic=deterministic, config=PATHS[path])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_empty_expert(rng, deterministic, path):
    # Experts 1 and 3 of every head get no route: their weight gradients are zeros.
    grads = check(rng, 6, 2, 4, 2, 32, 32, experts=[0, 2], deterministic=deterministic,
                  config=PATHS[path])
    for w in grads[2:]:
        assert not w.view(2, 4, -1)[:, [1, 3]].any()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_every_route_on_one_expert(rng, deterministic, path):
    # One expert per head takes all 70 tokens: three row blocks of 32, the last partial.
    check(rng, 70, 2, 3, 1, 16, 16, experts=[1], deterministic=deterministic,
          config=PATHS[path])


@pytest.mark.parametrize("split", [False, True])
def test_small_tiles(rng, split):
    # 16-row, 16-wide tiles and pointer loads: many tiles and slices per expert (split:
    # dx from the panels, pointer loads, 32-wide steps of I = 48: the last one partial).
    cfg = SMALL if not split else dataclasses.replace(
        SMALL, panel_dx=PanelDxConfig(32, 4, 1, tma=False))
    check(rng, 21, 2, 3, 2, 32, 48, config=cfg)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_differs_from_the_fused_kernel_only_in_dx_order(rng, deterministic, dtype):
    # dx from the panels adds the dx kernel's products (the same rounded dg, du) in
    # another order (every gate step, then every up step): dx agrees to fp32 rounding
    # before its cast to x's dtype; every other output comes from the same kernels either
    # way, bitwise.
    problem = make_problem(rng, 11, 2, 3, 2, 32, 64, dtype=dtype)
    fused = run(*problem, config=BIG, deterministic=deterministic)
    split = run(*problem, config=SPLIT, deterministic=deterministic)
    assert rel_err(split[0], fused[0]) <= (1e-6 if dtype == torch.float32 else 2.0**-8)
    for name, a, b in zip(NAMES[1:], fused[1:], split[1:], strict=True):
        assert torch.equal(a, b), name


def test_gluon_panel_kernel_asked_where_it_cannot_run(rng):
    # The Gluon panel kernel runs on sm_90 only (bf16, D = 256, I a multiple of 64): a
    # config that asks for it elsewhere is refused, not run on another path.
    problem = make_problem(rng, 5, 2, 3, 2, 32, 32)
    with pytest.raises(ValueError, match="warp_specialized needs an sm_90 GPU"):
        run(*problem, config=tuning.SM90_SPLIT_WS)


def test_a_table_split_falls_back_to_the_fused_kernel_where_gluon_cannot_run(rng,
                                                                             monkeypatch):
    # tuning.BACKWARD_SM90 picks the Gluon split at many rows per expert; where that kernel
    # cannot run (here: no sm_90 GPU) the table's choice runs as the fused dx kernel at the
    # same tiles, bitwise as that config asked for directly, with no warning or error.
    table_split = dataclasses.replace(
        SPLIT, dx=dataclasses.replace(SPLIT.dx, block_m=128, warp_specialized=True))
    fused = dataclasses.replace(table_split, dx=dataclasses.replace(
        table_split.dx, warp_specialized=False), panel_dx=None)
    monkeypatch.setattr(tuning, "expert_backward_config", lambda *a, **k: table_split)
    problem = make_problem(rng, 5, 2, 3, 2, 32, 64)
    want = run(*problem, config=fused)

    def no_split(*args, **kwargs):
        raise AssertionError("the fallback ran the split's panel dx GEMM")

    monkeypatch.setattr(eb, "_panel_dx", no_split)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(*problem)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert torch.equal(a, b), name


def test_split_asked_where_panels_do_not_fit(rng, monkeypatch):
    # dx from the panels needs the panels: a config that asks for it where one head's
    # panels pass the workspace limit is refused (the default recomputes, with a warning).
    monkeypatch.setattr(tuning, "PANEL_WORKSPACE_BYTES", 1)
    problem = make_problem(rng, 5, 2, 3, 2, 32, 32)
    with pytest.raises(ValueError, match="PANEL_WORKSPACE_BYTES"):
        run(*problem, config=SPLIT)


@pytest.mark.parametrize("path", PATHS)
def test_sigmoid_rcp_matches_oracle_and_the_division(rng, path):
    # ExpertBackwardConfig.sigmoid_rcp: as accurate as the division, and bitwise the
    # same where every 1 + e stays below 2^126 (g > -51.3), as here. On the CPU both
    # divide (the interpreter has no MUFU): the match shows the option reaches every
    # kernel and changes nothing else; the GPU test checks the reciprocal itself.
    config = PATHS[path]
    grads = check(rng, 13, 2, 3, 2, 32, 64, config=dataclasses.replace(config, sigmoid_rcp=True))
    problem = make_problem(torch.Generator().manual_seed(7), 13, 2, 3, 2, 32, 64)
    rcp = run(*problem, config=dataclasses.replace(config, sigmoid_rcp=True))
    for name, a, b in zip(NAMES, rcp, run(*problem, config=config), strict=True):
        assert torch.equal(a, b), name
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("path", PATHS)
def test_sigmoid_rcp_gives_zero_where_the_division_gives_a_subnormal(path):
    # Every g = 16 * -1 * 3.234375 = -51.75: 1 + e = 2^127.07, whose reciprocal is
    # subnormal. The division keeps it (tiny non-zero gradients); the reciprocal, as
    # rcp.approx.ftz, flushes it to zero: a, dg and du are zero, and so every gradient.
    S, H, E, K, D, I = 6, 1, 2, 1, 16, 32
    gen = torch.Generator().manual_seed(3)
    x = -torch.ones(S, H, D, dtype=torch.bfloat16)
    dy = torch.randn(S, H, D, generator=gen).bfloat16()
    wg = torch.full((H * E, D, I), 3.234375).bfloat16()
    wu = (torch.randn(H * E, D, I, generator=gen) * 0.1).bfloat16()
    wd = torch.randn(H * E, I, D, generator=gen).bfloat16()
    indices = torch.arange(S).remainder(E).view(H, S, K)
    probs = torch.rand(H, S, K, generator=gen) + 0.5
    problem = (x, probs, indices, wg, wu, wd, dy)
    config = PATHS[path]
    division = run(*problem, config=config)
    rcp = run(*problem, config=dataclasses.replace(config, sigmoid_rcp=True))
    for name, a, b in zip(NAMES, division, rcp, strict=True):
        assert torch.count_nonzero(b) == 0, name
        assert torch.isfinite(a).all() and a.abs().max() < 1e-30, name
    assert any(torch.count_nonzero(a) > 0 for a in division)


def test_split_config_checks():
    with pytest.raises(ValueError, match="needs panels"):
        ExpertBackwardConfig(dx=BIG.dx, dw=BIG.dw, panel_dx=PanelDxConfig(32, 4, 1))
    ws = dataclasses.replace(BIG.dx, warp_specialized=True)
    with pytest.raises(ValueError, match="panel_dx"):
        ExpertBackwardConfig(dx=ws, dw=BIG.dw, panel=BIG.panel)
    with pytest.raises(ValueError, match="128 rows"):  # BIG.dx has 32-row tiles
        ExpertBackwardConfig(dx=ws, dw=BIG.dw, panel=BIG.panel, panel_dx=PanelDxConfig(32, 4, 1))
    with pytest.raises(ValueError, match="no cluster variant"):
        ExpertBackwardConfig(dx=dataclasses.replace(ws, block_m=128, cluster=2), dw=BIG.dw,
                             panel=BIG.panel, panel_dx=PanelDxConfig(32, 4, 1))
    with pytest.raises(ValueError, match="panel_store_bytes must be 8 or 16"):
        dataclasses.replace(BIG, panel_store_bytes=4)
    with pytest.raises(ValueError, match="its own sigmoid_rcp"):
        dataclasses.replace(BIG, dx=dataclasses.replace(BIG.dx, sigmoid_rcp=True))
    with pytest.raises(ValueError, match="block_i must be a power of two"):
        PanelDxConfig(24, 4, 1)
    steps, cfg = [], PanelDxConfig(32, 4, 2)
    while cfg is not None:
        steps.append((cfg.block_i, cfg.num_stages))
        cfg = tuning.step_down_panel_dx(cfg)
    assert steps == [(32, 2), (32, 1), (16, 1)]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.float32),
                                          (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_panel_groups(rng, monkeypatch, deterministic, dtype, wdtype, split):
    # Panels that hold one head at a time: one dx launch and three panel GEMMs per
    # head, the dx combine capped to the same heads (float32 dx: a workspace per
    # group, not the result itself, which only a single group may add into).
    elem = 2 if dtype == wdtype == torch.bfloat16 else 4
    per_head = eb._panel_rows(9, 3, 9 * 3 * 2, 4, 1, 32) * (2 * 32 + 3 * 48) * elem
    monkeypatch.setattr(tuning, "PANEL_WORKSPACE_BYTES", per_head)
    check(rng, 9, 3, 4, 2, 32, 48, dtype=dtype, wdtype=wdtype, deterministic=deterministic,
          config=SPLIT if split else BIG)


@pytest.mark.parametrize("deterministic", [False, True])
def test_layout_with_uneven_heads_is_refused(rng, deterministic):
    # R = S*H*K routes, but head 0 has them all: grids sized for S*K routes a head
    # would miss some, so such a layout is refused (a device-side assertion on CUDA).
    gather_ids = torch.arange(8).repeat(2)  # 2 routes a token, all on head 0
    offsets = torch.tensor([0, 8, 16, 16, 16, 16, 16])
    assert_refused(rng, 8, 2, 3, gather_ids, offsets, deterministic, "every head")


def assert_refused(rng, S, H, E, gather_ids, offsets, deterministic, match):
    """Both the forward and the backward refuse this layout with a ValueError."""
    R = gather_ids.numel()
    x, _, _, wg, wu, wd, dy = make_problem(rng, S, H, E, R // (S * H), 16, 16)
    sorted_probs = torch.rand(R, generator=rng)
    with pytest.raises(ValueError, match=match):
        eb.triton_expert_backward(dy, x, gather_ids, sorted_probs, offsets, wg, wu, wd,
                                  deterministic=deterministic)
    with pytest.raises(ValueError, match=match):
        ef.triton_expert_forward(x, gather_ids, sorted_probs, offsets, wg, wu, wd,
                                 deterministic=deterministic)


def test_panels_too_large_recompute_with_a_warning(rng, monkeypatch):
    # When one head's panels would pass the limit the weight gradients are
    # recomputed, with one warning that says why.
    monkeypatch.setattr(tuning, "PANEL_WORKSPACE_BYTES", 1)
    monkeypatch.setattr(eb, "_warned_recompute", False)
    with pytest.warns(UserWarning, match="PANEL_WORKSPACE_BYTES"):
        check(rng, 5, 2, 3, 2, 32, 32)


def test_panel_k_step_smaller_than_tile(rng):
    # Panel GEMM steps of 16 rows over 32-row tiles, 16 x 32 output tiles (the last
    # column block of I = 48 partial), pointer loads.
    cfg = ExpertBackwardConfig(dx=BIG.dx, dw=BIG.dw,
                               panel=PanelGemmConfig(16, 32, 16, 4, 1, tma=False))
    check(rng, 40, 2, 3, 2, 32, 48, config=cfg)


def test_gluon_dw_gemm_asked_where_it_cannot_run(rng, monkeypatch):
    # PanelGemmConfig.warp_specialized runs on sm_90 only (bf16): a config that asks for
    # it elsewhere is refused; the same config from the table runs the Triton kernel at
    # the same tiles, bitwise as that config asked for directly.
    ws = dataclasses.replace(BIG, panel=PanelGemmConfig(64, 64, 64, 4, 2,
                                                        warp_specialized=True))
    triton_tiles = dataclasses.replace(ws, panel=dataclasses.replace(ws.panel,
                                                                     warp_specialized=False))
    problem = make_problem(rng, 5, 2, 3, 2, 64, 64)
    with pytest.raises(ValueError, match=r"panel\.warp_specialized needs an sm_90 GPU"):
        run(*problem, config=ws)
    want = run(*problem, config=triton_tiles)
    monkeypatch.setattr(tuning, "expert_backward_config", lambda *a, **k: ws)
    ran = []
    weight_gradients = eb._Panels.weight_gradients

    def record(self, *args, **kwargs):
        ran.append(self.tiles)
        return weight_gradients(self, *args, **kwargs)

    monkeypatch.setattr(eb._Panels, "weight_gradients", record)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(*problem)
    assert ran == [triton_tiles.panel]  # the panel GEMMs at the same tiles, in Triton
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert torch.equal(a, b), name
    # A table's config with Triton tiles of its own for that case runs those.
    fallback = PanelGemmConfig(32, 64, 32, 4, 1)
    monkeypatch.setattr(tuning, "expert_backward_config", lambda *a, **k: dataclasses.replace(
        ws, panel=dataclasses.replace(ws.panel, triton_fallback=fallback)))
    want = run(*problem, config=dataclasses.replace(ws, panel=fallback))
    ran.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(*problem)
    assert ran == [fallback]
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("named_fallback", [True, False])
def test_gluon_dw_gemm_after_dx_tiles_step_down(rng, monkeypatch, named_fallback):
    # If the dx kernel steps its tiles down below the Gluon dW GEMM's heights after the
    # fit check passed (out of resources at launch), the panel GEMMs run as the Triton
    # kernel at the config's triton_fallback tiles (else at its own tiles), bitwise as
    # those tiles asked for.
    ws_tiles = PanelGemmConfig(64, 64, 64, 4, 2, warp_specialized=True)
    if named_fallback:
        fallback = PanelGemmConfig(32, 64, 32, 4, 1)
        ws_tiles = dataclasses.replace(ws_tiles, triton_fallback=fallback)
    else:
        fallback = dataclasses.replace(ws_tiles, warp_specialized=False)
    ws = dataclasses.replace(BIG, panel=ws_tiles)
    assert ws.dx.block_m not in tuning.GLUON_DW_DX_ROWS  # the stepped-down tiles
    problem = make_problem(rng, 5, 2, 3, 2, 64, 64)
    want = run(*problem, config=dataclasses.replace(ws, panel=fallback))
    monkeypatch.setattr(eb, "_gluon_dw_fits", lambda *a: True)  # as the check passed
    ran = []
    weight_gradients = eb._Panels.weight_gradients

    def record(self, *args, **kwargs):
        weight_gradients(self, *args, **kwargs)
        ran.append(self.tiles)

    monkeypatch.setattr(eb._Panels, "weight_gradients", record)
    got = run(*problem, config=ws)
    assert ran == [fallback]
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert torch.equal(a, b), name


def test_sm90_table_rows_fit_their_kernels():
    # The Gluon dW GEMM takes panels of 64- or 128-row dx tiles; a row that pairs it with
    # other dx tiles would raise where the row is named and fall back where it is not.
    # Its named config (off in the table since 2026-12-06) keeps measured Triton tiles.
    assert tuning.SM90_PANEL_FEW_WS.warp_specialized
    assert tuning.SM90_PANEL_FEW_WS.triton_fallback is not None
    for _, row in tuning.BACKWARD_SM90:
        if row.panel is not None and row.panel.warp_specialized:
            assert row.dx.block_m in tuning.GLUON_DW_DX_ROWS, row
            assert row.panel.triton_fallback is not None, row  # measured Triton tiles


def test_gluon_dw_gemm_config_checks():
    assert PanelGemmConfig(64, 128, 64, 4, 4, warp_specialized=True).shared_bytes() == 229376
    with pytest.raises(ValueError, match="block_m = block_k = 64"):
        PanelGemmConfig(128, 128, 64, 4, 2, warp_specialized=True)
    with pytest.raises(ValueError, match="block_n 64, 128 or 256"):
        PanelGemmConfig(64, 32, 64, 4, 2, warp_specialized=True)
    with pytest.raises(ValueError, match="278528 bytes of shared memory"):
        PanelGemmConfig(64, 128, 64, 4, 5, warp_specialized=True)
    assert PanelGemmConfig(64, 128, 64, 4, 3, warp_specialized=True,
                           store_buffers=2).shared_bytes() == 212992
    with pytest.raises(ValueError, match="num_stages >= 2"):
        PanelGemmConfig(64, 128, 64, 4, 1, warp_specialized=True)
    with pytest.raises(ValueError, match="store_buffers: 1 or 2"):
        PanelGemmConfig(64, 128, 64, 4, 2, warp_specialized=True, store_buffers=3)
    triton = PanelGemmConfig(64, 128, 64, 4, 2)
    with pytest.raises(ValueError, match="triton_fallback"):
        PanelGemmConfig(64, 128, 64, 4, 2, triton_fallback=triton)  # not warp_specialized
    with pytest.raises(ValueError, match="triton_fallback"):
        PanelGemmConfig(64, 128, 64, 4, 2, warp_specialized=True,
                        triton_fallback=dataclasses.replace(triton, warp_specialized=True))
    # as_triton: the tiles run where the Gluon kernel cannot.
    assert triton.as_triton() is triton
    assert PanelGemmConfig(64, 64, 64, 4, 6, warp_specialized=True,
                           triton_fallback=triton).as_triton() == triton
    assert PanelGemmConfig(64, 64, 64, 4, 6, warp_specialized=True).as_triton() == \
        PanelGemmConfig(64, 64, 64, 4, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes(rng, dtype):
    check(rng, 5, 2, 3, 2, 32, 32, dtype=dtype)


def test_mixed_dtypes(rng):
    # fp32 activations and gradients with bf16 weights: all dots in fp32, like the reference.
    check(rng, 5, 2, 3, 2, 32, 32, dtype=torch.float32, wdtype=torch.bfloat16)


@pytest.mark.parametrize("deterministic", [False, True])
def test_no_tokens(deterministic):
    # S = 0: no routes, nothing launched; the weight gradients are zeros.
    x = torch.zeros(0, 2, 16, dtype=torch.bfloat16)
    w = torch.ones(6, 16, 16, dtype=torch.bfloat16)
    layout = sort_routes_reference(torch.zeros(2, 0, 2), torch.zeros(2, 0, 2, dtype=torch.long), 3)
    dx, dprobs, dg, du, dd = eb.triton_expert_backward(x, x, *layout, w, w, w,
                                                       deterministic=deterministic)
    assert dx.shape == (0, 2, 16) and dprobs.shape == (0,)
    assert dg.shape == w.shape and not dg.any() and not du.any() and not dd.any()


@pytest.mark.parametrize("D", [32, 256])  # 256: wider than one block of the slot-sum kernel
@pytest.mark.parametrize("deterministic", [False, True])
def test_head_groups(rng, monkeypatch, deterministic, D):
    # Workspace limits smaller than one head's buffer: one dx launch per head (the
    # head grouping is the forward's HeadGroups, which reads tuning's limits).
    monkeypatch.setattr(tuning, "DEFAULT_WORKSPACE_BYTES", 1)
    monkeypatch.setattr(tuning, "DETERMINISTIC_WORKSPACE_BYTES", 1)
    check(rng, 5, 3, 3, 2, D, 16, deterministic=deterministic)


@pytest.mark.parametrize("path", ["panels", "split"])
def test_deterministic_bitwise(rng, path):
    # The kernels alone: bitwise equal run to run; under a token permutation dx and
    # dprobs permute bitwise, while the weight gradients (sums over an expert's routes
    # in layout order) agree up to rounding. The op hands the kernels a layout in
    # content order, which makes them bitwise too (tests/test_experts.py).
    S, H, E, K = 12, 2, 4, 3
    x, probs, indices, wg, wu, wd, dy = make_problem(rng, S, H, E, K, 32, 32)
    first = run(x, probs, indices, wg, wu, wd, dy, deterministic=True, config=PATHS[path])
    again = run(x, probs, indices, wg, wu, wd, dy, deterministic=True, config=PATHS[path])
    for name, a, b in zip(NAMES, first, again, strict=True):
        assert torch.equal(a, b), name
    perm = torch.randperm(S, generator=rng)
    moved = run(x[perm], probs[:, perm], indices[:, perm], wg, wu, wd, dy[perm],
                deterministic=True, config=PATHS[path])
    assert torch.equal(moved[0], first[0][perm])
    assert torch.equal(moved[1], first[1][:, perm])
    for name, a, b in zip(NAMES[2:], moved[2:], first[2:], strict=True):
        assert rel_err(a, b) <= 4e-3, name


def test_default_mode_matches_deterministic(rng):
    # The modes differ only in the order of dx's K adds: the rest is bitwise equal.
    problem = make_problem(rng, 9, 2, 4, 3, 32, 32)
    atomic = run(*problem, config=BIG)
    ordered = run(*problem, deterministic=True, config=BIG)
    assert rel_err(atomic[0], ordered[0]) <= 4e-3
    for name, a, b in zip(NAMES[1:], atomic[1:], ordered[1:], strict=True):
        assert torch.equal(a, b), name


def test_deterministic_needs_uniform_k(rng):
    x, probs, indices, wg, wu, wd, dy = make_problem(rng, 4, 1, 3, 2, 16, 16)
    gather_ids, sorted_probs, offsets = sort_routes_reference(probs, indices, 3)
    with pytest.raises(ValueError, match="deterministic"):
        eb.triton_expert_backward(dy, x, gather_ids[:-1], sorted_probs[:-1], offsets.clamp(max=7),
                                  wg, wu, wd, deterministic=True)


def test_configs():
    assert tuning.PANEL_WORKSPACE_BYTES == 2 * 2**30  # the 2 GiB the README and docs state
    cfg = expert_backward_config(torch.device("cpu"), 24.0)
    assert isinstance(cfg, ExpertBackwardConfig)
    assert isinstance(cfg.dx, ExpertForwardConfig) and isinstance(cfg.dw, ExpertForwardConfig)


def test_hopper_configs_by_operand_dtype(monkeypatch):
    # On sm_90, float32 operands start from tiles that fit shared memory (checked by
    # compiling for sm_90: dx 224 KB, dw 172 KB of 227), instead of stepping down at
    # launch with a recompilation per step.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    fp32 = expert_backward_config(cuda, 768.0, fp32_operands=True)
    assert (fp32.dx.block_m, fp32.dx.block_i, fp32.dx.num_stages) == (64, 32, 1)
    assert (fp32.dw.block_m, fp32.dw.block_i, fp32.dw.num_stages) == (32, 32, 1)
    bf16 = expert_backward_config(cuda, 768.0)
    assert (bf16.dw.block_m, bf16.dw.num_stages) == (128, 1)  # the measured default


def test_panel_config_checks_and_step_down():
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        PanelGemmConfig(32, 32, 24, 4, 1)
    with pytest.raises(ValueError, match="num_warps"):
        PanelGemmConfig(32, 32, 32, 3, 1)
    with pytest.raises(ValueError, match="num_stages"):
        PanelGemmConfig(32, 32, 32, 4, 0)
    # Shrinking: pipelining depth first, then the output tile's columns, then its rows.
    steps, cfg = [], PanelGemmConfig(32, 32, 16, 4, 2)
    while cfg is not None:
        steps.append((cfg.block_m, cfg.block_n, cfg.num_stages))
        cfg = tuning.step_down_panel(cfg)
    assert steps == [(32, 32, 2), (32, 32, 1), (32, 16, 1), (16, 16, 1)]


def test_deterministic_refuses_uneven_tokens(rng):
    # Every head owns S*K routes, but token 0 has 3 and token 1 has 1: the default
    # mode's grids cover it, the deterministic slots (K per (token, head)) do not.
    gather_ids = torch.tensor([0, 1, 2, 3, 0, 2, 0, 3])
    offsets = torch.tensor([0, 4, 6, 8])
    assert_refused(rng, 4, 1, 3, gather_ids, offsets, True, "every \\(token, head\\)")
