"""Fused expert MLP backward: dx, d(probabilities) and the three weight gradients.

With g, u = x Wg, x Wu (fp32), a = cast(swiglu7(g, u)), t = dy Wd^T and p the
route's probability (docs/contract.md section 4 and `reference.expert_backward_reference`):

    dprobs = rowsum(a * t)                     (over I; = rowsum((a Wd) * dy))
    da     = p * t;  dg, du = SwiGLU7'(g, u) applied to da
    dx     = dg Wg^T + du Wu^T                 summed over the K routes of (s, h)
    dWd    = a^T (p dy);  dWg = x^T dg;  dWu = x^T du

Nothing of size [routes, I] is kept between forward and backward. By default
(`_Panels`) the dx kernel, which computes g, u, t, dg, du and a anyway, also
writes the weight gradients' operands for one group of heads to a bounded
workspace ("panels"), and three plain GEMMs per expert read them back:
8 GEMMs of [rows, D, I] in all. Where one head's panels would not fit their
limit, the dW kernel recomputes g, u and t instead (11 GEMMs).

- `_expert_dx_kernel`: one program per (expert, row block), the forward's tile
  map. It loops over I in slices (g, u, t: three dots; dx: two more) and
  keeps a [BLOCK_M, D] fp32 dx accumulator and a per-row dprobs sum. dx rows
  are combined per (token, head) as the forward combines y: fp32 atomics by
  default, ordered slots plus an ordered sum in deterministic mode. With
  PANELS it stores x, dy, dg, du and a * p of its rows.
- `_panel_dx_kernel` (with `ExpertBackwardConfig.panel_dx`): dx from the panels, dg
  Wg^T + du Wu^T over each tile's panel rows, combined as the dx kernel combines; the
  dx kernel then leaves its dx products out (DX=False), or on sm_90 the Gluon panel
  kernel of `expert_panels_sm90.py` writes the panels and dprobs in its place.
- `_panel_dw_kernel`: dWg = x^T dg, dWu = x^T du, dWd = (a p)^T dy, one
  program per (expert, output tile), the expert's panel rows summed in
  ascending order; one owner per element, written once in the weight dtype.
  On sm_90 `PanelGemmConfig.warp_specialized` runs the same contract in Gluon
  (`panel_dw_sm90.py`), with the same bits.
- `_expert_dw_kernel` (recompute): one program per (expert, I slice). It loops
  over the expert's row blocks in ascending order, accumulates dWg, dWu and
  dWd^T for its slice in fp32 registers and writes them once in the weight
  dtype: each gradient element has exactly one owner, so no atomics, and the
  sum order is fixed (deterministic in both modes).

dprobs has one owner per route too. So in deterministic mode every output is
bitwise reproducible; dx and dprobs are also independent of the token order,
while the dW sums run over an expert's routes in token order, so permuting
the tokens permutes their summands (equal up to rounding, not bitwise).

16-bit operands: dg, du and a * p are rounded to the weight dtype for the
tensor cores (the reference keeps them in fp32), which adds about one bf16
rounding of relative error to dx and dW.

The launch needs no host synchronisation: grids come from shapes (the dx
grid is the forward's upper bound on tiles, the panel GEMMs' grid the
experts times the output tiles, the dW grid F * cdiv(I, BLOCK_I)), so the
backward can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import tuning
from .expert_forward import (
    HeadGroups,
    combine_rows,
    divide,
    launch_with_step_down,
    round_fp32,
    tile_map,
    tile_rows,
    tma_fits,
)
from .tuning import (
    ExpertBackwardConfig,
    PanelGemmConfig,
    interpreting,
    on_sm90,
    step_down_panel,
    step_down_panel_dx,
)

__all__ = ["triton_expert_backward"]


@triton.jit
def _swiglu7_backward(g, u, da, RCP: tl.constexpr, INTERPRET: tl.constexpr):
    """SwiGLU7 at fp32 (g, u) and its input gradients for the upstream da.

    Returns a (fp32, before the cast to the weight dtype), dg, du. Clamps
    pass the gradient where the input lies inside the clamp range, bounds
    included, as torch.clamp does. RCP: the sigmoid's reciprocal as
    `ExpertBackwardConfig.sigmoid_rcp` says; INTERPRET: under the interpreter
    (the kernels' UPCAST); both `expert_forward.divide`'s.
    """
    gc = tl.minimum(g, 7.0)
    uc1 = tl.minimum(tl.maximum(u, -7.0), 7.0) + 1.0
    # sigmoid(1.702 g) = 1 / (1 + 2^(-1.702 log2(e) g)): one exp2 and a fast
    # reciprocal on the special-function units (as the forward).
    sig = divide(1.0, 1.0 + tl.exp2(-2.4554669595930157 * gc), RCP, INTERPRET)
    silu = gc * sig
    a = silu * uc1
    # Each mask right before its use: computed first, 64 masks would stay live across
    # the products, more than the predicate registers (ptxas then packs them into bits).
    dg = da * uc1 * (sig + 1.702 * silu * (1.0 - sig))
    dg = tl.where(g <= 7.0, dg, 0.0)
    du = da * silu
    du = tl.where((u >= -7.0) & (u <= 7.0), du, 0.0)
    return a, dg, du


@triton.jit
def _to_operand(v, dtype: tl.constexpr, UPCAST: tl.constexpr, DOT_FP32: tl.constexpr):
    """fp32 `v` as a dot operand: rounded to the 16-bit `dtype` for the tensor
    cores, kept in fp32 when the dots run in fp32 (DOT_FP32), rounded but
    held in fp32 under the interpreter (UPCAST), whose 16-bit math is wrong."""
    if UPCAST:
        if DOT_FP32:
            return v
        else:
            return round_fp32(v, dtype)
    elif DOT_FP32:
        return v
    else:
        return v.to(dtype)


@triton.jit
def _expert_dx_kernel(
    x_ptr, dy_ptr, H,  # x_heads, grad_y: contiguous [S, H, D]
    gather_ids_ptr, probs_ptr, offsets_ptr,  # the RouteLayout: [R], [R], [H*E + 1]
    tile_expert_ptr, tile_first_ptr,  # [T_max] int32, [G*E] int32 (forward's tile_map)
    wg_ptr, wu_ptr, wd_ptr,  # [H*E, D, I], [H*E, D, I], [H*E, I, D]: pointers or TMA descriptors
    dx_ptr, slot_ptr, dprobs_ptr,  # dx: fp32 [S, G, D] or [G*S*K, D] (deterministic); [R]; [R]
    xp_ptr, dyp_ptr, dgp_ptr, dup_ptr, app_ptr,  # PANELS: [P, D], [P, D], [P, I] x 3
    E, first_expert, num_experts, first_head, group_heads, slot_base,
    D: tl.constexpr, I: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_I: tl.constexpr, DETERMINISTIC: tl.constexpr,
    UPCAST: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    PANELS: tl.constexpr, DX: tl.constexpr = True, RCP: tl.constexpr = False,
):
    """dx rows and dprobs of one tile of routes.

    Launch grid: (T_max,), T_max >= the number of (expert, row block) tiles of
    the `num_experts` flat experts starting at `first_expert` (G heads), as the
    forward. Program t owns rows [offsets[f] + b * BLOCK_M, ... + BLOCK_M) of
    expert f (clipped to offsets[f + 1]): their dprobs (exclusive) and their
    dx rows, added atomically into the fp32 [S, G, D] buffer, or stored to
    their slots (deterministic). Programs past the last tile return at once.
    UPCAST, DOT_FP32, PRECISION, USE_TMA: as in the forward kernel.
    PANELS: also write the tile's rows of x, dy, dg, du and a * p (the
    operands of the weight gradients, as the dots would take them) to panel
    rows [t * BLOCK_M, (t + 1) * BLOCK_M), rows past the expert's end as zeros.
    DX=False (with PANELS): no dx (`_panel_dx_kernel` computes it from the panels): the
    program leaves out the dx products, their accumulator and the combine.
    RCP: `ExpertBackwardConfig.sigmoid_rcp`.
    """
    pid = tl.program_id(0)
    e = tl.load(tile_expert_ptr + pid)
    if e >= num_experts:
        return
    f, head, rows, row_ok, tokens = tile_rows(pid, e, tile_first_ptr, offsets_ptr,
                                              gather_ids_ptr, first_expert, E, BLOCK_M)
    prow = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # PANELS: this tile's rows

    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # Row starts are multiples of 16 elements (D is): 16-byte vector loads.
    row_base = tl.multiple_of(tokens * (H * D) + head * D, 16)
    xy_offs = row_base[:, None] + d[None, :]
    xy_ok = row_ok[:, None] & d_ok[None, :]
    # Rows past the tile load as zeros: g = u = t = 0 there, so they add nothing.
    x = tl.load(x_ptr + xy_offs, mask=xy_ok, other=0.0)
    dy = tl.load(dy_ptr + xy_offs, mask=xy_ok, other=0.0)
    if UPCAST or DOT_FP32:
        x = x.to(tl.float32)
        dy = dy.to(tl.float32)
    p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if PANELS:
        # Masked rows loaded as zeros: the padding rows of the panels are zeros.
        panel_dtype = xp_ptr.dtype.element_ty
        xy_panel = prow[:, None] * D + d[None, :]
        tl.store(xp_ptr + xy_panel, x.to(panel_dtype), mask=d_ok[None, :])
        tl.store(dyp_ptr + xy_panel, dy.to(panel_dtype), mask=d_ok[None, :])

    i = tl.arange(0, BLOCK_I)
    if not USE_TMA:
        wg_ptrs = wg_ptr + f * D * I + d[:, None] * I + i[None, :]  # [BLOCK_D, BLOCK_I]
        wu_ptrs = wu_ptr + f * D * I + d[:, None] * I + i[None, :]
        wd_ptrs = wd_ptr + f * I * D + i[:, None] * D + d[None, :]  # [BLOCK_I, BLOCK_D]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dprob = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        if USE_TMA:
            # The descriptors' bounds zero-fill the slice past I, like the masks.
            wg = wg_ptr.load([f.to(tl.int32), 0, i0]).reshape(BLOCK_D, BLOCK_I)
            wu = wu_ptr.load([f.to(tl.int32), 0, i0]).reshape(BLOCK_D, BLOCK_I)
            wd = wd_ptr.load([f.to(tl.int32), i0, 0]).reshape(BLOCK_I, BLOCK_D)
        elif EVEN_D and EVEN_I:
            wg = tl.load(wg_ptrs)
            wu = tl.load(wu_ptrs)
            wd = tl.load(wd_ptrs)
        else:
            # Zero weights past D or I give g = u = t = 0, hence a = dg = du = 0.
            gu_ok = d_ok[:, None] & (i0 + i < I)[None, :]
            wg = tl.load(wg_ptrs, mask=gu_ok, other=0.0)
            wu = tl.load(wu_ptrs, mask=gu_ok, other=0.0)
            wd = tl.load(wd_ptrs, mask=(i0 + i < I)[:, None] & d_ok[None, :], other=0.0)
        w_dtype = wd.dtype
        if UPCAST or DOT_FP32:
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
            wd = wd.to(tl.float32)
        g = tl.dot(x, wg, input_precision=PRECISION)
        u = tl.dot(x, wu, input_precision=PRECISION)
        t = tl.dot(dy, tl.trans(wd), input_precision=PRECISION)
        a, dg, du = _swiglu7_backward(g, u, t * p[:, None], RCP, UPCAST)
        # The forward multiplied the activation rounded to the weight dtype.
        if UPCAST:
            a = round_fp32(a, w_dtype)
        else:
            a = a.to(w_dtype).to(tl.float32)
        dprob += tl.sum(a * t, axis=1)
        dg = _to_operand(dg, w_dtype, UPCAST, DOT_FP32)
        du = _to_operand(du, w_dtype, UPCAST, DOT_FP32)
        if PANELS:
            # The weight-gradient operands, rounded as `_dw_rows` rounds them.
            ap = _to_operand(a * p[:, None], w_dtype, UPCAST, DOT_FP32)
            i_panel = prow[:, None] * I + (i0 + i)[None, :]
            i_ok = (i0 + i < I)[None, :]
            tl.store(dgp_ptr + i_panel, dg.to(panel_dtype), mask=i_ok)
            tl.store(dup_ptr + i_panel, du.to(panel_dtype), mask=i_ok)
            tl.store(app_ptr + i_panel, ap.to(panel_dtype), mask=i_ok)
        if DX:
            acc = tl.dot(dg, tl.trans(wg), acc, input_precision=PRECISION)
            acc = tl.dot(du, tl.trans(wu), acc, input_precision=PRECISION)
        if not USE_TMA:
            wg_ptrs += BLOCK_I
            wu_ptrs += BLOCK_I
            wd_ptrs += BLOCK_I * D

    tl.store(dprobs_ptr + rows, dprob, mask=row_ok)
    if DX:
        combine_rows(dx_ptr, slot_ptr, acc, xy_ok, rows, row_ok, tokens, head, d, slot_base,
                     group_heads, first_head, D, DETERMINISTIC)


@triton.jit
def _panel_dx_steps(a_ptr, w_ptr, acc, pid, f, prow, d_ok, D: tl.constexpr, I: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
                    UPCAST: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                    USE_TMA: tl.constexpr):
    """acc += A W^T over I in steps of BLOCK_I: A a panel [P, I] (its tile's rows), W the
    expert's [D, I] weight (dg with W_gate, du with W_up)."""
    i = tl.arange(0, BLOCK_I)
    d = tl.arange(0, BLOCK_D)
    for i0 in range(0, I, BLOCK_I):
        if USE_TMA:
            # The descriptors' bounds zero-fill columns past I.
            a = a_ptr.load([pid * BLOCK_M, i0])
            w = w_ptr.load([f.to(tl.int32), 0, i0]).reshape(BLOCK_D, BLOCK_I)
        else:
            i_ok = (i0 + i < I)[None, :]
            a = tl.load(a_ptr + prow[:, None] * I + (i0 + i)[None, :], mask=i_ok, other=0.0)
            w = tl.load(w_ptr + f * D * I + d[:, None] * I + (i0 + i)[None, :],
                        mask=d_ok[:, None] & i_ok, other=0.0)
        if UPCAST or DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _panel_dx_kernel(
    dgp_ptr, dup_ptr,  # panels dg, du [P, I]: pointers, or descriptors of [BLOCK_M, BLOCK_I] blocks
    wg_ptr, wu_ptr,  # [H*E, D, I]: pointers, or descriptors of [1, BLOCK_D, BLOCK_I] blocks
    gather_ids_ptr, offsets_ptr,  # the RouteLayout: [R], [H*E + 1]
    tile_expert_ptr, tile_first_ptr,  # the dx kernel's tile map: [T_max], [G*E] int32
    dx_ptr, slot_ptr,  # fp32 [S, G, D] or [G*S*K, D] (deterministic); slots [R]
    E, first_expert, num_experts, first_head, group_heads, slot_base,
    D: tl.constexpr, I: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
    DETERMINISTIC: tl.constexpr, UPCAST: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dx rows of one tile of the dx kernel's panels: dg Wg^T + du Wu^T.

    Launch grid: the dx launch's (T_max,); program t reads panel rows [t * BLOCK_M,
    (t + 1) * BLOCK_M) (the routes of tile t, zeros past its expert's end), sums the
    products over I in steps of BLOCK_I, gate then up, in fp32, and combines the rows
    per (token, head) as `_expert_dx_kernel` does. Programs past the last tile return.
    The panels hold dg and du as the dx kernel's dots would take them (rounded to the
    dots' dtype): the products are those of its dx, added in another order (every gate
    step, then every up step).
    """
    pid = tl.program_id(0)
    e = tl.load(tile_expert_ptr + pid)
    if e >= num_experts:
        return
    f, head, rows, row_ok, tokens = tile_rows(pid, e, tile_first_ptr, offsets_ptr,
                                              gather_ids_ptr, first_expert, E, BLOCK_M)
    prow = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # One product a step, gate then up, so that Triton keeps a wgmma in flight across the
    # steps (with two chained products a step it waits for each).
    acc = _panel_dx_steps(dgp_ptr, wg_ptr, acc, pid, f, prow, d_ok, D, I, BLOCK_M, BLOCK_I,
                          BLOCK_D, UPCAST, DOT_FP32, PRECISION, USE_TMA)
    acc = _panel_dx_steps(dup_ptr, wu_ptr, acc, pid, f, prow, d_ok, D, I, BLOCK_M, BLOCK_I,
                          BLOCK_D, UPCAST, DOT_FP32, PRECISION, USE_TMA)
    combine_rows(dx_ptr, slot_ptr, acc, row_ok[:, None] & d_ok[None, :], rows, row_ok, tokens,
                 head, d, slot_base, group_heads, first_head, D, DETERMINISTIC)


@triton.jit
def _dw_rows(
    x_ptr, dy_ptr, H, gather_ids_ptr, probs_ptr, row0, end, head,
    wg, wu, wd_t, acc_g, acc_u, acc_d, w_dtype: tl.constexpr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, RCP: tl.constexpr,
):
    """One row block [row0, row0 + BLOCK_M) of an expert, added to the three
    weight-gradient accumulators of `_expert_dw_kernel`'s I slice."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = tl.load(gather_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    # Row starts are multiples of 16 elements (D is): 16-byte vector loads.
    row_base = tl.multiple_of(tokens * (H * D) + head * D, 16)
    xy_offs = row_base[:, None] + d[None, :]
    xy_ok = row_ok[:, None] & (d < D)[None, :]
    # Rows past the expert load as zeros and p = 0: they add nothing.
    x = tl.load(x_ptr + xy_offs, mask=xy_ok, other=0.0)
    dy = tl.load(dy_ptr + xy_offs, mask=xy_ok, other=0.0)
    if UPCAST or DOT_FP32:
        x = x.to(tl.float32)
        dy = dy.to(tl.float32)
    p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    g = tl.dot(x, wg, input_precision=PRECISION)
    u = tl.dot(x, wu, input_precision=PRECISION)
    t = tl.dot(dy, wd_t, input_precision=PRECISION)
    a, dg, du = _swiglu7_backward(g, u, t * p[:, None], RCP, UPCAST)
    if UPCAST:
        a = round_fp32(a, w_dtype)
    else:
        a = a.to(w_dtype).to(tl.float32)
    ap = _to_operand(a * p[:, None], w_dtype, UPCAST, DOT_FP32)
    dg = _to_operand(dg, w_dtype, UPCAST, DOT_FP32)
    du = _to_operand(du, w_dtype, UPCAST, DOT_FP32)
    acc_g = tl.dot(tl.trans(x), dg, acc_g, input_precision=PRECISION)
    acc_u = tl.dot(tl.trans(x), du, acc_u, input_precision=PRECISION)
    acc_d = tl.dot(tl.trans(dy), ap, acc_d, input_precision=PRECISION)
    return acc_g, acc_u, acc_d


@triton.jit
def _expert_dw_kernel(
    x_ptr, dy_ptr, H,  # x_heads, grad_y: contiguous [S, H, D]
    gather_ids_ptr, probs_ptr, offsets_ptr,  # the RouteLayout: [R], [R], [H*E + 1]
    wg_ptr, wu_ptr, wd_ptr,  # weights [F, D, I], [F, D, I], [F, I, D]
    dwg_ptr, dwu_ptr, dwd_ptr,  # their gradients, same shapes and dtype
    E,
    D: tl.constexpr, I: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    RCP: tl.constexpr = False,
):
    """Weight gradients of one (flat expert, I slice).

    Launch grid: (F * cdiv(I, BLOCK_I),); program q owns expert f = q //
    cdiv(I, BLOCK_I) and columns [j * BLOCK_I, (j + 1) * BLOCK_I) of I, j = q %
    cdiv(I, BLOCK_I): dWg[f][:, slice], dWu[f][:, slice], dWd[f][slice, :],
    each written once (an expert without routes writes zeros). Consecutive
    programs share an expert, so its gathered rows are re-read from L2.
    All three accumulators are [BLOCK_D, BLOCK_I] (dWd transposed), so every
    weight-gradient dot has M = D rows (wide tensor-core tiles) and reads
    the gathered x or dy tile as a transposed view, without copies.
    RCP: `ExpertBackwardConfig.sigmoid_rcp`.
    """
    NUM_SLICES: tl.constexpr = (I + BLOCK_I - 1) // BLOCK_I
    pid = tl.program_id(0)
    f = (pid // NUM_SLICES).to(tl.int64)
    i0 = (pid % NUM_SLICES) * BLOCK_I
    head = f // E
    start = tl.load(offsets_ptr + f)
    end = tl.load(offsets_ptr + f + 1)

    d = tl.arange(0, BLOCK_D)
    i = i0 + tl.arange(0, BLOCK_I)
    d_ok = d < D
    gu_offs = f * D * I + d[:, None] * I + i[None, :]  # [BLOCK_D, BLOCK_I]
    gu_ok = d_ok[:, None] & (i < I)[None, :]
    # Loaded once: the slice stays on chip for the whole loop over rows.
    wg = tl.load(wg_ptr + gu_offs, mask=gu_ok, other=0.0)
    wu = tl.load(wu_ptr + gu_offs, mask=gu_ok, other=0.0)
    wd_t = tl.load(wd_ptr + f * I * D + i[None, :] * D + d[:, None], mask=gu_ok, other=0.0)
    w_dtype = wg.dtype
    if UPCAST or DOT_FP32:
        wg = wg.to(tl.float32)
        wu = wu.to(tl.float32)
        wd_t = wd_t.to(tl.float32)

    acc_g = tl.zeros([BLOCK_D, BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_D, BLOCK_I], dtype=tl.float32)
    acc_d = tl.zeros([BLOCK_D, BLOCK_I], dtype=tl.float32)  # dWd^T
    num_blocks = tl.cdiv(end - start, BLOCK_M)
    if UPCAST:
        # The interpreter cannot range() over a loaded scalar; a while loop
        # runs the same blocks in the same order.
        b = 0
        while b < num_blocks:
            acc_g, acc_u, acc_d = _dw_rows(
                x_ptr, dy_ptr, H, gather_ids_ptr, probs_ptr, start + b * BLOCK_M, end, head,
                wg, wu, wd_t, acc_g, acc_u, acc_d, w_dtype,
                D, BLOCK_M, BLOCK_D, UPCAST, DOT_FP32, PRECISION, RCP)
            b += 1
    else:
        for b in range(0, num_blocks):
            acc_g, acc_u, acc_d = _dw_rows(
                x_ptr, dy_ptr, H, gather_ids_ptr, probs_ptr, start + b * BLOCK_M, end, head,
                wg, wu, wd_t, acc_g, acc_u, acc_d, w_dtype,
                D, BLOCK_M, BLOCK_D, UPCAST, DOT_FP32, PRECISION, RCP)

    if UPCAST:
        acc_g = round_fp32(acc_g, w_dtype)
        acc_u = round_fp32(acc_u, w_dtype)
        acc_d = round_fp32(acc_d, w_dtype)
    tl.store(dwg_ptr + gu_offs, acc_g.to(w_dtype), mask=gu_ok)
    tl.store(dwu_ptr + gu_offs, acc_u.to(w_dtype), mask=gu_ok)
    tl.store(dwd_ptr + f * I * D + i[None, :] * D + d[:, None], acc_d.to(w_dtype), mask=gu_ok)


@triton.jit
def _panel_tiles(a_ptr, b_ptr, r, m0, n0, M: tl.constexpr, N: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_TMA: tl.constexpr):
    """Panel rows [r, r + BLOCK_K): A's columns [m0, m0 + BLOCK_M), B's [n0, n0 + BLOCK_N),
    zero past M or N (masks, or the descriptors' bounds)."""
    if USE_TMA:
        a = a_ptr.load([r.to(tl.int32), m0])
        b = b_ptr.load([r.to(tl.int32), n0])
    else:
        k = r + tl.arange(0, BLOCK_K)
        m = m0 + tl.arange(0, BLOCK_M)
        n = n0 + tl.arange(0, BLOCK_N)
        a = tl.load(a_ptr + k[:, None] * M + m[None, :], mask=(m < M)[None, :], other=0.0)
        b = tl.load(b_ptr + k[:, None] * N + n[None, :], mask=(n < N)[None, :], other=0.0)
    return a, b


@triton.jit
def _panel_dw_kernel(
    a_ptr, b_ptr, c_ptr,  # panels A [P, M], B [P, N] (pointers or TMA descriptors); C [F, M, N]
    offsets_ptr, tile_first_ptr,  # CSR offsets [H*E + 1]; the dx launch's tile_first [n]
    first_expert,
    M: tl.constexpr, N: tl.constexpr, TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """C[f] = A_f^T B_f for the n experts of one panel group, one output tile a program.

    A_f, B_f: the panel rows of expert f = first_expert + e, rows
    [tile_first[e] * TILE_M, (tile_first[e] + tiles) * TILE_M), tiles =
    cdiv(routes of f, TILE_M) (the dx kernel's tiles; padding rows are zeros).
    Launch grid: (n * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),); program q owns
    expert e = q // (tiles of C) and one [BLOCK_M, BLOCK_N] tile of C[f],
    summed over the expert's rows in ascending order in fp32 and written once
    in C's dtype (an expert without routes writes zeros). One owner per
    element and a fixed order: deterministic. BLOCK_K divides TILE_M.
    USE_TMA: a_ptr, b_ptr are descriptors with blocks [BLOCK_K, BLOCK_M] and
    [BLOCK_K, BLOCK_N], whose bounds zero-fill columns past M or N.
    """
    NUM_M: tl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
    NUM_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    e = pid // (NUM_M * NUM_N)
    m0 = (pid // NUM_N) % NUM_M * BLOCK_M
    n0 = pid % NUM_N * BLOCK_N
    f = (first_expert + e).to(tl.int64)
    routes = tl.load(offsets_ptr + f + 1) - tl.load(offsets_ptr + f)
    row0 = tl.load(tile_first_ptr + e).to(tl.int64) * TILE_M
    steps = tl.cdiv(routes, TILE_M) * (TILE_M // BLOCK_K)

    m = m0 + tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if UPCAST:
        # The interpreter cannot range() over a loaded scalar; a while loop
        # runs the same steps in the same order.
        step = 0
        while step < steps:
            a, b = _panel_tiles(a_ptr, b_ptr, row0 + step * BLOCK_K, m0, n0, M, N,
                                BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA)
            acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc,
                         input_precision=PRECISION)
            step += 1
    else:
        for step in range(0, steps):
            a, b = _panel_tiles(a_ptr, b_ptr, row0 + step * BLOCK_K, m0, n0, M, N,
                                BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA)
            acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    c_dtype = c_ptr.dtype.element_ty
    if UPCAST:
        acc = round_fp32(acc, c_dtype)
    tl.store(c_ptr + f * M * N + m[:, None] * N + n[None, :], acc.to(c_dtype),
             mask=(m < M)[:, None] & (n < N)[None, :])


class _Panels:
    """The operands of the weight gradients, written by the dx kernel (PANELS).

    For the experts of one launch of the dx kernel (a group of `heads` heads),
    with T tiles of block_m rows in its grid: x, dy [T * block_m, D] and dg,
    du, a * p [T * block_m, I] in the dtype the dots take (the weights' 16-bit
    dtype, or float32), tile t's routes in rows [t * block_m, (t + 1) * block_m),
    zeros past an expert's last route. The three weight gradients are then
    plain GEMMs over each expert's contiguous rows (`_panel_dw_kernel`):
    dWg = x^T dg, dWu = x^T du, dWd = (a p)^T dy, without recomputing g, u and
    dy Wd^T (8 GEMMs of [rows, D, I] in all, against 11 for `_expert_dw_kernel`).
    One buffer of at most `PANEL_WORKSPACE_BYTES` serves every group.
    """

    def __init__(self, tiles: PanelGemmConfig, heads: int, rows_per_head: int,
                 D: int, I: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tiles, self.heads = tiles, heads
        self.rows = heads * rows_per_head  # panel rows of the largest group
        self.buffer = torch.empty(self.rows * (2 * D + 3 * I), dtype=dtype, device=device)
        self.D, self.I = D, I

    @classmethod
    def plan(cls, config, x_heads, R, F, I, dot_fp32, w_dtype, warn=True) -> _Panels | None:
        """Panels for this problem, or None for the recomputing dW kernel: no panel
        config, or one head's panels would pass PANEL_WORKSPACE_BYTES (with `warn`, a
        warning says so once)."""
        S, H, D = x_heads.shape
        if config.panel is None:
            return None
        dtype = torch.float32 if dot_fp32 else w_dtype
        block_m = config.dx.block_m
        E = F // H
        per_head = _panel_rows(S, H, R, E, 1, block_m)
        per_head_bytes = per_head * (2 * D + 3 * I) * dtype.itemsize
        heads = min(H, tuning.PANEL_WORKSPACE_BYTES // per_head_bytes)
        if heads == 0:
            if warn:
                _warn_recompute(per_head_bytes)
            return None
        return cls(config.panel, heads, per_head, D, I, dtype, x_heads.device)

    def views(self, rows: int) -> tuple[torch.Tensor, ...]:
        """x, dy [rows, D] and dg, du, a*p [rows, I]: views of one buffer."""
        if rows > self.rows:
            raise AssertionError(f"panels of {rows} rows asked of a buffer of {self.rows}")
        D, I = self.D, self.I
        sizes = (rows * D, rows * D, rows * I, rows * I, rows * I)
        parts = self.buffer[:sum(sizes)].split(sizes)
        return tuple(t.view(rows, -1) for t in parts)

    def weight_gradients(self, views, tile_first, first_expert: int, experts: int, block_m: int,
                         offsets, grads, dot_fp32: bool, precision: str, interpret: bool):
        """dWg, dWu, dWd of `experts` flat experts from `first_expert`, from the panels."""
        xp, dyp, dgp, dup, app = views
        d_gate, d_up, d_down = grads
        if self.tiles.warp_specialized and block_m not in tuning.GLUON_DW_DX_ROWS:
            # The dx kernel stepped its tiles down (out of resources) after `_gluon_dw_fits`
            # passed them: the panels' padding no longer suits the Gluon kernel, so these
            # GEMMs run as the Triton kernel, as where it cannot run at all.
            self.tiles = self.tiles.as_triton()
        for a, b, c in ((xp, dgp, d_gate), (xp, dup, d_up), (app, dyp, d_down)):
            M, N = a.shape[1], b.shape[1]
            if self.tiles.warp_specialized:
                # The Gluon kernel (its fit checked by `_gluon_dw_fits` before the backward
                # began).
                from . import panel_dw_sm90  # Gluon: imported where it may run

                panel_dw_sm90.launch_dw(a, b, c, offsets, tile_first,
                                        first_expert=first_expert, experts=experts,
                                        tile_m=block_m, block_n=self.tiles.block_n,
                                        stages=self.tiles.num_stages,
                                        buffers=self.tiles.store_buffers)
                continue

            def launch(t, a=a, b=b, c=c, M=M, N=N):  # bound now: runs in this pass
                block_k = min(t.block_k, block_m)
                use_tma = (t.tma and (M * a.element_size()) % 16 == 0
                           and (N * b.element_size()) % 16 == 0)
                if use_tma:
                    a_arg = TensorDescriptor.from_tensor(a, [block_k, t.block_m])
                    b_arg = TensorDescriptor.from_tensor(b, [block_k, t.block_n])
                else:
                    a_arg, b_arg = a, b
                grid = (experts * triton.cdiv(M, t.block_m) * triton.cdiv(N, t.block_n),)
                _panel_dw_kernel[grid](
                    a_ptr=a_arg, b_ptr=b_arg, c_ptr=c,
                    offsets_ptr=offsets, tile_first_ptr=tile_first, first_expert=first_expert,
                    M=M, N=N, TILE_M=block_m,
                    BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=block_k,
                    UPCAST=interpret, DOT_FP32=dot_fp32, PRECISION=precision,
                    USE_TMA=use_tma, num_warps=t.num_warps, num_stages=t.num_stages,
                )

            self.tiles = launch_with_step_down(launch, self.tiles, step_down_panel)


def _gluon_dw_fits(x_heads: torch.Tensor, w_down: torch.Tensor, dot_fp32: bool,
                   config: ExpertBackwardConfig) -> bool:
    """Whether `panel_dw_sm90` takes this backward's panels: an sm_90 GPU, bf16 panels and
    weight gradients, D and I multiples of 64 and of block_n, the dx kernel's tiles (the
    panels' row padding) of `tuning.GLUON_DW_DX_ROWS` rows."""
    D, I = w_down.shape[2], w_down.shape[1]
    n = config.panel.block_n
    return (on_sm90(x_heads)
            and not dot_fp32 and w_down.dtype == torch.bfloat16
            and D % 64 == 0 and I % 64 == 0 and D % n == 0 and I % n == 0
            and config.dx.block_m in tuning.GLUON_DW_DX_ROWS)


def _panel_rows(S: int, H: int, R: int, E: int, heads: int, block_m: int,
                uniform: bool = True) -> int:
    """Rows of the panels of `heads` heads: the dx grid's bound on tiles, times block_m.
    uniform: every head owns S * K routes (`expert_forward.uniform_routes`), else any
    of the R routes may be the group's."""
    routes = S * heads * (R // (S * H)) if uniform and R % (S * H) == 0 else R
    return (triton.cdiv(routes, block_m) + heads * E) * block_m


_warned_recompute = False


def _warn_recompute(per_head_bytes: int) -> None:
    global _warned_recompute
    if not _warned_recompute:
        _warned_recompute = True
        warnings.warn(
            f"expert_backward: one head's weight-gradient panels would take "
            f"{per_head_bytes / 2**30:.2f} GiB, more than the "
            f"{tuning.PANEL_WORKSPACE_BYTES / 2**30:.2f} "
            f"GiB allowed (mhmoe.kernels.tuning.PANEL_WORKSPACE_BYTES); the weight "
            f"gradients "
            f"recompute g, u and dy W_down^T instead (slower, same results up to rounding)",
            stacklevel=3)


def _backward_dw(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                 d_gate, d_up, d_down, tiles, dot_fp32, precision, interpret,
                 rcp=False) -> None:
    """The three weight gradients by recomputation: one launch over every (expert, I slice)."""
    _, H, D = x_heads.shape
    F, _, I = w_gate.shape

    def launch(t):
        _expert_dw_kernel[(F * triton.cdiv(I, t.block_i),)](
            x_ptr=x_heads, dy_ptr=grad_y, H=H,
            gather_ids_ptr=gather_ids, probs_ptr=sorted_probs, offsets_ptr=offsets,
            wg_ptr=w_gate, wu_ptr=w_up, wd_ptr=w_down,
            dwg_ptr=d_gate, dwu_ptr=d_up, dwd_ptr=d_down, E=F // H,
            D=D, I=I, BLOCK_M=t.block_m, BLOCK_I=t.block_i, BLOCK_D=triton.next_power_of_2(D),
            UPCAST=interpret, DOT_FP32=dot_fp32, PRECISION=precision, RCP=rcp,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )

    launch_with_step_down(launch, tiles)


def _panel_dx(views, tile_expert, tile_first, gather_ids, offsets, w_gate, w_up, out, slots,
              tiles, *, E, h0, g, slot_base, block_m, deterministic, dot_fp32, precision,
              interpret):
    """dx rows of one head group from its dg, du panels into the group's combine
    workspace `out` (`_panel_dx_kernel` over the dx launch's tiles)."""
    D, I = w_gate.shape[1], w_gate.shape[2]
    dgp, dup = views[2], views[3]
    block_d = triton.next_power_of_2(D)
    tma_ok = (tma_fits(D, I, w_gate.element_size())
              and (I * dgp.element_size()) % 16 == 0)

    def launch(t):
        use_tma = t.tma and tma_ok
        if use_tma:
            args = (TensorDescriptor.from_tensor(dgp, [block_m, t.block_i]),
                    TensorDescriptor.from_tensor(dup, [block_m, t.block_i]),
                    TensorDescriptor.from_tensor(w_gate, [1, block_d, t.block_i]),
                    TensorDescriptor.from_tensor(w_up, [1, block_d, t.block_i]))
        else:
            args = (dgp, dup, w_gate, w_up)
        _panel_dx_kernel[(tile_expert.numel(),)](
            *args, gather_ids, offsets, tile_expert, tile_first, out, slots,
            E, h0 * E, g * E, h0, g, slot_base,
            D=D, I=I, BLOCK_M=block_m, BLOCK_I=t.block_i, BLOCK_D=block_d,
            DETERMINISTIC=deterministic, UPCAST=interpret, DOT_FP32=dot_fp32,
            PRECISION=precision, USE_TMA=use_tma, num_warps=t.num_warps,
            num_stages=t.num_stages,
        )

    return launch_with_step_down(launch, tiles, step_down_panel_dx)


def _backward_dx(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                 dx, dprobs, tiles, deterministic, dot_fp32, precision, interpret,
                 panels=None, grads=None, panel_dx=None, rcp=False, store_bytes=16) -> None:
    """dx and dprobs, in groups of heads whose fp32 workspace fits the forward's limits
    (and with `panels`, at most `panels.heads` heads, each launch followed by the
    weight gradients of its experts from the panels it wrote). With `panels` and
    `panel_dx` (a `PanelDxConfig`), the dx kernel leaves dx out and `_panel_dx_kernel`
    computes it from the panels. rcp, store_bytes: `ExpertBackwardConfig.sigmoid_rcp`
    and `.panel_store_bytes`."""
    split = panels is not None and panel_dx is not None
    S, H, D = x_heads.shape
    F, _, I = w_gate.shape
    R = gather_ids.numel()
    E = F // H
    groups = HeadGroups(dx, gather_ids, offsets, E, deterministic, "expert_backward",
                        max_heads=panels.heads if panels is not None else None)
    block_d = triton.next_power_of_2(D)
    tma_ok = tma_fits(D, I, w_down.element_size())
    for h0, g, _routes, out in groups:
        ran = {}

        def tile_plan(block_m, with_total=False, g=g, h0=h0):
            """(tiles of the launch's grid bound, its tile map; `expert_forward.tile_map`)."""
            max_tiles = _panel_rows(S, H, R, E, g, block_m, groups.uniform_k) // block_m
            return max_tiles, tile_map(offsets, h0 * E, g * E, block_m, max_tiles,
                                       with_total=with_total)

        def launch(t, h0=h0, g=g, out=out, ran=ran):  # bound now: runs in this pass
            use_tma = t.tma and tma_ok
            if use_tma:
                weights = (TensorDescriptor.from_tensor(w_gate, [1, block_d, t.block_i]),
                           TensorDescriptor.from_tensor(w_up, [1, block_d, t.block_i]),
                           TensorDescriptor.from_tensor(w_down, [1, t.block_i, block_d]))
            else:
                weights = (w_gate, w_up, w_down)
            max_tiles, (tile_expert, tile_first) = tile_plan(t.block_m)
            views = panels.views(max_tiles * t.block_m) if panels is not None else (dx,) * 5
            _expert_dx_kernel[(max_tiles,)](
                x_ptr=x_heads, dy_ptr=grad_y, H=H,
                gather_ids_ptr=gather_ids, probs_ptr=sorted_probs, offsets_ptr=offsets,
                tile_expert_ptr=tile_expert, tile_first_ptr=tile_first,
                wg_ptr=weights[0], wu_ptr=weights[1], wd_ptr=weights[2],
                dx_ptr=out, slot_ptr=groups.slots, dprobs_ptr=dprobs,
                xp_ptr=views[0], dyp_ptr=views[1], dgp_ptr=views[2], dup_ptr=views[3],
                app_ptr=views[4],
                E=E, first_expert=h0 * E, num_experts=g * E, first_head=h0, group_heads=g,
                slot_base=h0 * S * groups.K,
                D=D, I=I, BLOCK_M=t.block_m, BLOCK_I=t.block_i, BLOCK_D=block_d,
                EVEN_D=D == block_d, EVEN_I=I % t.block_i == 0, DETERMINISTIC=deterministic,
                UPCAST=interpret, DOT_FP32=dot_fp32, PRECISION=precision, USE_TMA=use_tma,
                PANELS=panels is not None, DX=not split, RCP=rcp, num_warps=t.num_warps,
                num_stages=t.num_stages,
            )
            ran.update(views=views, tile_expert=tile_expert, tile_first=tile_first)

        if split and tiles.warp_specialized:
            # The Gluon panel kernel (its tiles are 128 rows, as tiles.block_m: the
            # config's check); persistent, so it takes the tile count.
            from . import expert_panels_sm90 as ws  # Gluon: imported where it may run

            max_tiles, (tile_expert, tile_first, total) = tile_plan(tiles.block_m, True)
            views = panels.views(max_tiles * tiles.block_m)
            ws.launch_panels(x_heads, grad_y, gather_ids, sorted_probs, offsets, w_gate, w_up,
                             w_down, dprobs, views, tile_expert, tile_first, total, E=E,
                             first_expert=h0 * E, rcp=rcp, store_bytes=store_bytes)
            ran.update(views=views, tile_expert=tile_expert, tile_first=tile_first)
        else:
            tiles = launch_with_step_down(launch, tiles)
        if split:
            panel_dx = _panel_dx(ran["views"], ran["tile_expert"], ran["tile_first"],
                                 gather_ids, offsets, w_gate, w_up, out, groups.slots, panel_dx,
                                 E=E, h0=h0, g=g, slot_base=h0 * S * groups.K,
                                 block_m=tiles.block_m, deterministic=deterministic,
                                 dot_fp32=dot_fp32, precision=precision, interpret=interpret)
        if panels is not None:
            panels.weight_gradients(ran["views"], ran["tile_first"], h0 * E, g * E,
                                    tiles.block_m, offsets, grads, dot_fp32, precision,
                                    interpret)
        groups.finish(h0, g, out, interpret)


def triton_expert_backward(
    grad_y: torch.Tensor,
    x_heads: torch.Tensor,
    gather_ids: torch.Tensor,
    sorted_probs: torch.Tensor,
    offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    deterministic: bool = False,
    config: ExpertBackwardConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `triton_expert_forward` (the math of `expert_backward_reference`).

    grad_y: [S, H, D] (x_heads' dtype); x_heads: [S, H, D]; gather_ids: [R]
    int32/int64; sorted_probs: [R] float; offsets: [H*E + 1] int64 CSR by flat
    expert; w_gate, w_up: [H*E, D, I]; w_down: [H*E, I, D].
    Returns dx [S, H, D] (x dtype), dprobs [R] (sorted_probs' dtype), dW_gate,
    dW_up [H*E, D, I], dW_down [H*E, I, D] (weight dtype); every sum in fp32.

    deterministic: every output bitwise reproducible; dx and dprobs also
    independent of the token order. Needs the same number K = R / (S*H) of
    routes for every (token, head), as the forward's deterministic mode. The
    default mode differs only in dx (fp32 atomic adds of the K routes).
    config: force tiles (tests). Inputs are assumed valid
    (`experts.check_expert_inputs`); nothing is read back to the host. Works
    on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1.
    """
    S, H, D = x_heads.shape
    F, _, I = w_gate.shape
    R = gather_ids.numel()
    device = x_heads.device
    dx = torch.empty(S, H, D, dtype=x_heads.dtype, device=device)
    dprobs = torch.empty(R, dtype=torch.float32, device=device)
    d_gate = torch.empty_like(w_gate, memory_format=torch.contiguous_format)
    d_up = torch.empty_like(w_up, memory_format=torch.contiguous_format)
    d_down = torch.empty_like(w_down, memory_format=torch.contiguous_format)
    if S == 0 or R == 0 or D == 0 or I == 0:
        return (dx.zero_(), dprobs.zero_().to(sorted_probs.dtype), d_gate.zero_(), d_up.zero_(),
                d_down.zero_())
    interpret = interpreting()
    dot_fp32 = (not (x_heads.dtype == grad_y.dtype == w_down.dtype)
                or w_down.dtype == torch.float32)
    forced = config is not None
    if config is None:
        config = tuning.expert_backward_config(device, R / F, interpret, fp32_operands=dot_fp32)
    # One [S, H, D] layout for both: the kernels share their gather offsets.
    x_heads, grad_y = x_heads.contiguous(), grad_y.contiguous()
    w_gate, w_up, w_down = w_gate.contiguous(), w_up.contiguous(), w_down.contiguous()
    gather_ids, sorted_probs, offsets = (
        gather_ids.contiguous(), sorted_probs.contiguous(), offsets.contiguous())
    precision = "ieee" if dot_fp32 else "tf32"  # tf32 is ignored by 16-bit dots
    if config.dx.warp_specialized:
        from . import expert_panels_sm90 as ws  # Gluon: imported where it may run

        if not ws.panels_fit(x_heads, grad_y, w_gate, w_up, w_down):
            if forced:
                raise ValueError(
                    "config.dx.warp_specialized needs an sm_90 GPU, bf16 x, grad_y and "
                    f"weights, D = 256 and I a multiple of 64; got {x_heads.device}, "
                    f"{x_heads.dtype}/{grad_y.dtype}/{w_down.dtype}, D={D}, I={I}")
            # A table's split with the Gluon kernel falls back to the fused dx kernel at
            # the same tiles: the Triton split is not faster than the fused one there.
            config = dataclasses.replace(
                config, dx=dataclasses.replace(config.dx, warp_specialized=False),
                panel_dx=None)
    if config.panel is not None and config.panel.warp_specialized and not _gluon_dw_fits(
            x_heads, w_down, dot_fp32, config):
        if forced:
            raise ValueError(
                "config.panel.warp_specialized needs an sm_90 GPU, bf16 operands, D and I "
                f"multiples of 64 and of block_n ({config.panel.block_n}) and dx tiles of "
                f"{tuning.GLUON_DW_DX_ROWS} rows; got {x_heads.device}, "
                f"{x_heads.dtype}/{w_down.dtype}, D={D}, I={I}, dx block_m {config.dx.block_m}")
        # A table's Gluon dW GEMM runs as the Triton kernel where it cannot run: at its
        # triton_fallback tiles, else at the same tiles (the same sums: tests/test_gpu.py
        # checks them bitwise).
        config = dataclasses.replace(config, panel=config.panel.as_triton())
    split_forced = forced and config.panel_dx is not None
    panels = _Panels.plan(config, x_heads, R, F, I, dot_fp32, w_down.dtype,
                          warn=not split_forced)
    if panels is None and split_forced:
        raise ValueError(
            "config.panel_dx: dx from the panels needs one head's panels within "
            f"tuning.PANEL_WORKSPACE_BYTES ({tuning.PANEL_WORKSPACE_BYTES} bytes); at this "
            "size the default config recomputes instead")
    if panels is None:
        _backward_dw(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                     d_gate, d_up, d_down, config.dw, dot_fp32, precision, interpret,
                     config.sigmoid_rcp)
    _backward_dx(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                 dx, dprobs, config.dx, deterministic, dot_fp32, precision, interpret,
                 panels, (d_gate, d_up, d_down), config.panel_dx, config.sigmoid_rcp,
                 config.panel_store_bytes)
    return dx, dprobs.to(sorted_probs.dtype), d_gate, d_up, d_down


def dx_signature(D: int, block_i: int) -> dict:
    """`_expert_dx_kernel`'s argument types as the launcher passes them on sm_90 (bf16, TMA
    weight slices of block_i), for compiling it without a GPU."""
    return {"x_ptr": "*bf16", "dy_ptr": "*bf16", "H": "i32", "gather_ids_ptr": "*i32",
            "probs_ptr": "*fp32", "offsets_ptr": "*i64", "tile_expert_ptr": "*i32",
            "tile_first_ptr": "*i32",
            "wg_ptr": f"tensordesc<bf16[1, {D}, {block_i}]>",
            "wu_ptr": f"tensordesc<bf16[1, {D}, {block_i}]>",
            "wd_ptr": f"tensordesc<bf16[1, {block_i}, {D}]>",
            "dx_ptr": "*fp32", "slot_ptr": "*i32", "dprobs_ptr": "*fp32",
            "xp_ptr": "*bf16", "dyp_ptr": "*bf16", "dgp_ptr": "*bf16",
            "dup_ptr": "*bf16", "app_ptr": "*bf16", "E": "i32", "first_expert": "i32",
            "num_experts": "i32", "first_head": "i32", "group_heads": "i32",
            "slot_base": "i32"}


def panel_dw_compile_cases(panel, dx_rows: int) -> list:
    """The panel dW GEMM at `panel`'s tiles (a `tuning.PanelGemmConfig`) for both of
    MAGI-2's weight shapes, [D, I] (W_gate and W_up) and [I, D] (W_down), with experts'
    rows padded to `dx_rows` (`mhmoe.kernels.CompileCase`); block_k at most dx_rows, as the
    launcher clamps it."""
    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase

    D, I, p = M.head_dim, M.expert_intermediate_size, panel
    k = min(p.block_k, dx_rows)
    if p.warp_specialized:
        from . import panel_dw_sm90

        return panel_dw_sm90.sm90_compile_cases(p.block_n, p.num_stages, p.store_buffers,
                                                dx_rows)
    return [CompileCase(
        f"panel dW {m_dim}x{n_dim} {p.block_m}/{p.block_n}/{k}/"
        f"{p.num_warps}/{p.num_stages} (dx rows {dx_rows})",
        _panel_dw_kernel,
        {"a_ptr": f"tensordesc<bf16[{k}, {p.block_m}]>",
         "b_ptr": f"tensordesc<bf16[{k}, {p.block_n}]>", "c_ptr": "*bf16",
         "offsets_ptr": "*i64", "tile_first_ptr": "*i32", "first_expert": "i32"},
        dict(M=m_dim, N=n_dim, TILE_M=dx_rows, BLOCK_M=p.block_m, BLOCK_N=p.block_n,
             BLOCK_K=k, UPCAST=False, DOT_FP32=False, PRECISION="tf32",
             USE_TMA=p.tma),
        p.num_warps, p.num_stages) for m_dim, n_dim in ((D, I), (I, D))]


def sm90_compile_cases() -> list:
    """The dx (with and without panels), dW and panel kernels at the sm_90 default tiles,
    and the split backward's two Triton kernels at `tuning.SM90_SPLIT`
    (`mhmoe.kernels.CompileCase`; MAGI-2's dims)."""
    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase
    from .tuning import BACKWARD_SM90

    D, I = M.head_dim, M.expert_intermediate_size
    tma = tma_fits(D, I, 2)
    cases = []
    # Rows that differ only in the split (panel_dx, the Gluon kernel) share Triton tiles.
    rows = []
    for _, b in BACKWARD_SM90:
        b = dataclasses.replace(b, dx=dataclasses.replace(b.dx, warp_specialized=False),
                                panel_dx=None)
        if b not in rows:
            rows.append(b)

    def dx_case(x, name, **constexprs):
        return CompileCase(
            f"expert dx {x.block_m}/{x.block_i}/{x.num_warps}/{x.num_stages}{name}",
            _expert_dx_kernel, dx_signature(D, x.block_i),
            dict(D=D, I=I, BLOCK_M=x.block_m, BLOCK_I=x.block_i, BLOCK_D=D, EVEN_D=True,
                 EVEN_I=I % x.block_i == 0, DETERMINISTIC=False, UPCAST=False,
                 DOT_FP32=False, PRECISION="tf32", USE_TMA=tma, **constexprs),
            x.num_warps, x.num_stages)

    for b in rows:
        x = b.dx
        cases += [dx_case(x, " panels", PANELS=True), dx_case(x, "", PANELS=False)]
        w = b.dw
        cases.append(CompileCase(
            f"expert dW {w.block_m}/{w.block_i}/{w.num_warps}/{w.num_stages}",
            _expert_dw_kernel,
            {"x_ptr": "*bf16", "dy_ptr": "*bf16", "H": "i32", "gather_ids_ptr": "*i32",
             "probs_ptr": "*fp32", "offsets_ptr": "*i64", "wg_ptr": "*bf16",
             "wu_ptr": "*bf16", "wd_ptr": "*bf16", "dwg_ptr": "*bf16", "dwu_ptr": "*bf16",
             "dwd_ptr": "*bf16", "E": "i32"},
            dict(D=D, I=I, BLOCK_M=w.block_m, BLOCK_I=w.block_i, BLOCK_D=D, UPCAST=False,
                 DOT_FP32=False, PRECISION="tf32"),
            w.num_warps, w.num_stages))
        cases += panel_dw_compile_cases(b.panel, x.block_m)
        if b.panel.triton_fallback is not None:  # where the row's Gluon dW GEMM cannot run
            cases += panel_dw_compile_cases(b.panel.triton_fallback, x.block_m)
    # The Gluon dW GEMM, off in the table (tuning.SM90_PANEL_FEW_WS says why), at its named
    # tiles and the dx heights tests/test_gpu.py checks, so that a kernel that stops
    # compiling fails here.
    for dx_rows in tuning.GLUON_DW_DX_ROWS:
        cases += panel_dw_compile_cases(tuning.SM90_PANEL_FEW_WS, dx_rows)
    # dx from the panels (tuning.SM90_SPLIT): the dx kernel without its products, and
    # the panel dx GEMM.
    # Also with ExpertBackwardConfig.sigmoid_rcp (the inline reciprocal, every kernel's).
    x, pdx = tuning.SM90_SPLIT.dx, tuning.SM90_SPLIT.panel_dx
    cases += [dx_case(x, f" panels{', rcp' if rcp else ''}, no dx", PANELS=True, DX=False,
                      RCP=rcp) for rcp in (False, True)]
    for det in (False, True):
        cases.append(CompileCase(
            f"panel dx {x.block_m}/{pdx.block_i}/{pdx.num_warps}/{pdx.num_stages}"
            f"{' deterministic' if det else ''}",
            _panel_dx_kernel,
            {"dgp_ptr": f"tensordesc<bf16[{x.block_m}, {pdx.block_i}]>",
             "dup_ptr": f"tensordesc<bf16[{x.block_m}, {pdx.block_i}]>",
             "wg_ptr": f"tensordesc<bf16[1, {D}, {pdx.block_i}]>",
             "wu_ptr": f"tensordesc<bf16[1, {D}, {pdx.block_i}]>",
             "gather_ids_ptr": "*i32", "offsets_ptr": "*i64", "tile_expert_ptr": "*i32",
             "tile_first_ptr": "*i32", "dx_ptr": "*fp32", "slot_ptr": "*i32", "E": "i32",
             "first_expert": "i32", "num_experts": "i32", "first_head": "i32",
             "group_heads": "i32", "slot_base": "i32"},
            dict(D=D, I=I, BLOCK_M=x.block_m, BLOCK_I=pdx.block_i, BLOCK_D=D,
                 DETERMINISTIC=det, UPCAST=False, DOT_FP32=False, PRECISION="tf32",
                 USE_TMA=pdx.tma),
            pdx.num_warps, pdx.num_stages))
    return cases
