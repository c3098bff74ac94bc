"""Per-architecture tile choices of the fused expert backward, as data.

The backward runs two kernels (`kernels/expert_backward.py`), each with its
own tiles, so `ExpertBackwardConfig` holds one `ExpertForwardConfig` (the
same four numbers: block_m, block_i, num_warps, num_stages, plus tma) for
each. `expert_backward_config()` picks one from the GPU architecture and the
shapes alone (never from the routing, which lives on the device); tests and
benchmarks can pass their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .configs import ExpertForwardConfig


@dataclass(frozen=True)
class ExpertBackwardConfig:
    """Tiles of the two backward kernels.

    dx: the (expert, row block) kernel of dx and dprobs. block_m routes per
        program, a [block_m, D] fp32 accumulator in registers, a loop over I
        in slices of block_i (as the forward). tma: weight slices through
        tensor descriptors where the shapes allow.
    dw: the (expert, I slice) kernel of the weight gradients. block_i is the
        width of the slice a program owns (three fp32 [D, block_i]
        accumulators live in registers, so block_i * D bounds the warps
        needed); block_m is the row block of its loop over the expert's
        routes; tma is unused (the weight slices are loaded once).
    """

    dx: ExpertForwardConfig
    dw: ExpertForwardConfig


# Mean rows per expert (R / number of flat experts) -> tiles; the first row
# whose bound is >= the mean wins. Few rows per expert: smaller tiles waste
# less work on padding (not measured yet). The dw kernel holds 3 * D * block_i
# fp32 accumulators: at D = 256, block_i = 32 that is 96 registers a thread
# over 8 warps. Measured on an H200 at S=32768 (benchmarks/NOTES.md,
# "Backward"): dw 128/32/8/1 75 ms against 64/32/8/2 92 ms for the whole
# backward; the dx tiles moved it by less than 3%.
_HOPPER = (
    (40.0, ExpertBackwardConfig(dx=ExpertForwardConfig(64, 32, 4, 3),
                                dw=ExpertForwardConfig(64, 32, 8, 2))),
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(128, 32, 8, 2),
                                        dw=ExpertForwardConfig(128, 32, 8, 1))),
)
# float32 operands (fp32 weights, or mixed dtypes): twice the shared memory per
# tile, and the "ieee" dots are pipelined differently. Sizes from sm_90
# compile-only checks (triton.compile + ptxas, D = 256): dx 64/32/4/1 224 KB,
# dw 32/32/8/1 172 KB (limit 227 KB), where the bf16 rows above would need
# 336 KB and 248 KB; starting there saves the launch-time step-downs, each of
# which recompiles (10-25 s per fp32 kernel).
_HOPPER_FP32 = (
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(64, 32, 4, 1),
                                        dw=ExpertForwardConfig(32, 32, 8, 1))),
)
# Ampere/Ada and unknown CUDA GPUs: less shared memory, no wgmma.
_GENERIC_CUDA = (
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(64, 32, 4, 2),
                                        dw=ExpertForwardConfig(32, 32, 8, 1))),
)
# The Triton interpreter (CPU tests): big tiles run fastest there.
_INTERPRETER = (
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(32, 32, 4, 1),
                                        dw=ExpertForwardConfig(32, 32, 4, 1))),
)
_TABLES = {(9, 0): _HOPPER}


def expert_backward_config(
    device: torch.device, rows_per_expert: float, interpreting: bool = False,
    fp32_operands: bool = False,
) -> ExpertBackwardConfig:
    """The default tiles for a problem of `rows_per_expert` mean routes per expert
    (`fp32_operands`: the dots take float32 operands, see _HOPPER_FP32).

    A config that does not fit the chip is shrunk at launch time
    (`configs.step_down` on OutOfResources), kernel by kernel.
    """
    if interpreting or device.type != "cuda":
        table = _INTERPRETER
    else:
        arch = torch.cuda.get_device_capability(device)
        table = _TABLES.get(arch, _GENERIC_CUDA)
        if fp32_operands and arch == (9, 0):
            table = _HOPPER_FP32
    return next(c for bound, c in table if rows_per_expert <= bound)
