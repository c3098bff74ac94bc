"""Fused expert forward with fp8 (e4m3) expert weights (docs/contract.md section 10).

The same program structure as kernels/expert_forward.py: one program owns
BLOCK_M routes of one flat expert, gathers their x rows once, and walks the
intermediate dimension I in slices of BLOCK_I; the [rows, I] activations never
leave the chip. Weights arrive as e4m3 with fp32 scales, one per expert output
channel (`W = W_fp8 * scale`, the scale broadcast over the reduced dimension),
stored K-major for the tensor cores: W_gate and W_up as [F, I, D], W_down as
[F, D, I] (the layer's parameters are transposed views of these, see
mhmoe/fp8.py). Every product runs on the fp8 tensor cores (sm_89 or later):

- each x row is quantized with its own dynamic scale s_x = amax / 448, so
  g = (xq @ Wgq) * s_x * s_gate exactly factors the scales out of the fp32
  accumulation. SwiGLU7 runs on the fp32 accumulators (`swiglu7_tile`, the bf16
  kernel's); its output a is quantized per row and per slice of BLOCK_I columns
  (s_a = amax / 448 of that piece), and the down GEMM accumulates
  sum_slices s_a * (aq @ Wdq): the accumulator is kept in units of the current
  slice's scale (multiplied by s_prev / s_a before each slice, by the last s_a at
  the end), so the slices share one wgmma accumulator instead of two register
  tiles. BLOCK_I is therefore part of the numerics: `fp8.ACT_BLOCK`.

(A weight-only multiply, the fp8 weights widened to bf16 on chip, measured slower
at every size and was removed: docs/fp8.md.)

The epilogue and the combine (default: fp32 atomics; deterministic: per-route
slots summed in a fixed order) are those of the bf16 kernel (`combine_rows`,
`HeadGroups`). Every scale is per row, so a route's result does not depend on
which tile or which other tokens it was computed with.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import tuning
from .expert_forward import (
    HeadGroups,
    combine_rows,
    divide,
    swiglu7_tile,
    tile_map,
    tile_rows,
)
from .tuning import interpreting

# The largest finite e4m3 value, and the amax below which a row quantizes as if its
# amax were this (all-zero padding heads then give zeros, never 0/0). The same
# numbers as mhmoe.fp8's FP8_MAX and AMAX_FLOOR, as kernel constants.
_FP8_MAX = tl.constexpr(448.0)
_AMAX_FLOOR = tl.constexpr(2.0 ** -64)


@triton.jit
def _to_e4m3(v, INTERPRET: tl.constexpr):
    """fp32 v -> e4m3, round to nearest even, saturated at +-448 (the GPU's
    cvt.rn.satfinite, and torch's cast). The interpreter's cast rounds otherwise,
    so there the value is first rounded in fp32 on the bits: 3 mantissa bits in
    the normal range, multiples of 2^-9 below 2^-6 (by adding and subtracting
    1.5 * 2^14, whose fp32 spacing is 2^-9), then cast exactly."""
    if INTERPRET:
        a = tl.abs(v)
        bits = a.to(tl.uint32, bitcast=True)
        normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000).to(tl.float32,
                                                                           bitcast=True)
        sub = (a + 24576.0) - 24576.0
        r = tl.minimum(tl.where(a < 0.015625, sub, normal), _FP8_MAX)
        sign = v.to(tl.uint32, bitcast=True) & 0x80000000  # -0.0 stays -0.0, as on the GPU
        return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(
            tl.float8e4nv)
    else:
        return v.to(tl.float8e4nv)


@triton.jit
def _row_scale(v):
    """Dynamic per-row scale of an fp32 tile: max(amax, _AMAX_FLOOR) / 448."""
    return tl.maximum(tl.max(tl.abs(v), axis=1), _AMAX_FLOOR) / _FP8_MAX


@triton.jit
def _expert_forward_fp8_kernel(
    x_ptr, stride_xs, stride_xh,  # x_heads [S, H, D] bf16; unit stride along D
    gather_ids_ptr, probs_ptr, offsets_ptr,  # the RouteLayout: [R], [R], [H*E + 1]
    tile_expert_ptr, tile_first_ptr,  # the tile map of expert_forward.tile_map
    wg_desc, wu_desc, wd_desc,  # e4m3 descriptors: [F, I, D], [F, I, D], [F, D, I]
    sg_ptr, su_ptr, sd_ptr,  # fp32 channel scales: [F, I], [F, I], [F, D]
    out_ptr, slot_ptr,  # default: fp32 [S, G, D]; deterministic: fp32 [G*S*K, D], slots [R]
    E, first_expert, num_experts, first_head, group_heads, slot_base,
    D: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    DETERMINISTIC: tl.constexpr, INTERPRET: tl.constexpr, RCP: tl.constexpr = False,
):
    """Expert MLPs of one tile of routes, fp8 weights.

    Launch grid: (T_max,), as `expert_forward._expert_forward_kernel`: program t owns
    rows [offsets[f] + b * BLOCK_M, ...) of expert f (tile_expert[t], tile_first[f]);
    programs past the last tile return at once. D is a power of two >= 16 and BLOCK_I
    divides I (the launcher checks), so no load is masked but the rows'.
    RCP: `Fp8ForwardConfig.reciprocals`.
    """
    pid = tl.program_id(0)
    e = tl.load(tile_expert_ptr + pid)
    if e >= num_experts:
        return
    f, head, rows, row_ok, tokens = tile_rows(pid, e, tile_first_ptr, offsets_ptr,
                                              gather_ids_ptr, first_expert, E, BLOCK_M)
    d = tl.arange(0, D)
    i = tl.arange(0, BLOCK_I)
    x = tl.load(x_ptr + tokens[:, None] * stride_xs + head * stride_xh + d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    s_x = _row_scale(x)
    # Row scales lie in [2^-73, 2^119]: with RCP the reciprocal's bits are the division's.
    xq = _to_e4m3(divide(x, s_x[:, None], RCP, INTERPRET), INTERPRET)
    s_prev = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    f32 = f.to(tl.int32)
    for i0 in range(0, I, BLOCK_I):
        wg = wg_desc.load([f32, i0, 0]).reshape(BLOCK_I, D)
        wu = wu_desc.load([f32, i0, 0]).reshape(BLOCK_I, D)
        wd = wd_desc.load([f32, 0, i0]).reshape(D, BLOCK_I)
        sg = tl.load(sg_ptr + f * I + i0 + i)
        su = tl.load(su_ptr + f * I + i0 + i)
        g = tl.dot(xq, tl.trans(wg)) * s_x[:, None] * sg[None, :]
        u = tl.dot(xq, tl.trans(wu)) * s_x[:, None] * su[None, :]
        a = swiglu7_tile(g, u, RCP, INTERPRET)
        s_a = _row_scale(a)
        aq = _to_e4m3(divide(a, s_a[:, None], RCP, INTERPRET), INTERPRET)
        acc = acc * divide(s_prev, s_a, RCP, INTERPRET)[:, None]
        acc = tl.dot(aq, tl.trans(wd), acc)
        s_prev = s_a
    acc = acc * s_prev[:, None]
    sd = tl.load(sd_ptr + f * D + d)
    prob = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * sd[None, :] * prob[:, None]
    combine_rows(out_ptr, slot_ptr, acc, row_ok[:, None], rows, row_ok, tokens, head, d,
                 slot_base, group_heads, first_head, D, DETERMINISTIC)


def triton_expert_forward_fp8(
    x_heads: torch.Tensor,
    gather_ids: torch.Tensor,
    sorted_probs: torch.Tensor,
    offsets: torch.Tensor,
    wg_t: torch.Tensor,
    wu_t: torch.Tensor,
    wd_t: torch.Tensor,
    gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    *,
    deterministic: bool = False,
    config: tuning.Fp8ForwardConfig | None = None,
) -> torch.Tensor:
    """Expert MLPs of every route with fp8 weights, summed per (token, head).

    x_heads: [S, H, D] bf16; the layout as `triton_expert_forward`'s;
    wg_t, wu_t: [H*E, I, D] e4m3 (W_gate and W_up transposed, contiguous);
    wd_t: [H*E, D, I] e4m3 (W_down transposed, contiguous);
    gate_scale, up_scale: [H*E, I] fp32; down_scale: [H*E, D] fp32.
    Returns y [S, H, D] bf16. config: force tiles (tests; default
    `tuning.fp8_forward_config` by routes per expert); with `warp_specialized` the Gluon
    kernel of `expert_forward_fp8_sm90.py` runs instead, at the tiles of
    `tuning.fp8_forward_sm90_config`, with the same numerics (sm_90, D = 256, I a
    multiple of 64; elsewhere ValueError where `config` asked for it, the Triton kernel
    at the config's tiles where the table did). Raises ValueError unless D is a
    power of two >= 16 (a row is one tile) and the config's block_i divides I (the
    scale loads are not masked: a partial slice would read the next expert's scales).
    Inputs are otherwise assumed valid (`experts.check_fp8_expert_inputs`); nothing is
    read back to the host.
    """
    S, H, D = x_heads.shape
    F, I, _ = wg_t.shape
    E = F // H
    R = gather_ids.numel()
    interpret = interpreting()
    forced = config is not None
    if config is None:
        config = tuning.fp8_forward_config(x_heads.device, R / max(1, F), interpret)
    if D < 16 or D & (D - 1):
        raise ValueError(f"triton_expert_forward_fp8: D={D} must be a power of two >= 16")
    if I % config.block_i:
        raise ValueError(f"triton_expert_forward_fp8: block_i={config.block_i} must divide "
                         f"I={I}")
    if config.warp_specialized:
        from . import expert_forward_fp8_sm90 as ws  # Gluon: imported where it may run

        if not ws.fp8_ws_fits(x_heads, wg_t, wd_t):
            if forced:
                raise ValueError(
                    "config.warp_specialized needs an sm_90 GPU, bf16 x, e4m3 weights, "
                    f"D = 256 and I a multiple of 64; got {x_heads.device}, {x_heads.dtype}/"
                    f"{wg_t.dtype}, D={D}, I={I}")
            # A table's choice: the Triton kernel at the row's tiles.
            config = dataclasses.replace(config, warp_specialized=False,
                                         **tuning.GLUON_ONLY_OFF)
    y = torch.empty(S, H, D, dtype=x_heads.dtype, device=x_heads.device)
    if S == 0 or R == 0:
        return y.zero_()
    if x_heads.stride(2) != 1:
        x_heads = x_heads.contiguous()
    gather_ids, sorted_probs, offsets = (
        gather_ids.contiguous(), sorted_probs.contiguous(), offsets.contiguous())
    groups = HeadGroups(y, gather_ids, offsets, E, deterministic, "expert_forward_fp8")
    if config.warp_specialized:
        sm90 = tuning.fp8_forward_sm90_config()
        descs = ws.descriptors(wg_t, wu_t, wd_t, gate_scale, up_scale)
        for h0, g, routes, out in groups:
            max_tiles = triton.cdiv(routes, sm90.block_m) + g * E
            tile_expert, tile_first, total = tile_map(offsets, h0 * E, g * E, sm90.block_m,
                                                      max_tiles, with_total=True)
            ws.launch_fp8_ws(x_heads, gather_ids, sorted_probs, offsets, descs, down_scale,
                             out, groups.slots, tile_expert, tile_first, total, config=sm90,
                             E=E, first_expert=h0 * E, first_head=h0, group_heads=g,
                             slot_base=h0 * S * groups.K, I=I, deterministic=deterministic,
                             **ws.config_options(config))
            groups.finish(h0, g, out, interpret)
        return y
    bi = config.block_i
    descs = (TensorDescriptor.from_tensor(wg_t, [1, bi, D]),
             TensorDescriptor.from_tensor(wu_t, [1, bi, D]),
             TensorDescriptor.from_tensor(wd_t, [1, D, bi]))
    for h0, g, routes, out in groups:
        max_tiles = triton.cdiv(routes, config.block_m) + g * E
        tile_expert, tile_first = tile_map(offsets, h0 * E, g * E, config.block_m, max_tiles)
        _expert_forward_fp8_kernel[(max_tiles,)](
            x_heads, x_heads.stride(0), x_heads.stride(1),
            gather_ids, sorted_probs, offsets, tile_expert, tile_first, *descs,
            gate_scale, up_scale, down_scale, out, groups.slots,
            E, h0 * E, g * E, h0, g, h0 * S * groups.K,
            D=D, I=I, BLOCK_M=config.block_m, BLOCK_I=bi, DETERMINISTIC=deterministic,
            INTERPRET=interpret, RCP=config.reciprocals,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        groups.finish(h0, g, out, interpret)
    return y


def sm90_compile_cases() -> list:
    """This kernel at every sm_90 default tile of `tuning.FP8_FORWARD_SM90`, default and
    deterministic, and at the first with `Fp8ForwardConfig.reciprocals`
    (`mhmoe.kernels.CompileCase`; MAGI-2's dims)."""
    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase

    D, I = M.head_dim, M.expert_intermediate_size
    cases = []
    first = tuning.FP8_FORWARD_SM90[0][1]
    runs = [(c, det, False) for _, c in tuning.FP8_FORWARD_SM90 for det in (False, True)]
    for c, det, rcp in [*runs, (first, False, True)]:
        cases.append(CompileCase(
            f"expert forward fp8 {c.block_m}/{c.block_i}/{c.num_warps}/{c.num_stages}"
            f"{' deterministic' if det else ''}{' reciprocals' if rcp else ''}",
            _expert_forward_fp8_kernel,
            {"x_ptr": "*bf16", "stride_xs": "i32", "stride_xh": "i32",
             "gather_ids_ptr": "*i32", "probs_ptr": "*fp32", "offsets_ptr": "*i64",
             "tile_expert_ptr": "*i32", "tile_first_ptr": "*i32",
             "wg_desc": f"tensordesc<fp8e4nv[1, {c.block_i}, {D}]>",
             "wu_desc": f"tensordesc<fp8e4nv[1, {c.block_i}, {D}]>",
             "wd_desc": f"tensordesc<fp8e4nv[1, {D}, {c.block_i}]>",
             "sg_ptr": "*fp32", "su_ptr": "*fp32", "sd_ptr": "*fp32",
             "out_ptr": "*fp32", "slot_ptr": "*i32", "E": "i32", "first_expert": "i32",
             "num_experts": "i32", "first_head": "i32", "group_heads": "i32",
             "slot_base": "i32"},
            dict(D=D, I=I, BLOCK_M=c.block_m, BLOCK_I=c.block_i, DETERMINISTIC=det,
                 INTERPRET=False, RCP=rcp),
            c.num_warps, c.num_stages, ("stride_xs", "stride_xh")))
    return cases
