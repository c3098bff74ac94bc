"""The router logits' backward on tensor cores: d x and d gate of logits = x . gate^T.

    dx = triton_router_dx(grad, gate, x_heads)            # [S, H, D] in x's dtype
    dgate = triton_router_dgate(grad, x_heads, order)     # [H, E, D] fp32

grad is d logits [H, S, E] fp32, gate the fp32 router weight [H, E, D], x_heads the bf16
x [S, H, D]. In PyTorch both are fp32 GEMMs, which on an H200 run on the SIMT units
(their cost against these kernels: docs/routing.md, "The router's backward on tensor
cores"). Here they are bf16 tensor-core dots whose operands are exact pieces of the fp32
values (`split_bf16x3`, each fp32 value the exact sum of three bf16 values), so every
product of pieces is exact in the fp32 accumulator:

- d gate = grad^T x: x is exact in bf16, so the three pieces of grad give every product
  grad * x exactly (three dots): the fp32 GEMM's products, summed in fp32.
- dx = grad gate: both operands are fp32. Six of the pieces' nine cross terms (all but
  g2 w3, g3 w2 and g3 w3: the pieces are truncations, |g2| < 2^-7 |g| and |g3| <
  2^-15 |g|, so the three left out come to less than 2^-21 of the product) give each
  product to within a few of fp32's roundings (six dots; three, g1 w1 + g1 w2 + g2 w1,
  would leave up to ~2^-13 of each product, which a sum with cancellation turns into far
  more than fp32's error of the result). The result is rounded to x's dtype, as the
  PyTorch path rounds its fp32 one.

`_router_dgate_kernel` sums over tokens. Its grid splits each head's S rows into P
chunks of whole blocks, written apart and added in chunk order (`triton_router_dgate`);
P and the chunks follow from S alone (`tuning.router_dgate_chunks`), not from the number
of heads or the GPU, so every sum has a fixed order: run to run bitwise, and a head's d
gate the same whichever heads share the launch. Within a chunk each block's three dots
start from zero and the block is added to the chunk's sum with an fp32 add: the tensor
cores' accumulation truncates, and a chain of thousands of wgmma steps would carry that
into the result (~5e-5 relative, emulated), where this keeps fp32's rounding. With
`order` (deterministic mode: each head's tokens by content key, `routing.content_keys`)
the rows are read in that order, and the sums are also bitwise independent of where the
tokens sit in the batch.

Grids: dx (cdiv(S, BLOCK_S), H, cdiv(D, BLOCK_D)), program (b, h, n) owns dx[b-th block
of tokens, h, n-th block of D]; d gate (cdiv(E, BLOCK_E), cdiv(D, BLOCK_D), H * P),
program (m, n, h * P + p) owns the [BLOCK_E, BLOCK_D] tile (m, n) of head h's d gate over
chunk p of its rows. Tiles: `tuning.router_backward_config`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .router_logits import _dot_exact, split_bf16x3, split_router_weight
from .tuning import interpreting


@triton.jit
def _router_dx_kernel(
    grad_ptr, g_sh, g_ss,  # d logits [H, S, E] fp32, unit stride along E
    parts_ptr, N,  # the gate's bf16 pieces [3, N = H*E*D] (split_router_weight)
    dx_ptr, dx_ss, dx_sh,  # dx [S, H, D], unit stride along D
    S, E: tl.constexpr, D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """dx[s, h, :] = sum_e grad[h, s, e] * gate[h, e, :] (see the module docstring)."""
    h = tl.program_id(1)
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_ok = s < S
    d_ok = d < D
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for e0 in range(0, E, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_ok = e < E
        g = tl.load(grad_ptr + h.to(tl.int64) * g_sh + s[:, None].to(tl.int64) * g_ss
                    + e[None, :],
                    mask=s_ok[:, None] & e_ok[None, :], other=0.0)
        g1, g2, g3 = split_bf16x3(g)
        w = parts_ptr + (h * E + e)[:, None].to(tl.int64) * D + d[None, :]
        w_ok = e_ok[:, None] & d_ok[None, :]
        w1 = tl.load(w, mask=w_ok, other=0.0)
        w2 = tl.load(w + N, mask=w_ok, other=0.0)
        w3 = tl.load(w + 2 * N, mask=w_ok, other=0.0)
        # The small terms first.
        acc = _dot_exact(g2, w2, acc, INTERPRET)
        acc = _dot_exact(g3, w1, acc, INTERPRET)
        acc = _dot_exact(g1, w3, acc, INTERPRET)
        acc = _dot_exact(g2, w1, acc, INTERPRET)
        acc = _dot_exact(g1, w2, acc, INTERPRET)
        acc = _dot_exact(g1, w1, acc, INTERPRET)
    out = dx_ptr + s[:, None].to(tl.int64) * dx_ss + h.to(tl.int64) * dx_sh + d[None, :]
    if INTERPRET and dx_ptr.dtype.element_ty == tl.bfloat16:
        # The interpreter's cast to bf16 truncates; round to nearest even on the bits
        # first, as the GPU's cast does (finite values), then the cast is exact.
        bits = acc.to(tl.uint32, bitcast=True)
        acc = ((bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000).to(tl.float32,
                                                                       bitcast=True)
    tl.store(out, acc.to(dx_ptr.dtype.element_ty), mask=s_ok[:, None] & d_ok[None, :])


@triton.jit
def _dgate_block(grad_ptr, g_sh, g_ss, x_ptr, x_ss, x_sh, order_ptr, h, i, stop, e, e_ok, d,
                 d_ok, acc, S, BLOCK_S: tl.constexpr, ORDERED: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """acc + the rows i .. i + BLOCK_S - 1 (below stop) of head h's sum, in `order` if
    ORDERED: the block's products summed from zero, then added to acc in fp32."""
    r = i + tl.arange(0, BLOCK_S)
    r_ok = r < stop
    if ORDERED:
        tok = tl.load(order_ptr + h.to(tl.int64) * S + r, mask=r_ok, other=0)
    else:
        tok = r.to(tl.int64)
    g = tl.load(grad_ptr + h.to(tl.int64) * g_sh + tok[:, None] * g_ss + e[None, :],
                mask=r_ok[:, None] & e_ok[None, :], other=0.0)
    x = tl.load(x_ptr + tok[:, None] * x_ss + h.to(tl.int64) * x_sh + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    g1, g2, g3 = split_bf16x3(g)
    block = _dot_exact(tl.trans(g3), x, tl.zeros(acc.shape, tl.float32), INTERPRET)
    block = _dot_exact(tl.trans(g2), x, block, INTERPRET)
    return acc + _dot_exact(tl.trans(g1), x, block, INTERPRET)


@triton.jit
def _router_dgate_kernel(
    grad_ptr, g_sh, g_ss,  # d logits [H, S, E] fp32, unit stride along E
    x_ptr, x_ss, x_sh,  # x_heads [S, H, D] bf16, unit stride along D
    order_ptr,  # ORDERED: [H, S] int64, each head's rows in summation order
    part_ptr,  # fp32 [P, H, E, D]: each chunk's sum
    S, chunk, P,  # rows a chunk (a multiple of BLOCK_S), chunks a head
    H, E: tl.constexpr, D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
    ORDERED: tl.constexpr, INTERPRET: tl.constexpr,
):
    """part[p, h, e, :] = sum over chunk p of head h's rows s of grad[h, s, e] * x[s, h, :]
    (see the module docstring)."""
    h = tl.program_id(2) // P
    p = tl.program_id(2) % P
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    e_ok = e < E
    d_ok = d < D
    acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    start = p * chunk
    stop = tl.minimum(start + chunk, S)
    if INTERPRET:
        # The interpreter cannot range() over a runtime integer; the same steps in order.
        i = start
        while i < stop:
            acc = _dgate_block(grad_ptr, g_sh, g_ss, x_ptr, x_ss, x_sh, order_ptr, h, i, stop,
                               e, e_ok, d, d_ok, acc, S, BLOCK_S, ORDERED, INTERPRET)
            i += BLOCK_S
    else:
        for i in range(start, stop, BLOCK_S):
            acc = _dgate_block(grad_ptr, g_sh, g_ss, x_ptr, x_ss, x_sh, order_ptr, h, i, stop,
                               e, e_ok, d, d_ok, acc, S, BLOCK_S, ORDERED, INTERPRET)
    out = part_ptr + ((p * H + h) * E + e)[:, None].to(tl.int64) * D + d[None, :]
    tl.store(out, acc, mask=e_ok[:, None] & d_ok[None, :])


def check_router_backward_inputs(grad: torch.Tensor, x_heads: torch.Tensor,
                                 gate: torch.Tensor | None = None) -> None:
    """ValueError unless grad is fp32 [H, S, E], x_heads [S, H, D] (bf16 for d gate,
    whose exact products need it: gate None) and gate (if given) fp32 [H, E, D], all on
    one device."""
    if grad.dim() != 3 or x_heads.dim() != 3:
        raise ValueError("router backward: grad must be [H, S, E] and x_heads [S, H, D], got "
                         f"{tuple(grad.shape)} and {tuple(x_heads.shape)}")
    H, S, E = grad.shape
    if x_heads.shape[:2] != (S, H):
        raise ValueError(f"router backward: x_heads {tuple(x_heads.shape)} does not match "
                         f"grad {tuple(grad.shape)} ([S, H, D] against [H, S, E])")
    if grad.dtype != torch.float32:
        raise ValueError(f"router backward: grad must be fp32, got {grad.dtype}")
    if gate is None and x_heads.dtype != torch.bfloat16:
        raise ValueError(f"router backward: d gate takes bf16 x_heads, got {x_heads.dtype}")
    if not x_heads.dtype.is_floating_point:
        raise ValueError(f"router backward: x_heads must be a float tensor, got "
                         f"{x_heads.dtype}")
    if gate is not None and (gate.dtype != torch.float32
                             or tuple(gate.shape) != (H, E, x_heads.shape[2])):
        raise ValueError(f"router backward: gate must be fp32 [H, E, D] = "
                         f"{[H, E, x_heads.shape[2]]}, got {gate.dtype} {tuple(gate.shape)}")
    devices = {t.device for t in (grad, x_heads) + ((gate,) if gate is not None else ())}
    if len(devices) > 1:
        raise ValueError(f"router backward: inputs on several devices {sorted(map(str, devices))}")


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def triton_router_dx(grad: torch.Tensor, gate: torch.Tensor,
                     x_heads: torch.Tensor) -> torch.Tensor:
    """dx [S, H, D] in x_heads' dtype of logits = x . gate^T, from grad = d logits
    [H, S, E] fp32 and the fp32 gate [H, E, D] (x_heads gives the shape and dtype).
    Works on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1."""
    check_router_backward_inputs(grad, x_heads, gate)
    H, S, E = grad.shape
    D = gate.shape[2]
    dx = torch.empty(S, H, D, dtype=x_heads.dtype, device=x_heads.device)
    if S * H * D == 0:
        return dx
    if E == 0:
        return dx.zero_()
    grad = _unit_stride(grad)
    parts = split_router_weight(gate)
    cfg = tuning.router_backward_config(interpreting())
    grid = (triton.cdiv(S, cfg.block_s), H, triton.cdiv(D, cfg.block_d))
    _router_dx_kernel[grid](grad, grad.stride(0), grad.stride(1), parts, parts.shape[1], dx,
                            dx.stride(0), dx.stride(1), S, E=E, D=D, BLOCK_S=cfg.block_s,
                            BLOCK_E=cfg.block_e, BLOCK_D=cfg.block_d,
                            INTERPRET=interpreting(), num_warps=cfg.num_warps,
                            num_stages=cfg.num_stages)
    return dx


def triton_router_dgate(grad: torch.Tensor, x_heads: torch.Tensor,
                        order: torch.Tensor | None = None) -> torch.Tensor:
    """d gate [H, E, D] fp32 of logits = x . gate^T, from grad = d logits [H, S, E] fp32
    and the bf16 x_heads [S, H, D]: each head's tokens summed in a fixed order, that of
    `order` ([H, S] int64, a permutation of each head's tokens) where given, else
    ascending (see the module docstring; `order` is read as given: values outside
    [0, S) read outside the tensors). Works on CUDA tensors, and on CPU tensors under
    TRITON_INTERPRET=1."""
    check_router_backward_inputs(grad, x_heads)
    H, S, E = grad.shape
    D = x_heads.shape[2]
    if order is not None and (tuple(order.shape) != (H, S) or order.dtype != torch.int64
                              or order.device != grad.device):
        raise ValueError(f"triton_router_dgate: order must be int64 [H, S] = {[H, S]} on "
                         f"{grad.device}, got {order.dtype} {tuple(order.shape)} on "
                         f"{order.device}")
    if S == 0 or H * E * D == 0:
        return torch.zeros(H, E, D, dtype=torch.float32, device=grad.device)
    grad, x_heads = _unit_stride(grad), _unit_stride(x_heads)
    cfg = tuning.router_backward_config(interpreting())
    P, chunk = tuning.router_dgate_chunks(S, cfg)
    part = torch.empty(P, H, E, D, dtype=torch.float32, device=grad.device)
    ordered = order is not None
    grid = (triton.cdiv(E, cfg.block_e), triton.cdiv(D, cfg.block_d), H * P)
    _router_dgate_kernel[grid](grad, grad.stride(0), grad.stride(1), x_heads,
                               x_heads.stride(0), x_heads.stride(1),
                               order.contiguous() if ordered else grad, part, S, chunk, P, H,
                               E=E, D=D, BLOCK_S=cfg.block_s, BLOCK_E=cfg.block_e,
                               BLOCK_D=cfg.block_d, ORDERED=ordered,
                               INTERPRET=interpreting(), num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages)
    # The chunks in order: a fixed sum.
    dgate = part[0]
    for p in range(1, P):
        dgate = dgate + part[p]
    return dgate


def sm90_compile_cases() -> list:
    """Both kernels at their GPU tiles and MAGI-2's shapes, d gate in both orders
    (`mhmoe.kernels.CompileCase`)."""
    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase

    cfg = tuning.router_backward_config(False)
    E, D = M.num_experts, M.head_dim
    tiles = dict(BLOCK_S=cfg.block_s, BLOCK_E=cfg.block_e, BLOCK_D=cfg.block_d,
                 INTERPRET=False)
    strides = ("g_sh", "g_ss", "x_ss", "x_sh", "dx_ss", "dx_sh")
    cases = [CompileCase(
        f"router dx {cfg.block_s}/{cfg.block_e}/{cfg.block_d}", _router_dx_kernel,
        {"grad_ptr": "*fp32", "g_sh": "i32", "g_ss": "i32", "parts_ptr": "*bf16", "N": "i32",
         "dx_ptr": "*bf16", "dx_ss": "i32", "dx_sh": "i32", "S": "i32"},
        dict(E=E, D=D, **tiles), cfg.num_warps, cfg.num_stages,
        tuple(k for k in strides if k.startswith(("g_", "dx_"))))]
    for ordered in (False, True):
        cases.append(CompileCase(
            f"router d gate {cfg.block_s}/{cfg.block_e}/{cfg.block_d}"
            f"{' ordered' if ordered else ''}", _router_dgate_kernel,
            {"grad_ptr": "*fp32", "g_sh": "i32", "g_ss": "i32", "x_ptr": "*bf16", "x_ss": "i32",
             "x_sh": "i32", "order_ptr": "*i64" if ordered else "*fp32", "part_ptr": "*fp32",
             "S": "i32", "chunk": "i32", "P": "i32", "H": "i32"},
            dict(E=E, D=D, ORDERED=ordered, **tiles), cfg.num_warps, cfg.num_stages,
            tuple(k for k in strides if k.startswith(("g_", "x_")))))
    return cases
