"""Check and time the fused Triton expert backward at MAGI-2 shapes (run on a GPU machine).

    PYTHONPATH=src python3 benchmarks/bench_expert_backward.py --out $OUT/bwd.json

Steps, in order: the bf16 8192^3 matmul ceiling; correctness at S=4096
(every gradient against fp32 autograd through `expert_forward_reference` on
upcast inputs, next to the error of the PyTorch fp32 backward
`expert_backward_reference`); determinism (two runs bitwise); timings of
forward, backward and forward+backward over S and mode (default /
deterministic) with the peak extra memory; with --sweep, backward tile
configs at the largest S. Prints a table last and writes JSON to --out.
FLOP: forward 6 S H K D I; forward+backward counted as 3x the forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import time

import torch
import triton
from triton.testing import do_bench

from mhmoe.kernels.backward_configs import (
    ExpertBackwardConfig,
    PanelGemmConfig,
    expert_backward_config,
)
from mhmoe.kernels.configs import ExpertForwardConfig
from mhmoe.kernels.expert_backward import triton_expert_backward
from mhmoe.kernels.expert_forward import triton_expert_forward
from mhmoe.reference import expert_backward_reference, expert_forward_reference
from mhmoe.reference import sort_routes_reference as sort_routes

H, E, K, D, I = 12, 256, 6, 256, 1280
NAMES = ("dx", "dprobs", "d_gate", "d_up", "d_down")


def fwd_flops(S: int) -> float:
    return 6.0 * S * H * K * D * I


def make_problem(S: int, gen: torch.Generator, weights=None):
    """Random bf16 inputs and uniform random top-K routing (never zeros)."""
    F = H * E
    if weights is None:
        weights = (
            torch.randn(F, D, I, device="cuda", generator=gen).mul_(2 * D**-0.5).bfloat16(),
            torch.randn(F, D, I, device="cuda", generator=gen).mul_(2 * D**-0.5).bfloat16(),
            torch.randn(F, I, D, device="cuda", generator=gen).mul_(I**-0.5).bfloat16())
    x = torch.randn(S, H, D, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(S, H, D, device="cuda", generator=gen).bfloat16()
    scores = torch.rand(H, S, E, device="cuda", generator=gen)
    indices = scores.topk(K, dim=-1).indices
    probs = torch.rand(H, S, K, device="cuda", generator=gen) + 0.1
    probs = probs / probs.sum(-1, keepdim=True)
    layout = sort_routes(probs, indices, E)
    return x, dy, layout, weights


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def median_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def matmul_tflops() -> float:
    """The ceiling, measured in the same run: a bf16 8192^3 product on random data."""
    mat = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: mat @ mat, warmup=50, rep=200, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


def check(gen, weights) -> dict:
    """Per-gradient relative error at S=4096 against fp32 autograd; determinism."""
    x, dy, layout, (wg, wu, wd) = make_problem(4096, gen, weights)
    leaves = [t.float().requires_grad_() for t in (x, layout[1], wg, wu, wd)]
    y = expert_forward_reference(leaves[0], layout[0], leaves[1], layout[2], *leaves[2:])
    y.backward(dy.float())
    ref = [t.grad for t in leaves]
    del leaves, y
    torch_grads = expert_backward_reference(dy, x, *layout, wg, wu, wd)
    row = {"S": 4096, "torch_fp32_backward": {n: rel_err(t, r) for n, t, r in
                                              zip(NAMES, torch_grads, ref, strict=True)}}
    del torch_grads
    for det in (False, True):
        grads = triton_expert_backward(dy, x, *layout, wg, wu, wd, deterministic=det)
        row["deterministic" if det else "default"] = {
            n: rel_err(g, r) for n, g, r in zip(NAMES, grads, ref, strict=True)}
        again = triton_expert_backward(dy, x, *layout, wg, wu, wd, deterministic=det)
        row[f"bitwise_{'det' if det else 'default'}"] = {
            n: bool(torch.equal(a, b)) for n, a, b in zip(NAMES, grads, again, strict=True)}
    return row


def time_size(S: int, gen, weights, det: bool, reps: int) -> dict:
    x, dy, layout, (wg, wu, wd) = make_problem(S, gen, weights)
    fwd = lambda: triton_expert_forward(x, *layout, wg, wu, wd, deterministic=det)  # noqa: E731
    bwd = lambda: triton_expert_backward(dy, x, *layout, wg, wu, wd,  # noqa: E731
                                         deterministic=det)

    def both():
        fwd()
        bwd()

    row = {"S": S, "deterministic": det}
    row["bwd_ms"] = median_ms(bwd, reps)
    try:  # the forward is edited by others: a broken forward must not hide the backward
        row["fwd_ms"] = median_ms(fwd, reps)
    except Exception as exc:
        row["fwd_error"] = repr(exc)[:300]
        row["fwd_ms"], fwd = float("nan"), (lambda: torch.empty(S, H, D, device="cuda"))
    row["fwd_bwd_ms"] = median_ms(both, reps)
    row["fwd_bwd_tflops_3x"] = 3 * fwd_flops(S) / row["fwd_bwd_ms"] / 1e9
    row["bwd_over_fwd"] = row["bwd_ms"] / row["fwd_ms"]
    # Peak memory beyond inputs, parameters, the output and the gradients.
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = fwd()
    grads = bwd()
    torch.cuda.synchronize()
    kept = sum(t.numel() * t.element_size() for t in (y, *grads))
    row["extra_gb"] = (torch.cuda.max_memory_allocated() - base - kept) / 1e9
    del y, grads
    return row


def parse_config(spec: str, default: ExpertBackwardConfig) -> ExpertBackwardConfig:
    """'dx=m/i/w/s,dw=m/i/w/s,panel=m/n/k/w/s[/tma]' over `default` (fields in the
    dataclasses' order, booleans as 0/1); 'panel=none': recompute."""
    parts = dict(p.split("=") for p in spec.split(","))
    tiles = {}
    for key, value in parts.items():
        if key == "panel":
            tiles[key] = None if value == "none" else PanelGemmConfig(*map(int, value.split("/")))
        else:
            tiles[key] = ExpertForwardConfig(*map(int, value.split("/")))
    return dataclasses.replace(default, **tiles)


def sweep(S: int, gen, weights, specs: str, reps: int) -> list[dict]:
    """Backward time (default mode) of each config (see `parse_config`), and the largest
    relative difference of its gradients from the default config's."""
    x, dy, layout, (wg, wu, wd) = make_problem(S, gen, weights)
    default = expert_backward_config(torch.device("cuda"), S * K / E)
    ref = triton_expert_backward(dy, x, *layout, wg, wu, wd, config=default)
    rows = []
    for spec in filter(None, specs.split(";")):
        cfg = parse_config(spec, default)
        try:
            grads = triton_expert_backward(dy, x, *layout, wg, wu, wd, config=cfg)
            ms = median_ms(lambda c=cfg: triton_expert_backward(dy, x, *layout, wg, wu, wd,
                                                                config=c), reps)
        except Exception as exc:  # a config that fails to compile is a row, not a crash
            rows.append({"S": S, "config": spec, "error": repr(exc)[:200]})
            continue
        diff = max(rel_err(g, r) for g, r in zip(grads, ref, strict=True))
        rows.append({"S": S, "config": spec, "bwd_ms": ms, "max_rel_diff_vs_default": diff})
        print(f"sweep S={S} {spec}: {ms:.2f} ms, max rel. diff vs default {diff:.2e}", flush=True)
        del grads
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="expert_backward.json")
    parser.add_argument("--sizes", default="4096,32768")
    parser.add_argument("--sweep", default="",
                        help="'dx=m/i/w/s,dw=m/i/w/s,panel=m/n/k/w/s|none;...' at the largest S")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "commit": commit, "shapes": dict(
                  H=H, E=E, K=K, D=D, I=I)}
    result["matmul_bf16_tflops"] = matmul_tflops()
    F = H * E
    weights = (
        torch.randn(F, D, I, device="cuda", generator=gen).mul_(2 * D**-0.5).bfloat16(),
        torch.randn(F, D, I, device="cuda", generator=gen).mul_(2 * D**-0.5).bfloat16(),
        torch.randn(F, I, D, device="cuda", generator=gen).mul_(I**-0.5).bfloat16())
    print(f"matmul {result['matmul_bf16_tflops']:.0f} TFLOP/s ({time.time() - t0:.0f} s)",
          flush=True)
    if not args.skip_checks:
        result["check"] = check(gen, weights)
        print(json.dumps(result["check"]), f"({time.time() - t0:.0f} s)", flush=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    result["configs"] = {S: repr(expert_backward_config(torch.device("cuda"), S * K / E))
                         for S in sizes}
    rows = []
    for S in sizes:
        for det in (False, True):
            rows.append(time_size(S, gen, weights, det, reps=5 if S > 8192 else 10))
            print(json.dumps(rows[-1]), f"({time.time() - t0:.0f} s)", flush=True)
    result["timings"] = rows
    if args.sweep:
        result["sweep"] = sweep(max(sizes), gen, weights, args.sweep, reps=3)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print("\n| S | mode | fwd ms | bwd ms | bwd/fwd | fwd+bwd ms | TFLOP/s (3x fwd) | extra GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['S']} | {'det' if r['deterministic'] else 'default'} | {r['fwd_ms']:.2f} | "
              f"{r['bwd_ms']:.2f} | {r['bwd_over_fwd']:.2f} | {r['fwd_bwd_ms']:.2f} | "
              f"{r['fwd_bwd_tflops_3x']:.0f} | {r['extra_gb']:.2f} |")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
