"""Timing-only: does the Gluon panel kernel wait on its ring? (results wrong on purpose)

    PYTHONPATH=src python3 benchmarks/experiments/panel_ring_depth.py STAGES ALIAS

Runs `bench_expert_backward.py --sizes 32768 --skip-checks --sweep-only --sweep rcp=1`
(prints the backward's time) with the panel kernel's ring at STAGES stages and, with
ALIAS=1, dy's shared tiles aliased to x's (`TIMING_ALIAS_DY`: 64 KB freed, so up to ten
stages fit; t then multiplies x, not dy). ALIAS=1 at six stages separates the aliasing's
own effect from the ring's. docs/expert-backward.md, "The panel kernel under ncu".
"""
import dataclasses
import runpy
import sys

import mhmoe.kernels.expert_panels_sm90 as ps
import mhmoe.kernels.tuning as tuning

stages, alias = int(sys.argv[1]), bool(int(sys.argv[2]))
base = tuning.PANELS_SM90_GLUON
if alias:
    # The config's check counts dy's 64 KB, which the alias frees.
    tuning.PanelsSm90Config.shared_bytes = lambda self: (
        tuning.ExpertForwardSm90Config.shared_bytes(self))
    options = ps.kernel_options
    ps.kernel_options = lambda *a, **k: {**options(*a, **k), "TIMING_ALIAS_DY": True}
tuning.PANELS_SM90_GLUON = dataclasses.replace(base, num_stages=stages)
print(f"panel ring: {stages} stages, dy aliased to x: {alias}", flush=True)
sys.argv = ["bench_expert_backward.py", "--sizes", "32768", "--skip-checks", "--sweep-only",
            "--sweep", "rcp=1", "--no-record"]
runpy.run_path("benchmarks/bench_expert_backward.py", run_name="__main__")
