"""Check and time the expert forward kernels at MAGI-2 dims (Triton; Gluon on sm_90).

    PYTHONPATH=src python3 benchmarks/bench_expert_forward.py [--sizes 1024,4096,16384,32768]
        [--sweep "64/32/4/3;128/32/8/3/1/1/1/2"] [--skip-checks] [--out OUT.json]
        [--no-record] [--commit HASH]
    PYTHONPATH=src python3 benchmarks/bench_expert_forward.py --cpu    (a dry run)

Steps, in order (GPU): the bf16 8192^3 matmul and device-copy peaks; checks at
S=1024 (uniform routing) and S=4096 (one expert at 30x the mean rows) against a
float64 `expert_forward_reference` of every route, beside the error of PyTorch's fp32
math; determinism (run to run, and under a token permutation), the default mode
against the deterministic one; a CUDA-graph capture with host synchronisation turned
into an error. Then per S and routing (uniform; skew30: expert 0 of head 0 at 30x the
mean): the default tiles (`tuning.expert_forward_config`, the Gluon kernel where they
say `warp_specialized`) in default and deterministic mode, eager (`mhmoe.bench.bench_ms`)
and replayed from a CUDA graph (`graph_ms`), with the peak extra memory. --sweep: tile
configs `m/i/w/s[/tma[/paired[/warp_specialized[/cluster]]]]` (the fields of
`ExpertForwardConfig` in order, booleans as 0/1), timed at each S on uniform routing in
shuffled interleaved rounds against the default tiles (`mhmoe.bench.interleaved`,
docs/measuring.md). A table last.

Rows (`mhmoe.bench.result_row`): kernel "expert_fwd", variant "default",
"deterministic", "default_graph", "deterministic_graph" or "sweep:<config>" (routing
"skew30" prefixed), tokens S, ms, TFLOP/s at 6 S H K D I FLOP, and the tiles that ran;
they go to benchmarks/results.jsonl unless --no-record; --out also writes the whole
run (environment, peaks, checks, rows) as one JSON file. --commit names the commit
where the tree travels without .git (as MHMOE_COMMIT does). --cpu: the same steps
under the Triton interpreter at toy dims (numbers meaningless, nothing recorded).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

if "--cpu" in sys.argv:  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch

import mhmoe
from mhmoe.bench import (
    append_results,
    bench_ms,
    call_peak_bytes,
    check_unique,
    environment,
    graph_ms,
    interleaved,
    measured_peaks,
    rel_err,
    result_row,
    time_fn,
)
from mhmoe.kernels.expert_forward import triton_expert_forward
from mhmoe.kernels.tuning import ExpertForwardConfig, expert_forward_config
from mhmoe.reference import expert_forward_reference


@dataclass(frozen=True)
class Setup:
    """Problem dims and where it runs (MAGI-2 on the GPU; toy dims for --cpu)."""

    H: int = 12
    E: int = 256
    K: int = 6
    D: int = 256
    I: int = 1280
    device: str = "cuda"
    sizes: tuple = (1024, 4096, 16384, 32768)
    check_sizes: tuple = (1024, 4096)


CPU_SETUP = Setup(H=2, E=8, K=2, D=32, I=64, device="cpu", sizes=(48,), check_sizes=(32, 48))


def flops(st: Setup, S: int) -> float:
    return 6.0 * S * st.H * st.K * st.D * st.I


def make_weights(st: Setup, gen: torch.Generator):
    F = st.H * st.E
    shapes = ((F, st.D, st.I, st.D), (F, st.D, st.I, st.D), (F, st.I, st.D, st.I))
    return tuple((torch.randn(*s[:3], device=st.device, generator=gen) * s[3]**-0.5).bfloat16()
                 for s in shapes)


def make_routes(st: Setup, S: int, gen: torch.Generator, skew: bool):
    """Uniform random top-K per (head, token); skew: expert 0 of head 0 gets 30x the mean."""
    scores = torch.rand(st.H, S, st.E, device=st.device, generator=gen)
    if skew:
        share = min(1.0, 30.0 * st.K / st.E)  # fraction of head 0's tokens that pick expert 0
        pick = torch.rand(S, device=st.device, generator=gen) < share
        scores[0, :, 0] += pick.float() * 2.0
    indices = scores.topk(st.K, dim=-1).indices
    probs = torch.rand(st.H, S, st.K, device=st.device, generator=gen) + 0.1
    return probs / probs.sum(-1, keepdim=True) * 4.9, indices


def parse_config(spec: str) -> ExpertForwardConfig:
    """'m/i/w/s[/tma[/paired[/warp_specialized[/cluster[/sigmoid_rcp]]]]]':
    ExpertForwardConfig's fields in order, booleans as 0/1."""
    fields = dataclasses.fields(ExpertForwardConfig)
    values = spec.split("/")
    if not 4 <= len(values) <= len(fields):
        raise SystemExit(f"--sweep: '{spec}' is not m/i/w/s[/tma[/paired[/ws[/cluster[/rcp]]]]]")
    kwargs = {f.name: (bool(int(v)) if f.type in (bool, "bool") else int(v))
              for f, v in zip(fields[:len(values)], values, strict=True)}
    return ExpertForwardConfig(**kwargs)


def describe(cfg: ExpertForwardConfig) -> str:
    name = f"{cfg.block_m}/{cfg.block_i}/{cfg.num_warps}/{cfg.num_stages}"
    name += f"/{int(cfg.tma)}/{int(cfg.paired)}/{int(cfg.warp_specialized)}/{cfg.cluster}"
    name += f"/{int(cfg.sigmoid_rcp)}"
    return name


def checks(st: Setup, gen, weights) -> dict:
    """Accuracy against float64, determinism, the modes, CUDA-graph capture."""
    wg, wu, wd = weights
    out: dict = {}
    for S in st.check_sizes:
        skew = S == st.check_sizes[-1]
        x = torch.randn(S, st.H, st.D, device=st.device, generator=gen).bfloat16()
        layout = mhmoe.sort_routes(*make_routes(st, S, gen, skew), st.E)
        ref = expert_forward_reference(x.double(), layout.gather_ids,
                                       layout.sorted_probs.double(), layout.offsets, wg, wu, wd)
        for det in (False, True):
            y = triton_expert_forward(x, *layout, wg, wu, wd, deterministic=det)
            out[f"rel_err_S{S}_det{int(det)}"] = rel_err(y, ref)
            out[f"nan_S{S}_det{int(det)}"] = bool(torch.isnan(y).any())
        fp32 = expert_forward_reference(x, *layout, wg, wu, wd)  # fp32 math, bf16 output
        out[f"rel_err_torch_fp32_S{S}"] = rel_err(fp32, ref)
    S = st.check_sizes[-1]
    x = torch.randn(S, st.H, st.D, device=st.device, generator=gen).bfloat16()
    probs, indices = make_routes(st, S, gen, skew=False)
    layout = mhmoe.sort_routes(probs, indices, st.E)
    y1 = triton_expert_forward(x, *layout, wg, wu, wd, deterministic=True)
    y2 = triton_expert_forward(x, *layout, wg, wu, wd, deterministic=True)
    perm = torch.randperm(S, device=st.device, generator=gen)
    layout_p = mhmoe.sort_routes(probs[:, perm], indices[:, perm], st.E)
    y3 = triton_expert_forward(x[perm], *layout_p, wg, wu, wd, deterministic=True)
    d1 = triton_expert_forward(x, *layout, wg, wu, wd)
    d2 = triton_expert_forward(x, *layout, wg, wu, wd)
    out["det_run_to_run_equal"] = bool(torch.equal(y1, y2))
    out["det_permutation_equal"] = bool(torch.equal(y3, y1[perm]))
    out["default_run_to_run_maxdiff"] = (d1.float() - d2.float()).abs().max().item()
    out["default_vs_det_maxdiff"] = (d1.float() - y1.float()).abs().max().item()
    if st.device == "cuda":
        for det in (False, True):
            try:
                y = capture_without_sync(
                    lambda det=det: triton_expert_forward(x, *layout, wg, wu, wd,
                                                          deterministic=det))
                again = triton_expert_forward(x, *layout, wg, wu, wd, deterministic=det)
                out[f"graph_det{int(det)}_maxdiff"] = (y.float() - again.float()).abs().max().item()
            except RuntimeError as exc:  # reported, and the timings still run
                out[f"graph_det{int(det)}_error"] = repr(exc)[:300]
    return out


def capture_without_sync(fn):
    """fn's output from a replay of fn captured in a CUDA graph, with host synchronisation
    made an error during the capture (the launcher must read nothing back)."""
    fn()  # compile, and warm any cache a first call fills
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.cuda.synchronize()
    return y


def extra_memory_gb(st: Setup, fn) -> float:
    """Peak memory one call allocates beyond what was allocated before it, in GB."""
    if st.device != "cuda":
        return float("nan")
    return call_peak_bytes(fn, st.device)[0] / 1e9


def time_size(st: Setup, S: int, gen, weights, sweep: list[ExpertForwardConfig],
              emit) -> None:
    """The default tiles in both modes and routings, eager and from a graph; the sweep."""
    wg, wu, wd = weights
    x = torch.randn(S, st.H, st.D, device=st.device, generator=gen).bfloat16()
    for skew in (False, True):
        layout = mhmoe.sort_routes(*make_routes(st, S, gen, skew), st.E)
        routing = "skew30" if skew else "uniform"
        default = expert_forward_config(x.device, layout.gather_ids.numel() / (st.H * st.E),
                                        st.D, wd.dtype)
        call = functools.partial(triton_expert_forward, x, *layout, wg, wu, wd)
        for det in (False, True):
            fn = functools.partial(call, deterministic=det)
            variant = ("skew30:" if skew else "") + ("deterministic" if det else "default")
            extra = dict(routing=routing, config=describe(default),
                         extra_mem_gb=extra_memory_gb(st, fn))
            if st.device == "cuda":
                emit(S, variant, bench_ms(fn), extra)
                emit(S, f"{variant}_graph", graph_ms(fn), extra)
            else:
                emit(S, variant, time_fn(fn, runs=1, warmup=1).median_ms, extra)
        if skew or not sweep:
            continue
        variants = [(f"default {describe(default)}", call)]
        ref = call()
        for cfg in sweep:
            fn = functools.partial(call, config=cfg)
            diff = rel_err(fn(), ref)
            print(f"sweep S={S} {describe(cfg)}: rel. diff from the default tiles {diff:.2e}",
                  flush=True)
            variants.append((f"sweep:{describe(cfg)}", fn))
        if st.device == "cuda":
            timed = interleaved(variants, rounds=10, per_round=5, seed=S)
            for name, t in timed.items():
                emit(S, name if name.startswith("sweep:") else "sweep:default", t.median_ms,
                     dict(routing=routing, config=name.split()[-1].removeprefix("sweep:"),
                          round_medians_ms=t.round_medians_ms))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="token counts, comma-separated")
    parser.add_argument("--sweep", default="",
                        help="configs m/i/w/s[/tma[/paired[/ws[/cluster]]]];... at every S")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--out", default=None, help="also write the run as one JSON file")
    parser.add_argument("--no-record", action="store_true",
                        help="do not append rows to benchmarks/results.jsonl")
    parser.add_argument("--commit", default=None, help="the commit, where .git is missing")
    parser.add_argument("--cpu", action="store_true",
                        help="a dry run under the Triton interpreter at toy dims")
    args = parser.parse_args()
    if args.commit:
        os.environ["MHMOE_COMMIT"] = args.commit
    st = CPU_SETUP if args.cpu else Setup()
    if args.sizes:
        st = dataclasses.replace(st, sizes=tuple(int(s) for s in args.sizes.split(",")))
    sweep = [parse_config(c.strip()) for c in args.sweep.split(";") if c.strip()]
    try:
        check_unique((describe(c) for c in sweep), "--sweep")
    except ValueError as exc:
        parser.error(str(exc))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # fail before the run
    env = environment(st.device)
    print(env, flush=True)
    peaks = measured_peaks(st.device)
    if peaks:
        print("peaks", peaks, flush=True)
    gen = torch.Generator(device=st.device).manual_seed(1234)
    weights = make_weights(st, gen)
    found = {} if args.skip_checks else checks(st, gen, weights)
    if found:
        print("checks", json.dumps(found), flush=True)
    rows = []

    def emit(S, variant, ms, extra):
        rows.append(result_row("expert_fwd", variant, S, ms, env=env,
                               tflops=flops(st, S) / (ms * 1e-3) / 1e12,
                               shape=dict(H=st.H, E=st.E, K=st.K, D=st.D, I=st.I),
                               peaks=peaks, **extra))
        print(f"S={S} {variant}: {ms:.3f} ms", flush=True)

    for S in st.sizes:
        time_size(st, S, gen, weights, sweep, emit)
        if st.device == "cuda":
            torch.cuda.empty_cache()

    if args.out:
        Path(args.out).write_text(json.dumps(
            {"environment": env, "peaks": peaks, "checks": found, "rows": rows}, indent=1) + "\n")
    if not (args.no_record or args.cpu):
        print(f"rows appended to {append_results(rows)}")
    for key, value in found.items():
        print(f"  {key}: {value}")
    print(f"\n{'S':>6} {'variant':>28} {'config':>22} {'ms':>8} {'TFLOP/s':>8} {'mem GB':>7}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['variant']:>28} {r['config']:>22} {r['ms']:8.3f} "
              f"{r['tflops']:8.1f} {r.get('extra_mem_gb', float('nan')):7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
