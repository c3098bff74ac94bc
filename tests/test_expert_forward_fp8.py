"""The fp8 expert kernel (kernels/expert_forward_fp8.py) against its float64 twin
(mhmoe.fp8.fp8_expert_reference), in the Triton interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from mhmoe.fp8 import (
    ACT_BLOCK,
    FP8,
    fp8_expert_reference,
    quantize_weights,
)
from mhmoe.kernels import expert_forward_fp8 as k8
from mhmoe.kernels.expert_forward import swiglu7_tile
from mhmoe.kernels.tuning import Fp8ForwardConfig
from mhmoe.reference import expert_forward_reference, sort_routes_reference

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests (the GPU ones are in test_gpu.py)")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def problem(S, H, E, K, D, I, seed):
    """bf16 x, a sorted layout (every (token, head) routed to K distinct experts) and
    bf16 Gaussian weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S, H, D, generator=gen).bfloat16()
    w = [torch.randn(H * E, D, I, generator=gen) * D**-0.5,
         torch.randn(H * E, D, I, generator=gen) * D**-0.5,
         torch.randn(H * E, I, D, generator=gen) * I**-0.5]
    w = [t.bfloat16() for t in w]
    idx = torch.argsort(torch.rand(H, S, E, generator=gen), dim=-1)[..., :K]
    probs = torch.rand(H, S, K, generator=gen)
    layout = sort_routes_reference(probs, idx, E)
    return x, layout, w


def run(x, layout, q, config, deterministic=False):
    return k8.triton_expert_forward_fp8(
        x, *layout, q.w_gate.transpose(1, 2), q.w_up.transpose(1, 2),
        q.w_down.transpose(1, 2), q.gate_scale, q.up_scale, q.down_scale,
        deterministic=deterministic, config=config)


# Two tile heights: a tile of 16 routes, and one of 32 (more tiles end inside an expert).
CONFIGS = {"block_m 32": Fp8ForwardConfig(32, ACT_BLOCK, 4, 1),
           "block_m 16": Fp8ForwardConfig(16, ACT_BLOCK, 4, 1)}


@pytest.mark.parametrize("mode", sorted(CONFIGS))
@pytest.mark.parametrize("S,H,E,K,D,I,edge", [
    (40, 2, 4, 2, 32, 128, "two row blocks per expert"),
    (1, 1, 4, 1, 32, 64, "S=1, one head, K=1, empty experts"),
    (24, 2, 3, 3, 16, 64, "K=E, the smallest D"),
    (20, 1, 1, 1, 32, 192, "one expert, every token on it, I not a power of two"),
])
def test_kernel_equals_its_float64_twin(mode, S, H, E, K, D, I, edge):
    x, layout, w = problem(S, H, E, K, D, I, seed=S + I)
    q = quantize_weights(*w)
    twin = fp8_expert_reference(x, *layout, q)
    for deterministic in (False, True):
        y = run(x, layout, q, CONFIGS[mode], deterministic)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        # the kernel's result is rounded to bf16 (2^-9 relative) and its fp32
        # accumulators may move a quantized activation by one e4m3 step now and then
        assert rel_err(y, twin) < 4e-3, (mode, edge, deterministic)


@pytest.mark.parametrize("mode", sorted(CONFIGS))
def test_reciprocals_reach_the_kernel_and_leave_the_interpreters_results(mode, monkeypatch):
    # Fp8ForwardConfig.reciprocals: the launcher passes it to the kernel as RCP (checked
    # on the launch itself: no output under the interpreter can show it, which divides
    # the scales either way and whose sigmoid flush vanishes in the activation's
    # quantization); the results stay bitwise the default's. test_gpu.py checks the
    # inline reciprocals on the GPU.
    import dataclasses

    x, layout, w = problem(40, 2, 4, 2, 32, 128, seed=5)
    q = quantize_weights(*w)
    rcp = dataclasses.replace(CONFIGS[mode], reciprocals=True)
    kernel, seen = k8._expert_forward_fp8_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["RCP"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(k8, "_expert_forward_fp8_kernel", Spy())
    for deterministic in (False, True):
        seen.clear()
        got = run(x, layout, q, rcp, deterministic)
        assert seen and all(seen), seen
        seen.clear()
        assert torch.equal(got, run(x, layout, q, CONFIGS[mode], deterministic))
        assert seen and not any(seen), seen


@triton.jit
def _swiglu7_kernel(g_ptr, u_ptr, out_ptr, N: tl.constexpr, RCP: tl.constexpr):
    n = tl.arange(0, N)
    a = swiglu7_tile(tl.load(g_ptr + n), tl.load(u_ptr + n), RCP, True)
    tl.store(out_ptr + n, a)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # g = -60: 1 + e = inf
def test_swiglu7_reciprocal_flushes_where_it_is_subnormal():
    # swiglu7_tile with RCP (the fp8 kernels' reciprocals), as the interpreter emulates
    # rcp.approx.ftz: 1 + e in (2^126, 2^128) (g = -51.75: 2^127.07) has a subnormal
    # reciprocal, which the reciprocal flushes (g * 0 = -0) where the division rescales
    # (g / y ~ -3e-37); elsewhere the two agree bitwise.
    g = torch.tensor([-51.75, -60.0, -10.0, -1.0, 0.0, 0.5, 3.0, 9.0])
    u = torch.tensor([0.5, 0.5, -9.0, 2.0, 1.0, 8.0, -0.25, 0.0])
    out = {rcp: torch.empty(8) for rcp in (False, True)}
    for rcp, o in out.items():
        _swiglu7_kernel[(1,)](g, u, o, N=8, RCP=rcp)
    assert out[False][0] != 0 and abs(out[False][0]) < 1e-30
    assert out[True][0] == 0 and torch.signbit(out[True][0])
    assert torch.equal(out[True][1:], out[False][1:])
    # against float64: min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1)
    gc = g.double().clamp(max=7.0)
    ref = gc * torch.sigmoid(1.702 * gc) * (u.double().clamp(-7.0, 7.0) + 1.0)
    assert torch.allclose(out[True].double(), ref, rtol=1e-6, atol=1e-30)


def test_fp8_error_budget_against_the_bf16_layer():
    # contract: relative error <= 6.5e-2 against the float64 evaluation of the bf16 weights
    x, layout, w = problem(64, 2, 4, 2, 64, 256, seed=3)
    q = quantize_weights(*w)
    y = run(x, layout, q, CONFIGS["block_m 32"])
    full = expert_forward_reference(x.double(), *layout, *(t.double() for t in w))
    err = rel_err(y, full)
    cos = torch.nn.functional.cosine_similarity(y.double().flatten(), full.flatten(), dim=0)
    assert err < 6.5e-2 and cos > 0.998, (err, cos)
    assert err > 1e-2  # not vacuous: the fp8 rounding is there


def test_deterministic_mode_is_bitwise_under_token_permutation():
    S, H, E, K, D, I = 48, 2, 4, 2, 32, 64
    x, layout, w = problem(S, H, E, K, D, I, seed=7)
    q = quantize_weights(*w)
    gather_ids, sorted_probs, offsets = layout
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(1))
    inverse = torch.argsort(perm)
    # the same routes with the tokens renumbered: x_p[j] = x[perm[j]], token t -> inverse[t];
    # re-sorted by expert, then by new token id, as sort_routes would order them
    new_ids = inverse[gather_ids.long()]
    expert = torch.repeat_interleave(torch.arange(H * E), offsets.diff())
    order = torch.argsort(expert * S + new_ids)
    layout_p = (new_ids[order].int(), sorted_probs[order], offsets)
    for config in CONFIGS.values():
        y = run(x, layout, q, config, deterministic=True)
        y_p = run(x[perm], layout_p, q, config, deterministic=True)
        assert torch.equal(y_p, y[perm])


@pytest.mark.parametrize("D,I,message", [
    (32, 96, "block_i=64 must divide I=96"),  # a partial slice would read the next expert's scales
    (48, 64, "D=48 must be a power of two"),  # D not a power of two
    (8, 64, "D=8 must be a power of two >= 16"),  # D below the smallest tile
])
def test_launcher_refuses_shapes_the_kernel_cannot_take(D, I, message):
    x, layout, w = problem(8, 1, 2, 1, D, I, seed=0)
    q = quantize_weights(*w)
    with pytest.raises(ValueError, match=message):
        run(x, layout, q, None)  # the default tiles
    with pytest.raises(ValueError, match=message):
        run(x, layout, q, CONFIGS["block_m 16"])


def test_config_block_i_is_the_activation_block():
    with pytest.raises(ValueError, match=f"block_i must be {ACT_BLOCK}"):
        Fp8ForwardConfig(32, 32, 4, 1)


def test_forced_warp_specialized_refuses_where_it_cannot_run():
    # The Gluon kernel (kernels/expert_forward_fp8_sm90.py) runs on sm_90 only, with D =
    # 256: asked for anywhere else it is an error, never a silent switch to another kernel.
    x, layout, w = problem(8, 1, 2, 1, 256, 64, seed=0)
    q = quantize_weights(*w)
    with pytest.raises(ValueError, match="warp_specialized needs an sm_90 GPU"):
        run(x, layout, q, Fp8ForwardConfig(128, ACT_BLOCK, 8, 3, warp_specialized=True))


def test_a_table_choice_of_the_gluon_kernel_runs_the_triton_one_where_it_cannot(
        monkeypatch):
    # tuning.FP8_FORWARD_SM90 picks the Gluon kernel above 96 routes an expert; where it
    # cannot run (here: no sm_90 GPU) the table's row runs as the Triton kernel at its
    # tiles, bitwise as those tiles asked for directly, with no error or warning.
    import warnings

    from mhmoe.kernels import tuning

    tiles = Fp8ForwardConfig(32, ACT_BLOCK, 4, 1)
    # (with the Gluon kernel's own options on: they go with the Gluon kernel)
    monkeypatch.setattr(tuning, "fp8_forward_config", lambda *a, **k: Fp8ForwardConfig(
        32, ACT_BLOCK, 4, 1, warp_specialized=True, skip_empty_halves=True,
        chunked_x=True))
    x, layout, w = problem(20, 2, 4, 2, 32, 64, seed=3)
    q = quantize_weights(*w)
    for deterministic in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = run(x, layout, q, None, deterministic)
        assert torch.equal(got, run(x, layout, q, tiles, deterministic)), deterministic


@pytest.mark.parametrize("option", ["skip_empty_halves", "chunked_x"])
def test_gluon_options_need_the_gluon_kernel(option):
    with pytest.raises(ValueError, match=f"{option} is an option of the Gluon"):
        Fp8ForwardConfig(32, ACT_BLOCK, 4, 1, **{option: True})
    assert getattr(Fp8ForwardConfig(128, ACT_BLOCK, 4, 1, warp_specialized=True,
                                    **{option: True}), option)


@pytest.mark.parametrize("option, constexpr", [("skip_empty_halves", "SKIP"),
                                               ("chunked_x", "CHUNKED")])
def test_gluon_options_reach_the_gluon_launch(monkeypatch, option, constexpr):
    # The Gluon kernel cannot run here: with its shape check passed, the launch itself is
    # recorded (its kwargs become the kernel's constexprs through kernel_options), once a
    # head group, with the option as asked and the other off; tests/test_gpu.py runs the
    # kernel.
    from mhmoe.kernels import expert_forward_fp8_sm90 as ws

    seen = []
    monkeypatch.setattr(ws, "fp8_ws_fits", lambda *a: True)
    monkeypatch.setattr(ws, "launch_fp8_ws", lambda *a, **k: seen.append(k))
    x, layout, w = problem(20, 2, 4, 2, 256, 64, seed=3)
    q = quantize_weights(*w)
    options = ("reciprocals", "skip_empty_halves", "chunked_x")
    for on in (True, False):
        seen.clear()
        run(x, layout, q, Fp8ForwardConfig(128, ACT_BLOCK, 4, 1, warp_specialized=True,
                                           **{option: on}))
        assert seen and all(k[option] is on for k in seen), seen
        assert all(k[o] is False for k in seen for o in options if o != option), seen
        cfg = ws.fp8_forward_sm90_config()
        assert ws.kernel_options(cfg, 256, 64, False, **{option: on})[constexpr] is on
    with pytest.raises(TypeError, match="no option"):
        ws.kernel_options(ws.fp8_forward_sm90_config(), 256, 64, False, prefetch=True)


def test_gluon_tiles_must_fit_the_shared_memory():
    # 96 KB of x tiles and 8 KB of activations leave room for 7 ring stages of 16.5 KB.
    import dataclasses

    from mhmoe.kernels.tuning import fp8_forward_sm90_config

    config = fp8_forward_sm90_config()
    assert config.num_stages == 7 and config.shared_bytes() + 1024 <= 227 * 1024
    with pytest.raises(ValueError, match="must fit the sm_90 shared memory"):
        dataclasses.replace(config, num_stages=8)
    with pytest.raises(ValueError, match="written for block_m=128"):
        dataclasses.replace(config, block_m=64)
    # A warpgroup's block holds 3 stages while the other has not read the first: with a
    # shorter ring the loader could never refill it (found by review; the kernel hangs).
    with pytest.raises(ValueError, match="must hold a block's 3 stages"):
        dataclasses.replace(config, num_stages=2)
    assert dataclasses.replace(config, num_stages=3).num_stages == 3
    # The bf16 kernel's blocks hold 6 (two down chunks, four gate|up chunks).
    from mhmoe.kernels.tuning import expert_forward_sm90_config

    with pytest.raises(ValueError, match="must hold a block's 6 stages"):
        dataclasses.replace(expert_forward_sm90_config(), num_stages=5)


def test_quantize_weights_per_output_channel():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 32, 48, generator=gen)
    w[2, :, 5] = 0  # an all-zero channel quantizes to zeros, with a finite scale
    q = quantize_weights(w, w, w.transpose(1, 2).contiguous())
    assert q.w_gate.dtype == FP8 and q.gate_scale.shape == (6, 48)
    assert q.down_scale.shape == (6, 32)
    # K-major storage: W_gate is a view of a contiguous [F, I, D] tensor
    assert q.w_gate.transpose(1, 2).is_contiguous()
    deq = q.dequantized(torch.float64)[0]
    # each channel's largest magnitude is exact (it maps to 448), the rest within
    # half an e4m3 step (2^-4 relative) or the subnormal spacing
    amax = w.abs().amax(dim=1)
    assert torch.allclose(deq.abs().amax(dim=1), amax.double(), rtol=1e-6)
    bound = torch.maximum(w.abs().double() * 2**-4, (amax / 448 * 2**-9).double().unsqueeze(1))
    assert ((deq - w.double()).abs() <= bound + 1e-12).all()
    assert (deq[2, :, 5] == 0).all() and torch.isfinite(q.gate_scale).all()


@triton.jit
def _cast_kernel(v_ptr, out_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(out_ptr + o, k8._to_e4m3(tl.load(v_ptr + o), True))


def test_interpreter_e4m3_rounding_is_torchs():
    # nearest even with saturation, across normals, subnormals, ties and overflow
    steps = torch.tensor([448.0, 460.0, 464.0, 1e6, 2.0**-9, 2.0**-10, 3 * 2.0**-11,
                          2.0**-6, 0.0, 17.0, 18.0, 19.0, 0.0673, 1e-30, 2.0**-7 * 1.0625])
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([steps, -steps, torch.randn(4096 - 2 * len(steps), generator=gen) * 30])
    out = torch.empty(values.numel(), dtype=FP8)
    _cast_kernel[(1,)](values, out, N=values.numel())
    assert torch.equal(out.view(torch.uint8), values.to(FP8).view(torch.uint8))
