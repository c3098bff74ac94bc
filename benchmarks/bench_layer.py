"""The whole MultiHeadMoE on one GPU: routing + layout + experts, forward and backward.

    PYTHONPATH=src python3 benchmarks/bench_layer.py [--tokens 1024,32768] [--no-record]
        [--routing uniform,skewed,hot,hot-last]
    PYTHONPATH=src python3 benchmarks/bench_layer.py --profile 32768 [--routing hot]

For each token count: the published-style routing and layout (fp32 logits,
sigmoid, bias, torch.topk, normalisation, argsort + bincount), our routing
and layout (eager and replayed from a CUDA graph), the expert kernel alone,
the whole layer forward (eager and from a CUDA graph) and forward+backward
(`torch.autograd.grad` of x and the trainable parameters, eager and from a CUDA
graph), in default and deterministic mode, with the memory forward+backward takes
beyond its inputs, the parameters and the gradients. `--routing` adds skewed routes
(`skew_router`: a quarter of each head's experts take half of its routes; one hot
expert per head, its first or with hot-last its last, takes every token of its head),
timed for the layer forward and
forward+backward (eager, default mode). The bf16 8192^3 matmul and a device
copy are measured in the same run. `--profile S` instead prints torch.profiler's table of
the GPU kernels of forward+backward at S tokens, routed as the one --routing given (where
the time goes; nothing recorded).
Medians of `do_bench` (mhmoe.bench.bench_ms).
Rows go to benchmarks/results.jsonl unless --no-record; --out also writes the
run as one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import mhmoe
from mhmoe.bench import (
    append_results,
    bench_ms,
    call_peak_bytes,
    capture_graph,
    environment,
    measured_peaks,
    result_row,
    tensor_bytes,
)


def published_route_and_layout(x_heads, layer):
    """The published recipe, for comparison: topk, then argsort and bincount (a host sync)."""
    cfg = layer.config
    H, E = cfg.num_heads, cfg.num_experts
    logits = torch.bmm(x_heads.transpose(0, 1).float(),
                       layer.gate.view(H, E, -1).transpose(1, 2))
    scores = torch.sigmoid(logits)
    select = scores + layer.router.expert_bias_ema.view(H, 1, E)
    indices = torch.topk(select, cfg.top_k, dim=-1).indices
    probs = scores.gather(-1, indices)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12) * cfg.route_scale
    flat = (indices + torch.arange(H, device=indices.device).view(H, 1, 1) * E).flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=H * E)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return order, probs.flatten()[order], offsets


def magi2_layer(device: torch.device) -> mhmoe.MultiHeadMoE:
    """The MAGI-2 layer the layer benchmarks time: seeded parameters, a small expert bias."""
    cfg = mhmoe.MAGI2_PREVIEW
    layer = mhmoe.MultiHeadMoE(cfg, device=device)
    layer.reset_parameters(generator=torch.Generator(device=device).manual_seed(0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.router.expert_bias_ema.copy_(torch.randn(cfg.num_flat_experts, generator=gen)
                                           .mul_(0.01))
    return layer


ROUTINGS = ("uniform", "skewed", "hot", "hot-last")


def route_share(layer, x_heads: torch.Tensor, experts: torch.Tensor) -> float:
    """Share of the routes of x_heads that go to `experts` (ids within a head)."""
    with torch.no_grad():
        indices = layer.route_heads(x_heads).indices
    return torch.isin(indices, experts).float().mean().item()


def skew_router(layer, routing: str, x_heads: torch.Tensor) -> float:
    """Set the selection bias for `routing` (ROUTINGS) and return the share of routes the
    favoured experts take on x_heads. The bias shifts selection only (contract section 3),
    so the probabilities keep their form.

    skewed: a fixed quarter of each head's experts get one bias b, found by bisection so
    that they take half of the routes. hot: expert 0 of every head gets a bias of 1, which
    sigmoid scores (in (0, 1)) can never overcome: it takes every token of its head.
    hot-last: the same with the head's last expert, whose tiles come last in the kernels'
    tile orders where expert 0's come first.
    """
    cfg = layer.config
    H, E = cfg.num_heads, cfg.num_experts
    bias = layer.selection_bias().view(H, E)  # the bias selection reads (ema or main)
    device = x_heads.device
    with torch.no_grad():
        bias.zero_()
        if routing == "uniform":
            return 1.0
        if routing in ("hot", "hot-last"):
            hot = 0 if routing == "hot" else E - 1
            bias[:, hot] = 1.0
            return route_share(layer, x_heads, torch.full((1,), hot, device=device))
        favoured = torch.randperm(E, generator=torch.Generator().manual_seed(0))[:E // 4]
        favoured = favoured.to(device)
        lo, hi = 0.0, 1.0
        for _ in range(20):
            bias[:, favoured] = (lo + hi) / 2
            if route_share(layer, x_heads, favoured) < 0.5:
                lo = (lo + hi) / 2
            else:
                hi = (lo + hi) / 2
        bias[:, favoured] = hi
        return route_share(layer, x_heads, favoured)


def measure_skewed(layer, S: int, routing: str, device: torch.device) -> dict:
    """The layer forward and forward+backward (eager, default mode) under `routing`."""
    cfg = layer.config
    gen = torch.Generator(device=device).manual_seed(S)
    x = torch.randn(S, cfg.hidden_size, device=device, generator=gen).bfloat16()
    dy = torch.randn(S, cfg.hidden_size, device=device, generator=gen).bfloat16()
    saved = layer.selection_bias().detach().clone()
    share = skew_router(layer, routing, x.view(S, cfg.num_heads, cfg.head_dim))
    params = [p for p in layer.parameters() if p.requires_grad]
    xg = x.clone().requires_grad_(True)
    try:
        with torch.no_grad():
            layer_ms = bench_ms(lambda: layer(x))
        fwd_bwd_ms = bench_ms(lambda: torch.autograd.grad(layer(xg), [xg, *params], dy))
    finally:
        with torch.no_grad():
            layer.selection_bias().copy_(saved)
    return {"tokens": S, "routing": routing, "favoured_share": share,
            "layer_ms": layer_ms, "layer_fwd_bwd_ms": fwd_bwd_ms}


def measure(layer, S: int, device: torch.device) -> dict:
    """One token count: every time of the table, medians in ms."""
    cfg = layer.config
    gen = torch.Generator(device=device).manual_seed(S)
    x = torch.randn(S, cfg.hidden_size, device=device, generator=gen).bfloat16()
    dy = torch.randn(S, cfg.hidden_size, device=device, generator=gen).bfloat16()
    xh = x.view(S, cfg.num_heads, cfg.head_dim)
    params = [p for p in layer.parameters() if p.requires_grad]
    row = {"tokens": S}
    with torch.no_grad():
        row["published_route_layout_ms"] = bench_ms(lambda: published_route_and_layout(xh, layer))
        row["route_layout_ms"] = bench_ms(lambda: layer.route_layout(xh))
        # From a CUDA graph: the kernels without the host's launch cost, whose jitter
        # dominates the eager number of these short kernels.
        graph, _ = capture_graph(lambda: layer.route_layout(xh))
        row["route_layout_graph_ms"] = bench_ms(graph.replay)
        del graph
        layout = layer.route_layout(xh)
    w = (layer.W_gate, layer.W_up, layer.W_down)
    xg = x.clone().requires_grad_(True)

    def fwd_bwd():
        return torch.autograd.grad(layer(xg), [xg, *params], dy)

    for det in (False, True):
        tag = "det_" if det else ""
        layer.config = cfg.replace(deterministic=det)
        with torch.no_grad():
            row[f"{tag}experts_ms"] = bench_ms(
                lambda det=det: mhmoe.expert_forward(xh, *layout, *w, deterministic=det))
            row[f"{tag}layer_ms"] = bench_ms(lambda: layer(x))
            graph, _ = capture_graph(lambda: layer(x))
            row[f"{tag}layer_graph_ms"] = bench_ms(graph.replay)
            del graph
        row[f"{tag}layer_fwd_bwd_ms"] = bench_ms(fwd_bwd)
        # Peak memory beyond what was held before (inputs, parameters) and the gradients
        # returned: the workspaces and saved activations of one forward+backward.
        peak, grads = call_peak_bytes(fwd_bwd, device)
        row[f"{tag}fwd_bwd_extra_gb"] = (peak - tensor_bytes(grads)) / 1e9
        del grads
        try:
            graph, _ = capture_graph(fwd_bwd)
        except RuntimeError as err:  # reported, and the column left empty
            print(f"S={S}: forward+backward cannot be captured in a CUDA graph: {err}",
                  file=sys.stderr)
            row[f"{tag}layer_fwd_bwd_graph_ms"] = None
        else:
            row[f"{tag}layer_fwd_bwd_graph_ms"] = bench_ms(graph.replay)
            del graph
    layer.config = cfg
    flops = cfg.expert_flops(S)
    row["layer_tflops"] = flops / (row["layer_ms"] * 1e-3) / 1e12
    # forward + backward counted as three forwards, as the peer kernels report it
    row["layer_fwd_bwd_tflops"] = 3 * flops / (row["layer_fwd_bwd_ms"] * 1e-3) / 1e12
    return row


# (column of measure(), results-file kernel, variant, FLOP multiple of the forward or None)
ROWS = (
    ("published_route_layout_ms", "published_route_layout", "default", None),
    ("route_layout_ms", "route_layout", "default", None),
    ("route_layout_graph_ms", "route_layout", "graph", None),
    ("experts_ms", "experts_fwd", "default", 1),
    ("det_experts_ms", "experts_fwd", "deterministic", 1),
    ("layer_ms", "layer", "default", 1),
    ("layer_graph_ms", "layer", "graph", 1),
    ("det_layer_ms", "layer", "deterministic", 1),
    ("det_layer_graph_ms", "layer", "deterministic_graph", 1),
    ("layer_fwd_bwd_ms", "layer_fwd_bwd", "default", 3),
    ("layer_fwd_bwd_graph_ms", "layer_fwd_bwd", "graph", 3),
    ("det_layer_fwd_bwd_ms", "layer_fwd_bwd", "deterministic", 3),
    ("det_layer_fwd_bwd_graph_ms", "layer_fwd_bwd", "deterministic_graph", 3),
)


def profile(layer, S: int, device: torch.device, routing: str = "uniform",
            steps: int = 3) -> None:
    """torch.profiler's per-kernel table of `steps` forward+backward passes at S tokens,
    routed as `routing` says (`skew_router`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cfg = layer.config
    gen = torch.Generator(device=device).manual_seed(S)
    x = torch.randn(S, cfg.hidden_size, device=device, generator=gen).bfloat16()
    dy = torch.randn(S, cfg.hidden_size, device=device, generator=gen).bfloat16()
    share = skew_router(layer, routing, x.view(S, cfg.num_heads, cfg.head_dim))
    params = [p for p in layer.parameters() if p.requires_grad]
    xg = x.clone().requires_grad_(True)

    def fwd_bwd():
        return torch.autograd.grad(layer(xg), [xg, *params], dy)

    fwd_bwd()  # compile outside the profile
    torch.cuda.synchronize(device)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd_bwd()
        torch.cuda.synchronize(device)
    favoured = "" if routing == "uniform" else f", favoured experts {share:.1%} of the routes"
    print(f"S={S}, {routing} routing{favoured}: forward+backward x {steps}, GPU kernels by "
          "total time")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                    max_name_column_width=70))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,4096,16384,32768")
    parser.add_argument("--routing", default="uniform",
                        help=f"comma-separated routings of {ROUTINGS}: uniform gives the "
                        "whole table, the others the layer forward and forward+backward")
    parser.add_argument("--out", default=None, help="also write the run as one JSON file")
    parser.add_argument("--profile", type=int, default=None, metavar="S",
                        help="print the profiler's kernel table of forward+backward at S "
                        "tokens (routed as --routing says, one routing) and exit")
    parser.add_argument("--no-record", action="store_true",
                        help="do not append rows to benchmarks/results.jsonl")
    args = parser.parse_args()
    if os.environ.get("MAGI2_DETERMINISTIC"):
        parser.error("unset MAGI2_DETERMINISTIC: it would override the modes this benchmark "
                     "sets itself (default and deterministic)")
    tokens = [int(t) for t in args.tokens.split(",")]
    routings = args.routing.split(",")
    if not set(routings) <= set(ROUTINGS):
        parser.error(f"--routing: each of {ROUTINGS}, got {args.routing!r}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # fail before the sweep
    device = torch.device("cuda")
    layer = magi2_layer(device)
    if args.profile:
        if len(routings) != 1:
            parser.error("--profile takes one --routing")
        profile(layer, args.profile, device, routings[0])
        return 0
    cfg = layer.config
    env = environment(device)
    peaks = measured_peaks(device)
    rows, skewed = [], []
    for S in tokens:
        if "uniform" in routings:
            rows.append(measure(layer, S, device))
            print(json.dumps(rows[-1]), flush=True)
        for routing in routings:
            if routing != "uniform":
                skewed.append(measure_skewed(layer, S, routing, device))
                print(json.dumps(skewed[-1]), flush=True)
    print(f"\nbf16 8192^3 matmul {peaks['matmul_tflops']:.0f} TFLOP/s, copy "
          f"{peaks['copy_tbs']:.2f} TB/s")
    cols = ("published_route_layout_ms", "route_layout_ms", "route_layout_graph_ms",
            "experts_ms", "layer_ms", "layer_graph_ms", "det_layer_ms", "layer_fwd_bwd_ms",
            "layer_fwd_bwd_graph_ms", "det_layer_fwd_bwd_ms", "layer_fwd_bwd_tflops")
    heads = ("publ. route+CSR", "route+CSR", "route+CSR graph", "experts", "layer",
             "layer graph", "det layer", "fwd+bwd", "fwd+bwd graph", "det fwd+bwd",
             "fwd+bwd TFLOP/s")
    print(f"{'S':>7} " + " ".join(f"{h:>15}" for h in heads))
    for r in rows:
        print(f"{r['tokens']:>7} " + " ".join(f"{r[c]:>15.3f}" if r[c] is not None
                                             else f"{'-':>15}" for c in cols))
        print(f"{'':>7} forward+backward beyond inputs, parameters and gradients: "
              f"{r['fwd_bwd_extra_gb']:.2f} GB (deterministic {r['det_fwd_bwd_extra_gb']:.2f})")
    uniform = {r["tokens"]: r for r in rows}
    for r in skewed:
        base = uniform.get(r["tokens"])
        vs = (f" ({r['layer_ms'] / base['layer_ms']:.2f}x / "
              f"{r['layer_fwd_bwd_ms'] / base['layer_fwd_bwd_ms']:.2f}x uniform)" if base else "")
        print(f"{r['tokens']:>7} {r['routing']}: favoured experts take "
              f"{100 * r['favoured_share']:.1f}% of the routes; layer {r['layer_ms']:.3f} ms, "
              f"fwd+bwd {r['layer_fwd_bwd_ms']:.3f} ms{vs}")
    if not args.no_record:
        command = (f"PYTHONPATH=src python3 benchmarks/bench_layer.py --tokens {args.tokens}"
                   f" --routing {args.routing}")

        def tflops(tokens, ms, mult):
            return None if mult is None else mult * cfg.expert_flops(tokens) / (ms * 1e-3) / 1e12

        results = [result_row(kernel, variant, r["tokens"], r[col], env=env,
                              tflops=tflops(r["tokens"], r[col], mult), command=command,
                              **({"extra_gb": r[f"{'det_' if 'deterministic' in variant else ''}"
                                                f"fwd_bwd_extra_gb"]}
                                 if col.endswith("layer_fwd_bwd_ms") else {}), **peaks)
                   for r in rows for col, kernel, variant, mult in ROWS if r[col] is not None]
        results += [result_row(kernel, r["routing"], r["tokens"], r[col], env=env,
                               tflops=tflops(r["tokens"], r[col], mult), command=command,
                               favoured_share=r["favoured_share"], **peaks)
                    for r in skewed for col, kernel, mult in
                    (("layer_ms", "layer", 1), ("layer_fwd_bwd_ms", "layer_fwd_bwd", 3))]
        print(f"rows appended to {append_results(results)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env,
                                              "config": json.loads(cfg.to_json()),
                                              "peaks": peaks, "rows": rows,
                                              "skewed": skewed}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
