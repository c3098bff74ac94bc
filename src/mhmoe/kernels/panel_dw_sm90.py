"""The panel dW GEMMs for Hopper (sm_90) in Gluon, warp-specialised.

The contract of `expert_backward._panel_dw_kernel`: C[f] = A_f^T B_f for the experts of
one panel group, A_f and B_f the expert's panel rows (x and dg, x and du, a p and dy),
each [BLOCK_M, BLOCK_N] output tile summed over those rows in ascending order in fp32
(wgmma, K = 64 steps) and written once in bf16; an expert without routes gets zeros.

Why a kernel of its own: under ncu (docs/expert-backward.md, "The dW GEMMs under ncu")
the largest share of the Triton kernel's warp samples is the wait for the bulk loads of
the step about to be multiplied: 39% at 1,024 tokens, where every tile is one step and a
program issues its loads only once its previous tile is written, and 43% at 32,768.
Here loader warps walk the same tiles ahead of the consumers, so a tile's loads are in
flight while the tiles before it are multiplied and stored.

One persistent program an SM takes the output tiles q, q + programs, ...; it splits them
between two consumer warpgroups (even and odd tiles of its own list), so that one
warpgroup's epilogue runs beside the other's wgmmas. Partitions:

- two consumer warpgroups (the default partition is consumer 0): per tile, wgmmas over
  its steps from their own ring (A read transposed from the [64 rows, 64] stage), then
  the accumulator rounded to bf16 into one of BUFS staging tiles and written by bulk
  copies of [64, 64] boxes, left in flight until that staging tile comes round again;
- two loader warps, one a consumer, each filling its consumer's ring of NSTAGE stages
  (A [64, 64] and B [64, BLOCK_N]: one bulk copy of each 64-column box) in the order the
  consumer reads them;
- two idle warps, so that the loaders' warpgroup is whole (setmaxnreg).

Numerics: the Triton kernel's at the same BLOCK_N with block_m = block_k = 64: the same
wgmma shape (m64nNk16) and K order, so bitwise equal (`tests/test_gpu.py`).

Shapes it takes (`expert_backward._gluon_dw_fits`): bf16 panels and C, M a multiple of 64
(C as [F * M, N] by 64-row boxes then stays inside each expert), BLOCK_N dividing N, panel
rows of the dx kernel a multiple of 64, sm_90.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .expert_forward_sm90 import _idle

# Registers a thread (setmaxnreg): the consumers hold a [64, BLOCK_N] fp32 accumulator
# (BLOCK_N / 2 registers) beside its bf16 copy for the staging tile; the loaders little.
CONSUMER_REGS = 232
LOADER_REGS = 40
MAXNREG = 168


@gluon.jit
def _tile(tile, offsets_ptr, tile_first_ptr, first_expert, M: gl.constexpr, N: gl.constexpr,
          TILE_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Output tile `tile`: (flat expert f, first row of C[f] m0, first column n0, its
    first panel row, its K steps of 64 rows)."""
    NUM_M: gl.constexpr = M // 64
    NUM_N: gl.constexpr = N // BLOCK_N
    e = tile // (NUM_M * NUM_N)
    m0 = (tile // NUM_N) % NUM_M * 64
    n0 = tile % NUM_N * BLOCK_N
    f = first_expert + e
    routes = gl.load(offsets_ptr + f + 1) - gl.load(offsets_ptr + f)
    row0 = gl.load(tile_first_ptr + e) * TILE_M
    steps = (gl.cdiv(routes, TILE_M) * (TILE_M // 64)).to(gl.int32)
    return f, m0, n0, row0, steps


@gluon.jit
def _loader(a_desc, b_desc, a_s, b_s, ready, empty, offsets_ptr, tile_first_ptr,
            first_expert, tiles, C: gl.constexpr, M: gl.constexpr, N: gl.constexpr,
            TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, NSTAGE: gl.constexpr):
    """Consumer C's stages: every step of each of its tiles, in its order."""
    programs = gl.num_programs(0)
    n = 0
    for tile in range(gl.program_id(0) + C * programs, tiles, 2 * programs):
        _, m0, n0, row0, steps = _tile(tile, offsets_ptr, tile_first_ptr, first_expert, M, N,
                                       TILE_M, BLOCK_N)
        for s in range(steps):
            slot = n % NSTAGE
            # Free once the consumer's wgmma that read its previous use retired (the
            # barriers start with phase 1 complete).
            mbarrier.wait(empty.index(slot), ((n // NSTAGE) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 64 * (64 + BLOCK_N) * 2)
            r = row0 + s * 64
            tma.async_copy_global_to_shared(a_desc, [r, m0], bar, a_s.index(slot))
            for c in gl.static_range(BLOCK_N // 64):
                tma.async_copy_global_to_shared(b_desc, [r, n0 + c * 64], bar,
                                                b_s.index(slot).slice(c * 64, 64, dim=1))
            n += 1


@gluon.jit
def _consumer(c_desc, a_s, b_s, c_s, ready, empty, offsets_ptr, tile_first_ptr,
              first_expert, tiles, C: gl.constexpr, M: gl.constexpr, N: gl.constexpr,
              TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, NSTAGE: gl.constexpr,
              BUFS: gl.constexpr):
    """Consumer C's tiles: the sum over the steps, then the bulk stores of C from staging
    tile k % BUFS (k: the tiles it stored before)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    programs = gl.num_programs(0)
    n = 0
    k = 0
    for tile in range(gl.program_id(0) + C * programs, tiles, 2 * programs):
        f, m0, n0, _, steps = _tile(tile, offsets_ptr, tile_first_ptr, first_expert, M, N,
                                    TILE_M, BLOCK_N)
        acc = gl.zeros([64, BLOCK_N], gl.float32, acc_layout)
        for s in range(steps):
            slot = n % NSTAGE
            mbarrier.wait(ready.index(slot), (n // NSTAGE) & 1)
            acc = warpgroup_mma(a_s.index(slot).permute((1, 0)), b_s.index(slot), acc,
                                is_async=True)
            # One wgmma left in flight: the previous step's retired, its stage is free.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if s > 0:
                mbarrier.arrive(empty.index((n - 1) % NSTAGE), count=1)
            n += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if steps > 0:
            mbarrier.arrive(empty.index((n - 1) % NSTAGE), count=1)
        out = acc.to(gl.bfloat16)
        # The bulk stores that read this staging tile, BUFS tiles ago, are done: each
        # copy is a bulk group of its own, and the newer tiles' may stay in flight (the
        # thread that issued them waits; the barrier passes that on to the warpgroup).
        tma.store_wait((BUFS - 1) * (BLOCK_N // 64))
        gl.thread_barrier()
        staging = c_s.index(k % BUFS)
        staging.store(out)
        fence_async_shared()
        gl.thread_barrier()
        row = f * M + m0
        for c in gl.static_range(BLOCK_N // 64):
            tma.async_copy_shared_to_global(c_desc, [row, n0 + c * 64],
                                            staging.slice(c * 64, 64, dim=1))
        k += 1
    tma.store_wait(0)


@gluon.jit
def _panel_dw_sm90_kernel(
    a_desc, b_desc,  # panels A [P, M], B [P, N]; [64, 64] boxes
    c_desc,  # C as [F * M, N]; [64, 64] boxes
    offsets_ptr, tile_first_ptr,  # CSR offsets [H*E + 1]; the dx launch's tile_first [n]
    first_expert, tiles,  # output tiles of the launch: experts * (M / 64) * (N / BLOCK_N)
    M: gl.constexpr, N: gl.constexpr, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NSTAGE: gl.constexpr, BUFS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):
    """C[f] = A_f^T B_f (see the module docstring). Launch grid: (programs,), persistent;
    4 warps (consumer 0) plus the workers. NSTAGE: stages of each consumer's ring; BUFS:
    its staging tiles."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.bfloat16)
    a_s0 = gl.allocate_shared_memory(gl.bfloat16, [NSTAGE, 64, 64], a_layout)
    a_s1 = gl.allocate_shared_memory(gl.bfloat16, [NSTAGE, 64, 64], a_layout)
    b_s0 = gl.allocate_shared_memory(gl.bfloat16, [NSTAGE, 64, BLOCK_N], b_layout)
    b_s1 = gl.allocate_shared_memory(gl.bfloat16, [NSTAGE, 64, BLOCK_N], b_layout)
    c_s0 = gl.allocate_shared_memory(gl.bfloat16, [BUFS, 64, BLOCK_N], b_layout)
    c_s1 = gl.allocate_shared_memory(gl.bfloat16, [BUFS, 64, BLOCK_N], b_layout)
    ready0 = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    ready1 = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty0 = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty1 = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NSTAGE):
        mbarrier.init(ready0.index(s), count=1)
        mbarrier.init(ready1.index(s), count=1)
        mbarrier.init(empty0.index(s), count=1)
        mbarrier.init(empty1.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (c_desc, a_s0, b_s0, c_s0, ready0, empty0, offsets_ptr, tile_first_ptr,
                     first_expert, tiles, 0, M, N, TILE_M, BLOCK_N, NSTAGE, BUFS)),
        (_consumer, (c_desc, a_s1, b_s1, c_s1, ready1, empty1, offsets_ptr, tile_first_ptr,
                     first_expert, tiles, 1, M, N, TILE_M, BLOCK_N, NSTAGE, BUFS)),
        (_loader, (a_desc, b_desc, a_s0, b_s0, ready0, empty0, offsets_ptr, tile_first_ptr,
                   first_expert, tiles, 0, M, N, TILE_M, BLOCK_N, NSTAGE)),
        (_loader, (a_desc, b_desc, a_s1, b_s1, ready1, empty1, offsets_ptr, tile_first_ptr,
                   first_expert, tiles, 1, M, N, TILE_M, BLOCK_N, NSTAGE)),
        (_idle, (1,)),
    ], [4, 1, 1, 2], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS, LOADER_REGS])


def descriptors(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
    """[64, 64]-box descriptors of A, B and C as [F * M, N]."""
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    N = c.shape[2]
    return tuple(TensorDescriptor.from_tensor(t, [64, 64], layout)
                 for t in (a, b, c.view(-1, N)))


def kernel_options(M: int, N: int, tile_m: int, block_n: int, stages: int,
                   buffers: int) -> dict:
    """The constexprs of `_panel_dw_sm90_kernel`."""
    return dict(M=M, N=N, TILE_M=tile_m, BLOCK_N=block_n, NSTAGE=stages, BUFS=buffers,
                CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS)


def launch_dw(a, b, c, offsets, tile_first, *, first_expert: int, experts: int, tile_m: int,
              block_n: int, stages: int, buffers: int) -> None:
    """C[f] for `experts` flat experts from `first_expert` (the shapes that
    `expert_backward._gluon_dw_fits` admits): one persistent program an SM, at most one
    for each two output tiles."""
    if tile_m % 64:
        # Each tile's steps would come out zero and its gradients zeros.
        raise ValueError(f"the Gluon dW GEMM needs dx tiles of a multiple of 64 rows, got "
                         f"{tile_m}")
    M, N = c.shape[1:]
    tiles = experts * (M // 64) * (N // block_n)
    sms = torch.cuda.get_device_properties(c.device).multi_processor_count
    programs = max(1, min(sms, (tiles + 1) // 2))
    _panel_dw_sm90_kernel[(programs,)](
        *descriptors(a, b, c), offsets, tile_first, first_expert, tiles,
        **kernel_options(M, N, tile_m, block_n, stages, buffers), num_warps=4,
        maxnreg=MAXNREG)


def sm90_compile_cases(block_n: int, stages: int, buffers: int, tile_m: int = 128) -> list:
    """This kernel at MAGI-2's two weight shapes, [D, I] (W_gate and W_up) and [I, D]
    (W_down) (`mhmoe.kernels.CompileCase`)."""
    from triton.runtime.jit import mangle_type

    from ..config import MAGI2_PREVIEW as M
    from . import CompileCase

    D, I = M.head_dim, M.expert_intermediate_size
    cases = []
    for m_dim, n_dim in ((D, I), (I, D)):
        p = torch.empty(256, m_dim, dtype=torch.bfloat16)
        q = torch.empty(256, n_dim, dtype=torch.bfloat16)
        descs = descriptors(p, q, torch.empty(2, m_dim, n_dim, dtype=torch.bfloat16))
        sig = {**{k: mangle_type(d) for k, d in zip(("a_desc", "b_desc", "c_desc"), descs,
                                                    strict=True)},
               "offsets_ptr": "*i64", "tile_first_ptr": "*i32", "first_expert": "i32",
               "tiles": "i32"}
        cases.append(CompileCase(
            f"panel dW {m_dim}x{n_dim} ws (Gluon) 64/{block_n}/{stages}/{buffers} "
            f"(dx rows {tile_m})",
            _panel_dw_sm90_kernel, sig,
            kernel_options(m_dim, n_dim, tile_m, block_n, stages, buffers), 4, 1, (),
            MAXNREG))
    return cases
