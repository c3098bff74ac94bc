"""Content keys (kernels/row_keys.py): the kernel against its PyTorch twin
(mhmoe.reference.row_keys_reference), bitwise; the twin against the formula worked out
with Python integers; what the keys are for (equal rows, equal keys; different rows,
different keys; independent of where a row sits); invalid input.

Without a GPU the kernel runs in the Triton interpreter (tests/conftest.py).
"""

import pytest
import torch

pytest.importorskip("triton")

from mhmoe.kernels.row_keys import triton_row_keys
from mhmoe.reference import ROW_KEY_MIXERS, ROW_KEY_STEP, row_keys_reference
from mhmoe.routing import content_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _key_by_hand(words: list[int]) -> int:
    """The key of one row from its elements' bits (zero-extended), in Python integers."""
    sums = []
    for seed, mul1, mul2, s1, s2, s3 in ROW_KEY_MIXERS:
        total = 0
        for c, v in enumerate(words):
            z = ((v + c * ROW_KEY_STEP) % 2**32) ^ seed
            z = ((z ^ (z >> s1)) * mul1) % 2**32
            z = ((z ^ (z >> s2)) * mul2) % 2**32
            total += z ^ (z >> s3)
        sums.append(total)
    return (sums[0] % 2**31) * 2**32 + sums[1] % 2**32


def test_twin_matches_the_formula_by_hand(rng):
    # bf16 then fp32 columns; the bits read unsigned (negative numbers set the top bit)
    a = torch.randn(2, 3, 5, generator=rng).to(torch.bfloat16)
    b = torch.randn(2, 3, 4, generator=rng)
    keys = row_keys_reference(a, b)
    assert keys.shape == (3, 2) and keys.dtype == torch.int64
    for s in range(2):
        for h in range(3):
            words = ([int(v) % 2**16 for v in a[s, h].view(torch.int16)] +
                     [int(v) % 2**32 for v in b[s, h].view(torch.int32)])
            assert int(keys[h, s]) == _key_by_hand(words), (s, h)


def test_float64_reads_two_words_an_element(rng):
    a = torch.randn(1, 1, 3, dtype=torch.float64, generator=rng)
    b = torch.zeros(1, 1, 0, dtype=torch.float32)
    words = [int(v) % 2**32 for v in a[0, 0].view(torch.int32)]
    assert int(row_keys_reference(a, b)[0, 0]) == _key_by_hand(words)


@pytest.mark.parametrize("S,H,Wa,Wb,da,db", [
    (37, 3, 32, 16, torch.bfloat16, torch.float32),   # MAGI-2's pair: x rows, d logits rows
    (5, 1, 100, 7, torch.float16, torch.bfloat16),    # widths not powers of two, one head
    (1, 2, 300, 1, torch.float32, torch.float64),     # S = 1; a row wider than a tile
    (0, 2, 4, 4, torch.bfloat16, torch.bfloat16),     # S = 0
])
def test_kernel_matches_twin(rng, S, H, Wa, Wb, da, db):
    a = (torch.randn(S, H, Wa, generator=rng) * 3).to(da)
    # b as the router backward passes d logits: an [H, S, W] tensor seen as [S, H, W]
    b = (torch.randn(H, S, Wb, generator=rng) * 3).to(db).transpose(0, 1)
    got = triton_row_keys(a.to(DEVICE), b.to(DEVICE)).cpu()
    want = row_keys_reference(a, b)
    assert got.shape == (H, S) and torch.equal(got, want)
    assert (want >= 0).all()
    assert torch.equal(content_keys(a.to(DEVICE), b.to(DEVICE)).cpu(), want)


def test_keys_follow_the_rows_not_their_place(rng):
    S, H = 40, 2
    a = torch.randn(S, H, 16, generator=rng).to(torch.bfloat16)
    b = torch.randn(S, H, 8, generator=rng).to(torch.bfloat16)
    a[7] = a[3]  # token 7 repeats token 3
    b[7] = b[3]
    keys = row_keys_reference(a, b)
    assert torch.equal(keys[:, 7], keys[:, 3])
    others = torch.cat([keys[:, :7], keys[:, 8:]], dim=1)
    assert others.flatten().unique().numel() == others.numel()  # distinct rows, distinct keys
    perm = torch.randperm(S, generator=rng)
    assert torch.equal(row_keys_reference(a[perm], b[perm]), keys[:, perm])
    # one bit anywhere changes the key, including between a's last column and b's first
    flipped = b.clone()
    flipped[0, 0, 0] = -flipped[0, 0, 0]
    assert row_keys_reference(a, flipped)[0, 0] != keys[0, 0]
    row = torch.cat([a, b], 2)  # the same row split elsewhere: only its content counts
    assert torch.equal(row_keys_reference(row[:, :, :15], row[:, :, 15:]), keys)


def test_the_op_the_compiled_router_backward_calls(rng):
    # torch.compile traces the router's backward: the CUDA keys run behind an op
    # (opaque, with a fake implementation); here its body runs in the interpreter.
    from mhmoe.routing import _row_keys_triton_op

    a = torch.randn(6, 2, 16, generator=rng).to(torch.bfloat16)
    b = torch.randn(2, 6, 16, generator=rng).transpose(0, 1)
    torch.library.opcheck(_row_keys_triton_op, (a, b))
    assert torch.equal(_row_keys_triton_op(a, b), row_keys_reference(a, b))


def test_chunking_does_not_change_keys(rng):
    a = torch.randn(9, 2, 8, generator=rng)
    b = torch.randn(9, 2, 8, generator=rng)
    assert torch.equal(row_keys_reference(a, b, chunk_rows=5), row_keys_reference(a, b))


def test_rejects_bad_input():
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match=r"\[S, H, Wa\]"):
        row_keys_reference(x, torch.zeros(4, 3, 8))
    with pytest.raises(ValueError, match=r"\[S, H, Wa\]"):
        triton_row_keys(x[0], x)
    with pytest.raises(ValueError, match="real elements"):
        row_keys_reference(x, torch.zeros(4, 2, 8, dtype=torch.complex64))
    with pytest.raises(ValueError, match="columns"):
        row_keys_reference(torch.zeros(1, 1, 2**20), torch.zeros(1, 1, 1))

