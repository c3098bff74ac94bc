"""The Gluon panel kernel's quad transpose and 16-byte store (inline PTX,
`expert_panels_sm90._QUAD_TRANSPOSE_STORE`), run lane by lane on the CPU.

The GPU test (`test_gpu.py::test_split_backward_and_gluon_panel_kernel`) checks the
kernel's panels bitwise against the Triton path; this checks the PTX text itself on
every CPU run: a small interpreter of the instructions it uses (anything else fails),
over the 32 lanes of a warp, with shuffles reading the other lanes' registers.
"""

from __future__ import annotations

import re

import pytest

from mhmoe.kernels import expert_panels_sm90


def _operands(text: str) -> list[str]:
    return [a.strip() for a in re.split(r",(?![^{]*})", text)]


def run_warp(asm: str, inputs: list[list], operands: int):
    """Runs `asm` on 32 lanes. inputs[lane][i] is the value of $(1 + i) (the output is $0).
    Returns, per lane, the list of (address, values) of its st.global.v4 stores."""
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
        if op == "shfl.sync.idx.b32":
            dst, src, lane_of, clamp, mask = args
            assert (clamp, mask) == ("31", "-1"), line  # whole warp, no segments
            sent = [regs[lane][src] for lane in range(32)]
            for lane in range(32):
                regs[lane][dst] = sent[value(lane, lane_of) & 31]
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
            elif op == "st.global.v4.b32":
                address = value(lane, args[0].strip("[]"))
                stores[lane].append((address, [r[v.strip()] for v in
                                               args[1].strip("{}").split(",")]))
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
