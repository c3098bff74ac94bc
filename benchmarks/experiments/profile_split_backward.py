"""Experiment (2026-12-05, not kept): GPU time per kernel of the expert backward at
S = 32,768 for the default config and the split configs (docs/expert-backward.md, "dx
from the panels"). Run on the GPU machine from the repository root:

    PYTHONPATH=src python3 benchmarks/experiments/profile_split_backward.py
"""
import collections
import dataclasses
import sys

sys.path.insert(0, "benchmarks")
import bench_expert_backward as b
import torch

import mhmoe.kernels.tuning as tuning
from mhmoe.kernels.expert_backward import triton_expert_backward

st = b.Setup()
gen = torch.Generator(device="cuda").manual_seed(0)
w = b.make_weights(st, gen)
S = 32768
x, dy, layout = b.make_problem(st, S, gen)
default = tuning.expert_backward_config(x.device, S * st.K / st.E)
cfgs = {"default": default, "split": tuning.SM90_SPLIT,
        "split 64/32/4/3": dataclasses.replace(tuning.SM90_SPLIT,
                                               dx=b.ExpertForwardConfig(64, 32, 4, 3)),
        "split ws": tuning.SM90_SPLIT_WS}
for name, cfg in cfgs.items():
    def f(cfg=cfg):
        return triton_expert_backward(dy, x, *layout, *w, config=cfg)
    f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            f()
        torch.cuda.synchronize()
    tot = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name[:60]] += e.device_time_total / 3 / 1000
    print(f"== {name}: total {sum(tot.values()):.2f} ms")
    for k, v in tot.most_common(8):
        print(f"   {v:7.2f} ms  {k}")
