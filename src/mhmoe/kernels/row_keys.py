"""Content keys of (token, head) rows: the order deterministic mode sums tokens in.

    keys = triton_row_keys(x_heads, grad_y)          # [S, H, Wa], [S, H, Wb] -> [H, S] int64

A weight gradient is a sum over tokens. Summed in token order, it changes (by rounding)
when the tokens are permuted. Deterministic mode instead sums each expert's tokens in
the order of a key computed from the bits of the rows being multiplied: the same rows
give the same key wherever they sit in the batch, so the order, and with it every bit
of the sum, is independent of the token order. Rows with equal keys are, but for a
hash collision (about 2^-63 for a pair), equal rows: their contributions are equal and
their order does not matter.

The key of row (s, h) reads the element bits of a[s, h, :] then b[s, h, :] as one row of
W = Wa + Wb columns (an 8-byte element counts as two 32-bit columns). Element c with
bits v (zero-extended to 32 bits) becomes
z = (v + c * STEP) mod 2^32, and z goes through two independent 32-bit mixers; each
mixer's outputs are summed over the row (so the key does not depend on how the row is
split into blocks), and the two sums give the key's high 31 and low 32 bits. Every
intermediate value is a non-negative int64 below 2^63, so the PyTorch twin
(`reference.row_keys_reference`) computes the same integers with no overflow.

Grid: (cdiv(S * H, BLOCK_R),); program p owns rows r = s * H + h in
[p * BLOCK_R, (p + 1) * BLOCK_R) and loops over their columns in blocks of BLOCK_C.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import (
    ROW_KEY_MIXERS,
    ROW_KEY_STEP,
    check_row_key_inputs,
    integer_view,
)
from . import tuning
from .tuning import interpreting

# The twin's constants (one definition, so that both compute the same integers).
_STEP = tl.constexpr(ROW_KEY_STEP)
_A = ROW_KEY_MIXERS[0]
_B = ROW_KEY_MIXERS[1]
_A_SEED, _A_MUL1, _A_MUL2 = tl.constexpr(_A[0]), tl.constexpr(_A[1]), tl.constexpr(_A[2])
_A_S1, _A_S2, _A_S3 = tl.constexpr(_A[3]), tl.constexpr(_A[4]), tl.constexpr(_A[5])
_B_SEED, _B_MUL1, _B_MUL2 = tl.constexpr(_B[0]), tl.constexpr(_B[1]), tl.constexpr(_B[2])
_B_S1, _B_S2, _B_S3 = tl.constexpr(_B[3]), tl.constexpr(_B[4]), tl.constexpr(_B[5])


@triton.jit
def _mix(z, seed: tl.constexpr, mul1: tl.constexpr, mul2: tl.constexpr, s1: tl.constexpr,
         s2: tl.constexpr, s3: tl.constexpr):
    z = z ^ seed
    z = ((z ^ (z >> s1)) * mul1) & 0xFFFFFFFF
    z = ((z ^ (z >> s2)) * mul2) & 0xFFFFFFFF
    return z ^ (z >> s3)


@triton.jit
def _block_sums(ptr, rows_off, row_ok, c, width, col0, bits_mask):
    """The two mixers' sums over one block of columns c (< width) of the rows at
    ptr + rows_off, which are columns col0 + c of the key's row."""
    ok = row_ok[:, None] & (c < width)[None, :]
    v = tl.load(ptr + rows_off[:, None] + c[None, :], mask=ok, other=0)
    v = v.to(tl.int64) & bits_mask
    z = (v + (col0 + c).to(tl.int64)[None, :] * _STEP) & 0xFFFFFFFF
    za = _mix(z, _A_SEED, _A_MUL1, _A_MUL2, _A_S1, _A_S2, _A_S3)
    zb = _mix(z, _B_SEED, _B_MUL1, _B_MUL2, _B_S1, _B_S2, _B_S3)
    return tl.sum(tl.where(ok, za, 0), axis=1), tl.sum(tl.where(ok, zb, 0), axis=1)


@triton.jit
def _row_keys_kernel(a_ptr, b_ptr, keys_ptr, S, H, a_ss, a_sh, b_ss, b_sh,
                     Wa: tl.constexpr, Wb: tl.constexpr, A_BITS: tl.constexpr, B_BITS: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """keys[h, s] of rows r = s * H + h (a, b: integer views of the rows' elements,
    last dimension contiguous; strides in elements)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < S * H
    s = (r // H).to(tl.int64)
    h = (r % H).to(tl.int64)
    sum_a = tl.zeros([BLOCK_R], dtype=tl.int64)
    sum_b = tl.zeros([BLOCK_R], dtype=tl.int64)
    for c0 in range(0, Wa, BLOCK_C):
        da, db = _block_sums(a_ptr, s * a_ss + h * a_sh, row_ok, c0 + tl.arange(0, BLOCK_C),
                             Wa, 0, (1 << A_BITS) - 1)
        sum_a += da
        sum_b += db
    for c0 in range(0, Wb, BLOCK_C):
        da, db = _block_sums(b_ptr, s * b_ss + h * b_sh, row_ok, c0 + tl.arange(0, BLOCK_C),
                             Wb, Wa, (1 << B_BITS) - 1)
        sum_a += da
        sum_b += db
    key = ((sum_a & 0x7FFFFFFF) << 32) | (sum_b & 0xFFFFFFFF)
    tl.store(keys_ptr + h * S + s, key, mask=row_ok)


def triton_row_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """keys [H, S] int64 of the rows (a[s, h, :], b[s, h, :]) (see the module docstring).

    a: [S, H, Wa], b: [S, H, Wb], any real element types of 1, 2, 4 or 8 bytes, any
    strides (a transposed [H, S, W] view is read in place where its last dimension is
    contiguous, else copied).
    Works on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1.
    """
    S, H = check_row_key_inputs(a, b)
    keys = torch.empty(H, S, dtype=torch.int64, device=a.device)
    if S * H == 0:
        return keys
    a, a_bits = integer_view(a if a.stride(2) == 1 else a.contiguous())
    b, b_bits = integer_view(b if b.stride(2) == 1 else b.contiguous())
    block_r, block_c = tuning.row_keys_tiles(interpreting())
    grid = (triton.cdiv(S * H, block_r),)
    # The widths are compile-time constants (a layer's D and E): the interpreter cannot
    # range() over a runtime argument.
    _row_keys_kernel[grid](a, b, keys, S, H, a.stride(0), a.stride(1), b.stride(0),
                           b.stride(1), Wa=a.shape[2], Wb=b.shape[2], A_BITS=a_bits,
                           B_BITS=b_bits, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return keys


def sm90_compile_cases() -> list:
    """The key kernel at its GPU tiles and MAGI-2's widths, for both pairs it hashes:
    x with dy (bf16, bf16) and x with the router's d logits (bf16, fp32)
    (`mhmoe.kernels.CompileCase`)."""
    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase

    block_r, block_c = tuning.row_keys_tiles(False)
    widths = {"x, dy": (M.head_dim, "*i16", 16), "x, d logits": (M.num_experts, "*i32", 32)}
    return [CompileCase(
        f"row keys {block_r}/{block_c} ({pair})", _row_keys_kernel,
        {"a_ptr": "*i16", "b_ptr": b_type, "keys_ptr": "*i64", "S": "i32", "H": "i32",
         "a_ss": "i32", "a_sh": "i32", "b_ss": "i32", "b_sh": "i32"},
        dict(Wa=M.head_dim, Wb=wb, A_BITS=16, B_BITS=b_bits, BLOCK_R=block_r,
             BLOCK_C=block_c),
        4, 1, ("a_ss", "a_sh", "b_ss", "b_sh"))
        for pair, (wb, b_type, b_bits) in widths.items()]
