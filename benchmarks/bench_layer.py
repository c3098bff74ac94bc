"""The whole MultiHeadMoE forward on one GPU: routing + layout + experts (issue 4).

    PYTHONPATH=src python3 benchmarks/bench_layer.py --out $OUT/layer.json

For each token count: the published-style routing and layout (fp32 logits,
sigmoid, bias, torch.topk, normalisation, argsort + bincount), our routing
and layout (eager and replayed from a CUDA graph), the expert kernel alone,
and the whole layer forward, eager and replayed from a CUDA graph, in default
and deterministic mode. The bf16 8192^3 matmul is measured in the same run.
Medians of `do_bench`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

import mhmoe
from mhmoe.bench import copy_bandwidth_tbs, environment, matmul_peak_tflops


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


def graph_of(fn):
    """A CUDA graph of fn() (after two warm-up calls on a side stream), and what the
    captured call returned (its outputs live in the graph's memory)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


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


def measure(layer, S: int, device: torch.device) -> dict:
    """One token count: every time of the table, medians in ms."""
    cfg = layer.config
    x = torch.randn(S, cfg.hidden_size, device=device).bfloat16()
    xh = x.view(S, cfg.num_heads, cfg.head_dim)
    row = {"tokens": S}
    row["published_route_layout_ms"] = do_bench(
        lambda: published_route_and_layout(xh, layer), return_mode="median")
    row["route_ms"] = do_bench(lambda: layer.route_heads(xh), return_mode="median")
    row["route_layout_ms"] = do_bench(lambda: layer.route_layout(xh), return_mode="median")
    # The same from a CUDA graph: the kernels without the host's launch cost, whose jitter
    # moved the eager number by 0.1 ms between two runs of session 14 (0.515 / 0.631 ms).
    graph, _ = graph_of(lambda: layer.route_layout(xh))
    row["route_layout_graph_ms"] = do_bench(graph.replay, return_mode="median")
    del graph
    layout = layer.route_layout(xh)
    w = (layer.W_gate, layer.W_up, layer.W_down)
    for det in (False, True):
        tag = "det_" if det else ""
        layer.config = cfg.replace(deterministic=det)
        row[f"{tag}experts_ms"] = do_bench(
            lambda det=det: mhmoe.expert_forward(xh, *layout, *w, deterministic=det),
            return_mode="median")
        row[f"{tag}layer_ms"] = do_bench(lambda: layer(x), return_mode="median")
        graph, _ = graph_of(lambda: layer(x))
        row[f"{tag}layer_graph_ms"] = do_bench(graph.replay, return_mode="median")
        del graph
    layer.config = cfg
    row["layer_tflops"] = cfg.expert_flops(S) / (row["layer_ms"] * 1e-3) / 1e12
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,4096,16384,32768")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    layer = magi2_layer(device)
    cfg = layer.config
    peaks = {"matmul_tflops": matmul_peak_tflops(device), "copy_tbs": copy_bandwidth_tbs(device)}
    rows = []
    with torch.no_grad():
        for S in [int(t) for t in args.tokens.split(",")]:
            rows.append(measure(layer, S, device))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nbf16 8192^3 matmul {peaks['matmul_tflops']:.0f} TFLOP/s, copy "
          f"{peaks['copy_tbs']:.2f} TB/s")
    head = ("S", "publ. route+CSR", "route", "route+CSR", "route+CSR graph", "experts",
            "layer", "layer graph", "det layer", "det graph", "TFLOP/s")
    print(" ".join(f"{h:>15}" for h in head))
    for r in rows:
        vals = (r["tokens"], r["published_route_layout_ms"], r["route_ms"], r["route_layout_ms"],
                r["route_layout_graph_ms"], r["experts_ms"], r["layer_ms"], r["layer_graph_ms"],
                r["det_layer_ms"], r["det_layer_graph_ms"], r["layer_tflops"])
        print(" ".join(f"{v:>15.3f}" if isinstance(v, float) else f"{v:>15}" for v in vals))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"environment": environment(device),
                                              "config": json.loads(cfg.to_json()),
                                              "peaks": peaks, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
