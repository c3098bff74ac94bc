"""The CPU suite's speed-ups of Triton's interpreter (tests/conftest.py) against torch.

conftest replaces three pieces of the interpreter with faster ones of the same meaning:
the xor reduction (which tl.flip, tl.sort and tl.bitonic_merge use), the language patching
on each @triton.jit helper call, and the numpy dtype table. A kernel built from those
pieces, run in the interpreter, must still give torch's sort, flip and xor.
"""

import functools
import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="checks the interpreter's patches")


@triton.jit
def _flipped(x):
    return tl.flip(x, 1)


@triton.jit
def _probe_kernel(x_ptr, sort_ptr, flip_ptr, xor_ptr, half_ptr, R: tl.constexpr,
                  C: tl.constexpr):
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    x = tl.load(x_ptr + rows[:, None] * C + cols[None, :])
    tl.store(sort_ptr + rows[:, None] * C + cols[None, :], tl.sort(x, 1, descending=True))
    tl.store(flip_ptr + rows[:, None] * C + cols[None, :], _flipped(x))  # a helper call
    tl.store(xor_ptr + rows, tl.xor_sum(x, 1))
    h = (x % 2048).to(tl.float16) * 0.5  # a dtype the table maps, through a cast
    tl.store(half_ptr + rows[:, None] * C + cols[None, :], h)


def test_patched_interpreter_sorts_flips_and_xors_as_torch(rng):
    from triton.runtime import interpreter

    # the replacements are the ones in force (a rename in Triton would drop them silently)
    for patched in (interpreter.ReduceOps.apply_impl, interpreter.InterpretedFunction.__call__,
                    interpreter._get_np_dtype):
        assert patched.__module__ == "conftest", patched
    R, C = 8, 64
    x = torch.randint(-2**30, 2**30, (R, C), generator=rng, dtype=torch.int32)
    x[0, :] = 7  # ties
    x[1, ::2] = x[1, 1::2]
    out = [torch.empty_like(x) for _ in range(2)]
    xor = torch.empty(R, dtype=torch.int32)
    half = torch.empty(R, C, dtype=torch.float16)
    _probe_kernel[(1,)](x, *out, xor, half, R=R, C=C)
    assert torch.equal(out[0], torch.sort(x, 1, descending=True).values)
    assert torch.equal(out[1], torch.flip(x, (1,)))
    want = torch.tensor([functools.reduce(lambda a, b: a ^ b, row.tolist()) for row in x],
                        dtype=torch.int32)
    assert torch.equal(xor, want)
    assert torch.equal(half, torch.fmod(x, 2048).to(torch.float16) * 0.5)  # C-style %
    # the launch put the language back (helpers skipped patching, not restoring)
    assert tl.core.is_builtin(tl.arange)
