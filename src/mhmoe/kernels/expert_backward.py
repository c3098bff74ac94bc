"""Fused expert MLP backward: dx, d(probabilities) and the three weight gradients.

With g, u = x Wg, x Wu (fp32), a = cast(swiglu7(g, u)), t = dy Wd^T and p the
route's probability (SPEC section 4 and `reference.expert_backward_reference`):

    dprobs = rowsum(a * t)                     (over I; = rowsum((a Wd) * dy))
    da     = p * t;  dg, du = SwiGLU7'(g, u) applied to da
    dx     = dg Wg^T + du Wu^T                 summed over the K routes of (s, h)
    dWd    = a^T (p dy);  dWg = x^T dg;  dWu = x^T du

Nothing of size [routes, I] is stored: both kernels recompute g, u and t.

- `_expert_dx_kernel`: one program per (expert, row block), the forward's tile
  map. It loops over I in slices (g, u, t: three dots; dx: two more) and
  keeps a [BLOCK_M, D] fp32 dx accumulator and a per-row dprobs sum. dx rows
  are combined per (token, head) as the forward combines y: fp32 atomics by
  default, ordered slots plus an ordered sum in deterministic mode.
- `_expert_dw_kernel`: one program per (expert, I slice). It loops over the
  expert's row blocks in ascending order, accumulates dWg, dWu and dWd^T for
  its slice in fp32 registers and writes them once in the weight dtype:
  each gradient element has exactly one owner, so no atomics, and the sum
  order is fixed (deterministic in both modes).

dprobs has one owner per route too. So in deterministic mode every output is
bitwise reproducible; dx and dprobs are also independent of the token order,
while the dW sums run over an expert's routes in token order, so permuting
the tokens permutes their summands (equal up to rounding, not bitwise).

16-bit operands: dg, du and a * p are rounded to the weight dtype for the
tensor cores (the reference keeps them in fp32), which adds about one bf16
rounding of relative error to dx and dW.

The launch needs no host synchronisation: grids come from shapes (the dx
grid is the forward's upper bound on tiles; the dW grid is F * cdiv(I,
BLOCK_I)), so the backward can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .backward_configs import ExpertBackwardConfig, expert_backward_config
from .expert_forward import (
    HeadGroups,
    _combine_rows,
    _interpreting,
    _round_fp32,
    _tile_map,
    _tile_rows,
    launch_with_step_down,
    tma_fits,
)

__all__ = ["triton_expert_backward"]


@triton.jit
def _swiglu7_backward(g, u, da):
    """SwiGLU7 at fp32 (g, u) and its input gradients for the upstream da.

    Returns a (fp32, before the cast to the weight dtype), dg, du. Clamps
    pass the gradient where the input lies inside the clamp range, bounds
    included, as torch.clamp does.
    """
    gc = tl.minimum(g, 7.0)
    uc1 = tl.minimum(tl.maximum(u, -7.0), 7.0) + 1.0
    # sigmoid(1.702 g) = 1 / (1 + 2^(-1.702 log2(e) g)): one exp2 and a fast
    # reciprocal on the special-function units (as the forward).
    sig = tl.fdiv(1.0, 1.0 + tl.exp2(-2.4554669595930157 * gc))
    silu = gc * sig
    a = silu * uc1
    dg = tl.where(g <= 7.0, da * uc1 * (sig + 1.702 * silu * (1.0 - sig)), 0.0)
    du = tl.where((u >= -7.0) & (u <= 7.0), da * silu, 0.0)
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
            return _round_fp32(v, dtype)
    elif DOT_FP32:
        return v
    else:
        return v.to(dtype)


@triton.jit
def _expert_dx_kernel(
    x_ptr, dy_ptr, H,  # x_heads, grad_y: contiguous [S, H, D]
    gather_ids_ptr, probs_ptr, offsets_ptr,  # the RouteLayout: [R], [R], [H*E + 1]
    tile_expert_ptr, tile_first_ptr,  # [T_max] int32, [G*E] int32 (forward's _tile_map)
    wg_ptr, wu_ptr, wd_ptr,  # [H*E, D, I], [H*E, D, I], [H*E, I, D]: pointers or TMA descriptors
    dx_ptr, slot_ptr, dprobs_ptr,  # dx: fp32 [S, G, D] or [G*S*K, D] (deterministic); [R]; [R]
    E, first_expert, num_experts, first_head, group_heads, slot_base,
    D: tl.constexpr, I: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_I: tl.constexpr, DETERMINISTIC: tl.constexpr,
    UPCAST: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dx rows and dprobs of one tile of routes.

    Launch grid: (T_max,), T_max >= the number of (expert, row block) tiles of
    the `num_experts` flat experts starting at `first_expert` (G heads), as the
    forward. Program t owns rows [offsets[f] + b * BLOCK_M, ... + BLOCK_M) of
    expert f (clipped to offsets[f + 1]): their dprobs (exclusive) and their
    dx rows, added atomically into the fp32 [S, G, D] buffer, or stored to
    their slots (deterministic). Programs past the last tile return at once.
    UPCAST, DOT_FP32, PRECISION, USE_TMA: as in the forward kernel.
    """
    pid = tl.program_id(0)
    e = tl.load(tile_expert_ptr + pid)
    if e >= num_experts:
        return
    f, head, rows, row_ok, tokens = _tile_rows(pid, e, tile_first_ptr, offsets_ptr,
                                               gather_ids_ptr, first_expert, E, BLOCK_M)

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
        a, dg, du = _swiglu7_backward(g, u, t * p[:, None])
        # The forward multiplied the activation rounded to the weight dtype.
        if UPCAST:
            a = _round_fp32(a, w_dtype)
        else:
            a = a.to(w_dtype).to(tl.float32)
        dprob += tl.sum(a * t, axis=1)
        dg = _to_operand(dg, w_dtype, UPCAST, DOT_FP32)
        du = _to_operand(du, w_dtype, UPCAST, DOT_FP32)
        acc = tl.dot(dg, tl.trans(wg), acc, input_precision=PRECISION)
        acc = tl.dot(du, tl.trans(wu), acc, input_precision=PRECISION)
        if not USE_TMA:
            wg_ptrs += BLOCK_I
            wu_ptrs += BLOCK_I
            wd_ptrs += BLOCK_I * D

    tl.store(dprobs_ptr + rows, dprob, mask=row_ok)
    _combine_rows(dx_ptr, slot_ptr, acc, xy_ok, rows, row_ok, tokens, head, d, slot_base,
                  group_heads, first_head, D, DETERMINISTIC)


@triton.jit
def _dw_rows(
    x_ptr, dy_ptr, H, gather_ids_ptr, probs_ptr, row0, end, head,
    wg, wu, wd_t, acc_g, acc_u, acc_d, w_dtype: tl.constexpr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
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
    a, dg, du = _swiglu7_backward(g, u, t * p[:, None])
    if UPCAST:
        a = _round_fp32(a, w_dtype)
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
                D, BLOCK_M, BLOCK_D, UPCAST, DOT_FP32, PRECISION)
            b += 1
    else:
        for b in range(0, num_blocks):
            acc_g, acc_u, acc_d = _dw_rows(
                x_ptr, dy_ptr, H, gather_ids_ptr, probs_ptr, start + b * BLOCK_M, end, head,
                wg, wu, wd_t, acc_g, acc_u, acc_d, w_dtype,
                D, BLOCK_M, BLOCK_D, UPCAST, DOT_FP32, PRECISION)

    if UPCAST:
        acc_g = _round_fp32(acc_g, w_dtype)
        acc_u = _round_fp32(acc_u, w_dtype)
        acc_d = _round_fp32(acc_d, w_dtype)
    tl.store(dwg_ptr + gu_offs, acc_g.to(w_dtype), mask=gu_ok)
    tl.store(dwu_ptr + gu_offs, acc_u.to(w_dtype), mask=gu_ok)
    tl.store(dwd_ptr + f * I * D + i[None, :] * D + d[:, None], acc_d.to(w_dtype), mask=gu_ok)


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
    interpreting = _interpreting()
    dot_fp32 = (not (x_heads.dtype == grad_y.dtype == w_down.dtype)
                or w_down.dtype == torch.float32)
    if config is None:
        config = expert_backward_config(device, R / F, interpreting, fp32_operands=dot_fp32)
    # One [S, H, D] layout for both: the kernels share their gather offsets.
    x_heads, grad_y = x_heads.contiguous(), grad_y.contiguous()
    w_gate, w_up, w_down = w_gate.contiguous(), w_up.contiguous(), w_down.contiguous()
    gather_ids, sorted_probs, offsets = (
        gather_ids.contiguous(), sorted_probs.contiguous(), offsets.contiguous())
    precision = "ieee" if dot_fp32 else "tf32"  # tf32 is ignored by 16-bit dots
    _backward_dw(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                 d_gate, d_up, d_down, config.dw, dot_fp32, precision, interpreting)
    _backward_dx(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                 dx, dprobs, config.dx, deterministic, dot_fp32, precision, interpreting)
    return dx, dprobs.to(sorted_probs.dtype), d_gate, d_up, d_down


def _backward_dw(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                 d_gate, d_up, d_down, tiles, dot_fp32, precision, interpreting) -> None:
    """The three weight gradients: one launch over every (expert, I slice)."""
    _, H, D = x_heads.shape
    F, _, I = w_gate.shape

    def launch(t):
        _expert_dw_kernel[(F * triton.cdiv(I, t.block_i),)](
            x_ptr=x_heads, dy_ptr=grad_y, H=H,
            gather_ids_ptr=gather_ids, probs_ptr=sorted_probs, offsets_ptr=offsets,
            wg_ptr=w_gate, wu_ptr=w_up, wd_ptr=w_down,
            dwg_ptr=d_gate, dwu_ptr=d_up, dwd_ptr=d_down, E=F // H,
            D=D, I=I, BLOCK_M=t.block_m, BLOCK_I=t.block_i, BLOCK_D=triton.next_power_of_2(D),
            UPCAST=interpreting, DOT_FP32=dot_fp32, PRECISION=precision,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )

    launch_with_step_down(launch, tiles)


def _backward_dx(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                 dx, dprobs, tiles, deterministic, dot_fp32, precision, interpreting) -> None:
    """dx and dprobs, in groups of heads whose fp32 workspace fits the forward's limits."""
    S, H, D = x_heads.shape
    F, _, I = w_gate.shape
    E = F // H
    groups = HeadGroups(dx, gather_ids, offsets, E, deterministic, "expert_backward")
    block_d = triton.next_power_of_2(D)
    tma_ok = tma_fits(D, I, w_down.element_size())
    for h0, g, routes, out in groups:

        def launch(t, h0=h0, g=g, routes=routes, out=out):  # bound now: runs in this pass
            use_tma = t.tma and tma_ok
            if use_tma:
                weights = (TensorDescriptor.from_tensor(w_gate, [1, block_d, t.block_i]),
                           TensorDescriptor.from_tensor(w_up, [1, block_d, t.block_i]),
                           TensorDescriptor.from_tensor(w_down, [1, t.block_i, block_d]))
            else:
                weights = (w_gate, w_up, w_down)
            max_tiles = triton.cdiv(routes, t.block_m) + g * E
            tile_expert, tile_first = _tile_map(offsets, h0 * E, g * E, t.block_m, max_tiles)
            _expert_dx_kernel[(max_tiles,)](
                x_ptr=x_heads, dy_ptr=grad_y, H=H,
                gather_ids_ptr=gather_ids, probs_ptr=sorted_probs, offsets_ptr=offsets,
                tile_expert_ptr=tile_expert, tile_first_ptr=tile_first,
                wg_ptr=weights[0], wu_ptr=weights[1], wd_ptr=weights[2],
                dx_ptr=out, slot_ptr=groups.slots, dprobs_ptr=dprobs,
                E=E, first_expert=h0 * E, num_experts=g * E, first_head=h0, group_heads=g,
                slot_base=h0 * S * groups.K,
                D=D, I=I, BLOCK_M=t.block_m, BLOCK_I=t.block_i, BLOCK_D=block_d,
                EVEN_D=D == block_d, EVEN_I=I % t.block_i == 0, DETERMINISTIC=deterministic,
                UPCAST=interpreting, DOT_FP32=dot_fp32, PRECISION=precision, USE_TMA=use_tma,
                num_warps=t.num_warps, num_stages=t.num_stages,
            )

        tiles = launch_with_step_down(launch, tiles)
        groups.finish(h0, g, out, interpreting)
