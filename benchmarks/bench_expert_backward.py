"""Check and time the fused expert backward at MAGI-2 dims (run on a GPU machine).

    PYTHONPATH=src python3 benchmarks/bench_expert_backward.py [--sizes 4096,32768]
        [--sweep "dx=m/i/w/s,dw=m/i/w/s,panel=m/n/k/w/s[/tma[/gws[/bufs]]]|none,
                  pdx=i/w/s,ws=1,rcp=1,st=8;..."]
        [--skip-checks] [--sweep-only] [--routing uniform|skewed|hot|hot-last]
        [--out OUT.json] [--no-record]
    PYTHONPATH=src python3 benchmarks/bench_expert_backward.py --cpu    (a dry run)

Steps, in order (GPU): the bf16 8192^3 matmul and device-copy peaks; checks at
S=4096: every gradient against fp32 autograd through `expert_forward_reference` on
upcast inputs, next to the error of the PyTorch fp32 backward
`expert_backward_reference`, and each mode run twice (bitwise equal or not); then per S
and mode (default / deterministic): the forward, the backward and forward+backward
(`mhmoe.bench.bench_ms`), with the peak memory beyond inputs, outputs and gradients.
--sweep: backward tile configs over the default ones of `tuning.expert_backward_config`
(ExpertForwardConfig / PanelGemmConfig / PanelDxConfig fields in order, booleans as 0/1;
panel=none: the recomputing dW kernel; gws=1: the Gluon dW GEMM with bufs staging tiles
(`PanelGemmConfig.warp_specialized`, `store_buffers`); pdx: dx from the panels; ws=1
with pdx: the Gluon panel kernel; rcp=1: the sigmoid's reciprocal, `sigmoid_rcp`; st=8:
the Gluon kernel's 8-byte stores, `panel_store_bytes`), timed at the largest S in default
mode in shuffled interleaved rounds against the default tiles (`mhmoe.bench.interleaved`,
docs/measuring.md), with the largest relative difference of their gradients from the
default's; --sweep-only leaves out the per-size default and deterministic timings before
it (the sweep times the default tiles beside its variants anyway). A table last.

FLOP: the forward 6 S H K D I; the backward counted as twice the forward and
forward+backward as three times, as the peer kernels report them. Rows
(`mhmoe.bench.result_row`): kernel "expert_bwd" (with the forward's time beside it) and
"expert_fwd_bwd", variant "default", "deterministic" or "sweep:<config>"; they go to
benchmarks/results.jsonl unless --no-record; --out also writes the whole run
(environment, peaks, checks, rows) as one JSON file. --cpu: the same steps under the
Triton interpreter at toy dims (numbers meaningless, nothing recorded). --routing: the
routes every step draws (`route_scores`; uniform by default), recorded in each row's
shape: a tile table is chosen on uniform routes and must hold up on skewed and hot ones
(docs/expert-backward.md, "Skewed routing and the Gluon dW GEMM").
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
    interleaved,
    measured_peaks,
    rel_err,
    result_row,
    script_command,
    tensor_bytes,
    time_fn,
)
from mhmoe.kernels.expert_backward import triton_expert_backward
from mhmoe.kernels.expert_forward import triton_expert_forward
from mhmoe.kernels.tuning import (
    ExpertBackwardConfig,
    ExpertForwardConfig,
    PanelDxConfig,
    PanelGemmConfig,
    expert_backward_config,
)
from mhmoe.reference import expert_backward_reference, expert_forward_reference

NAMES = ("dx", "dprobs", "d_gate", "d_up", "d_down")


@dataclass(frozen=True)
class Setup:
    """Problem dims and where it runs (MAGI-2 on the GPU; toy dims for --cpu)."""

    H: int = 12
    E: int = 256
    K: int = 6
    D: int = 256
    I: int = 1280
    device: str = "cuda"
    sizes: tuple = (4096, 32768)
    check_s: int = 4096
    routing: str = "uniform"


CPU_SETUP = Setup(H=2, E=8, K=2, D=32, I=64, device="cpu", sizes=(48,), check_s=48)


def fwd_flops(st: Setup, S: int) -> float:
    return 6.0 * S * st.H * st.K * st.D * st.I


def make_weights(st: Setup, gen: torch.Generator):
    """bf16 weights; gate and up scaled so that some g and u pass the clamps at 7."""
    F = st.H * st.E
    return (
        torch.randn(F, st.D, st.I, device=st.device, generator=gen).mul_(2 * st.D**-0.5).bfloat16(),
        torch.randn(F, st.D, st.I, device=st.device, generator=gen).mul_(2 * st.D**-0.5).bfloat16(),
        torch.randn(F, st.I, st.D, device=st.device, generator=gen).mul_(st.I**-0.5).bfloat16())


ROUTINGS = ("uniform", "skewed", "hot", "hot-last")


def route_scores(st: Setup, S: int, gen: torch.Generator) -> torch.Tensor:
    """[H, S, E] scores whose top K are the routes, as `st.routing` says: uniform, every
    expert alike; skewed, a fixed quarter of each head's experts take half of the routes
    (one bias on their scores, found by bisection); hot, expert 0 of every head takes
    every token of its head; hot-last, the head's last expert does (its tiles come last
    in the kernels' tile orders). bench_layer.py's `skew_router` skews the layer's router
    so."""
    scores = torch.rand(st.H, S, st.E, device=st.device, generator=gen)
    if st.routing in ("hot", "hot-last"):
        hot = 0 if st.routing == "hot" else st.E - 1
        scores[:, :, hot] += 1.0  # above every other score, which lie in [0, 1)
    elif st.routing == "skewed":
        favoured = torch.randperm(st.E, generator=torch.Generator().manual_seed(0))
        favoured = favoured[:st.E // 4].to(st.device)
        lo, hi = 0.0, 1.0
        for _ in range(20):
            bias = (lo + hi) / 2
            picks = scores.index_add(2, favoured, torch.full_like(scores[:, :, favoured], bias))
            picks = picks.topk(st.K, dim=-1).indices
            if torch.isin(picks, favoured).float().mean().item() < 0.5:
                lo = bias
            else:
                hi = bias
        scores.index_add_(2, favoured, torch.full_like(scores[:, :, favoured], hi))
    return scores


def make_problem(st: Setup, S: int, gen: torch.Generator):
    """Random bf16 x and dy, random top-K routing as `st.routing` says (`route_scores`;
    probabilities never zero), its layout."""
    x = torch.randn(S, st.H, st.D, device=st.device, generator=gen).bfloat16()
    dy = torch.randn(S, st.H, st.D, device=st.device, generator=gen).bfloat16()
    indices = route_scores(st, S, gen).topk(st.K, dim=-1).indices
    probs = torch.rand(st.H, S, st.K, device=st.device, generator=gen) + 0.1
    probs = probs / probs.sum(-1, keepdim=True)
    return x, dy, mhmoe.sort_routes(probs, indices, st.E)


def checks(st: Setup, gen, weights) -> dict:
    """Per-gradient relative error at check_s against fp32 autograd; repeatability."""
    x, dy, layout = make_problem(st, st.check_s, gen)
    wg, wu, wd = weights
    leaves = [t.float().requires_grad_() for t in (x, layout.sorted_probs, wg, wu, wd)]
    y = expert_forward_reference(leaves[0], layout.gather_ids, leaves[1], layout.offsets,
                                 *leaves[2:])
    y.backward(dy.float())
    ref = [t.grad for t in leaves]
    del leaves, y
    torch_grads = expert_backward_reference(dy, x, *layout, wg, wu, wd)
    out = {"S": st.check_s,
           "torch_fp32_backward": {n: rel_err(t, r)
                                   for n, t, r in zip(NAMES, torch_grads, ref, strict=True)}}
    del torch_grads
    for det in (False, True):
        mode = "deterministic" if det else "default"
        grads = triton_expert_backward(dy, x, *layout, wg, wu, wd, deterministic=det)
        out[mode] = {n: rel_err(g, r) for n, g, r in zip(NAMES, grads, ref, strict=True)}
        again = triton_expert_backward(dy, x, *layout, wg, wu, wd, deterministic=det)
        out[f"bitwise_{mode}"] = {n: bool(torch.equal(a, b))
                                  for n, a, b in zip(NAMES, grads, again, strict=True)}
    return out


def timer(st: Setup):
    """bench_ms on the GPU; one timed call under the interpreter (--cpu)."""
    if st.device == "cuda":
        return bench_ms
    return lambda fn: time_fn(fn, runs=1, warmup=1).median_ms


def time_size(st: Setup, S: int, gen, weights, det: bool) -> dict:
    """Forward, backward and forward+backward times of one S and mode; extra memory."""
    x, dy, layout = make_problem(st, S, gen)
    fwd = functools.partial(triton_expert_forward, x, *layout, *weights, deterministic=det)
    bwd = functools.partial(triton_expert_backward, dy, x, *layout, *weights,
                            deterministic=det)

    def both():
        fwd()
        bwd()

    ms = timer(st)
    row = {"fwd_ms": ms(fwd), "bwd_ms": ms(bwd), "fwd_bwd_ms": ms(both)}
    row["bwd_over_fwd"] = row["bwd_ms"] / row["fwd_ms"]
    row["config"] = repr(expert_backward_config(x.device, layout.gather_ids.numel()
                                                / (st.H * st.E)))
    row["extra_gb"] = float("nan")
    if st.device == "cuda":
        # Peak memory beyond inputs, parameters, the output and the gradients.
        peak, (y, grads) = call_peak_bytes(lambda: (fwd(), bwd()), st.device)
        row["extra_gb"] = (peak - tensor_bytes((y, *grads))) / 1e9
    return row


def parse_config(spec: str, default: ExpertBackwardConfig) -> ExpertBackwardConfig:
    """'dx=m/i/w/s,dw=m/i/w/s,panel=m/n/k/w/s[/tma[/gws[/bufs]]],pdx=i/w/s[/tma],
    ws=0|1,rcp=0|1,st=8|16' over `default` (fields in the dataclasses' order, booleans
    as 0/1); 'panel=none': recompute; gws, bufs: the Gluon dW GEMM; pdx: dx from the
    panels (`PanelDxConfig`); ws=1: with pdx, the Gluon panel kernel
    (dx.warp_specialized); rcp: `sigmoid_rcp`; st: `panel_store_bytes`."""
    tiles, ws = {}, None
    for part in spec.split(","):
        key, value = part.split("=")
        if key == "rcp":
            tiles["sigmoid_rcp"] = bool(int(value))
        elif key == "st":
            tiles["panel_store_bytes"] = int(value)
        elif key == "panel":
            tiles[key] = None if value == "none" else PanelGemmConfig(*map(int, value.split("/")))
        elif key == "pdx":
            tiles["panel_dx"] = (None if value == "none"
                                 else PanelDxConfig(*map(int, value.split("/"))))
        elif key == "ws":
            ws = bool(int(value))
        else:
            tiles[key] = ExpertForwardConfig(*map(int, value.split("/")))
    if ws is not None:
        tiles["dx"] = dataclasses.replace(tiles.get("dx", default.dx), warp_specialized=ws)
    return dataclasses.replace(default, **tiles)


def sweep_specs(text: str) -> list[str]:
    """The --sweep variants in order (';'-separated, blanks and spaces around parts
    dropped). Each is timed and recorded under its own name beside the default tiles'
    ("default"), so a variant named "default" or given twice is a ValueError, read with
    the arguments: on a GPU the names would collide in the interleaved timing after every
    size was timed. So is a part that is not key=value with both sides, which the sweep
    would otherwise only report and skip after the sizes' timings."""
    specs = []
    for spec in text.split(";"):
        parts = [part.strip() for part in spec.split(",")]
        if not any(parts):
            continue
        spec = ",".join(parts)
        if spec == "default":
            raise ValueError("--sweep: 'default' names the default tiles, which are always "
                             "timed; give only the variants")
        for part in parts:
            key, eq, value = part.partition("=")
            if not (key and eq and value) or "=" in value:
                raise ValueError(f"--sweep: variant {spec!r}: {part!r} is not key=value")
        specs.append(spec)
    check_unique(specs, "--sweep")
    return specs


def sweep(st: Setup, S: int, gen, weights, specs: list[str]) -> list[tuple[str, float, dict]]:
    """Backward time (default mode) of each config (see `parse_config`) against the
    default's, interleaved, and the largest relative difference of its gradients from
    the default config's: (variant, ms, extra with the config) for each."""
    x, dy, layout = make_problem(st, S, gen)
    default = expert_backward_config(x.device, S * st.K / st.E)
    call = functools.partial(triton_expert_backward, dy, x, *layout, *weights)
    ref = call(config=default)
    variants, diffs = [("sweep:default", functools.partial(call, config=default))], {}
    for spec in specs:
        try:
            cfg = parse_config(spec, default)
            grads = call(config=cfg)
        except Exception as exc:  # a config refused or failing to compile is reported
            print(f"sweep S={S} {spec}: {exc!r}"[:300], flush=True)
            continue
        diffs[spec] = max(rel_err(g, r) for g, r in zip(grads, ref, strict=True))
        variants.append((f"sweep:{spec}", functools.partial(call, config=cfg)))
        del grads
    if st.device == "cuda":
        timed = {name: t.median_ms for name, t in
                 interleaved(variants, rounds=5, per_round=3, seed=S).items()}
    else:
        timed = {name: time_fn(fn, runs=1).median_ms for name, fn in variants}
    out = []
    for name, ms in timed.items():
        spec = name.removeprefix("sweep:")
        extra = {"config": repr(default) if spec == "default" else spec,
                 "max_rel_diff_vs_default": diffs.get(spec, 0.0)}
        print(f"sweep S={S} {spec}: {ms:.2f} ms, max rel. diff vs default "
              f"{extra['max_rel_diff_vs_default']:.2e}", flush=True)
        out.append((name, ms, extra))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="token counts, comma-separated")
    parser.add_argument("--sweep", default="",
                        help="'dx=m/i/w/s,dw=m/i/w/s,panel=m/n/k/w/s|none;...' at the largest S")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--routing", default="uniform", choices=ROUTINGS,
                        help="the routes: uniform, skewed (a quarter of the experts take "
                        "half of them), hot or hot-last (the first or the last expert of "
                        "each head takes every token)")
    parser.add_argument("--sweep-only", action="store_true",
                        help="time only the --sweep (at the largest S), not each mode per S")
    parser.add_argument("--out", default=None, help="also write the run as one JSON file")
    parser.add_argument("--no-record", action="store_true",
                        help="do not append rows to benchmarks/results.jsonl")
    parser.add_argument("--cpu", action="store_true",
                        help="a dry run under the Triton interpreter at toy dims")
    args = parser.parse_args()
    if args.sweep_only and not args.sweep:
        parser.error("--sweep-only needs --sweep")
    try:
        specs = sweep_specs(args.sweep)
    except ValueError as exc:
        parser.error(str(exc))
    st = dataclasses.replace(CPU_SETUP if args.cpu else Setup(), routing=args.routing)
    if args.sizes:
        st = dataclasses.replace(st, sizes=tuple(int(s) for s in args.sizes.split(",")))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # fail before the run
    env = environment(st.device)
    print(env, flush=True)
    peaks = measured_peaks(st.device)
    if peaks:
        print("peaks", peaks, flush=True)
    gen = torch.Generator(device=st.device).manual_seed(0)
    weights = make_weights(st, gen)
    found = {} if args.skip_checks else checks(st, gen, weights)
    if found:
        print("checks", json.dumps(found), flush=True)
    shape = dict(H=st.H, E=st.E, K=st.K, D=st.D, I=st.I, routing=st.routing)
    rows, table = [], []
    command = script_command("bench_expert_backward.py", sys.argv[1:])
    for S in () if args.sweep_only else st.sizes:
        for det in (False, True):
            t = time_size(st, S, gen, weights, det)
            mode = "deterministic" if det else "default"
            flop = fwd_flops(st, S)
            rows.append(result_row("expert_bwd", mode, S, t["bwd_ms"], env=env,
                                   tflops=2 * flop / (t["bwd_ms"] * 1e-3) / 1e12,
                                   fwd_ms=t["fwd_ms"], bwd_over_fwd=t["bwd_over_fwd"],
                                   extra_gb=t["extra_gb"], config=t["config"], shape=shape,
                                   peaks=peaks, command=command))
            rows.append(result_row("expert_fwd_bwd", mode, S, t["fwd_bwd_ms"], env=env,
                                   tflops=3 * flop / (t["fwd_bwd_ms"] * 1e-3) / 1e12,
                                   shape=shape, peaks=peaks, command=command))
            table.append((S, mode, t))
            print(f"S={S} {mode}: {json.dumps(t)}", flush=True)
        if st.device == "cuda":
            torch.cuda.empty_cache()
    if specs:
        S = max(st.sizes)
        for variant, ms, extra in sweep(st, S, gen, weights, specs):
            rows.append(result_row("expert_bwd", variant, S, ms, env=env,
                                   tflops=2 * fwd_flops(st, S) / (ms * 1e-3) / 1e12,
                                   shape=shape, peaks=peaks, command=command, **extra))

    if args.out:
        Path(args.out).write_text(json.dumps(
            {"environment": env, "peaks": peaks, "checks": found, "rows": rows}, indent=1) + "\n")
    if not (args.no_record or args.cpu):
        print(f"rows appended to {append_results(rows)}")
    print("\n| S | mode | fwd ms | bwd ms | bwd/fwd | fwd+bwd ms | TFLOP/s (3x fwd) | extra GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for S, mode, t in table:
        print(f"| {S} | {mode} | {t['fwd_ms']:.2f} | {t['bwd_ms']:.2f} | {t['bwd_over_fwd']:.2f} "
              f"| {t['fwd_bwd_ms']:.2f} | {3 * fwd_flops(st, S) / t['fwd_bwd_ms'] / 1e9:.0f} "
              f"| {t['extra_gb']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
