"""Compile-only: the expert dx kernel at MAGI-2 dims for sm_90 at the tiles given, with the
registers, spills, shared memory and wgmma shapes ptxas and cuobjdump report (no GPU).

    PYTHONPATH=src python3 benchmarks/experiments/dx_tiles_compile.py M/I/W/S/T/P ...

M/I/W/S: block_m, block_i, warps, stages; T: 1 for the transposed form (TRANSPOSED: the
weights as the wgmma's A operand, the routes as its N); P: 1 with the panel stores.
docs/expert-backward.md, "The dx kernel's tiles at few rows".
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import sass_audit as sa

from mhmoe.kernels.expert_backward import _expert_dx_kernel, dx_signature

D, I = 256, 1280
for spec in sys.argv[1:]:
    bm, bi, w, st, tr, panels = map(int, spec.split("/"))
    k = sa.compile_sm90(_expert_dx_kernel, dx_signature(D, bi),
                        dict(D=D, I=I, BLOCK_M=bm, BLOCK_I=bi, BLOCK_D=D, EVEN_D=True,
                             EVEN_I=I % bi == 0, DETERMINISTIC=False, UPCAST=False,
                             DOT_FP32=False, PRECISION="tf32", USE_TMA=True,
                             PANELS=bool(panels), TRANSPOSED=bool(tr)), w, st)
    sass, res = sa.assemble(k)
    print(spec, res, sa.wgmma_shapes(sass), flush=True)
