"""Every per-architecture tile choice of the kernels, as data.

One place for the tiles, chosen by documented functions from the GPU
architecture and the problem's shapes (never from routing results, which live
on the device). Tests and benchmarks can pass their own configs instead.

    expert_forward_config()    ExpertForwardConfig   kernels/expert_forward.py (+ _sm90.py)
    expert_forward_sm90_config()  ExpertForwardSm90Config  kernels/expert_forward_sm90.py
    slot_sum_config()          SlotSumConfig         the expert combine's finishing kernel
    combine_workspace_bytes()  the expert combine's workspace limit (bytes)
    expert_backward_config()   ExpertBackwardConfig  kernels/expert_backward.py
    fp8_forward_config()       Fp8ForwardConfig      kernels/expert_forward_fp8.py
    fp8_forward_sm90_config()  Fp8ForwardSm90Config  kernels/expert_forward_fp8_sm90.py
    panels_sm90_config()       PanelsSm90Config      kernels/expert_panels_sm90.py
    logits_route_config()      LogitsRouteConfig     kernels/router_logits.py
    router_backward_config()   RouterBackwardConfig  kernels/router_backward.py
    route_tiles(), shortlist_route_tiles()  RouteTiles, ShortlistRouteTiles  kernels/topk.py
    layout_block_t(), layout_chunk(), ..., LAYOUT_SCAN_TILES           kernels/layout.py

`step_down()` / `step_down_panel()` / `step_down_panel_dx()` give the next smaller
config when one does not fit the chip. The reasons behind each table row, and the
measurements that chose it, are in docs/expert-forward.md, docs/expert-backward.md and
docs/routing.md.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertForwardConfig:
    """Tiles of the fused expert kernel (`kernels/expert_forward.py`).

    block_m:    routes (rows of the gathered x tile) one program owns; the
                fp32 accumulator is [block_m, D] and lives in registers.
    block_i:    width of one slice of the intermediate dimension I; the
                program loops over I in slices of block_i.
    num_warps:  warps per program (4 = one Hopper warpgroup).
    num_stages: software-pipelining depth of the weight-slice loads.
    tma:        load weight slices with tensor descriptors (bulk copies) where
                the shapes allow; False forces per-thread pointer loads.
    paired:     multiply x by the gate and up slices as one [D, 2*block_i]
                operand (one wgmma of N = 2*block_i, per-thread pointer loads
                over both tensors) where W_gate and W_up allow it; `tma` then
                applies to W_down alone. False: two dots, gate and up.
    warp_specialized: the Gluon kernel of `kernels/expert_forward_sm90.py` (sm_90, bf16,
                D = 256, I a multiple of 64): persistent, two MMA warpgroups taking
                turns, two loader warps; its tiles are its own (128 routes, slices of
                64). The other fields are the Triton kernel's tiles for shapes it does
                not take when the default table picks the row; a config a caller passes
                with warp_specialized for such a shape raises ValueError.
    cluster:    with warp_specialized, 2 runs the kernel in clusters of two CTAs
                that share each weight stage by multicast bulk copies (1: no clusters).
    sigmoid_rcp: the forward kernels' SwiGLU7 sigmoid g / (1 + e) as g times
                rcp.approx.ftz(1 + e), without the full-range division's range checks:
                bitwise the same where 1 + e <= 2^126 (g > -51.3); for 1 + e in (2^126,
                2^128), g in (-52.1, -51.3), the division rescales and gives g / (1 + e)
                ~ -3e-37, the reciprocal (subnormal, flushed) g * 0 (as
                `Fp8ForwardConfig.reciprocals`'s sigmoid, docs/expert-forward.md). The
                backward's tiles (ExpertBackwardConfig's dx and dw) leave it False: the
                backward's own is `ExpertBackwardConfig.sigmoid_rcp`.
    """

    block_m: int
    block_i: int
    num_warps: int
    num_stages: int
    tma: bool = True
    paired: bool = False
    warp_specialized: bool = False
    cluster: int = 1
    sigmoid_rcp: bool = False

    def __post_init__(self) -> None:
        check_tiles(self, ("block_m", "block_i"))
        if self.cluster not in (1, 2) or (self.cluster == 2 and not self.warp_specialized):
            raise ValueError("ExpertForwardConfig.cluster must be 1, or 2 with "
                             f"warp_specialized; got {self.cluster}")


def check_tiles(cfg, blocks: tuple[str, ...]) -> None:
    """Raise ValueError unless cfg's `blocks` are powers of two >= 16, num_warps a power
    of two <= 16 and num_stages >= 1 (the rules of every tile config here)."""
    kind = type(cfg).__name__
    for name in blocks:
        value = getattr(cfg, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{kind}.{name} must be a power of two >= 16, got {value}")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{kind}.num_warps must be a power of two <= 16, got {cfg.num_warps}")
    if cfg.num_stages < 1:
        raise ValueError(f"{kind}.num_stages must be >= 1, got {cfg.num_stages}")


# Rows per expert (R / number of flat experts, known from shapes alone) -> tiles.
# Each row is (upper bound on the mean rows per expert, config); the first row
# whose bound is >= the mean wins. Few rows per expert make the kernel stream
# weights (small block_m wastes less tensor-core work on padding); many rows
# make it compute-bound (block_m = 128 halves the weight re-reads from L2
# against 64, and two warpgroups share each weight slice in shared memory).
# paired (one N=64 wgmma for gate|up through pointer loads) pays only where the
# x tile is reused over several row blocks per expert; where the kernel streams
# weights the bulk copies of `tma` win. warp_specialized (the Gluon kernel) wins
# once each expert has a few row blocks, but not where both kernels only stream
# weights. cluster=2 (weight stages shared by multicast between two CTAs) pays
# only at many rows per expert. The measured crossovers behind each bound are in
# docs/expert-forward.md ("Tiles").
FORWARD_SM90 = (
    (40.0, ExpertForwardConfig(block_m=64, block_i=32, num_warps=4, num_stages=4)),
    (192.0, ExpertForwardConfig(block_m=128, block_i=32, num_warps=8, num_stages=3,
                                warp_specialized=True)),
    (576.0, ExpertForwardConfig(block_m=128, block_i=32, num_warps=8, num_stages=3,
                                paired=True, warp_specialized=True)),
    (float("inf"), ExpertForwardConfig(block_m=128, block_i=32, num_warps=8, num_stages=3,
                                       paired=True, warp_specialized=True, cluster=2)),
)
# Ampere/Ada and unknown CUDA GPUs: less shared memory, no wgmma.
FORWARD_GENERIC = (
    (float("inf"), ExpertForwardConfig(block_m=64, block_i=32, num_warps=4, num_stages=2)),
)
# The Triton interpreter (CPU tests): big tiles run fastest there.
FORWARD_INTERPRETER = (
    (float("inf"), ExpertForwardConfig(block_m=32, block_i=32, num_warps=4, num_stages=1)),
)
FORWARD_TABLES = {(9, 0): FORWARD_SM90}

# Shared memory a program may use, by architecture (bytes); the default for others.
_SMEM_BYTES = {(9, 0): 227 * 1024, (8, 0): 163 * 1024}
_SMEM_DEFAULT = 99 * 1024

# Workspace limits (bytes) of the expert launchers' combine (`expert_forward.HeadGroups`,
# also the backward's dx): the fp32 [S, G, D] accumulator of the default mode and the
# per-route [G*S*K, D] buffer of the deterministic mode are sized for at most this many
# bytes; larger problems run in several launches over groups of G heads.
DEFAULT_WORKSPACE_BYTES = 256 * 2**20
DETERMINISTIC_WORKSPACE_BYTES = 1024 * 2**20


def combine_workspace_bytes(deterministic: bool) -> int:
    """The combine's workspace limit in bytes for a mode (read at every call, so tests
    can lower DEFAULT_WORKSPACE_BYTES / DETERMINISTIC_WORKSPACE_BYTES to force head groups)."""
    return DETERMINISTIC_WORKSPACE_BYTES if deterministic else DEFAULT_WORKSPACE_BYTES


@dataclass(frozen=True)
class SlotSumConfig:
    """Tiles of the combine's finishing kernel (`expert_forward._sum_slots_kernel`), which
    adds the K per-route slots of each (token, head) in order (deterministic mode) or casts
    the default mode's fp32 [S, G, D] sums into the result's heads.

    block_p:    (token, head) pairs a program owns.
    block_d:    columns a program owns (at most: lowered to D's next power of two).
    num_warps:  warps per program.
    """

    block_p: int
    block_d: int
    num_warps: int

    def __post_init__(self) -> None:
        for name in ("block_p", "block_d"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SlotSumConfig.{name} must be a power of two, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"SlotSumConfig.num_warps must be a power of two <= 16, "
                             f"got {self.num_warps}")


# A streaming kernel (one read of the sums, one write of y): 32 x 128 fp32 a program, in
# one warpgroup, keeps each thread's loads 16 bytes wide and many programs in flight.
SLOT_SUM = SlotSumConfig(block_p=32, block_d=128, num_warps=4)


def slot_sum_config(d: int) -> SlotSumConfig:
    """The finishing kernel's tiles for head width `d` (the same on every GPU)."""
    block_d = min(SLOT_SUM.block_d, 1 << max(d - 1, 0).bit_length())
    return dataclasses.replace(SLOT_SUM, block_d=block_d)


def _arch(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def on_sm90(t: torch.Tensor) -> bool:
    """Whether `t` lives on an sm_90 GPU (H100, H200), where the Gluon kernels run."""
    return _arch(t.device) == (9, 0)


def _smem_bytes(cfg: ExpertForwardConfig, d: int, elem: int) -> int:
    """Shared memory the kernel needs: x tile, pipelined weight slices, barriers.

    The activation feeds the down GEMM from registers (Hopper), so it takes none.
    """
    block_d = 1 << max(d - 1, 0).bit_length()
    x_tile = cfg.block_m * block_d * elem
    weights = 3 * block_d * cfg.block_i * elem
    return x_tile + cfg.num_stages * weights + 1024


def expert_forward_config(
    device: torch.device, rows_per_expert: float, d: int, dtype: torch.dtype,
    interpreting: bool = False,
) -> ExpertForwardConfig:
    """The default tiles for a problem of `rows_per_expert` mean routes per expert.

    device: where the kernel runs; d: head width D; dtype: the weights' dtype.
    The table's choice is then shrunk (pipelining depth first, then block_i,
    then block_m) until its shared memory fits the architecture.
    """
    arch = _arch(device)
    if interpreting or arch is None:
        table = FORWARD_INTERPRETER
    else:
        table = FORWARD_TABLES.get(arch, FORWARD_GENERIC)
    cfg = pick(table, rows_per_expert)
    limit = _SMEM_BYTES.get(arch, _SMEM_DEFAULT) if arch is not None else None
    elem = 4 if dtype == torch.float32 else 2
    while limit is not None and _smem_bytes(cfg, d, elem) > limit:
        smaller = step_down(cfg)
        if smaller is None:
            break
        cfg = smaller
    return cfg


def pick(table, rows_per_expert: float) -> ExpertForwardConfig:
    """The config of the first row of `table` whose bound is >= rows_per_expert."""
    return next(c for bound, c in table if rows_per_expert <= bound)


def step_down(cfg: ExpertForwardConfig) -> ExpertForwardConfig | None:
    """The next config to try after `cfg` ran out of resources; None when none is left."""
    if cfg.num_stages > 1:
        return dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_i > 16:
        return dataclasses.replace(cfg, block_i=cfg.block_i // 2)
    if cfg.block_m > 16:
        return dataclasses.replace(cfg, block_m=cfg.block_m // 2,
                                   num_warps=max(1, cfg.num_warps // 2))
    return None


@dataclass(frozen=True)
class ExpertForwardSm90Config:
    """Tiles and register budget of the Gluon kernel (`kernels/expert_forward_sm90.py`),
    which runs where an `ExpertForwardConfig` says `warp_specialized` and the shapes fit.

    block_m:    routes a tile; each of the two MMA warpgroups owns half of them.
    block_i:    width of a slice of I, and the edge of the square TMA boxes that load
                every weight chunk (bf16: 128-byte rows, the widest swizzled box).
    num_warps:  warps of the default partition (MMA warpgroup 0).
    The kernel's code is written for block_m = 128, block_i = 64 and num_warps = 4
    (64-row warpgroup halves, [64, 128] ring stages); other values are refused.
    num_stages: depth of the weight ring, stages of [block_i, 2 * block_i] bf16 (16 KB)
                beside the 64 KB x tile in the SM's shared memory.
    maxnreg:    registers a thread at launch. The kernel runs 12 warps (the loaders' and
                the idle warps round up to a third warpgroup) of maxnreg registers, which
                fill the SM's 64K registers.
    mma_regs, load_regs: what each MMA warpgroup and the loader warpgroup then ask for
                (setmaxnreg): an MMA warpgroup holds its [64, 256] fp32 accumulator (128
                registers), the [64, 128] gate|up accumulator (64) and a(j) (16); the
                loaders need few, and give back what the MMA warpgroups take.
    """

    block_m: int
    block_i: int
    num_warps: int
    num_stages: int
    maxnreg: int
    mma_regs: int
    load_regs: int

    def shared_bytes(self) -> int:
        """Shared memory of the kernel's x tile and ring at these tiles (D = 256)."""
        return self.block_m * 256 * 2 + self.num_stages * self.block_i * 2 * self.block_i * 2

    def block_stages(self) -> int:
        """Ring stages one warpgroup's block holds at once (D = 256: a slice's two down
        chunks and four gate|up chunks). The ring needs as many: a warpgroup waits for
        the last of them while the other has not yet read the first."""
        return 2 + 256 // 64

    def __post_init__(self) -> None:
        name = type(self).__name__
        if (self.block_m, self.block_i, self.num_warps) != (128, 64, 4):
            raise ValueError(f"{name}: the Gluon kernel is written for block_m=128, "
                             "block_i=64, num_warps=4; got "
                             f"{self.block_m}, {self.block_i}, {self.num_warps}")
        if self.num_stages < self.block_stages():
            raise ValueError(f"{name}.num_stages={self.num_stages}: the ring must hold a "
                             f"block's {self.block_stages()} stages, or the kernel hangs")
        if self.shared_bytes() + 1024 > _SMEM_BYTES[(9, 0)]:
            raise ValueError(f"{name}.num_stages={self.num_stages}: the ring and the x tile "
                             "must fit the sm_90 shared memory")
        for field in ("mma_regs", "load_regs"):
            value = getattr(self, field)
            if value % 8 or not 24 <= value <= 256:
                raise ValueError(f"{name}.{field} must be a multiple of 8 in [24, 256] "
                                 f"(setmaxnreg), got {value}")
        if 2 * self.mma_regs + self.load_regs > 3 * self.maxnreg:
            raise ValueError(f"{name}: two MMA warpgroups of mma_regs and one of load_regs "
                             "must fit the 3 * maxnreg registers a thread the launch "
                             "reserves")


# Ten 16 KB stages fill what the x tile leaves of the 227 KB. 240 registers for the MMA
# warpgroups: with fewer, ptxas serialises every wgmma for want of registers (which the
# SASS audit's count of asynchronous waits catches); 2 * 240 + 24 = 3 * 168. The design
# and its measurements: docs/expert-forward.md ("The Gluon kernel (warp-specialised)").
FORWARD_SM90_GLUON = ExpertForwardSm90Config(block_m=128, block_i=64, num_warps=4,
                                             num_stages=10, maxnreg=168, mma_regs=240,
                                             load_regs=24)


def expert_forward_sm90_config() -> ExpertForwardSm90Config:
    """The Gluon kernel's tiles (it runs on sm_90 only, so there is one row)."""
    return FORWARD_SM90_GLUON


# The fp8 expert forward (kernels/expert_forward_fp8.py).


@dataclass(frozen=True)
class Fp8ForwardConfig:
    """Tiles of the fp8 expert kernel (fp8 tensor cores: x and the SwiGLU7 output
    quantized on the fly).

    block_m, num_warps, num_stages: as `ExpertForwardConfig`'s.
    block_i:    must be `fp8.ACT_BLOCK`: the SwiGLU7 output's scales are per row and
                per slice of block_i columns, so it is part of the numerics.
    warp_specialized: the Gluon kernel of `kernels/expert_forward_fp8_sm90.py` (sm_90,
                bf16 x, D = 256, I a multiple of 64) at the tiles of
                `fp8_forward_sm90_config()`, with the same numerics; a config that asks
                for it where it cannot run raises ValueError.
    reciprocals: the kernels' divisions as products with the divisor's reciprocal
                (rcp.approx.ftz, MUFU.RCP alone), without the full-range division's range
                checks and rescales: x and the SwiGLU7 output over their row scales, the
                rescale's s_prev / s_a (the division computes exactly that product for
                divisors in [2^-126, 2^126], which holds every scale: bitwise the same),
                and the sigmoid g / (1 + e) (the same where 1 + e <= 2^126, g > -51.3;
                for g in (-52.1, -51.3) ~ -3e-37 against g * 0, which the activation's
                quantization makes zero either way). The interpreter divides (the
                scales) and emulates the sigmoid's flush. Measurements: docs/fp8.md
                ("Reciprocals").
    skip_empty_halves: with warp_specialized only: the Gluon kernel's second MMA
                warpgroup does nothing but keep the ring and the turns in step where
                its 64 rows of a tile hold no route (every tile at 64 routes an expert
                or fewer, an expert's last tile of 64 or fewer above): no wgmma, SwiGLU
                or combine on padding rows. The routes' results are the same. The
                table's row at few routes an expert (docs/fp8.md, "What would close it",
                item 5).
    chunked_x:  with warp_specialized only: the Gluon kernel quantizes x at a tile's start
                in a run-time loop over groups of 8 rows, a short body run 8 times where
                the unrolled code is fetched afresh each tile; x's bf16 and e4m3 tiles laid
                out for it. The same values: the results are the same. The table's row at
                many routes an expert (docs/fp8.md, "What would close it", item 7).
    """

    block_m: int
    block_i: int
    num_warps: int
    num_stages: int
    warp_specialized: bool = False
    reciprocals: bool = False
    skip_empty_halves: bool = False
    chunked_x: bool = False

    def __post_init__(self) -> None:
        check_tiles(self, ("block_m", "block_i"))
        for option in GLUON_ONLY_OFF:
            if getattr(self, option) and not self.warp_specialized:
                raise ValueError(f"Fp8ForwardConfig.{option} is an option of the Gluon "
                                 "kernel: set warp_specialized=True with it")
        from ..fp8 import ACT_BLOCK

        if self.block_i != ACT_BLOCK:
            raise ValueError(f"Fp8ForwardConfig.block_i must be {ACT_BLOCK} (the activation "
                             f"scale's block), got {self.block_i}")


# Fp8ForwardConfig's options of the Gluon kernel alone, off: what a table row keeps where it
# runs the Triton kernel instead.
GLUON_ONLY_OFF = dict(skip_empty_halves=False, chunked_x=False)


# Mean rows per expert -> tiles. On sm_90 the warp-specialised Gluon kernel at every size,
# with its reciprocals: measured faster than the Triton tiles at few routes an expert and
# than itself without them at few and many; at few routes (a tile's second half mostly
# padding) with the empty halves skipped, at many with x's quantization chunked (docs/fp8.md,
# "Reciprocals" and "What would close it", items 4, 5 and 7). Each row's Triton tiles are
# what runs where the Gluon kernel cannot (D != 256, not sm_90): one warpgroup of 64 routes
# where few routes per expert make the kernel stream weights, two of 128 above. (A
# weight-only multiply measured slower at every size and was removed.)
_FP8_GLUON = dict(warp_specialized=True, reciprocals=True)
FP8_FORWARD_SM90 = (
    (96.0, Fp8ForwardConfig(block_m=64, block_i=64, num_warps=4, num_stages=3, **_FP8_GLUON,
                            skip_empty_halves=True)),
    (float("inf"), Fp8ForwardConfig(block_m=128, block_i=64, num_warps=8, num_stages=3,
                                    **_FP8_GLUON, chunked_x=True)),
)
FP8_FORWARD_INTERPRETER = (
    (float("inf"), Fp8ForwardConfig(block_m=32, block_i=64, num_warps=4, num_stages=1)),
)


@dataclass(frozen=True)
class Fp8ForwardSm90Config(ExpertForwardSm90Config):
    """Tiles and register budget of the fp8 Gluon kernel (`kernels/expert_forward_fp8_sm90.py`):
    the fields of `ExpertForwardSm90Config`, with its own shared memory: the bf16 x tile
    (64 KB), its e4m3 copy (32 KB), the quantized SwiGLU output of each warpgroup (2 x
    4 KB), and num_stages ring stages of 16 KB of e4m3 weights plus 512 bytes of channel
    scales. An MMA warpgroup holds its [64, 256] fp32 accumulator (128 registers) and the
    [64, 128] gate|up accumulator (64)."""

    def shared_bytes(self) -> int:
        return (self.block_m * 256 * 3 + self.block_m * 64
                + self.num_stages * (128 * 128 + 2 * 64 * 4))

    def block_stages(self) -> int:
        """A down chunk and two gate|up chunks (D = 256)."""
        return 1 + 256 // 128


# Seven stages (2.3 slices of I ahead) fill what the x tiles leave of the 227 KB; the
# register budget is the bf16 kernel's (docs/fp8.md, "The warp-specialised fp8 kernel").
FP8_FORWARD_SM90_GLUON = Fp8ForwardSm90Config(block_m=128, block_i=64, num_warps=4,
                                              num_stages=7, maxnreg=168, mma_regs=240,
                                              load_regs=24)


@dataclass(frozen=True)
class PanelsSm90Config(ExpertForwardSm90Config):
    """Tiles of the backward's Gluon panel kernel (`kernels/expert_panels_sm90.py`): the
    forward's ring stages and register fields (see `ExpertForwardSm90Config`), beside x
    and dy tiles (128 KB): mma_regs covers the [64, 128] gate|up accumulator (64
    registers) and the [64, 64] t (32) with the SwiGLU7 backward's temporaries."""

    def shared_bytes(self) -> int:
        """The forward's x tile and ring, and the dy tile (D = 256); the inherited check
        says "the x tile" of both."""
        return super().shared_bytes() + self.block_m * 256 * 2


# Six 16 KB stages, one block's, fill what the x and dy tiles leave of the 227 KB (the
# reuse distance this leaves the loader: docs/expert-backward.md, "dx from the panels").
# The kernel runs where an ExpertBackwardConfig's dx.warp_specialized asks for it
# (SM90_SPLIT_WS, BACKWARD_SM90's row above 192 rows an expert).
PANELS_SM90_GLUON = PanelsSm90Config(block_m=128, block_i=64, num_warps=4, num_stages=6,
                                     maxnreg=168, mma_regs=232, load_regs=40)


def panels_sm90_config() -> PanelsSm90Config:
    """The Gluon panel kernel's tiles (sm_90 only: one row)."""
    return PANELS_SM90_GLUON


def fp8_forward_sm90_config() -> Fp8ForwardSm90Config:
    """The fp8 Gluon kernel's tiles (it runs on sm_90 only, so there is one row)."""
    return FP8_FORWARD_SM90_GLUON


def fp8_forward_config(device: torch.device, rows_per_expert: float,
                       interpreting: bool = False) -> Fp8ForwardConfig:
    """The fp8 kernel's tiles for `rows_per_expert` mean routes per expert (Hopper's
    table on CUDA; the kernel needs sm_89 or later, which `experts.fp8_kernel_problem`
    checks before it runs)."""
    table = FP8_FORWARD_INTERPRETER if interpreting or device.type != "cuda" \
        else FP8_FORWARD_SM90
    return pick(table, rows_per_expert)


# Tiles of the logits (+ route) kernel of kernels/router_logits.py, per architecture, as data.


@dataclass(frozen=True)
class LogitsRouteConfig:
    """Tiles of the logits kernel of `kernels/router_logits.py`.

    block_s:    tokens one program owns; its [block_s, E] fp32 logits tile lives
                in registers (block_s * E * 4 bytes over 32 * num_warps threads).
    block_d:    the K step of each tl.dot (a power of two >= 16; the launcher
                lowers it to the largest power of two dividing D).
    num_warps:  warps per program (4 = one Hopper warpgroup, which owns 64 rows).
    num_stages: software-pipelining depth of the x and weight slice loads.
    from_tile:  gather each picked expert's logit from the register tile (a masked
                sum per top-k round; the logits tile stays live beside the
                selection tile: two tiles of registers) rather than re-reading
                it from the logits written to memory (then always written:
                block_s * E * 4 bytes of stores a program, one tile of registers).
    split:      two launches: the kernel computes and writes the logits only
                (ROUTE=False), then `_route_kernel` routes them (its own tiles):
                each part runs at its own occupancy, for 4 bytes per score
                written and read again. from_tile is then unused.
    half_stores: with split, store the logits tile as two halves of its columns
                (when the tile has >= 32 columns, min(block_e, E); else ignored), so
                the layout change before the stores takes half the shared memory
                (the same values are written).
    block_e:    with split, the experts (columns) one program computes, a power of
                two >= 16 (None or >= E: all E). A program reads block_e rows of the
                weight parts: tiles of many tokens and few experts read as few weight
                bytes per token as tiles of all experts, in fewer registers.
    tma_store:  with split, the logits leave through bulk (TMA) stores (sm_90).
    shortlist:  with split, for sigmoid scores without groups and K <= 16: the logits
                kernel also lists, per row and column block, its next_pow2(K) largest
                approximate keys (expert ids in their low bits), whose experts hold the
                row's exact top K (`topk._shortlist`), and `_shortlist_route_kernel`
                routes each row from those lists: the K picked logits read where the
                keys order the picks, the listed ones where they do not, instead of all
                E (the same results, bitwise).
    merged_lists: with shortlist, where K < next_pow2(K) < block_e / 4: the lists come
                from sorting networks on each thread's keys and two merges between
                threads (`topk._shortlist_merged`) instead of next_pow2(K) + 1 passes
                over the tile's keys (nine at K = 6; the same lists where both are sure,
                bitwise the same routes either way; fewer instructions and registers
                on sm_90, docs/routing.md "Shortlists").
    """

    block_s: int
    block_d: int
    num_warps: int
    num_stages: int
    from_tile: bool
    split: bool = False
    half_stores: bool = False
    block_e: int | None = None
    tma_store: bool = False
    shortlist: bool = False
    merged_lists: bool = False

    def __post_init__(self) -> None:
        blocks = ("block_s", "block_d") + (("block_e",) if self.block_e is not None else ())
        check_tiles(self, blocks)
        if self.block_e is not None and not self.split:
            raise ValueError("LogitsRouteConfig.block_e needs split: routing takes whole rows")
        if self.shortlist and not self.split:
            raise ValueError("LogitsRouteConfig.shortlist needs split")


# Hopper (sm_90): the split kernels (logits, then the route kernel), 128 tokens x 128
# of the experts a program on one warpgroup, so that two programs share an SM and
# one's tensor-core phase overlaps the other's epilogue; bulk (TMA) stores of the
# logits in two column halves (fewer registers, half the shared memory of the
# layout change); shortlists by merged sorting networks. Why each of these, and the
# tiles swept against it: docs/routing.md ("Tiles of the logits kernel").
LOGITS_ROUTE_CONFIGS = {
    (9, 0): LogitsRouteConfig(block_s=128, block_d=32, num_warps=4, num_stages=3,
                              from_tile=False, split=True, half_stores=True, block_e=128,
                              tma_store=True, shortlist=True, merged_lists=True),
}
# Other CUDA GPUs (no wgmma): 8 warps keep the tile at 64 registers a thread (sm_80: no spills).
LOGITS_ROUTE_GENERIC = LogitsRouteConfig(block_s=64, block_d=32, num_warps=8, num_stages=2,
                                          from_tile=False)
# The interpreter (CPU tests): its cost is per program and per op, so big tiles.
LOGITS_ROUTE_INTERPRETER = LogitsRouteConfig(block_s=128, block_d=256, num_warps=4,
                                              num_stages=1, from_tile=True)


def logits_route_config(device: torch.device, interpreting: bool = False) -> LogitsRouteConfig:
    """The default tiles of `kernels/router_logits.py`'s logits (+ route) kernel on `device`
    (the interpreter's off CUDA or when `interpreting`)."""
    if device.type != "cuda" or interpreting:
        return LOGITS_ROUTE_INTERPRETER
    arch = torch.cuda.get_device_capability(device)
    return LOGITS_ROUTE_CONFIGS.get(arch, LOGITS_ROUTE_GENERIC)


# Routing: route kernel and layout
#
# The route kernels of kernels/topk.py, the layout kernels of kernels/layout.py and
# the weight split of kernels/router_logits.py. Their tiles do not depend on the
# architecture (no tensor cores); they do on the interpreter, whose cost is per program
# and per op, so it takes whole blocks. Why each value: docs/routing.md ("Packed keys",
# "Shortlists") and docs/layout.md ("History and measurements (S = 32,768)").


def interpreting() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET=1: CPU tensors, the tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    """The least power of two >= n (n >= 1), as triton.next_power_of_2."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class RouteTiles:
    """Tiles of the route kernel (`kernels/topk.py`, `_route_kernel`).

    block_rows: tokens of one head a program routes at a time; their [block_rows,
                next_pow2(E)] fp32 logits tile lives in registers.
    num_warps:  warps per program.
    iters:      tiles a program walks, loading the next one while routing the current.
    """

    block_rows: int
    num_warps: int
    iters: int = 1


# fp32 columns one warp covers (32 lanes x 16-byte loads). A wider row would be split
# across warps, and each of its 2 K row reductions would go through shared memory with
# a barrier: such rows get one warp a program.
ROUTE_WARP_COLUMNS = 128
# Scores a thread holds: few registers, so many programs share an SM.
ROUTE_SCORES_PER_THREAD = 16
ROUTE_MAX_ROWS = 64
# The interpreter: as many rows as make this many scores a program (at most 128 rows).
ROUTE_INTERPRETER_SCORES = 16384


def route_tiles(S: int, E: int, interpreting: bool = False, *, block_rows: int | None = None,
                num_warps: int | None = None, iters: int | None = None) -> RouteTiles:
    """The route kernel's tiles for S tokens of a head with E experts; the keywords
    override a choice (tests, tuning).

    num_warps: 1 where a row is wider than a warp covers, else 4. block_rows: about
    ROUTE_SCORES_PER_THREAD scores a thread (at most ROUTE_MAX_ROWS rows), no more rows
    than S needs; an explicit block_rows is taken as it is. iters: 1 (more tiles a
    program measured no faster).
    """
    block_e = _next_pow2(max(E, 1))
    if num_warps is None:
        num_warps = 1 if block_e > ROUTE_WARP_COLUMNS else 4
    if block_rows is None:
        block_rows = max(1, min(ROUTE_MAX_ROWS, ROUTE_SCORES_PER_THREAD * 32 * num_warps //
                                block_e))
        if interpreting:
            block_rows = max(1, min(128, ROUTE_INTERPRETER_SCORES // block_e))
        block_rows = min(block_rows, _next_pow2(max(S, 1)))
    return RouteTiles(block_rows, num_warps, 1 if iters is None else iters)


@dataclass(frozen=True)
class ShortlistRouteTiles:
    """Tiles of the shortlist route kernel (`kernels/topk.py`, `_shortlist_route_kernel`).

    block_rows:    tokens of one head a program routes from their shortlists.
    num_warps:     warps per program.
    fallback_rows: rows a program with an unsure list walks at a time, routing from the
                   whole logits only those steps that hold an unsure row.
    """

    block_rows: int
    num_warps: int
    fallback_rows: int


# GPU: 16 rows on one warp (docs/routing.md, "Shortlists").
SHORTLIST_ROUTE_TILES = ShortlistRouteTiles(block_rows=16, num_warps=1, fallback_rows=2)
SHORTLIST_ROUTE_INTERPRETER = ShortlistRouteTiles(block_rows=128, num_warps=1, fallback_rows=2)


def shortlist_route_tiles(S: int, interpreting: bool = False, *, block_rows: int | None = None,
                          num_warps: int | None = None) -> ShortlistRouteTiles:
    """The shortlist route kernel's tiles for S tokens a head; the keywords override a
    choice. block_rows (given or not) is cut to the power of two S needs."""
    base = SHORTLIST_ROUTE_INTERPRETER if interpreting else SHORTLIST_ROUTE_TILES
    rows = min(base.block_rows if block_rows is None else block_rows, _next_pow2(max(S, 1)))
    return ShortlistRouteTiles(rows, base.num_warps if num_warps is None else num_warps,
                               min(base.fallback_rows, rows))


# The layout (kernels/layout.py).

# Tokens a block of the layout's per-block expert counts ([H, cdiv(S, T), E]: 6 MB at
# MAGI-2's S = 32768, where 8-token blocks would take 50 MB).
LAYOUT_BLOCK_T = 64
# The interpreter: blocks of this many route slots.
LAYOUT_INTERPRETER_SLOTS = 1024
# Routes a step of the ranking scatter (a lane of two warps each).
LAYOUT_CHUNK = 64
# Route slots a sub-block of the "count" count step: its pairwise rank tile is the square.
LAYOUT_SUB_SLOTS = 64
# Routes a step of the count-only kernel, at most.
LAYOUT_HIST_MAX_ROUTES = 1024
# Warps of the offsets, scatter and count-only kernels.
LAYOUT_NUM_WARPS = 4


@dataclass(frozen=True)
class LayoutScanTiles:
    """Tiles of the layout's scan (`_layout_scan_kernel`).

    block_b:   blocks a step of a program's loop over a head's blocks (at most
               next_pow2(NB)); 512 covers S = 32768 in one step, with its loads in flight
               together rather than in dependent steps.
    block_ec:  experts a program (at most next_pow2(E)).
    num_warps: warps per program.
    """

    block_b: int = 512
    block_ec: int = 8
    num_warps: int = 4


LAYOUT_SCAN_TILES = LayoutScanTiles()


def layout_block_t(top_k: int, interpreting: bool = False) -> int:
    """Tokens a block of the layout's counts (and of the counts the route kernels make for
    it). A function of top_k alone, not of S, so that the routing op and the layout op
    agree on it, and a compiled graph's fake shapes can compute it."""
    if interpreting:
        return max(1, LAYOUT_INTERPRETER_SLOTS // _next_pow2(top_k))
    return LAYOUT_BLOCK_T


def layout_chunk(block_t: int, top_k: int, interpreting: bool = False) -> int:
    """Routes a step of the ranking scatter: LAYOUT_CHUNK, the whole block in the
    interpreter."""
    return _next_pow2(block_t * top_k) if interpreting else LAYOUT_CHUNK


def layout_rank_scatter_warps(chunk: int) -> int:
    """Warps of the ranking scatter: a lane a route of the step, one to four warps."""
    return max(1, min(4, chunk // 32))


def layout_sub_t(block_t: int, top_k: int, interpreting: bool = False) -> int:
    """Tokens a sub-block of the "count" count step: LAYOUT_SUB_SLOTS route slots (the
    whole block in the interpreter)."""
    return block_t if interpreting else max(1, LAYOUT_SUB_SLOTS // _next_pow2(top_k))


def layout_count_warps(block_t: int, sub_t: int) -> int:
    """Warps of the "count" count step: 2 while it loops over sub-blocks (few registers,
    many programs an SM to hide each sub-block's loads), 4 for a block taken whole."""
    return 4 if sub_t == block_t else 2


def layout_hist_block_r(block_t: int, top_k: int) -> int:
    """Routes a step of the count-only kernel: a block's routes at once, up to
    LAYOUT_HIST_MAX_ROUTES."""
    return min(_next_pow2(block_t * top_k), LAYOUT_HIST_MAX_ROUTES)


# The exact split of the router weight (`split_router_weight`): elements a program, warps.
SPLIT_WEIGHT_BLOCK = 1024
SPLIT_WEIGHT_WARPS = 4


# The expert backward (kernels/expert_backward.py).

# The dx kernel's tile heights (the panels' row padding) at which the backward runs the
# Gluon dW GEMM (kernels/panel_dw_sm90.py): it reduces in 64-row steps, so each expert's
# panel rows must be whole steps, and these two are the heights the SASS audit compiles it
# at and tests/test_gpu.py checks, so the only ones a table may pair it with. Elsewhere it
# runs as Triton.
GLUON_DW_DX_ROWS = (64, 128)

# Bytes the panels of one launch group may take (see `expert_backward.py`): at
# MAGI-2 dims and 32,768 tokens one head's panels are 1.86 GiB in bf16.
PANEL_WORKSPACE_BYTES = 2 * 2**30


@dataclass(frozen=True)
class PanelGemmConfig:
    """Tiles of the panel GEMM C[f] = A_f^T B_f (`_panel_dw_kernel`).

    block_m, block_n: the [block_m, block_n] output tile of C[f] one program
        owns (fp32 accumulator in registers).
    block_k: panel rows per step of the reduction loop; clamped at launch to the dx
        kernel's block_m (the panel's row padding), which it must then divide.
    num_warps, num_stages: warps per program, pipelining depth of the loads.
    tma: load the panel tiles with tensor descriptors where the shapes allow.
    warp_specialized: the Gluon kernel of `kernels/panel_dw_sm90.py` (sm_90, bf16): loader
        warps run ahead of two consumer warpgroups, num_stages stages a consumer;
        block_m = block_k = 64 and num_warps = 4 (a consumer), block_n 64, 128 or 256
        (one program an SM; C leaves by bulk copies).
    store_buffers: with warp_specialized, a consumer's staging tiles (1 or 2): with two,
        a tile's bulk stores stay in flight while the next tile is staged.
    triton_fallback: with warp_specialized, the Triton tiles a table's config runs where
        the Gluon kernel cannot (not bf16, D or I not multiples of 64 and of block_n, dx
        tiles not of `GLUON_DW_DX_ROWS` rows); None: the same tiles in Triton.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = True
    warp_specialized: bool = False
    store_buffers: int = 1
    triton_fallback: PanelGemmConfig | None = None

    def __post_init__(self) -> None:
        check_tiles(self, ("block_m", "block_n", "block_k"))
        if self.triton_fallback is not None and (
                not self.warp_specialized or self.triton_fallback.warp_specialized):
            raise ValueError("PanelGemmConfig.triton_fallback: Triton tiles for a "
                             "warp_specialized config")
        if self.warp_specialized:
            if (self.block_m, self.block_k, self.num_warps) != (64, 64, 4) \
                    or self.block_n not in (64, 128, 256):
                raise ValueError("PanelGemmConfig.warp_specialized takes block_m = block_k = "
                                 "64, num_warps = 4 and block_n 64, 128 or 256, got "
                                 f"{self.block_m}/{self.block_n}/{self.block_k}/"
                                 f"{self.num_warps}")
            if self.num_stages < 2:
                # A consumer frees a stage only once the next step's wgmma is issued: with
                # one stage, a tile of two steps would wait on itself.
                raise ValueError("PanelGemmConfig.warp_specialized needs num_stages >= 2, "
                                 f"got {self.num_stages}")
            if self.store_buffers not in (1, 2):
                raise ValueError("PanelGemmConfig.store_buffers: 1 or 2, got "
                                 f"{self.store_buffers!r}")
            if self.shared_bytes() + 1024 > _SMEM_BYTES[(9, 0)]:
                raise ValueError(f"{self}: the Gluon kernel's rings and "
                                 f"staging tiles take {self.shared_bytes()} bytes of shared "
                                 f"memory, more than sm_90's {_SMEM_BYTES[(9, 0)]} less 1 KB "
                                 "for its barriers")

    def as_triton(self) -> PanelGemmConfig:
        """The Triton tiles this config runs where its Gluon kernel cannot (or where the
        dx tiles step down below `GLUON_DW_DX_ROWS`): triton_fallback, else the same
        tiles; a Triton config is itself."""
        if not self.warp_specialized:
            return self
        return self.triton_fallback or dataclasses.replace(self, warp_specialized=False)

    def shared_bytes(self) -> int:
        """The Gluon kernel's shared memory (warp_specialized): for each of the two
        consumers num_stages stages of a [64, 64] A box and a [64, block_n] B tile, and
        store_buffers [64, block_n] staging tiles, in bf16; its mbarriers below 1 KB."""
        return 2 * (self.num_stages * (64 + self.block_n)
                    + self.store_buffers * self.block_n) * 64 * 2


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
class PanelDxConfig:
    """Tiles of dx from the panels (`_panel_dx_kernel`): dx rows = dg Wg^T + du Wu^T over
    a tile of the dx kernel's panel rows (its block_m), the [block_m, D] fp32 accumulator
    in registers, the reduction over I in steps of block_i (one dot a step: every gate
    step, then every up step). num_warps, num_stages: warps a program, pipelining depth of
    the loads. tma: the weight slices through tensor descriptors where the shapes allow."""

    block_i: int
    num_warps: int
    num_stages: int
    tma: bool = True

    def __post_init__(self) -> None:
        check_tiles(self, ("block_i",))


def step_down_panel_dx(cfg: PanelDxConfig) -> PanelDxConfig | None:
    """The next `PanelDxConfig` to try after `cfg` ran out of resources; None when none is
    left."""
    if cfg.num_stages > 1:
        return dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_i > 16:
        return dataclasses.replace(cfg, block_i=cfg.block_i // 2)
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
    panel_dx: with panels, dx from the panels in a GEMM of its own (`_panel_dx_kernel`'s
        tiles): the dx kernel then computes g, u and t, writes dprobs and the panels and
        leaves out dx's two products and its [block_m, D] accumulator. None: the dx
        kernel computes dx itself. dx.warp_specialized (with panel_dx): the Gluon
        panel kernel of `kernels/expert_panels_sm90.py` writes the panels and dprobs
        where the shapes fit it (sm_90, bf16, D = 256, I a multiple of 64).
    sigmoid_rcp: the SwiGLU7 backward's sigmoid 1 / (1 + e) as one reciprocal on the
        special-function unit (rcp.approx.ftz, in every backward kernel) instead of the
        full-range division, which adds a range check and two rescales an element. The
        two agree bitwise where 1 + e <= 2^126 (g > -51.3); below, the division gives a
        subnormal sigmoid and the reciprocal zero. The interpreter (CPU) emulates the
        flush: the correctly rounded 1 / (1 + e), zero where 1 + e > 2^126 (not MUFU's
        approximation, which agrees with the division on the GPU).
    panel_store_bytes: how the Gluon panel kernel writes dg, du and a p: 16 (each quad of
        lanes transposes its words by three shuffles, then 16-byte stores) or 8 (lane
        pairs swap one word a store by one shuffle, then 8-byte stores, fewer
        instructions); the values are the same. Only the Gluon kernel reads it.
    The measurements behind both: docs/expert-backward.md ("The panel kernel's window").
    """

    dx: ExpertForwardConfig
    dw: ExpertForwardConfig
    panel: PanelGemmConfig | None = None
    panel_dx: PanelDxConfig | None = None
    sigmoid_rcp: bool = False
    panel_store_bytes: int = 16

    def __post_init__(self) -> None:
        if self.panel_dx is not None and self.panel is None:
            raise ValueError("ExpertBackwardConfig.panel_dx needs panels (panel is None)")
        if self.dx.warp_specialized and self.panel_dx is None:
            raise ValueError("ExpertBackwardConfig.dx.warp_specialized: the Gluon panel "
                             "kernel leaves dx to panel_dx, which is None")
        if self.dx.cluster != 1:
            raise ValueError("ExpertBackwardConfig.dx.cluster: the backward has no cluster "
                             f"variant, got {self.dx.cluster}")
        if self.dx.warp_specialized and self.dx.block_m != 128:
            raise ValueError("ExpertBackwardConfig.dx.warp_specialized: the Gluon panel "
                             f"kernel's tiles are 128 rows (the panels'), got {self.dx.block_m}")
        if self.dx.sigmoid_rcp or self.dw.sigmoid_rcp:
            raise ValueError("ExpertBackwardConfig: the backward's reciprocal is its own "
                             "sigmoid_rcp, not its dx or dw tiles'")
        if self.panel_store_bytes not in (8, 16):
            raise ValueError("ExpertBackwardConfig.panel_store_bytes must be 8 or 16, got "
                             f"{self.panel_store_bytes}")


# Mean rows per expert (R / number of flat experts) -> tiles; the first row
# whose bound is >= the mean wins. The dw kernel holds 3 * D * block_i fp32
# accumulators: at D = 256, block_i = 32 that is 96 registers a thread over 8
# warps. The dx kernel's panel stores need 8 KB more shared memory than the
# forward's tiles, hence block_i = 16 with 3 stages (209 KB of the 227 KB) at
# many rows per expert. The sweeps behind each choice: docs/expert-backward.md.
SM90_PANEL = PanelGemmConfig(128, 256, 64, 8, 3)
# At few rows an expert (64 or fewer in the table) the dW GEMMs are short in K (rows) and
# one 128/256 tile an SM (147 KB of shared memory) leaves its stores and the next tile's
# loads unoverlapped; 64/128 tiles of 2 stages fit 4 programs an SM, which pays at few
# rows and costs at many
# (the sweep: docs/expert-backward.md, "The dW GEMMs at few rows an expert").
SM90_PANEL_FEW = PanelGemmConfig(64, 128, 64, 4, 2)
SM90_FUSED = ExpertBackwardConfig(dx=ExpertForwardConfig(128, 16, 8, 3),
                                  dw=ExpertForwardConfig(128, 32, 8, 1), panel=SM90_PANEL)
# dx from the panels (ExpertBackwardConfig.panel_dx), with the Triton dx kernel leaving
# its products out (SM90_SPLIT) or with the Gluon panel kernel (SM90_SPLIT_WS, which the
# backward runs as the fused SM90_FUSED where the Gluon kernel cannot: not bf16, D != 256).
# 64/8/4: 196 KB of shared memory and 231 registers, no spills, a wgmma in flight across
# steps. The split reads W_gate and W_up once more (4 GB at MAGI-2's dims), which its
# faster kernels repay only at many rows per expert: SM90_SPLIT_WS from 192 up, where
# ~1 ms of extra reads meets the 3.3 ms it saved at 768 (32,768 tokens), scaled by rows:
# an estimate until the sweep at 4,096 and 16,384 tokens places it
# (docs/expert-backward.md, "dx from the panels").
SM90_PANEL_DX = PanelDxConfig(64, 8, 4)
SM90_SPLIT = dataclasses.replace(SM90_FUSED, panel_dx=SM90_PANEL_DX)
SM90_SPLIT_WS = dataclasses.replace(
    SM90_SPLIT, dx=dataclasses.replace(SM90_SPLIT.dx, warp_specialized=True),
    sigmoid_rcp=True, panel_store_bytes=8)
# The Gluon dW GEMM (kernels/panel_dw_sm90.py) at its best measured tiles, 64/64 and six
# stages (with 128-row dx tiles; where it cannot run, the Triton tiles measured there).
# Off in the table: 2.5-3.3% faster than SM90_PANEL_FEW in the expert backward with
# uniform routing, but with one hot expert a head (4,096 routes: tiles of 64 steps among
# tiles of 2) forward+backward took 1.17x uniform routing's time at 4,096 tokens against
# 1.01x with the Triton tiles (H100). Its persistent programs take their tiles in a fixed
# order, which explains part of that (docs/expert-backward.md, "Skewed routing and the
# Gluon dW GEMM").
SM90_PANEL_FEW_WS = PanelGemmConfig(64, 64, 64, 4, 6, warp_specialized=True,
                                    triton_fallback=SM90_PANEL_FEW)
# At few rows an expert the dx kernel pads each expert's routes to whole tiles, so the
# tile height sets how much of its work, of the panels it writes and of the dW GEMMs'
# reductions is padding: 32-row tiles (mma.sync: a warpgroup's wgmma takes 64 rows) around
# 24 rows an expert, 64-row tiles up to ~64, 128-row tiles above, where an expert's
# routes span several tiles and each tile reads its weights again. The bounds sit between
# the token counts swept (docs/expert-backward.md, "The dx kernel's tiles at few rows").
SM90_FEW_ROWS = ExpertBackwardConfig(dx=ExpertForwardConfig(64, 32, 4, 3),
                                     dw=ExpertForwardConfig(64, 32, 8, 2), panel=SM90_PANEL_FEW)
BACKWARD_SM90 = (
    (28.0, dataclasses.replace(SM90_FEW_ROWS, dx=ExpertForwardConfig(32, 32, 4, 4))),
    (64.0, SM90_FEW_ROWS),
    (192.0, dataclasses.replace(SM90_FUSED, panel=SM90_PANEL_FEW)),
    (float("inf"), SM90_SPLIT_WS),
)
# float32 operands (fp32 weights, or mixed dtypes): twice the shared memory per
# tile, so the bf16 rows above would not fit (dx 336 KB, dw 248 KB against 227 KB);
# starting from tiles that fit saves the launch-time step-downs, each of which
# recompiles a kernel.
BACKWARD_SM90_FP32 = (
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(64, 32, 4, 1),
                                        dw=ExpertForwardConfig(32, 32, 8, 1),
                                        panel=PanelGemmConfig(64, 64, 32, 4, 2))),
)
# Ampere/Ada and unknown CUDA GPUs: less shared memory, no wgmma.
BACKWARD_GENERIC = (
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(64, 32, 4, 2),
                                        dw=ExpertForwardConfig(32, 32, 8, 1),
                                        panel=PanelGemmConfig(64, 64, 32, 4, 2, tma=False))),
)
# The Triton interpreter (CPU tests): big tiles run fastest there.
BACKWARD_INTERPRETER = (
    (float("inf"), ExpertBackwardConfig(dx=ExpertForwardConfig(32, 32, 4, 1),
                                        dw=ExpertForwardConfig(32, 32, 4, 1),
                                        panel=PanelGemmConfig(32, 32, 32, 4, 1))),
)
BACKWARD_TABLES = {(9, 0): BACKWARD_SM90}


def expert_backward_config(
    device: torch.device, rows_per_expert: float, interpreting: bool = False,
    fp32_operands: bool = False,
) -> ExpertBackwardConfig:
    """The default tiles for a problem of `rows_per_expert` mean routes per expert
    (`fp32_operands`: the dots take float32 operands, see BACKWARD_SM90_FP32).

    A config that does not fit the chip is shrunk at launch time
    (`step_down` on OutOfResources), kernel by kernel.
    """
    if interpreting or device.type != "cuda":
        table = BACKWARD_INTERPRETER
    else:
        arch = torch.cuda.get_device_capability(device)
        table = BACKWARD_TABLES.get(arch, BACKWARD_GENERIC)
        if fp32_operands and arch == (9, 0):
            table = BACKWARD_SM90_FP32
    return next(c for bound, c in table if rows_per_expert <= bound)


# Content keys (kernels/row_keys.py): (rows a program, columns a step). Integer hashing
# that reads each row once; no tensor cores. The GPU tiles are not tuned (not yet run on
# a GPU when written); the interpreter's cost is per program and per op, so big tiles.
ROW_KEYS_TILES = (32, 64)
ROW_KEYS_TILES_INTERPRET = (256, 256)


def row_keys_tiles(interpret: bool) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the content-key kernel."""
    return ROW_KEYS_TILES_INTERPRET if interpret else ROW_KEYS_TILES


# The router logits' backward on tensor cores (kernels/router_backward.py).


@dataclass(frozen=True)
class RouterBackwardConfig:
    """Tiles of both router backward kernels: dx programs own [block_s, block_d] of a
    head's dx and step over E by block_e; d gate programs own [block_e, block_d] of a
    head's d gate and step over a chunk of its tokens by block_s. dgate_chunk: tokens a
    d gate chunk at least (a multiple of block_s; `router_dgate_chunks`)."""

    block_s: int
    block_e: int
    block_d: int
    num_warps: int
    num_stages: int
    dgate_chunk: int

    def __post_init__(self) -> None:
        check_tiles(self, ("block_s", "block_e", "block_d"))
        if self.dgate_chunk < self.block_s or self.dgate_chunk % self.block_s:
            raise ValueError(f"RouterBackwardConfig.dgate_chunk={self.dgate_chunk} must be a "
                             f"positive multiple of block_s={self.block_s}")


# One warpgroup, [64, 128] fp32 accumulators (64 registers a thread), K steps of 64:
# bf16 dots of m64n128k16 wgmmas, their A operands (the split d logits) from registers.
# One stage: with 2 or 3, Triton 3.6 pipelines the last dot of a step across the loop's
# back-edge and the next step's loads and splits write the registers of that wgmma's A
# operand while it may still read them (the SASS audit finds 68-207 such writes a kernel;
# the race of docs/routing.md). d gate chunks of 4,096 tokens: 8 at S = 32,768, 768
# programs at MAGI-2's dims. Not yet measured (docs/routing.md, "The router's backward on
# tensor cores").
ROUTER_BACKWARD_SM90 = RouterBackwardConfig(block_s=64, block_e=64, block_d=128, num_warps=4,
                                            num_stages=1, dgate_chunk=4096)
# Small chunks, so that the tests' few hundred tokens still make several.
ROUTER_BACKWARD_INTERPRETER = RouterBackwardConfig(block_s=32, block_e=32, block_d=64,
                                                   num_warps=4, num_stages=1, dgate_chunk=64)
# At most this many d gate chunks (the partial sums take P times d gate's 3 MB).
ROUTER_DGATE_MAX_CHUNKS = 16


def router_backward_config(interpreting: bool) -> RouterBackwardConfig:
    """The router backward kernels' tiles (GPU: sm_90's; the interpreter: small ones)."""
    return ROUTER_BACKWARD_INTERPRETER if interpreting else ROUTER_BACKWARD_SM90


def router_dgate_chunks(S: int, config: RouterBackwardConfig) -> tuple[int, int]:
    """(P, chunk): the d gate kernel cuts each head's S tokens into P chunks of `chunk`
    tokens (the last one shorter): config.dgate_chunk, or longer where that would make
    more than ROUTER_DGATE_MAX_CHUNKS, in whole blocks. From S alone, so that a head's
    sum has the same order whichever heads share the launch and whatever the GPU."""
    chunk = max(config.dgate_chunk, -(-S // ROUTER_DGATE_MAX_CHUNKS))
    chunk = -(-chunk // config.block_s) * config.block_s
    return max(1, -(-S // chunk)), chunk
