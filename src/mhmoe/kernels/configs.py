"""Per-architecture tile choices of the Triton kernels, as data.

`expert_forward_config()` picks an `ExpertForwardConfig` from the GPU
architecture and the problem's shapes (never from the routing itself, which
lives on the device); tests and benchmarks can pass their own config instead.
`step_down()` gives the next smaller config when one does not fit the chip.
`logits_route_config()` does the same for the router-logits kernel
(`LogitsRouteConfig`); the backward's tiles live in backward_configs.py.
"""

from __future__ import annotations

import dataclasses
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
    warp_specialized: the Gluon kernel of `kernels/expert_forward_ws.py` (sm_90, bf16,
                D = 256, I a multiple of 64): persistent, two MMA warpgroups taking
                turns, two loader warps; its tiles are its own (128 routes, slices of
                64). The other fields are the Triton kernel's tiles for shapes it does
                not take when the default table picks the row; a config a caller passes
                with warp_specialized for such a shape raises ValueError.
    cluster:    with warp_specialized, 2 runs the kernel in clusters of two CTAs
                that share each weight stage by multicast bulk copies (1: no clusters).
    """

    block_m: int
    block_i: int
    num_warps: int
    num_stages: int
    tma: bool = True
    paired: bool = False
    warp_specialized: bool = False
    cluster: int = 1

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
# x tile is reused over several row blocks per expert: measured on an H200
# (benchmarks/NOTES.md, v4) -8% at 384 rows per expert, -6% at 768, but +6% at
# 96, where the kernel streams weights and the bulk copies of `tma` win.
# warp_specialized (the Gluon kernel, for the shapes it takes; the Triton tiles beside it
# for the others): measured on an H200 (NOTES.md, forward v5) 9.4-10.1 ms against
# 11.2 at 768 rows per expert, 5.2-5.6 against 6.1 at 384, 1.91 against 2.08 at 96, but
# 1.59 against 1.55 at 24, where both stream weights and the Triton tiles stay.
# cluster=2 (forward v6, NOTES.md): 8.97-9.04 against 9.17 ms at 768 rows per expert
# (deterministic 9.33-9.61 against 9.47-9.90), but slower at 384 in deterministic mode
# (5.71-6.18 against 5.26-5.41) and far slower at 96 (2.73-2.81 against 1.70).
_HOPPER = (
    (40.0, ExpertForwardConfig(block_m=64, block_i=32, num_warps=4, num_stages=4)),
    (192.0, ExpertForwardConfig(block_m=128, block_i=32, num_warps=8, num_stages=3,
                                warp_specialized=True)),
    (576.0, ExpertForwardConfig(block_m=128, block_i=32, num_warps=8, num_stages=3,
                                paired=True, warp_specialized=True)),
    (float("inf"), ExpertForwardConfig(block_m=128, block_i=32, num_warps=8, num_stages=3,
                                       paired=True, warp_specialized=True, cluster=2)),
)
# Ampere/Ada and unknown CUDA GPUs: less shared memory, no wgmma.
_GENERIC_CUDA = (
    (float("inf"), ExpertForwardConfig(block_m=64, block_i=32, num_warps=4, num_stages=2)),
)
# The Triton interpreter (CPU tests): big tiles run fastest there.
_INTERPRETER = (
    (float("inf"), ExpertForwardConfig(block_m=32, block_i=32, num_warps=4, num_stages=1)),
)
_TABLES = {(9, 0): _HOPPER}

# Shared memory a program may use, by architecture (bytes); the default for others.
_SMEM_BYTES = {(9, 0): 227 * 1024, (8, 0): 163 * 1024}
_SMEM_DEFAULT = 99 * 1024

# Workspace limits (bytes) of the launcher: the fp32 accumulator of the default
# mode and the per-route buffer of the deterministic mode are sized for at most
# this many bytes; larger problems run in several launches over groups of heads.
DEFAULT_WORKSPACE_BYTES = 256 * 2**20
DETERMINISTIC_WORKSPACE_BYTES = 1024 * 2**20


def _arch(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


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
        table = _INTERPRETER
    else:
        table = _TABLES.get(arch, _GENERIC_CUDA)
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


# Tiles of the logits (+ route) kernel of kernels/routing.py, per architecture, as data.


@dataclass(frozen=True)
class LogitsRouteConfig:
    """Tiles of `kernels.routing._logits_route_kernel`.

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
                row's exact top K (`routing._shortlist`), and `_shortlist_route_kernel`
                routes each row from those lists: the K picked logits read where the
                keys order the picks, the listed ones where they do not, instead of all
                E (the same results, bitwise).
    merged_lists: with shortlist, where K < next_pow2(K) < block_e / 4: the lists come
                from sorting networks on each thread's keys and two merges between
                threads (`routing._shortlist_merged`) instead of next_pow2(K) + 1 passes
                over the tile's keys (nine at K = 6; the same lists where both are sure,
                bitwise the same routes either way; sm_90: 12% fewer SASS
                instructions and 155 registers instead of 167; logits kernel 361 us
                against 365, NOTES.md routing v15).
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


# Hopper (sm_90). Compile-only numbers for E = D = 256, K = 6 (ptxas -v, sm_90a; NOTES.md):
# 64 tokens, one warpgroup (m64n256 wgmma, each thread 2 rows x 64 columns of the tile: row
# reductions are in-thread plus two shuffles), picked logits read back from memory: 255
# registers (292 B spilled around the tile store), 104 KB shared memory with 3 stages, so
# two programs fit an SM and one's tensor-core phase can overlap the other's routing. The
# alternatives the benchmark sweeps: 128 tokens on two warpgroups (half the weight reads
# from L2 per token, but one program an SM), and from_tile with 64 tokens on 8 warps (no
# logits written; each row split over two warps, reductions through shared memory).
#
# Measured on an H200 (NOTES.md, routing v4): the one-pass kernel took 1.43-1.94 ms at
# S=32768 over its tiles (1.77 with 64/32/4/3), no faster than cuBLAS's fp32 GEMM and the
# route kernel (1.75). So the default splits it (`split`): the kernel as an exact-split
# bf16 GEMM writing the logits, then `_route_kernel`. Since routing v7, each program
# computes 128 tokens x 128 of the 256 experts on one warpgroup, K steps of 32, 3 stages,
# the tile stored in two column halves (sm_90: 74 KB shared memory since routing v8's x in
# 2D boxes, 178 registers, two programs an SM): logits + route with counts 0.689 ms at
# S=32768 against 0.734 for the v5-v6 tile (128 tokens x all experts on two warpgroups,
# K steps of 64, 2 stages, one program an SM); NOTES.md tabulates 8 of the 18 tiles swept
# (all in benchmarks/results/routing_v7_split_block_e.json). Re-swept after routing v8's
# race fix: 0.676 ms, still the best with 128/32/8/3 (routing_v8_split.json). Routing v9:
# the logits leave through bulk (TMA) stores (154 registers instead of 178, the same 74 KB
# of shared memory, the same bits): 0.527-0.549 ms against 0.557-0.565 for st.global, logits
# + the new route kernel with counts (benchmarks/results/routing_v9_tma_store.json).
LOGITS_ROUTE_CONFIGS = {
    (9, 0): LogitsRouteConfig(block_s=128, block_d=32, num_warps=4, num_stages=3,
                              from_tile=False, split=True, half_stores=True, block_e=128,
                              tma_store=True, shortlist=True, merged_lists=True),
}
# Other CUDA GPUs (no wgmma): 8 warps keep the tile at 64 registers a thread (sm_80: no spills).
_LOGITS_ROUTE_GENERIC = LogitsRouteConfig(block_s=64, block_d=32, num_warps=8, num_stages=2,
                                          from_tile=False)
# The interpreter (CPU tests): its cost is per program and per op, so big tiles.
_LOGITS_ROUTE_INTERPRETER = LogitsRouteConfig(block_s=128, block_d=256, num_warps=4,
                                              num_stages=1, from_tile=True)


def logits_route_config(device: torch.device, interpreting: bool = False) -> LogitsRouteConfig:
    """The default tiles of `kernels/routing.py`'s logits (+ route) kernel on `device`
    (the interpreter's off CUDA or when `interpreting`)."""
    if device.type != "cuda" or interpreting:
        return _LOGITS_ROUTE_INTERPRETER
    arch = torch.cuda.get_device_capability(device)
    return LOGITS_ROUTE_CONFIGS.get(arch, _LOGITS_ROUTE_GENERIC)
