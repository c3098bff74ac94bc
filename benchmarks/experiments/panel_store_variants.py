"""Experiment (2026-12-05, not kept): the Gluon panel kernel with its dg, du, a p stores
left out, merged into one, or without the x / dy panel copies, timed in the split
backward at S = 32,768 (docs/expert-backward.md, "dx from the panels"). Writes variant
copies of kernels/expert_panels_sm90.py next to it (_scratch_v*.py). Run on the GPU
machine from the repository root:

    PYTHONPATH=src python3 benchmarks/experiments/panel_store_variants.py
"""
import collections
import importlib
import pathlib
import sys

sys.path.insert(0, "benchmarks")
import bench_expert_backward as b
import torch

import mhmoe.kernels as mk
import mhmoe.kernels.expert_panels_sm90 as ps
import mhmoe.kernels.tuning as tuning
from mhmoe.kernels.expert_backward import triton_expert_backward

src = pathlib.Path(ps.__file__).read_text()
STORES = '''            gl.store(dgp_ptr + at, dg.to(gl.bfloat16))
            gl.store(dup_ptr + at, du.to(gl.bfloat16))
            gl.store(app_ptr + at, (a * p[:, None]).to(gl.bfloat16))
'''
ONE = '''            gl.store(dgp_ptr + at, (dg + du + a * p[:, None]).to(gl.bfloat16))
'''
XDY = '''            for c in gl.static_range(D // 64):
                tma.async_copy_shared_to_global(xp_desc, [prow, c * 64],
                                                xs.index(w).slice(c * 64, 64, dim=1))
                tma.async_copy_shared_to_global(dyp_desc, [prow, c * 64],
                                                dys.index(w).slice(c * 64, 64, dim=1))
'''
assert STORES in src and XDY in src
variants = {"A baseline": src, "B no dg/du/ap stores": src.replace(STORES, ""),
            "C one store (sum)": src.replace(STORES, ONE),
            "D no x/dy TMA stores": src.replace(XDY, "            pass\n")}
st = b.Setup()
gen = torch.Generator(device="cuda").manual_seed(0)
w = b.make_weights(st, gen)
S = 32768
x, dy, layout = b.make_problem(st, S, gen)
for i, (name, text) in enumerate(variants.items()):
    path = pathlib.Path(ps.__file__).with_name(f"_scratch_v{i}.py")
    path.write_text(text)
    mod = importlib.import_module(f"mhmoe.kernels._scratch_v{i}")
    sys.modules["mhmoe.kernels.expert_panels_sm90"] = mod
    mk.expert_panels_sm90 = mod

    def f():
        return triton_expert_backward(dy, x, *layout, *w, config=tuning.SM90_SPLIT_WS)
    f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            f()
        torch.cuda.synchronize()
    tot = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name[:40]] += e.device_time_total / 3 / 1000
    print(f"== {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in tot.most_common(3)),
          flush=True)
