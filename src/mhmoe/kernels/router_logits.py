"""Router logits on tensor cores (docs/contract.md section 2, step 1), routed in the same
pass or right after it.

    out = triton_logits_route(x_heads, gate, options, expert_bias)
    # out.probs, out.indices [H, S, K]; out.logits [H, S, E] if asked; out.block_counts

The fp32 router weight is first split exactly into three bf16 parts
(`split_router_weight`; `_split_weight_kernel`, grid (cdiv(N, BLOCK),), a program owns
BLOCK weights), so that every product with bf16 x is exact in fp32 and the logits are
fp32 dot products computed on tensor cores (the argument: `_logits_route_kernel`).

`_logits_route_kernel`, grid (cdiv(S, BLOCK_S), H * (E // BLOCK_N)): program (b, h, n)
owns the [BLOCK_S, BLOCK_N] logits tile of tokens [b * BLOCK_S, (b + 1) * BLOCK_S) of
head h and experts [n * BLOCK_N, (n + 1) * BLOCK_N). Fused (BLOCK_N = E) it routes its
tile in registers with the route kernel's code (kernels/topk.py); split (the sm_90
default) it writes the tile, and with shortlists each row's next_pow2(K) best packed
keys of its block (`_write_shortlist`), for `_shortlist_route_kernel` (else
`_route_kernel`) to route right after. Tiles: `tuning.LogitsRouteConfig`. The design,
what was tried and what was measured: docs/routing.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config import RouterOptions
from . import tuning
from .topk import (
    SIGMOID_APPROX_ERROR,
    _route_rows,
    _shortlist,
    _shortlist_merged,
    bias_arg,
    launch_route,
    launch_shortlist_route,
    new_block_counts,
    shortlist_size,
)
from .tuning import LogitsRouteConfig, interpreting


@triton.jit
def _truncate_to_bf16(v):
    """v with the low 16 bits of its fp32 encoding cleared: the top 8 significant
    bits, exactly representable in bfloat16 (rounded toward zero)."""
    return (v.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _split_weight_kernel(w_ptr, parts_ptr, N, BLOCK: tl.constexpr):
    """parts[0] + parts[1] + parts[2] == w exactly, each part bfloat16.

    Launch grid: (cdiv(N, BLOCK),); program i owns elements [i * BLOCK, (i + 1) * BLOCK)
    of w [N] fp32 and writes them to parts [3, N] bf16. A finite fp32 w has a
    24-bit significand; w1 keeps its top 8 bits (truncation: never rounds up to
    inf), the residual w - w1 is exact (Sterbenz: same sign and binade) and has
    at most 16 significant bits, w2 keeps its top 8, and w3 = the rest has at
    most 8, so every step is exact and every part converts to bf16 exactly
    (whatever rounding the conversion uses). Exact as long as the residuals stay
    in fp32's normal range (|w| >= 2^-110); below, they lose bits under 2^-133.
    Non-finite w: w1 = w, w2 = w3 = 0, so inf and NaN weights give the logits
    x * w would give. (An infinite x gives NaN where a part is 0, inf * 0, where
    fp32 gives +-inf: that row's logits are not finite either way.)
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    w1, w2, w3 = split_bf16x3(tl.load(w_ptr + offs, mask=ok, other=0.0))
    tl.store(parts_ptr + offs, w1, mask=ok)
    tl.store(parts_ptr + N + offs, w2, mask=ok)
    tl.store(parts_ptr + 2 * N + offs, w3, mask=ok)


@triton.jit
def split_bf16x3(w):
    """fp32 w -> bf16 (w1, w2, w3) with w1 + w2 + w3 == w exactly (the argument:
    `_split_weight_kernel`; also the router backward's split of d logits)."""
    finite = tl.abs(w) < float("inf")  # false for NaN too
    w1 = tl.where(finite, _truncate_to_bf16(w), w)
    r = tl.where(finite, w - w1, 0.0)
    w2 = _truncate_to_bf16(r)
    w3 = r - w2
    return w1.to(tl.bfloat16), w2.to(tl.bfloat16), w3.to(tl.bfloat16)


@triton.jit
def _dot_exact(x, w, acc, INTERPRET: tl.constexpr):
    """acc + x @ w for bf16 x and w: products exact in fp32, fp32 accumulation.

    On the GPU a bf16 tensor-core dot (wgmma / mma with fp32 accumulators). The
    interpreter's bf16 arithmetic is wrong: there both go up to fp32 first, and
    an fp32 "ieee" dot gives the same exact products.
    """
    if INTERPRET:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(x, w, acc)


@triton.jit
def _write_shortlist(acc, s0, h, n, bias_ptr, short_ptr, S, E: tl.constexpr,
                     TOP_K: tl.constexpr, SHORT: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ERROR: tl.constexpr,
                     INTERPRET: tl.constexpr, MERGED: tl.constexpr = False):
    """short[h, s, n * SHORT + j] (int32): the packed keys of the shortlist (`_shortlist`,
    or `_shortlist_merged` if MERGED) of row s of the logits tile acc (tokens
    [s0, s0 + BLOCK_S) of head h, column block n), best first, or 0 throughout where the
    row is unsure (0 is no expert's key)."""
    tl.static_assert((E & (E - 1)) == 0, "shortlist keys need a power-of-two E")
    coln = n * BLOCK_N + tl.arange(0, BLOCK_N)
    bias_n = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias_n = tl.load(bias_ptr + h * E + coln)
    NSPLIT: tl.constexpr = E // BLOCK_N
    if MERGED:
        keys, unsure = _shortlist_merged(acc, coln, bias_n, E, TOP_K, SHORT, BLOCK_N,
                                         HAS_BIAS, ERROR, INTERPRET)
        # Every group holds the list: group 0 stores it.
        rows = s0 + tl.arange(0, BLOCK_S)[:, None, None]
        group = tl.arange(0, 4)[None, :, None]
        so = ((h.to(tl.int64) * S + rows) * NSPLIT + n) * SHORT + \
            tl.arange(0, SHORT)[None, None, :]
        tl.store(short_ptr + tl.broadcast_to(so, (BLOCK_S, 4, SHORT)),
                 tl.where(unsure[:, :, None], 0, keys).to(tl.int32, bitcast=True),
                 mask=(rows < S) & (group == 0))
    else:
        scol = tl.arange(0, SHORT)[None, :]
        keys, unsure = _shortlist(acc, coln, bias_n, scol, E, TOP_K, SHORT, BLOCK_N,
                                  HAS_BIAS, ERROR, INTERPRET)
        # Rows from a fresh arange: in the layout of the keys, not of acc's rows (those
        # cost registers on sm_90: docs/routing.md, "Shortlists").
        rows = s0 + tl.arange(0, BLOCK_S)
        so = ((h.to(tl.int64) * S + rows) * NSPLIT + n)[:, None] * SHORT + scol
        tl.store(short_ptr + so,
                 tl.where(unsure[:, None], 0, keys).to(tl.int32, bitcast=True),
                 mask=(rows < S)[:, None])


@triton.jit
def _logits_route_kernel(
    x_desc,  # x_heads as [S, H * D] bf16: a tensor descriptor, blocks [BLOCK_S, BLOCK_D]
    w_desc,  # router weight parts [3 * H * E, D] bf16 (w1, w2, w3): blocks [BLOCK_N, BLOCK_D]
    logits_ptr,  # output [H, S, E] fp32 contiguous (written if WRITE_LOGITS)
    bias_ptr,  # [H, E] fp32 contiguous (unused unless HAS_BIAS)
    probs_ptr, indices_ptr,  # outputs [H, S, K] fp32, int64, contiguous
    counts_ptr,  # [H, NB, E] int32 (unused unless COUNT_T > 0)
    S, H, NB, group_size, norm_eps, route_scale,
    E: tl.constexpr, D: tl.constexpr, TOP_K: tl.constexpr, SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr, ROUTE_NORM: tl.constexpr, NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, WRITE_LOGITS: tl.constexpr,
    FROM_TILE: tl.constexpr, INTERPRET: tl.constexpr, ROUTE: tl.constexpr = True,
    COUNT_T: tl.constexpr = 0, HALF_STORES: tl.constexpr = False, BLOCK_N: tl.constexpr = 0,
    l_desc=None, short_ptr=None, SHORT: tl.constexpr = 0, MERGED: tl.constexpr = False,
):
    """Router logits and top-k routing of BLOCK_S tokens of one head, in one pass.

    ROUTE=False: the logits alone (written; probs, indices untouched), for
    `_route_kernel` to route afterwards (LogitsRouteConfig.split); with
    COUNT_T > 0 it also zeroes the rows of counts [H, NB, E] of the blocks of
    COUNT_T tokens that start in its tile, which `_route_kernel` then adds
    into (no memset launch). ROUTE=True with COUNT_T > 0: the program adds its
    picks to counts itself (zeroed by the launcher), see `_route_rows`. ROUTE=False
    with SHORT > 0: the tile's shortlists too (`_write_shortlist`; MERGED picks the
    sorting networks' `_shortlist_merged` over `_shortlist`'s rounds).

    Launch grid: (cdiv(S, BLOCK_S), H * (E // BLOCK_N)); BLOCK_N (a power of two
    dividing E) is E unless ROUTE=False. Program (b, h) (BLOCK_N = E) owns tokens
    [b * BLOCK_S, (b + 1) * BLOCK_S) of head h: it computes their [BLOCK_S, E]
    logits tile logits[s, e] = sum_d x[s, h, d] * w[h*E + e, d] on tensor cores,
    keeps it in registers, and routes it with the same code as `_route_kernel`
    (`_route_rows`), writing probs and indices ([BLOCK_S, K] each) and, with
    WRITE_LOGITS, the fp32 logits tile (for the backward, and to gather the
    picked logits from unless FROM_TILE). Bulk (TMA) copies bring the x and
    weight slices: no per-element addresses in registers, and rows past S read
    as zeros (logits 0, no NaN arithmetic, nothing stored for them).

    Precision (docs/contract.md section 2, "computed in fp32, x upcast to fp32"): the fp32
    weight is split exactly into three bf16 parts (`_split_weight_kernel`), so
    w = w1 + w2 + w3 with no rounding; x is bf16, so every product x * w_i is
    exact in fp32 (8 x 8 significant bits), and the logit is an fp32 sum of the
    exact products x_d * w_d, each split into three terms. That is the fp32 dot
    product of the upcast x and w: only the order of the fp32 accumulation (and
    the tensor cores' rounding of its additions, which truncate) differs from
    cuBLAS's fp32 GEMM. So the logits are not bitwise cuBLAS's, but neither are
    cuBLAS's own across GPUs and library versions (its kernel, hence its
    summation order, is chosen per shape). The small parts go first (all of
    x @ w3 and x @ w2 over D, then x @ w1): their rounding errors are at 2^-8 of
    the logits' scale, so the result carries the rounding of one fp32 pass over
    D, as a plain fp32 dot product does (the interpreter: within D * 2^-24 *
    sum |x w| of the exact value, checked by the tests). What the library promises
    (docs/contract.md section 2), and the tests and benchmarks/bench_routing.py check
    against `route_reference`
    on torch's fp32 logits and on float64 logits: the same indices wherever the
    selection scores of adjacent picks (top K + 1) differ by more than 1e-6
    relative, probabilities within 1e-6 relative (for softmax, and the smallest
    sigmoid probabilities of K = E rows, within twice torch's own fp32 error).

    E is a power of two (the tile has no padding columns); BLOCK_D divides D.
    """
    b = tl.program_id(0)
    # ROUTE=False may split the experts: program (b, h * (E // BLOCK_N) + n) owns columns
    # [n * BLOCK_N, (n + 1) * BLOCK_N) of the tile. Routing needs whole rows: BLOCK_N == E.
    tl.static_assert(BLOCK_N > 0, "BLOCK_N must be passed (E, or a share of E when split)")
    NSPLIT: tl.constexpr = E // BLOCK_N
    h = tl.program_id(1) // NSPLIT
    n0 = (tl.program_id(1) % NSPLIT) * BLOCK_N
    s0 = b * BLOCK_S
    acc = tl.zeros([BLOCK_S, BLOCK_N], dtype=tl.float32)
    # x arrives as a 2D [BLOCK_S, BLOCK_D] box of [S, H * D], so both wgmma operands are
    # read from shared memory. A [BLOCK_S, 1, BLOCK_D] box of [S, H, D] needed a reshape,
    # after which Triton 3.6 kept x in registers as the A operand, and its pipelined loop
    # loaded the next x into those registers while the previous step's second wgmma was
    # still reading them (undefined in PTX): wrong logits now and then (docs/routing.md,
    # "The race in the logits kernel, and the SASS audit").
    for d0 in range(0, D, BLOCK_D):
        xt = x_desc.load([s0, h * D + d0])
        acc = _dot_exact(xt, w_desc.load([(2 * H + h) * E + n0, d0]).T, acc, INTERPRET)
        acc = _dot_exact(xt, w_desc.load([(H + h) * E + n0, d0]).T, acc, INTERPRET)
    for d0 in range(0, D, BLOCK_D):
        xt = x_desc.load([s0, h * D + d0])
        acc = _dot_exact(xt, w_desc.load([h * E + n0, d0]).T, acc, INTERPRET)

    rows = s0 + tl.arange(0, BLOCK_S)
    row_ok = rows < S
    # int64: H * S * E passes 2**31 at long sequences.
    row_base = logits_ptr + (h.to(tl.int64) * S + rows.to(tl.int64)) * E + n0
    if not ROUTE:
        if l_desc is not None:
            # Bulk (TMA) stores from shared memory: the warps hand the tile over and go
            # on, instead of holding their registers until each st.global has read them.
            # l_desc is logits [H, S, E] in [1, BLOCK_S, N] boxes: rows past S are clipped.
            if HALF_STORES and BLOCK_N >= 32:
                lo, hi = acc.reshape(BLOCK_S, 2, BLOCK_N // 2).permute(0, 2, 1).split()
                l_desc.store([h, s0, n0], lo.reshape(1, BLOCK_S, BLOCK_N // 2))
                l_desc.store([h, s0, n0 + BLOCK_N // 2], hi.reshape(1, BLOCK_S, BLOCK_N // 2))
            else:
                l_desc.store([h, s0, n0], acc.reshape(1, BLOCK_S, BLOCK_N))
        elif HALF_STORES and BLOCK_N >= 32:
            # Two stores of half the columns: the layout change before each store goes
            # through half the shared memory (in the wgmma layout a thread holds columns
            # of both halves, so the split itself moves nothing).
            lo, hi = acc.reshape(BLOCK_S, 2, BLOCK_N // 2).permute(0, 2, 1).split()
            half = tl.arange(0, BLOCK_N // 2)
            tl.store(row_base[:, None] + half[None, :], lo, mask=row_ok[:, None])
            tl.store(row_base[:, None] + (BLOCK_N // 2 + half)[None, :], hi,
                     mask=row_ok[:, None])
        else:
            tl.store(row_base[:, None] + tl.arange(0, BLOCK_N)[None, :], acc,
                     mask=row_ok[:, None])
        if COUNT_T > 0:
            # Block j of the counts is cleared by the programs whose tiles hold token
            # j * COUNT_T, each its own columns.
            NJ: tl.constexpr = (BLOCK_S + COUNT_T - 1) // COUNT_T  # powers of two: >= 1
            first = s0 + tl.arange(0, NJ) * COUNT_T
            clear = (first % COUNT_T == 0) & (first < S)
            row = (h * NB + first // COUNT_T).to(tl.int64)
            tl.store(counts_ptr + row[:, None] * E + n0 + tl.arange(0, BLOCK_N)[None, :],
                     tl.zeros([NJ, BLOCK_N], tl.int32), mask=clear[:, None])
        if SHORT > 0:
            _write_shortlist(acc, s0, h, tl.program_id(1) % NSPLIT, bias_ptr, short_ptr, S, E,
                             TOP_K, SHORT, BLOCK_S, BLOCK_N, HAS_BIAS, SIGMOID_APPROX_ERROR,
                             INTERPRET, MERGED)
    else:
        tl.static_assert(BLOCK_N == E, "routing needs whole rows")
        if WRITE_LOGITS:
            tl.store(row_base[:, None] + tl.arange(0, E)[None, :], acc, mask=row_ok[:, None])
            if not FROM_TILE:
                # The gathers of `_take_best` read logits that other threads wrote.
                tl.debug_barrier()
        _route_rows(acc, rows, row_base, h, bias_ptr, probs_ptr, indices_ptr, counts_ptr,
                    S, NB, group_size, norm_eps, route_scale, 1,
                    E, TOP_K, SOFTMAX, HAS_BIAS, ROUTE_NORM, NUM_GROUPS, TOPK_GROUPS,
                    BLOCK_S, E, BLOCK_K, BLOCK_G, COUNT_T, FROM_TILE, INTERPRET)


# ----------------------------------------------------------------------------- launchers


class LogitsRouteOutput(NamedTuple):
    """What `triton_logits_route` returns, whatever it was asked for.

    probs:        [H, S, K] float32, in selection order.
    indices:      [H, S, K] int64 in [0, E).
    logits:       [H, S, E] float32, the router logits; None unless return_logits.
    block_counts: [H, cdiv(S, T), E] int32 per-block expert counts (as `triton_route`'s);
                  None without count_block_t.
    """

    probs: torch.Tensor
    indices: torch.Tensor
    logits: torch.Tensor | None
    block_counts: torch.Tensor | None


FUSED_MAX_EXPERTS = 256  # the [block_s, E] register tile; larger E routes unfused


def logits_route_config(device: torch.device) -> LogitsRouteConfig:
    """The default tiles of the logits (+ route) kernel on `device` (`tuning.py`)."""
    return tuning.logits_route_config(device, interpreting())


def merged_lists(cfg: LogitsRouteConfig, top_k: int, short_n: int, block_n: int) -> bool:
    """Whether the logits kernel makes its shortlists by sorting networks
    (`_shortlist_merged`): asked by cfg.merged_lists, and possible (lists of short_n >
    top_k keys, fewer than a quarter of the block_n columns; short_n = 0: no lists)."""
    return cfg.merged_lists and top_k < short_n < block_n // 4


def fused_unsupported(x_heads: torch.Tensor, gate: torch.Tensor) -> str | None:
    """Why `triton_logits_route` cannot take these inputs, or None if it can.

    x_heads: [S, H, D] bfloat16 (its products with bf16 weight parts are exact in
    fp32; fp16 or fp32 x would not be); gate: [H, E, D] float32 with E a power of
    two in [16, 256] (the tile's columns, no padding; tl.dot needs N >= 16) and D
    a multiple of 16 (tl.dot needs K >= 16).
    """
    if x_heads.dim() != 3 or gate.dim() != 3:
        return (f"x_heads must be [S, H, D] and gate [H, E, D], got {tuple(x_heads.shape)} "
                f"and {tuple(gate.shape)}")
    _, H, D = x_heads.shape
    if gate.shape[0] != H or gate.shape[2] != D:
        return f"gate {tuple(gate.shape)} does not match x_heads {tuple(x_heads.shape)}"
    if x_heads.dtype != torch.bfloat16:
        return f"x must be bfloat16, got {x_heads.dtype}"
    if gate.dtype != torch.float32:
        return f"the router weight must be float32, got {gate.dtype}"
    E = gate.shape[1]
    if E < 16 or E > FUSED_MAX_EXPERTS or E & (E - 1):
        return f"E must be a power of two in [16, {FUSED_MAX_EXPERTS}], got {E}"
    if D < 16 or D % 16:
        return f"D must be a multiple of 16, got {D}"
    if x_heads.device != gate.device:
        return f"x_heads on {x_heads.device}, gate on {gate.device}"
    return None


def split_router_weight(gate: torch.Tensor) -> torch.Tensor:
    """gate: [..., D] float32 -> parts [3, gate.numel()] bfloat16, one launch.

    parts[0] + parts[1] + parts[2] == gate.flatten() exactly (see
    `_split_weight_kernel`): 3 x 8 significant bits hold fp32's 24, and bf16 has
    fp32's exponent range. 3072 x 256 weights: 3 MB read, 4.7 MB written.
    """
    w = gate.detach().contiguous().view(-1)
    parts = torch.empty(3, w.numel(), device=w.device, dtype=torch.bfloat16)
    if w.numel():
        block = tuning.SPLIT_WEIGHT_BLOCK
        _split_weight_kernel[(triton.cdiv(w.numel(), block),)](
            w, parts, w.numel(), BLOCK=block, num_warps=tuning.SPLIT_WEIGHT_WARPS)
    return parts


def triton_logits_route(
    x_heads: torch.Tensor,
    gate: torch.Tensor,
    options: RouterOptions,
    expert_bias: torch.Tensor | None = None,
    *,
    return_logits: bool = False,
    count_block_t: int | None = None,
    config: LogitsRouteConfig | None = None,
) -> LogitsRouteOutput:
    """Router logits and routing: the weight split, then one kernel for both (fused), or,
    with `config.split` (the sm_90 default), a logits kernel and a route kernel.

    x_heads: [S, H, D] bfloat16 (unit stride along D, else copied)
    gate: [H, E, D] float32, the router weight (logits = x_heads[s, h] . gate[h, e])
    expert_bias: [H, E] or [H*E] or None, selection only
    returns LogitsRouteOutput(probs [H, S, K] float32, indices [H, S, K] int64, logits
    [H, S, E] fp32 if return_logits else None, block_counts): the same as
    `triton_route(fp32 logits of x_heads and gate, ...)`, up to the order of the
    logits' fp32 accumulation (see `_logits_route_kernel`). No host sync.
    Inputs `fused_unsupported` refuses, and options that do not fit E, raise
    ValueError; the bias is assumed valid (`routing.route_tokens` checks it). config
    overrides the tiles (tests, tuning).

    count_block_t: block_counts as `triton_route`'s (split: the logits kernel zeroes
    them, the route kernel adds; fused: a memset, then the kernel adds).
    """
    reason = fused_unsupported(x_heads, gate)
    if reason is not None:
        raise ValueError(f"triton_logits_route: {reason}")
    S, H, D = x_heads.shape
    E = gate.shape[1]
    options.check(E, "triton_logits_route")
    top_k = options.top_k
    device = x_heads.device
    cfg = config or logits_route_config(device)
    write_logits = return_logits or not cfg.from_tile or cfg.split
    probs = torch.empty(H, S, top_k, device=device, dtype=torch.float32)
    indices = torch.empty(H, S, top_k, device=device, dtype=torch.int64)
    logits = torch.empty(H, S, E, device=device, dtype=torch.float32) if write_logits \
        else probs  # a placeholder pointer, never written
    counts = None
    if count_block_t is not None:
        # split: zeroed by the logits kernel (one launch less); fused: the kernel adds.
        counts = new_block_counts("triton_logits_route", H, S, E, count_block_t, device,
                                  zeroed=not (cfg.split and H and S))
    out = LogitsRouteOutput(probs, indices, logits if return_logits else None, counts)
    if H == 0 or S == 0:
        return out
    parts = split_router_weight(gate)
    bias = bias_arg(expert_bias, H, E, probs)
    block_d = min(cfg.block_d, D & -D)  # the largest power of two dividing D (>= 16)
    if x_heads.stride(2) != 1 or (H > 1 and x_heads.stride(1) != D) or \
            (x_heads.stride(0) * 2) % 16 or x_heads.data_ptr() % 16:
        # Viewed as [S, H * D] (see the kernel), with the 16-byte aligned row stride and
        # base that bulk copies need.
        x_heads = x_heads.contiguous()
    x_desc = TensorDescriptor.from_tensor(x_heads.view(S, H * D), [cfg.block_s, block_d])
    block_n = min(cfg.block_e or E, E) if cfg.split else E
    w_desc = TensorDescriptor.from_tensor(parts.view(3 * H * E, D), [block_n, block_d])
    count_t = count_block_t if counts is not None else 0
    short, short_n = None, 0
    if cfg.split and cfg.shortlist and options.score_func == "sigmoid" and \
            options.num_groups == 1 and top_k <= 16:
        short_n = shortlist_size(top_k, block_n)
        short = torch.empty(H, S, (E // block_n) * short_n, device=device, dtype=torch.int32)
    l_desc = None
    if cfg.split and cfg.tma_store:
        half = cfg.half_stores and block_n >= 32
        l_desc = TensorDescriptor.from_tensor(
            logits, [1, cfg.block_s, block_n // 2 if half else block_n])
    _logits_route_kernel[(triton.cdiv(S, cfg.block_s), H * (E // block_n))](
        x_desc, w_desc, logits, bias, probs, indices,
        probs if counts is None else counts,  # a placeholder pointer when not counting
        S, H, 0 if counts is None else counts.shape[1], max(E // options.num_groups, 1),
        float(options.norm_eps), float(options.route_scale),
        E=E, D=D, TOP_K=top_k, SOFTMAX=options.score_func == "softmax",
        HAS_BIAS=expert_bias is not None, ROUTE_NORM=bool(options.route_norm),
        NUM_GROUPS=options.num_groups, TOPK_GROUPS=options.topk_groups,
        BLOCK_S=cfg.block_s, BLOCK_D=block_d, BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_G=triton.next_power_of_2(options.num_groups), WRITE_LOGITS=write_logits,
        FROM_TILE=cfg.from_tile, INTERPRET=interpreting(), ROUTE=not cfg.split,
        COUNT_T=count_t, HALF_STORES=cfg.half_stores, BLOCK_N=block_n,
        l_desc=l_desc, short_ptr=short, SHORT=short_n,
        MERGED=merged_lists(cfg, top_k, short_n, block_n),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if short is not None:
        launch_shortlist_route(short, logits, options, expert_bias, probs, indices, counts,
                               count_t)
    elif cfg.split:
        launch_route(logits, options, expert_bias, probs, indices, counts, count_t)
    return out


def sm90_compile_cases() -> list:
    """The logits kernel at the sm_90 default tiles (`mhmoe.kernels.CompileCase`;
    MAGI-2's dims)."""
    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase

    D, E, K = M.head_dim, M.num_experts, M.top_k
    c = tuning.LOGITS_ROUTE_CONFIGS[(9, 0)]
    bn = min(c.block_e or E, E) if c.split else E
    tma_store = c.split and c.tma_store  # then the logits leave through a descriptor too
    store_n = bn // 2 if c.half_stores and bn >= 32 else bn
    short = shortlist_size(K, bn) if c.split and c.shortlist else 0
    merged = merged_lists(c, K, short, bn)
    return [CompileCase(
        f"logits {c.block_s}/{c.block_d}/{c.num_warps}/{c.num_stages} e{bn}"
        f"{' shortlists' if short else ''}{' merged' if merged else ''}",
        _logits_route_kernel,
        {"x_desc": f"tensordesc<bf16[{c.block_s}, {c.block_d}]>",
         "w_desc": f"tensordesc<bf16[{bn}, {c.block_d}]>", "logits_ptr": "*fp32",
         "bias_ptr": "*fp32", "probs_ptr": "*fp32", "indices_ptr": "*i64",
         "counts_ptr": "*i32", "S": "i32", "H": "i32", "NB": "i32", "group_size": "i32",
         "norm_eps": "fp32", "route_scale": "fp32",
         **({"l_desc": f"tensordesc<fp32[1, {c.block_s}, {store_n}]>"} if tma_store else {}),
         **({"short_ptr": "*i32"} if short else {})},
        dict(E=E, D=D, TOP_K=K, SOFTMAX=False, HAS_BIAS=True, ROUTE_NORM=True, NUM_GROUPS=1,
             TOPK_GROUPS=1, BLOCK_S=c.block_s, BLOCK_D=c.block_d,
             BLOCK_K=triton.next_power_of_2(K), BLOCK_G=1, WRITE_LOGITS=True,
             FROM_TILE=c.from_tile, INTERPRET=False, ROUTE=not c.split,
             COUNT_T=tuning.layout_block_t(K), HALF_STORES=c.half_stores, BLOCK_N=bn,
             SHORT=short, MERGED=merged),
        c.num_warps, c.num_stages, ("S",))]
