"""Fused expert MLP forward: gather, gate/up GEMMs, SwiGLU7, down GEMM, weighted combine.

One program owns BLOCK_M routes of one flat expert. It gathers their x rows
once, then walks the intermediate dimension I in slices of BLOCK_I:

    g, u = x @ W_gate[f][:, slice], x @ W_up[f][:, slice]      fp32 accumulators
    a    = swiglu7(g, u) cast to the weight dtype
    acc += a @ W_down[f][slice, :]                             fp32 [BLOCK_M, D]

so the [rows, I] intermediate never leaves the chip (the flash-attention
pattern). The epilogue scales each row by its route probability and combines:

- default mode: fp32 atomic adds into an fp32 [S, G, D] accumulator (G heads
  per launch), cast to x's dtype afterwards. The order of the K adds of a
  (token, head) depends on scheduling, so the last bits may vary between runs.
- deterministic mode: each route stores its row into its own slot
  ((h * S + s) * K + k, k = its rank among the routes of (s, h) in ascending
  expert order); a second kernel sums the K slots of every (token, head) in
  ascending k, starting from 0.0, which is the reference's order. Nothing
  depends on scheduling or on the order of the tokens.

Everything the launch needs comes from shapes: the grid is an upper bound on
the number of tiles, and each program finds its (expert, row block) in a
tile -> expert map computed on the device by torch ops (no host sync), so the
whole call can be captured in a CUDA graph.

The module reads in order: the @triton.jit helpers the backward and the fp8
forward share (`round_fp32`, `swiglu7_tile`, `tile_rows`, `combine_rows`), the
forward kernel, the combine's
finishing kernel, then the launcher `triton_expert_forward` with its host helpers
(the tile map, the head groups of the combine). Tiles come from kernels/tuning.py.
On sm_90 the launcher may hand the tiles to the Gluon kernel of
expert_forward_sm90.py instead (`ExpertForwardConfig.warp_specialized`).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from ..routing import route_experts
from . import tuning
from .tuning import ExpertForwardConfig, interpreting, step_down


@triton.jit
def round_fp32(v, dtype: tl.constexpr):
    """fp32 `v` rounded to `dtype` (nearest even), returned as fp32. Interpreter only.

    The interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest
    even, so bf16 is rounded here on the bits (finite values). Other dtypes
    round correctly through numpy.
    """
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def swiglu7_tile(g, u, RCP: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    """SwiGLU7 of fp32 gate and up accumulators (any matching tile shapes), in fp32:
    min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1). Shared by the bf16
    and fp8 forward kernels.

    The sigmoid is g / (1 + 2^(-1.702 log2(e) g)) with the fast (2 ulp) division: one
    exp2 and one reciprocal on the special-function units, which otherwise bound the
    kernels' loops. Far below the bf16 (or e4m3) rounding of the result. RCP,
    INTERPRET: `divide`'s (`ExpertForwardConfig.sigmoid_rcp`,
    `Fp8ForwardConfig.reciprocals`).
    """
    g = tl.minimum(g, 7.0)
    u = tl.minimum(tl.maximum(u, -7.0), 7.0)
    return divide(g, 1.0 + tl.exp2(-2.4554669595930157 * g), RCP, INTERPRET) * (u + 1.0)


@triton.jit
def divide(num, den, RCP: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    """num / den in fp32 as every kernel here divides: the full-range division
    (div.full.f32), or with RCP num times rcp.approx.ftz(den) (MUFU.RCP alone), which is
    what the division computes, bitwise, for den in [2^-126, 2^126], without its range
    checks and rescales; above 2^126 the reciprocal flushes to zero. INTERPRET: under
    the interpreter (no inline PTX), which divides and emulates that flush."""
    if RCP:
        if INTERPRET:
            return tl.where(den > 2.0**126, num * 0.0, num / den)
        else:
            return num * tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r",
                                                   [den], dtype=tl.float32, is_pure=True,
                                                   pack=1)
    else:
        return tl.fdiv(num, den)


@triton.jit
def tile_rows(pid, e, tile_first_ptr, offsets_ptr, gather_ids_ptr, first_expert, E,
              BLOCK_M: tl.constexpr):
    """The routes of tile `pid` (of local expert `e`): (f, head, rows, row_ok, tokens).

    rows: [BLOCK_M] positions in the layout, row_ok masks those past the
    expert's end, tokens: int64 token of each row. Shared by the forward and
    backward kernels, which walk the same tile map.
    """
    block = pid - tl.load(tile_first_ptr + e)
    f = (first_expert + e).to(tl.int64)  # int64: f * D * I exceeds 2^31 for large banks
    head = f // E
    start = tl.load(offsets_ptr + f)
    end = tl.load(offsets_ptr + f + 1)
    rows = start + block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = tl.load(gather_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    return f, head, rows, row_ok, tokens


@triton.jit
def combine_rows(out_ptr, slot_ptr, acc, ok, rows, row_ok, tokens, head, d, slot_base,
                 group_heads, first_head, D: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """Add a tile's fp32 [BLOCK_M, BLOCK_D] rows to their (token, head).

    Default: fp32 atomics into the [S, G, D] buffer (order of the K adds varies).
    Deterministic: a plain store to each route's own slot; `_sum_slots_kernel`
    adds the K slots of a (token, head) in a fixed order afterwards.
    """
    if DETERMINISTIC:
        slots = tl.load(slot_ptr + rows, mask=row_ok, other=0) - slot_base
        tl.store(out_ptr + slots[:, None] * D + d[None, :], acc, mask=ok)
    else:
        out_rows = tokens * group_heads + (head - first_head)
        tl.atomic_add(out_ptr + out_rows[:, None] * D + d[None, :], acc, mask=ok, sem="relaxed")


@triton.jit
def _expert_forward_kernel(
    x_ptr, stride_xs, stride_xh,  # x_heads [S, H, D]; unit stride along D
    gather_ids_ptr, probs_ptr, offsets_ptr,  # the RouteLayout: [R], [R], [H*E + 1]
    tile_expert_ptr, tile_first_ptr,  # [T_max] int32, [G*E] int32 (see the launcher)
    wg_ptr, wu_ptr, wd_ptr,  # [H*E, D, I], [H*E, D, I], [H*E, I, D]: pointers or TMA descriptors
    out_ptr, slot_ptr,  # default: fp32 [S, G, D]; deterministic: fp32 [G*S*K, D], slots [R]
    E, first_expert, num_experts, first_head, group_heads, slot_base,
    pair_delta,  # PAIRED: (w_up - w_gate) in elements, any sign, a multiple of 16
    D: tl.constexpr, I: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_I: tl.constexpr, DETERMINISTIC: tl.constexpr,
    UPCAST: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    PAIRED: tl.constexpr, RCP: tl.constexpr = False,
):
    """Expert MLPs of one tile of routes.

    Launch grid: (T_max,), T_max >= the number of (expert, row block) tiles of
    the `num_experts` flat experts starting at `first_expert` (G heads).
    Program t owns rows [offsets[f] + b * BLOCK_M, ...+ BLOCK_M) of expert f,
    clipped to offsets[f + 1], where f - first_expert = tile_expert[t] and
    b = t - tile_first[f - first_expert]; programs with tile_expert[t] ==
    num_experts have no tile and return at once.
    UPCAST (interpreter only): compute on fp32 copies of 16-bit loads, whose
    arithmetic the interpreter gets wrong. DOT_FP32: inputs of unequal or
    fp32 dtypes, multiplied in full fp32 (no tf32), as the reference does.
    USE_TMA: the w_* arguments are tensor descriptors with blocks
    [1, BLOCK_D, BLOCK_I] (gate, up) and [1, BLOCK_I, BLOCK_D] (down).
    PAIRED: wg_ptr is a pointer and W_up[f] starts pair_delta elements after
    W_gate[f] (wu_ptr is unused); each slice of both is loaded as one
    [BLOCK_D, 2 * BLOCK_I] operand (gate columns, then up columns), so gate
    and up take one wgmma of N = 2 * BLOCK_I instead of two of N = BLOCK_I:
    the x tile (the A operand, read from shared memory by every wgmma) is
    read once per slice instead of twice. Pointer loads rather than a
    descriptor: no TMA box lays the two tensors side by side in the layout
    the wgmma reads, and Triton 3.6 copies such a tile through registers.
    USE_TMA then applies to W_down alone.
    """
    pid = tl.program_id(0)
    e = tl.load(tile_expert_ptr + pid)
    if e >= num_experts:
        return
    f, head, rows, row_ok, tokens = tile_rows(pid, e, tile_first_ptr, offsets_ptr,
                                              gather_ids_ptr, first_expert, E, BLOCK_M)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    x_ptrs = x_ptr + tokens[:, None] * stride_xs + head * stride_xh + d[None, :]
    x = tl.load(x_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST or DOT_FP32:
        x = x.to(tl.float32)

    i = tl.arange(0, BLOCK_I)
    if PAIRED:
        c = tl.arange(0, 2 * BLOCK_I)
        c_i = c % BLOCK_I  # column c of the pair is column c_i of gate (c < BLOCK_I) or up
        gu_ptrs = (wg_ptr + f * D * I + d[:, None] * I + c_i[None, :]
                   + (c // BLOCK_I)[None, :] * pair_delta)  # [BLOCK_D, 2 * BLOCK_I]
    elif not USE_TMA:
        wg_ptrs = wg_ptr + f * D * I + d[:, None] * I + i[None, :]  # [BLOCK_D, BLOCK_I]
        wu_ptrs = wu_ptr + f * D * I + d[:, None] * I + i[None, :]
    if not USE_TMA:
        wd_ptrs = wd_ptr + f * I * D + i[:, None] * D + d[None, :]  # [BLOCK_I, BLOCK_D]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        # Zero-filled weights past D or I make g = u = 0, so a = 0 there.
        if PAIRED:
            if EVEN_D and EVEN_I:
                gu = tl.load(gu_ptrs)
            else:
                gu = tl.load(gu_ptrs, mask=d_ok[:, None] & (i0 + c_i < I)[None, :], other=0.0)
        elif USE_TMA:
            # Bulk tensor copies: no per-thread addresses, and the descriptors'
            # bounds zero-fill the slice past I (the same effect as the masks).
            wg = wg_ptr.load([f.to(tl.int32), 0, i0]).reshape(BLOCK_D, BLOCK_I)
            wu = wu_ptr.load([f.to(tl.int32), 0, i0]).reshape(BLOCK_D, BLOCK_I)
        elif EVEN_D and EVEN_I:
            wg = tl.load(wg_ptrs)
            wu = tl.load(wu_ptrs)
        else:
            gu_ok = d_ok[:, None] & (i0 + i < I)[None, :]
            wg = tl.load(wg_ptrs, mask=gu_ok, other=0.0)
            wu = tl.load(wu_ptrs, mask=gu_ok, other=0.0)
        if USE_TMA:
            wd = wd_ptr.load([f.to(tl.int32), i0, 0]).reshape(BLOCK_I, BLOCK_D)
        elif EVEN_D and EVEN_I:
            wd = tl.load(wd_ptrs)
        else:
            wd = tl.load(wd_ptrs, mask=(i0 + i < I)[:, None] & d_ok[None, :], other=0.0)
        w_dtype = wd.dtype
        if UPCAST or DOT_FP32:
            wd = wd.to(tl.float32)
        if PAIRED:
            if UPCAST or DOT_FP32:
                gu = gu.to(tl.float32)
            gu = tl.dot(x, gu, input_precision=PRECISION)  # [BLOCK_M, 2 * BLOCK_I] = [g | u]
            # In the wgmma accumulator layout a thread holds columns j and
            # j + BLOCK_I alike, so this split stays in registers.
            g, u = gu.reshape(BLOCK_M, 2, BLOCK_I).permute(0, 2, 1).split()
        else:
            if UPCAST or DOT_FP32:
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            g = tl.dot(x, wg, input_precision=PRECISION)
            u = tl.dot(x, wu, input_precision=PRECISION)
        a = swiglu7_tile(g, u, RCP, UPCAST)
        if UPCAST:
            a = round_fp32(a, w_dtype)
        else:
            a = a.to(w_dtype)
            if DOT_FP32:
                a = a.to(tl.float32)
        acc = tl.dot(a, wd, acc, input_precision=PRECISION)
        if PAIRED:
            gu_ptrs += BLOCK_I
        elif not USE_TMA:
            wg_ptrs += BLOCK_I
            wu_ptrs += BLOCK_I
        if not USE_TMA:
            wd_ptrs += BLOCK_I * D

    prob = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * prob[:, None]
    ok = row_ok[:, None] & d_ok[None, :]
    combine_rows(out_ptr, slot_ptr, acc, ok, rows, row_ok, tokens, head, d, slot_base,
                 group_heads, first_head, D, DETERMINISTIC)


@triton.jit
def _sum_slots_kernel(
    buf_ptr, y_ptr, stride_ys, stride_yh,  # buf fp32 [G*S*K, D]; y [S, H, D], unit D stride
    S, first_head, num_pairs,
    D: tl.constexpr, K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, TOKEN_MAJOR: tl.constexpr = False,
):
    """y[s, first_head + g] = sum over k = 0..K-1, in that order, of buf[(g*S + s)*K + k].

    Launch grid: (cdiv(G * S, BLOCK_P), cdiv(D, BLOCK_D)); program (p, q) owns
    BLOCK_P (head, token) pairs of the group and columns [q*BLOCK_D, ...).
    The sum starts from 0.0 and adds in ascending k: a fixed order. TOKEN_MAJOR
    (the default mode's [S, G, D] accumulator, K = 1): buf row (s*G + g) instead.
    """
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (pairs < num_pairs)[:, None] & (d < D)[None, :]
    acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for k in range(K):
        acc += tl.load(buf_ptr + (pairs * K + k)[:, None] * D + d[None, :], mask=ok, other=0.0)
    if TOKEN_MAJOR:
        G = num_pairs // S
        s = pairs // G
        g = pairs - s * G
    else:
        g = pairs // S
        s = pairs - g * S
    y_ptrs = y_ptr + s[:, None] * stride_ys + (first_head + g)[:, None] * stride_yh + d[None, :]
    if UPCAST:
        acc = round_fp32(acc, y_ptr.dtype.element_ty)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _pair_delta(w_gate: torch.Tensor, w_up: torch.Tensor, interpret: bool) -> int | None:
    """Distance from W_gate to W_up in elements when the kernel may load them as one
    operand (PAIRED), else None.

    Both contiguous, of one dtype and shape; the distance a whole number of
    elements and a multiple of 16 (so every 16-byte vector of the pair stays
    aligned and Triton knows it). Any sign: w_up may lie before w_gate, or in
    another allocation (the GPU's address space is flat). The interpreter copies
    CUDA tensors to the host one by one, which breaks the distance: CPU only there.
    """
    if (w_gate.dtype != w_up.dtype or w_gate.shape != w_up.shape
            or not (w_gate.is_contiguous() and w_up.is_contiguous())
            or (interpret and w_gate.device.type != "cpu")):
        return None
    delta, rest = divmod(w_up.data_ptr() - w_gate.data_ptr(), w_gate.element_size())
    if rest or delta % 16 or abs(delta) >= 2**62:
        return None
    return delta


def _route_slots(gather_ids: torch.Tensor, offsets: torch.Tensor, S: int, E: int,
                 K: int) -> torch.Tensor:
    """Slot of every route: (h * S + s) * K + k, k = its rank in its (s, h)'s routes.

    The CSR holds routes in ascending flat expert, so a stable sort by (h, s)
    lists each (s, h)'s K routes in ascending expert order; the position in
    that sorted list is the slot. Returns int64 [R]; torch ops only, no sync.
    """
    R = gather_ids.numel()
    F = offsets.numel() - 1
    flat = route_experts(offsets, R)
    key = (flat // E) * S + gather_ids.to(torch.int64)
    if F // E * S < 2**31:  # a 32-bit radix sort takes half the passes of a 64-bit one
        key = key.to(torch.int32)
    keys, order = torch.sort(key, stable=True)
    position = torch.arange(R, dtype=torch.int64, device=gather_ids.device)
    # Every (token, head) owns exactly K consecutive slots.
    _require(keys, position // K,
             "deterministic mode needs the same number of routes for every (token, head)")
    slots = torch.empty(R, dtype=torch.int64, device=gather_ids.device)
    slots[order] = position
    return slots


def _require(value: torch.Tensor, expected: torch.Tensor | int, what: str) -> None:
    """Check value == expected elementwise without a host synchronisation on the GPU.

    CPU tensors: a ValueError saying `what`. Other devices: a device-side assertion
    (`torch._assert_async`), which stops the stream's work with an error at the next
    synchronisation rather than letting a kernel read a layout its grid does not cover.
    """
    if value.device.type == "cpu":
        if not bool(torch.all(value == expected)):
            raise ValueError(what)
    else:
        torch._assert_async(torch.all(value == expected), what)


def uniform_routes(gather_ids: torch.Tensor, offsets: torch.Tensor, S: int, H: int) -> bool:
    """Whether the layout has K = R / (S * H) routes for every head (the grids then
    bound a group of g heads by S * g * K routes); False if R is not a multiple of S * H.

    R a multiple of S * H is taken as a promise that every head owns exactly S * K
    routes (as every `sort_routes` layout does): checked here, on the device for
    CUDA tensors (see `_require`), since a head with more would outgrow its grid.
    """
    R = gather_ids.numel()
    if S * H == 0 or R % (S * H):
        return False
    E = (offsets.numel() - 1) // H
    per_head = offsets[E::E] - offsets[:-1:E]
    _require(per_head, torch.full_like(per_head, R // H),
             f"a layout of R = S*H*K = {R} routes must give every head S*K = {R // H} of "
             f"them (every sort_routes layout does); this one does not")
    return True


def tile_map(offsets: torch.Tensor, first: int, count: int, block_m: int, max_tiles: int,
             with_total: bool = False):
    """Tiles of experts [first, first + count): (tile_expert [max_tiles], tile_first [count]),
    and with `with_total` the number of tiles (int32 [1], on the device).

    tile_expert[t] is the local expert of tile t, or `count` past the last tile;
    tile_first[e] is the first tile of local expert e. Torch ops only, no sync.
    """
    seg = offsets[first:first + count + 1]
    tiles = torch.div(seg[1:] - seg[:-1] + (block_m - 1), block_m, rounding_mode="floor")
    ends = torch.cumsum(tiles, 0)
    tile_first = (ends - tiles).to(torch.int32)
    t = torch.arange(max_tiles, device=offsets.device, dtype=ends.dtype)
    tile_expert = torch.searchsorted(ends, t, right=True, out_int32=True)
    if with_total:
        return tile_expert, tile_first, ends[-1:].to(torch.int32)
    return tile_expert, tile_first


def tma_fits(D: int, I: int, elem: int) -> bool:
    """Whether the weight slices can go through TMA descriptors: 16-byte aligned
    strides, and boxes of at most 256 rows with no padding of D."""
    block_d = triton.next_power_of_2(D)
    return block_d == D and D <= 256 and (D * elem) % 16 == 0 and (I * elem) % 16 == 0


def launch_with_step_down(launch, config, step=step_down):
    """Run `launch(config)`, shrinking the tiles (`step`, by default `tuning.step_down`)
    while they do not fit the chip; returns the config that ran."""
    while True:
        try:
            launch(config)
            return config
        except OutOfResources:
            smaller = step(config)
            if smaller is None:
                raise
            config = smaller


class HeadGroups:
    """The combine of a kernel whose programs each produce fp32 [rows, D] route rows
    of a [S, H, D] `result` (the forward's y, the backward's dx).

    Iterating gives (h0, g, routes, out): heads [h0, h0 + g) are one launch, whose
    workspace `out` stays within `tuning.combine_workspace_bytes`; `finish` then writes
    them into `result`. Default mode: `out` is an fp32 [S, g, D] buffer for atomic
    adds (`result` itself when it is fp32). Deterministic mode: `out` is an fp32
    [g*S*K, D] buffer of per-route slots (`slots`), which `_sum_slots_kernel` adds
    in a fixed order. `routes` bounds the routes of the group (for the grid).
    `max_heads` caps the heads of a group below what the workspace limits allow.
    """

    def __init__(self, result: torch.Tensor, gather_ids: torch.Tensor, offsets: torch.Tensor,
                 num_experts: int, deterministic: bool, op: str,
                 max_heads: int | None = None) -> None:
        S, H, D = result.shape
        R = gather_ids.numel()
        self.result, self.deterministic = result, deterministic
        self.uniform_k = uniform_routes(gather_ids, offsets, S, H)
        self.K = R // (S * H)
        cap = H if max_heads is None else max_heads
        limit = tuning.combine_workspace_bytes(deterministic)
        self.workspace = None
        if deterministic:
            if not self.uniform_k:
                raise ValueError(f"{op}: deterministic mode needs the same number of routes "
                                 f"for every (token, head); R={R} is not a multiple of "
                                 f"S*H={S * H}")
            self.slots = _route_slots(gather_ids, offsets, S, num_experts, self.K)
            self.size = max(1, min(H, cap, limit // (S * self.K * D * 4)))
            # One workspace for the largest group; each group uses a prefix of it.
            self.workspace = torch.empty(self.size * S * self.K * D, dtype=torch.float32,
                                         device=result.device)
        else:
            self.slots = gather_ids  # unused by the kernels in this mode
            if result.dtype == torch.float32 and cap >= H:
                self.size = H  # one group: accumulate straight into the result
            else:
                self.size = max(1, min(H, cap, limit // (S * D * 4)))
                self.workspace = torch.empty(S * self.size * D, dtype=torch.float32,
                                             device=result.device)

    def __iter__(self):
        S, H, D = self.result.shape
        for h0 in range(0, H, self.size):
            g = min(self.size, H - h0)
            # Every (token, head) of a uniform layout has exactly K routes, so the
            # group owns S*g*K of them; otherwise any of the R routes may be its.
            routes = S * g * self.K if self.uniform_k else self.slots.numel()
            if self.deterministic:
                out = self.workspace[:g * S * self.K * D].view(g * S * self.K, D)
            elif self.workspace is None:
                out = self.result.zero_()
            else:
                out = self.workspace[:S * g * D].view(S, g, D).zero_()
            yield h0, g, routes, out

    def finish(self, h0: int, g: int, out: torch.Tensor, interpret: bool) -> None:
        """Write the group's sums into heads [h0, h0 + g) of the result (nothing to do
        where the group accumulated into the result itself)."""
        S, _, D = self.result.shape
        if self.deterministic or self.workspace is not None:
            # Deterministic: the K slots of each (token, head) added in order. Default:
            # the [S, g, D] sums cast into the result's heads, token-major (faster than
            # torch's copy into that strided slice: docs/expert-forward.md, "The token-major
            # finish").
            t = tuning.slot_sum_config(D)
            grid = (triton.cdiv(g * S, t.block_p), triton.cdiv(D, t.block_d))
            _sum_slots_kernel[grid](
                out, self.result, self.result.stride(0), self.result.stride(1), S, h0, g * S,
                D=D, K=self.K if self.deterministic else 1, BLOCK_P=t.block_p,
                BLOCK_D=t.block_d, UPCAST=interpret, TOKEN_MAJOR=not self.deterministic,
                num_warps=t.num_warps,
            )


def triton_expert_forward(
    x_heads: torch.Tensor,
    gather_ids: torch.Tensor,
    sorted_probs: torch.Tensor,
    offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    deterministic: bool = False,
    config: ExpertForwardConfig | None = None,
) -> torch.Tensor:
    """Fused expert MLPs of every route, summed per (token, head) (docs/contract.md
    section 4).

    x_heads: [S, H, D] (bf16, fp16 or fp32); gather_ids: [R] int32/int64 token
    of each route; sorted_probs: [R] float; offsets: [H*E + 1] int64 CSR by
    flat expert; w_gate, w_up: [H*E, D, I]; w_down: [H*E, I, D] (D and I
    multiples of 16 on the GPU). Returns y [S, H, D] in x_heads' dtype.

    deterministic: bitwise reproducible and independent of the token order;
    needs every (token, head) to have the same number K = R / (S*H) of routes
    (true of every `sort_routes` layout). config: force tiles (tests; default
    `tuning.expert_forward_config`); with `warp_specialized` (the sm_90 default above
    40 routes per expert) the Gluon kernel of `expert_forward_sm90.py` runs instead, at
    the tiles of `tuning.expert_forward_sm90_config`, with the same results.
    Inputs are assumed valid (`experts.check_expert_inputs`); nothing is read
    back to the host. Works on CUDA tensors, and on CPU tensors under
    TRITON_INTERPRET=1.
    """
    S, H, D = x_heads.shape
    F, _, I = w_gate.shape
    E = F // H
    R = gather_ids.numel()
    device = x_heads.device
    y = torch.empty(S, H, D, dtype=x_heads.dtype, device=device)
    if S == 0 or R == 0 or D == 0 or I == 0:
        return y.zero_()
    interpret = interpreting()
    forced = config is not None
    if config is None:
        config = tuning.expert_forward_config(device, R / F, D, w_down.dtype, interpret)
    if config.warp_specialized:
        from . import expert_forward_sm90 as ws  # Gluon: imported where it may run

        if not ws.ws_fits(x_heads, w_gate, w_up, w_down):
            if forced:
                raise ValueError(
                    "config.warp_specialized needs an sm_90 GPU, bf16 x and weights, D = 256 "
                    f"and I a multiple of 64; got {x_heads.device}, {x_heads.dtype}/"
                    f"{w_down.dtype}, D={D}, I={I}")
            config = dataclasses.replace(config, warp_specialized=False, cluster=1)
    if x_heads.stride(2) != 1:
        x_heads = x_heads.contiguous()
    w_gate, w_up, w_down = w_gate.contiguous(), w_up.contiguous(), w_down.contiguous()
    gather_ids, sorted_probs, offsets = (
        gather_ids.contiguous(), sorted_probs.contiguous(), offsets.contiguous())
    dot_fp32 = x_heads.dtype != w_down.dtype or w_down.dtype == torch.float32
    groups = HeadGroups(y, gather_ids, offsets, E, deterministic, "expert_forward")
    if config.warp_specialized:
        sm90 = tuning.expert_forward_sm90_config()
        descs = ws.weight_descriptors(w_gate, w_up, w_down, sm90.block_i)
        tmaps = (ws.cached_tensor_maps(w_gate, w_up, w_down, sm90.block_i)
                 if config.cluster > 1 else None)
        for h0, g, routes, out in groups:
            max_tiles = triton.cdiv(routes, sm90.block_m) + g * E
            tile_expert, tile_first, total = tile_map(offsets, h0 * E, g * E, sm90.block_m,
                                                      max_tiles, with_total=True)
            ws.launch_ws(x_heads, gather_ids, sorted_probs, offsets, descs, out, groups.slots,
                         tile_expert, tile_first, total, config=sm90, E=E,
                         first_expert=h0 * E, first_head=h0, group_heads=g,
                         slot_base=h0 * S * groups.K, I=I, deterministic=deterministic,
                         cluster=config.cluster, tmaps=tmaps, rcp=config.sigmoid_rcp)
            groups.finish(h0, g, out, interpret)
        return y
    block_d = triton.next_power_of_2(D)
    use_tma = config.tma and tma_fits(D, I, w_down.element_size())
    pair_delta = _pair_delta(w_gate, w_up, interpret) if config.paired else None
    for h0, g, routes, out in groups:

        def launch(cfg, h0=h0, g=g, routes=routes, out=out):  # bound now: runs in this pass
            if pair_delta is not None:
                gate_up = (w_gate, w_up)  # w_up is not read: the kernel goes by pair_delta
            elif use_tma:
                gate_up = (TensorDescriptor.from_tensor(w_gate, [1, block_d, cfg.block_i]),
                           TensorDescriptor.from_tensor(w_up, [1, block_d, cfg.block_i]))
            else:
                gate_up = (w_gate, w_up)
            if use_tma:
                down = TensorDescriptor.from_tensor(w_down, [1, cfg.block_i, block_d])
            else:
                down = w_down
            max_tiles = triton.cdiv(routes, cfg.block_m) + g * E
            tile_expert, tile_first = tile_map(offsets, h0 * E, g * E, cfg.block_m, max_tiles)
            _expert_forward_kernel[(max_tiles,)](
                x_ptr=x_heads, stride_xs=x_heads.stride(0), stride_xh=x_heads.stride(1),
                gather_ids_ptr=gather_ids, probs_ptr=sorted_probs, offsets_ptr=offsets,
                tile_expert_ptr=tile_expert, tile_first_ptr=tile_first,
                wg_ptr=gate_up[0], wu_ptr=gate_up[1], wd_ptr=down,
                out_ptr=out, slot_ptr=groups.slots,
                E=E, first_expert=h0 * E, num_experts=g * E, first_head=h0,
                group_heads=g, slot_base=h0 * S * groups.K, pair_delta=pair_delta or 0,
                D=D, I=I, BLOCK_M=cfg.block_m, BLOCK_I=cfg.block_i,
                BLOCK_D=block_d, EVEN_D=D == block_d,
                EVEN_I=I % cfg.block_i == 0, DETERMINISTIC=deterministic,
                UPCAST=interpret, DOT_FP32=dot_fp32,
                PRECISION="ieee" if dot_fp32 else "tf32",  # tf32 is ignored by 16-bit dots
                USE_TMA=use_tma, PAIRED=pair_delta is not None, RCP=cfg.sigmoid_rcp,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )

        config = launch_with_step_down(launch, config)
        groups.finish(h0, g, out, interpret)
    return y


def sm90_compile_cases() -> list:
    """The Triton forward kernel at every sm_90 default tile, default and deterministic,
    and the first tile with `ExpertForwardConfig.sigmoid_rcp` (`mhmoe.kernels.CompileCase`;
    MAGI-2's dims)."""
    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase
    from .tuning import FORWARD_SM90

    D, I = M.head_dim, M.expert_intermediate_size
    tma = tma_fits(D, I, 2)
    cases = []
    runs = [(f, det) for _, f in FORWARD_SM90 for det in (False, True)]
    rcp = dataclasses.replace(FORWARD_SM90[0][1], sigmoid_rcp=True)
    for f, det in [*runs, (rcp, False)]:
        desc_gu = f"tensordesc<bf16[1, {D}, {f.block_i}]>"
        cases.append(CompileCase(
            f"expert forward {f.block_m}/{f.block_i}/{f.num_warps}/{f.num_stages}"
            f"{' paired' if f.paired else ''}{' deterministic' if det else ''}"
            f"{' sigmoid_rcp' if f.sigmoid_rcp else ''}",
            _expert_forward_kernel,
            {"x_ptr": "*bf16", "stride_xs": "i32", "stride_xh": "i32",
             "gather_ids_ptr": "*i32", "probs_ptr": "*fp32", "offsets_ptr": "*i64",
             "tile_expert_ptr": "*i32", "tile_first_ptr": "*i32",
             "wg_ptr": "*bf16" if f.paired or not tma else desc_gu,
             "wu_ptr": "*bf16" if f.paired or not tma else desc_gu,
             "wd_ptr": f"tensordesc<bf16[1, {f.block_i}, {D}]>" if tma else "*bf16",
             "out_ptr": "*fp32", "slot_ptr": "*i32", "E": "i32", "first_expert": "i32",
             "num_experts": "i32", "first_head": "i32", "group_heads": "i32",
             "slot_base": "i32", "pair_delta": "i32"},
            dict(D=D, I=I, BLOCK_M=f.block_m, BLOCK_I=f.block_i, BLOCK_D=D, EVEN_D=True,
                 EVEN_I=I % f.block_i == 0, DETERMINISTIC=det, UPCAST=False,
                 DOT_FP32=False, PRECISION="tf32", USE_TMA=tma, PAIRED=f.paired,
                 RCP=f.sigmoid_rcp),
            f.num_warps, f.num_stages, ("stride_xs", "stride_xh", "pair_delta")))
    return cases
