"""The router inputs the routing experiments share: MAGI-2's dims at S = 32768, seed 0;
their timers (`bench`, `kernels_in`, shuffled graph replays), and the pieces their scripts
have in common (graph capture, the config pair they compare, the logits kernel's audit case,
the command line).

x [S, H, D] bf16, gate [H, E, D] fp32 (scale D^-0.5: logits ~ N(0, 1)), a selection bias
~ N(0, 0.01^2), and the routing keywords of `triton_logits_route` / `triton_route`.
"""
import torch

H, E, D, K, S = 12, 256, 256, 6, 32768


def router_inputs(dev: torch.device, count_block_t: int | None = 64):
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(S, H, D, device=dev, generator=gen).bfloat16()
    gate = torch.randn(H, E, D, device=dev, generator=gen) * D**-0.5
    bias = torch.randn(H, E, device=dev, generator=gen) * 0.01
    kw = dict(top_k=K, score_func="sigmoid", expert_bias=bias, route_norm=True, norm_eps=1e-12,
              route_scale=4.9)
    if count_block_t is not None:
        kw["count_block_t"] = count_block_t
    return x, gate, bias, kw


def bench(fn) -> float:
    """fn's median time (ms, do_bench: L2 flushed before each run), 4 decimals."""
    import triton.testing

    return round(triton.testing.do_bench(fn, warmup=50, rep=400), 4)


def kernels_in(fn, calls: int = 30) -> dict:
    """The average time (us) of each event of `calls` calls of fn under the torch profiler
    (kernels, and the host events at 0), by name (50 characters)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    res = {}
    for ev in prof.key_averages():
        tot = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if ev.count and tot:
            res[ev.key[:50]] = round(tot / ev.count, 2)
    return res


def time_interleaved(graphs: dict, eager: dict, res: dict, rounds: int = 4) -> None:
    """Into res[name]: "route_layout_graph" (do_bench of graphs[name].replay) and
    "route_eager" (of eager[name]), the names interleaved over `rounds` rounds, then
    "kernels_graph_us" (`kernels_in` of the replays)."""
    import json

    for name in graphs:
        res[name]["route_layout_graph"] = []
        res[name]["route_eager"] = []
    for _ in range(rounds):
        for name, g in graphs.items():
            res[name]["route_layout_graph"].append(bench(g.replay))
            res[name]["route_eager"].append(bench(eager[name]))
    for name, g in graphs.items():
        res[name]["kernels_graph_us"] = kernels_in(g.replay)
        print(name, json.dumps(res[name]), flush=True)


def shuffled_replays(graphs: dict, rounds: int, replays: int) -> dict:
    """{name: [the median of each round's replay times, ms]}: `rounds` rounds, the graphs
    in a shuffled (seeded) order each round, `replays` replays a graph a round, each timed
    by its own pair of events (no L2 flush between them)."""
    import random
    import statistics

    import torch

    times = {n: [] for n in graphs}
    order = random.Random(0)
    for _ in range(rounds):
        for n in order.sample(list(graphs), len(graphs)):
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(replays)]
            for e0, e1 in ev:
                e0.record()
                graphs[n].replay()
                e1.record()
            torch.cuda.synchronize()
            times[n].append(statistics.median(e0.elapsed_time(e1) for e0, e1 in ev))
    return times


def report_replays(graphs: dict, times: dict, controls=(), unit: str = "ms") -> dict:
    """{name: {"median_<unit>", "round_medians_<unit>" of `shuffled_replays`' times, and
    "kernels_graph_us" (`kernels_in` of its replays) but for the controls (a graph
    repeated under another name)}}, each printed as it comes. unit: "ms" or "us"."""
    import json
    import statistics

    scale, digits = {"ms": (1.0, 4), "us": (1000.0, 2)}[unit]
    res = {}
    for n in graphs:
        res[n] = {f"median_{unit}": round(scale * statistics.median(times[n]), digits),
                  f"round_medians_{unit}": [round(scale * t, digits) for t in times[n]]}
        if n not in controls:
            res[n]["kernels_graph_us"] = kernels_in(graphs[n].replay)
        print(n, json.dumps(res[n]), flush=True)
    return res


def graph_of(fn):
    """bench_layer's `graph_of`: (a CUDA graph of fn(), the captured call's outputs)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import bench_layer

    return bench_layer.graph_of(fn)


def logits_configs(field: str, off: str, on: str) -> dict:
    """{off: the sm_90 logits-route config with `field` False, on: with it True}."""
    import dataclasses

    from mhmoe.kernels import configs

    base = configs.LOGITS_ROUTE_CONFIGS[(9, 0)]
    return {off: dataclasses.replace(base, **{field: False}),
            on: dataclasses.replace(base, **{field: True})}


def logits_audit_case():
    """The SASS audit's case of the sm_90 logits kernel: (name, fn, signature, constexprs,
    num_warps, num_stages, divisible, maxnreg), as `sass_audit.compile_sm90` takes them."""
    from mhmoe.kernels import sass_audit

    return next(c for c in sass_audit._cases() if c[0].startswith("logits"))


def experiment_main(compile_only, gpu) -> None:
    """The command line of the experiment scripts: `OUT.json` runs on the GPU; with a
    compile_only function, `--compile-only` compiles for sm_90 here (no GPU) instead."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    if compile_only is not None:
        p.add_argument("--compile-only", action="store_true")
    a = p.parse_args()
    if getattr(a, "compile_only", False):
        compile_only()
    elif a.out is None:
        p.error("give the output path" + (" (or --compile-only)" if compile_only else ""))
    else:
        gpu(a.out)
