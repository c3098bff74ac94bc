"""Interleaved A/B timing of expert-kernel variants under sustained load (H200).

    PYTHONPATH=src python3 benchmarks/experiments/ab.py OUT.json WHAT

Why. Under the MAGI-2 layer's load the H200 runs at its 700 W limit and its clocks drift
down for seconds (NOTES.md, session 13), so do_bench medians taken one variant after
another differ by as much as the changes they compare. Here the variants take turns:
ROUNDS rounds of PER_ROUND back-to-back calls of each, every call timed by its own pair
of CUDA events (no L2 flush; the calls follow each other as a model's layers do), the
order of the variants shuffled each round (seeded). A variant's time depends on what ran
before it: the first two runs of this script, in a fixed order and then in a rotated one
(which keeps each variant's predecessor), saw a variant 0.35 and 0.6 ms away from its own
control; in the second the slow copy always ran right after the slowest variant. Shuffled,
every variant sees the same mix of power states and predecessors. Reports each variant's
median and its median in every round; "control" variants repeat an earlier one under
another name (the harness's own spread).

WHAT: skip (forward v8's empty-half skip on and off, one CTA and clusters of two,
default mode at S = 32768, and DIAG 1, no weight bytes moved, on and off, one CTA);
skip2 (the same without DIAG, with a control of each cluster variant; needs
benchmarks/experiments/skip.patch applied, as skip). hints (L2 eviction hints, `L2_HINTS`
0-3 of the cluster variant, 0-1 of the one-CTA kernel, a control of each 0; needs
benchmarks/experiments/l2_hints.patch applied). Both were measured in session 14 and not
kept (benchmarks/NOTES.md); `git apply` the patch, run, then `git checkout` the kernel.
records (routing v15: the expert forward reading the layout's records in place, stride 2,
against contiguous copies of gather_ids and sorted_probs; needs
benchmarks/experiments/records.patch applied: measured, not kept).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_expert_kernel as B
from expert_ws import WS, WS2, half_tails, uniform_problem

from mhmoe.kernels import expert_forward_ws as ws
from mhmoe.kernels.expert_forward import triton_expert_forward

ROUNDS, PER_ROUND = 20, 10


def interleaved(variants, rounds=ROUNDS, per_round=PER_ROUND):
    """variants: [(name, fn)], fn() runs one call (setting its switches first). Returns
    {name: {"median_ms", "round_medians_ms"}}."""
    for _, fn in variants:  # compile and warm every variant first
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name, _ in variants}
    order = random.Random(0)
    for _ in range(rounds):
        for name, fn in order.sample(variants, len(variants)):
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(per_round)]
            for a, b in ev:
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            times[name].append([a.elapsed_time(b) for a, b in ev])
    out = {}
    for name, rounds_ms in times.items():
        flat = [t for r in rounds_ms for t in r]
        out[name] = {"median_ms": statistics.median(flat),
                     "round_medians_ms": [statistics.median(r) for r in rounds_ms]}
        print(name, round(out[name]["median_ms"], 3),
              [round(m, 2) for m in out[name]["round_medians_ms"]], flush=True)
    return out


def skip_variants(gen):
    wg, wu, wd = B.make_weights(gen)
    x, lay = uniform_problem(32768, gen)
    print("experts with a half-empty last tile:", half_tails(lay, B.E), flush=True)
    launch = ws.launch_ws

    def variant(cfg, skip, diag=0):
        def fn():
            ws.SKIP_EMPTY_HALVES = skip
            ws.launch_ws = (launch if diag == 0 else
                            (lambda *a, **k: launch(*a, **{**k, "diag": diag})))
            try:
                return triton_expert_forward(x, *lay, wg, wu, wd, config=cfg)
            finally:
                ws.launch_ws = launch
        return fn

    return [("c1_skip0", variant(WS, False)), ("c1_skip1", variant(WS, True)),
            ("c2_skip0", variant(WS2, False)), ("c2_skip1", variant(WS2, True)),
            ("c1_skip0_control", variant(WS, False)),
            ("c1_diag1_skip0", variant(WS, False, 1)), ("c1_diag1_skip1", variant(WS, True, 1))]


def hint_variants(gen):
    wg, wu, wd = B.make_weights(gen)
    x, lay = uniform_problem(32768, gen)

    def variant(cfg, hints):
        def fn():
            ws.L2_HINTS = hints
            return triton_expert_forward(x, *lay, wg, wu, wd, config=cfg)
        return fn

    return ([(f"c2_hints{h}", variant(WS2, h)) for h in range(4)]
            + [("c2_hints0_control", variant(WS2, 0))]
            + [(f"c1_hints{h}", variant(WS, h)) for h in range(2)]
            + [("c1_hints0_control", variant(WS, 0))])


def record_variants(gen):
    """Routing v15: the default expert forward (clusters at S = 32768) on one layout read
    as `sort_routes` gives it (gather_ids and sorted_probs, views of stride 2 into the
    records) and from contiguous copies of the same two arrays, with a control of each."""
    from mhmoe.kernels.expert_forward import expert_forward_config

    wg, wu, wd = B.make_weights(gen)
    x, lay = uniform_problem(32768, gen)
    assert lay.gather_ids.stride() == (2,), lay.gather_ids.stride()
    flat = (lay.gather_ids.contiguous(), lay.sorted_probs.contiguous(), lay.offsets)
    cfg = expert_forward_config(x.device, lay.gather_ids.numel() / (B.H * B.E), B.D, wd.dtype)

    def variant(layout):
        return lambda: triton_expert_forward(x, *layout, wg, wu, wd, config=cfg)

    a, b = variant(tuple(lay)), variant(flat)
    if not torch.equal(a(), b()):  # fp32 atomics: the same values up to their order
        torch.testing.assert_close(a(), b(), rtol=1e-2, atol=1e-2)
    return [("strided", a), ("contiguous", b), ("strided_control", a),
            ("contiguous_control", b)]


def main():
    out_path, what = sys.argv[1], sys.argv[2]
    gen = torch.Generator(device="cuda").manual_seed(4321)
    res = {"gpu": torch.cuda.get_device_name(), "rounds": ROUNDS, "per_round": PER_ROUND}
    if what == "skip":
        res["skip"] = interleaved(skip_variants(gen))
    if what == "skip2":
        v = dict(skip_variants(gen))
        res["skip2"] = interleaved([(n, v[n]) for n in ("c1_skip0", "c1_skip1", "c2_skip0",
                                                        "c2_skip1")]
                                   + [("c2_skip0_control", v["c2_skip0"]),
                                      ("c2_skip1_control", v["c2_skip1"])])
        ws.SKIP_EMPTY_HALVES = True
    if what == "records":
        res["records"] = interleaved(record_variants(gen))
    if what == "hints":
        res["hints"] = interleaved(hint_variants(gen))
        ws.L2_HINTS = 0
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
