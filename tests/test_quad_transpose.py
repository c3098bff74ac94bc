"""The Gluon panel kernel's stores of bf16 pairs through lane exchanges (inline PTX): the
quad transpose before 16-byte stores (`expert_panels_sm90._QUAD_TRANSPOSE_STORE`) and
the pair swap before 8-byte ones (`_PAIR_SWAP_STORE`), run lane by lane on the CPU.

The GPU tests (`test_gpu.py::test_split_backward_and_gluon_panel_kernel`,
`test_gluon_panel_kernel_variants`) check the kernel's panels bitwise against the Triton
path; this checks the PTX text itself on every CPU run: a small interpreter of the
instructions it uses (anything else fails), over the 32 lanes of a warp, with shuffles
reading the other lanes' registers.
"""

from __future__ import annotations

import re

import pytest

from mhmoe.kernels import expert_panels_sm90


def _operands(text: str) -> list[str]:
    return [a.strip() for a in re.split(r",(?![^{]*})", text)]


def run_warp(asm: str, inputs: list[list], operands: int):
    """Runs `asm` on 32 lanes. inputs[lane][i] is the value of $(1 + i) (the output is $0).
    Returns, per lane, the list of (address, values) of its st.global stores; an address
    `[$k+N]` is (the value of $k, N)."""
    body = [line.strip().rstrip(";") for line in asm.strip().strip("{}").splitlines()]
    body = [line for line in body if line and not line.startswith(".reg")]
    regs = [{f"${i + 1}": inputs[lane][i] for i in range(operands)} for lane in range(32)]
    stores: list[list] = [[] for _ in range(32)]

    def value(lane, x):
        if x in regs[lane]:
            return regs[lane][x]
        if x == "%laneid":
            return lane
        return int(x, 0)

    for line in body:
        op, rest = line.split(None, 1)
        args = _operands(rest)
        if op in ("shfl.sync.idx.b32", "shfl.sync.bfly.b32"):
            dst, src, lane_of, clamp, mask = args
            assert (clamp, mask) == ("31", "-1"), line  # whole warp, no segments
            sent = [regs[lane][src] for lane in range(32)]
            for lane in range(32):
                other = value(lane, lane_of) if op.endswith("idx.b32") \
                    else lane ^ value(lane, lane_of)
                regs[lane][dst] = sent[other & 31]
            continue
        for lane in range(32):
            r = regs[lane]
            if op in ("mov.u32", "mov.b32"):
                r[args[0]] = value(lane, args[1])
            elif op == "and.b32":
                r[args[0]] = value(lane, args[1]) & value(lane, args[2])
            elif op == "or.b32":
                r[args[0]] = value(lane, args[1]) | value(lane, args[2])
            elif op == "sub.u32":
                r[args[0]] = (value(lane, args[1]) - value(lane, args[2])) % 2**32
            elif op == "setp.ne.b32":
                r[args[0]] = value(lane, args[1]) != value(lane, args[2])
            elif op == "selp.b32":
                r[args[0]] = r[args[1]] if r[args[3]] else r[args[2]]
            elif op in ("st.global.v4.b32", "st.global.v2.b32"):
                base, _, offset = args[0].strip("[]").partition("+")
                address = value(lane, base)
                if offset:
                    address = (address, int(offset))
                words = [r[v.strip()] for v in args[1].strip("{}").split(",")]
                assert len(words) == int(op[-5]), line
                stores[lane].append((address, words))
            else:
                pytest.fail(f"instruction not modelled: {line}")
    return stores


def test_quad_transpose_store_gives_each_lane_four_consecutive_words():
    asm = expert_panels_sm90._QUAD_TRANSPOSE_STORE.value
    # Lane q of quad g holds word q of each group jj (pair column 4 jj + q of row g);
    # its address operand is group q's.
    inputs = [[(lane // 4, 4 * jj + lane % 4) for jj in range(4)] + [("row", lane // 4,
                                                                        "group", lane % 4)]
              for lane in range(32)]
    stores = run_warp(asm, inputs, operands=5)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        assert stores[lane] == [(("row", g, "group", q), [(g, 4 * q + m) for m in range(4)])]


def test_the_simulation_can_fail():
    # A swapped pair of the closing selects moves two words: the check above would fail.
    asm = expert_panels_sm90._QUAD_TRANSPOSE_STORE.value
    broken = asm.replace("selp.b32 %o0, %y2, %y0, %p2", "selp.b32 %o0, %y0, %y2, %p2")
    assert broken != asm
    inputs = [[(lane // 4, 4 * jj + lane % 4) for jj in range(4)] + [lane]
              for lane in range(32)]
    stores = run_warp(broken, inputs, operands=5)
    assert any(stores[lane][0][1] != [(lane // 4, 4 * (lane % 4) + m) for m in range(4)]
               for lane in range(32))


def _pair_swap_row_words(asm: str) -> dict:
    """Runs the pair swap on a warp whose 8 rows (lane // 4) hold words (row, 4 jj + q)
    as _PAIR_SWAP_STORE's operands ($9: q & 1, $10: the row's base plus the first store's
    byte offset); returns {(row, word index in the row's slice): [values stored]}."""
    inputs = []
    for lane in range(32):
        row, q = lane // 4, lane % 4
        first = 4 * ((q & 2) + 4 * (q & 1))
        inputs.append([(row, 4 * jj + q) for jj in range(8)] + [q & 1, 1000 * row + first])
    stored: dict = {}
    for lane in range(32):
        for address, words in run_warp(asm, inputs, operands=10)[lane]:
            address = sum(address) if isinstance(address, tuple) else address
            assert address % 8 == 0, (lane, address)  # st.global.v2's alignment
            row, byte = divmod(address, 1000)
            for i, w in enumerate(words):
                stored.setdefault((row, byte // 4 + i), []).append(w)
    return stored


def test_pair_swap_store_writes_each_word_of_a_row_once_in_place():
    stored = _pair_swap_row_words(expert_panels_sm90._PAIR_SWAP_STORE.value)
    # Every word of the 8 rows' 32-word slices, each once, holding its own pair column.
    assert stored == {(row, w): [(row, w)] for row in range(8) for w in range(32)}


def test_the_pair_swap_simulation_can_fail():
    # The odd lane keeping the wrong word of a pair moves two words.
    asm = expert_panels_sm90._PAIR_SWAP_STORE.value
    broken = asm.replace("selp.b32 %hi1, $4, %x1, %odd", "selp.b32 %hi1, $3, %x1, %odd")
    assert broken != asm
    stored = _pair_swap_row_words(broken)
    assert stored != {(row, w): [(row, w)] for row in range(8) for w in range(32)}
