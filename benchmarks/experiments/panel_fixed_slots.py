"""The Gluon panel kernel with constant ring slots (FIXED_SLOTS): bitwise check, then time.

    PYTHONPATH=src python3 benchmarks/experiments/panel_fixed_slots.py check
    PYTHONPATH=src python3 benchmarks/experiments/panel_fixed_slots.py time 0|1

check: the expert backward in deterministic mode with and without FIXED_SLOTS on the GPU
test's cases (tests/test_gpu.py, `panel_case`), all five outputs bitwise. time: the
expert backward at 32,768 tokens (`bench_expert_backward.py --sweep-only`, two timings of
the table's config a process) with FIXED_SLOTS off or on. docs/expert-backward.md.
"""
import runpy
import sys

import torch

import mhmoe.kernels.expert_panels_sm90 as ps
import mhmoe.kernels.tuning as tuning

options = ps.kernel_options


def fixed(on: bool) -> None:
    ps.kernel_options = lambda *a, **k: {**options(*a, **k), "FIXED_SLOTS": on}


if sys.argv[1] == "check":
    import pytest

    sys.path.insert(0, "tests")
    from test_gpu import panel_case

    for case in ((300, 2, 8, 2, 192, "tiles ending inside an expert's rows"),
                 (8192, 2, 8, 4, 64, "about 4 tiles a program, one slice of I"),
                 (1000, 3, 16, 4, 320, "empty: every head-0 token on expert 0"),
                 (4096, 12, 256, 6, 1280, "MAGI-2's expert shapes")):
        with pytest.MonkeyPatch.context() as mp:
            _, _, _, _, run = panel_case(*case, mp)
            fixed(False)
            want = run(tuning.SM90_SPLIT_WS)
            fixed(True)
            got = run(tuning.SM90_SPLIT_WS)
            again = run(tuning.SM90_SPLIT_WS)
        same = [torch.equal(a, b) and torch.equal(a, c)
                for a, b, c in zip(want, got, again, strict=True)]
        print(case[:5], "bitwise (dx, dprobs, dWg, dWu, dWd):", same, flush=True)
        del want, got, again
else:
    fixed(bool(int(sys.argv[2])))
    print("FIXED_SLOTS", sys.argv[2], flush=True)
    sys.argv = ["bench_expert_backward.py", "--sizes", "32768", "--skip-checks",
                "--sweep-only", "--sweep", "rcp=1", "--no-record"]
    runpy.run_path("benchmarks/bench_expert_backward.py", run_name="__main__")
