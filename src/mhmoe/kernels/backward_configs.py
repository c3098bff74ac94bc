"""Per-architecture tile choices of the fused expert backward, as data.

The backward (`kernels/expert_backward.py`) runs the dx kernel and either the
panel GEMMs (`panel`, the default where the panels fit their workspace) or the
recomputing dW kernel (`dw`), each with its own tiles. `ExpertBackwardConfig`
holds an `ExpertForwardConfig` (block_m, block_i, num_warps, num_stages, tma)
for the dx and dW kernels and a `PanelGemmConfig` for the panel GEMMs.
`expert_backward_config()` picks one from the GPU architecture and the shapes
alone (never from the routing, which lives on the device); tests and
benchmarks can pass their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .configs import ExpertForwardConfig, check_tiles

# Bytes the panels of one launch group may take (see `expert_backward.py`): at
# MAGI-2 dims and 32,768 tokens one head's panels are 1.86 GiB in bf16.
PANEL_WORKSPACE_BYTES = 2 * 2**30


@dataclass(frozen=True)
class PanelGemmConfig:
    """Tiles of the panel GEMM C[f] = A_f^T B_f (`_panel_dw_kernel`).

    block_m, block_n: the [block_m, block_n] output tile of C[f] one program
        owns (fp32 accumulator in registers).
    block_k: panel rows per step of the reduction loop; at most the dx
        kernel's block_m (the panel's row padding), which it must divide.
    num_warps, num_stages: warps per program, pipelining depth of the loads.
    tma: load the panel tiles with tensor descriptors where the shapes allow.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = True

    def __post_init__(self) -> None:
        check_tiles(self, ("block_m", "block_n", "block_k"))


def step_down_panel(cfg: PanelGemmConfig) -> PanelGemmConfig | None:
    """The next panel config to try after `cfg` ran out of resources; None when none is left."""
    if cfg.num_stages > 1:
        return dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > 16:
        return dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    if cfg.block_m > 16:
        return dataclasses.replace(cfg, block_m=cfg.block_m // 2)
    return None


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
    panel: the panel GEMMs' tiles, or None for the recomputing dW kernel.
    """

    dx: ExpertForwardConfig
    dw: ExpertForwardConfig
    panel: PanelGemmConfig | None = None


# Mean rows per expert (R / number of flat experts) -> tiles; the first row
# whose bound is >= the mean wins. Few rows per expert: smaller tiles waste
# less work on padding (not measured yet). The dw kernel holds 3 * D * block_i
# fp32 accumulators: at D = 256, block_i = 32 that is 96 registers a thread
# over 8 warps. Measured on an H200 at S=32768 (benchmarks/NOTES.md,
# "Backward"): dw 128/32/8/1 75 ms against 64/32/8/2 92 ms for the whole
# backward; the dx tiles moved it by less than 3%.
# The panel GEMMs: 128 x 256 output tiles, 64 panel rows a step, 3 stages (sm_90:
# 147 KB of shared memory, 154 registers). Measured at S=32768 (NOTES.md, backward
# v2): whole backward 40.8 ms against 41.4 with 128 x 128 tiles (3 stages) and 42.5
# with 128 x 128 tiles and 4 stages. The
# dx kernel's panel stores need 8 KB more shared memory, so 128/32/8/2 (237 KB with
# them, over the 227 KB) gives way to 128/16/8/3 (209 KB), which measured within
# 0.5% of it without panels; 128/16/8/2 lost 13 ms.
_HOPPER_PANEL = PanelGemmConfig(128, 256, 64, 8, 3)
_HOPPER = (
    (40.0, ExpertBackwardConfig(dx=ExpertForwardConfig(64, 32, 4, 3),
                                dw=ExpertForwardConfig(64, 32, 8, 2), panel=_HOPPER_PANEL)),
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(128, 16, 8, 3),
                                        dw=ExpertForwardConfig(128, 32, 8, 1),
                                        panel=_HOPPER_PANEL)),
)
# float32 operands (fp32 weights, or mixed dtypes): twice the shared memory per
# tile, and the "ieee" dots are pipelined differently. Sizes from sm_90
# compile-only checks (triton.compile + ptxas, D = 256): dx 64/32/4/1 224 KB,
# dw 32/32/8/1 172 KB (limit 227 KB), where the bf16 rows above would need
# 336 KB and 248 KB; starting there saves the launch-time step-downs, each of
# which recompiles (10-25 s per fp32 kernel).
_HOPPER_FP32 = (
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(64, 32, 4, 1),
                                        dw=ExpertForwardConfig(32, 32, 8, 1),
                                        panel=PanelGemmConfig(64, 64, 32, 4, 2))),
)
# Ampere/Ada and unknown CUDA GPUs: less shared memory, no wgmma.
_GENERIC_CUDA = (
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(64, 32, 4, 2),
                                        dw=ExpertForwardConfig(32, 32, 8, 1),
                                        panel=PanelGemmConfig(64, 64, 32, 4, 2, tma=False))),
)
# The Triton interpreter (CPU tests): big tiles run fastest there.
_INTERPRETER = (
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(32, 32, 4, 1),
                                        dw=ExpertForwardConfig(32, 32, 4, 1),
                                        panel=PanelGemmConfig(32, 32, 32, 4, 1))),
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
