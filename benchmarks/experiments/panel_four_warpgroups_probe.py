"""Compile-only probe (no GPU): four MMA warpgroups of 32-wide slices, registers, spills.

    .venv/bin/python benchmarks/experiments/panel_four_warpgroups_probe.py 96 104 ...

The Gluon panel kernel's MMA body cut to 32-wide slices (gate|up N = 64, t N = 32; the
SwiGLU7 backward of the shipped kernel), four warpgroups of it (a pair a 64-row half,
taking alternate slices), a ring of two slices (96 KB), no turns, plain bf16 stores, no
loaders: a rough register probe, not a kernel. Prints, for each MMA register budget,
what ptxas reports and the slice loops (tools/sass_audit.py). docs/expert-backward.md,
"Again, by warpgroup, and two hypotheses tested".
"""
import sys

sys.path.insert(0, 'tools')
sys.path.insert(0, 'src')
import sass_audit as sa
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mhmoe.kernels.expert_panels_sm90 import _swiglu7_backward


@gluon.jit
def _mma(W: gl.constexpr, xs, dys, sg, sd, ready, empty, probs_ptr, out_ptr, dprobs_ptr,
         ntiles, NI: gl.constexpr, RCP: gl.constexpr):
    gu_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, 64, 16])
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 32, 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, t_layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, t_layout)
    P: gl.constexpr = W // 2
    Q: gl.constexpr = W % 2
    xh = xs.index(P)
    dyh = dys.index(P)
    n = 0
    for tile in range(gl.program_id(0), ntiles, gl.num_programs(0)):
        rows = tile * 128 + P * 64 + gl.arange(0, 64, layout=rows_l)
        p = gl.load(probs_ptr + rows)
        dprob = gl.zeros([64], gl.float32, rows_l)
        for j in range(Q, NI, 2):
            slot = (n % 2)
            mbarrier.wait(ready.index(slot), (n // 2) & 1)
            gu = gl.zeros([64, 64], gl.float32, gu_layout)
            for c in gl.static_range(4):
                gu = warpgroup_mma(xh.slice(c * 64, 64, dim=1), sg.index(slot * 4 + c), gu,
                                   use_acc=c > 0, is_async=True)
                gu = warpgroup_mma_wait(num_outstanding=1, deps=(gu,))
            t = gl.zeros([64, 32], gl.float32, t_layout)
            for h in gl.static_range(2):
                st = sd.index(slot * 2 + h)
                for c in gl.static_range(2):
                    t = warpgroup_mma(dyh.slice(h * 128 + c * 64, 64, dim=1),
                                      st.slice(c * 64, 64, dim=1).permute((1, 0)), t,
                                      use_acc=h + c > 0, is_async=True)
                    t = warpgroup_mma_wait(num_outstanding=1, deps=(t,))
            gu, t = warpgroup_mma_wait(num_outstanding=0, deps=(gu, t))
            mbarrier.arrive(empty.index(slot), count=1)
            n += 1
            g, u = gu.reshape([64, 2, 32]).permute((0, 2, 1)).split()
            g = gl.convert_layout(g, t_layout)
            u = gl.convert_layout(u, t_layout)
            a, dg, du = _swiglu7_backward(g, u, t, p, RCP)
            dprob += gl.sum(a * t, axis=1)
            cols = j * 32 + gl.arange(0, 32, layout=cols_l)
            offs = rows[:, None].to(gl.int64) * (NI * 32) + cols[None, :]
            gl.store(out_ptr + offs, dg.to(gl.bfloat16))
            gl.store(out_ptr + 1000000 + offs, du.to(gl.bfloat16))
            gl.store(out_ptr + 2000000 + offs, (a * p[:, None]).to(gl.bfloat16))
        gl.store(dprobs_ptr + rows + Q * 1000000, dprob)


@gluon.jit
def _nothing(x):
    pass


@gluon.jit
def probe_kernel(probs_ptr, out_ptr, dprobs_ptr, ntiles, NI: gl.constexpr, RCP: gl.constexpr,
                 MMA_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
    xy: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 256], gl.bfloat16)
    xs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 256], xy)
    dys = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 256], xy)
    sg = gl.allocate_shared_memory(gl.bfloat16, [8, 64, 64],
                                   gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16))
    sd = gl.allocate_shared_memory(gl.bfloat16, [4, 32, 128],
                                   gl.NVMMASharedLayout.get_default_for([32, 128], gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_nothing, (ntiles,)),
        (_mma, (0, xs, dys, sg, sd, ready, empty, probs_ptr, out_ptr, dprobs_ptr, ntiles, NI, RCP)),
        (_mma, (1, xs, dys, sg, sd, ready, empty, probs_ptr, out_ptr, dprobs_ptr, ntiles, NI, RCP)),
        (_mma, (2, xs, dys, sg, sd, ready, empty, probs_ptr, out_ptr, dprobs_ptr, ntiles, NI, RCP)),
        (_mma, (3, xs, dys, sg, sd, ready, empty, probs_ptr, out_ptr, dprobs_ptr, ntiles, NI, RCP)),
    ], [4, 4, 4, 4], [MMA_REGS, MMA_REGS, MMA_REGS, MMA_REGS])


sig = {"probs_ptr": "*fp32", "out_ptr": "*bf16", "dprobs_ptr": "*fp32", "ntiles": "i32"}
for regs in (int(a) for a in sys.argv[1:]):
    k = sa.compile_sm90(probe_kernel, sig, dict(NI=40, RCP=True, MMA_REGS=regs, LOAD_REGS=24),
                        4, 1, (), 96)
    sass, res = sa.assemble(k)
    print(regs, res, "async waits", sa.async_waits(sass), sa.wgmma_shapes(sass))
    for lp in sa.wgmma_loops(sass):
        print("   ", lp["instructions"], lp["issue_cycles"], lp["static_cycles"])
