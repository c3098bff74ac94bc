"""Accuracy of one static scale for the SwiGLU7 output (1/8: its clamps bound |a| by 56)
against the fp8 scheme's dynamic scale per row and 64 columns, float64 emulation on the
CPU, one expert at a time at MAGI-2's expert shapes (D = 256, I = 1280), Gaussian x and
weights with the gate and up weights scaled by 1, 1/4 and 1/20 (smaller activations).

    PYTHONPATH=src python3 benchmarks/experiments/fp8_static_act.py

Each row: the median and largest |a|, then the relative error of the expert's output
against float64 math on the bf16 weights with x and the weights quantized as the scheme
does and the SwiGLU output (1) not quantized, (2) quantized per row and 64 columns, (3)
quantized with the static scale; mean over 8 experts of 256 rows. An experiment, not
kept (docs/fp8.md, "What would close it", item 6).
"""

import torch

from mhmoe.fp8 import quantize_weights, row_scales, to_fp8
from mhmoe.reference import swiglu7_reference

D, I, EXPERTS, ROWS = 256, 1280, 8, 256


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    torch.manual_seed(0)
    for gain in (1.0, 0.25, 0.05):
        errs = {"not quantized": [], "per row and 64": [], "static 1/8": []}
        for _ in range(EXPERTS):
            w = [(torch.randn(1, D, I) * D**-0.5 * gain).bfloat16(),
                 (torch.randn(1, D, I) * D**-0.5 * gain).bfloat16(),
                 (torch.randn(1, I, D) * I**-0.5).bfloat16()]
            wg, wu, wd = (t[0] for t in quantize_weights(*w).dequantized(torch.float64))
            x = torch.randn(ROWS, D).bfloat16().float()
            ref = swiglu7_reference(x.double() @ w[0][0].double(),
                                    x.double() @ w[1][0].double()) @ w[2][0].double()
            s_x = row_scales(x, 1)
            xq = to_fp8(x, s_x, 1).double() * s_x.double()[:, None]
            a = swiglu7_reference(xq @ wg, xq @ wu)
            dynamic = torch.zeros(ROWS, D, dtype=torch.float64)
            for i0 in range(0, I, 64):
                piece = a[:, i0:i0 + 64].float()
                s_a = row_scales(piece, 1)
                dynamic += (to_fp8(piece, s_a, 1).double() @ wd[i0:i0 + 64]) \
                    * s_a.double()[:, None]
            static = to_fp8(a.float(), torch.full((ROWS,), 1 / 8), 1).double() / 8 @ wd
            for name, out in zip(errs, (a @ wd, dynamic, static), strict=True):
                errs[name].append(rel(out, ref))
        print(f"gate/up weights x{gain}: |a| median {a.abs().median():.3g} max "
              f"{a.abs().max():.3g}; " + ", ".join(f"{k} {sum(v) / len(v):.4f}"
                                                   for k, v in errs.items()))


if __name__ == "__main__":
    main()
