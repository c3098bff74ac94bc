"""Accuracy of fp8 layers (mhmoe.quantize) against the bf16 layers they come from.

    PYTHONPATH=src python3 benchmarks/fp8_accuracy.py [--layers 8] [--tokens 256] [--device cpu]

Seeded bf16 layers (MAGI-2's routing: top-6, sigmoid, route_scale 4.9; the expert
dims of --head-dim and --intermediate), each quantized with `mhmoe.quantize(layer,
"fp8")`. Printed, one JSON object:

- `one_layer`: the first fp8 layer's output against the float64 evaluation of its
  bf16 layer (the same routes: the router sees the unquantized x), relative error and
  cosine similarity; the bf16 layer's own error against the same reference beside it.
- `stack`: a residual stack h = h + moe(h) through all --layers, fp8 against the same
  stack in bf16: the relative error of the final h, and of its change h - x (the sum of
  the layers' outputs), which the residual does not dilute. Beside it the bf16 stack
  against the same stack with float32 inputs and activations (the same weight values):
  how much the stack itself amplifies a small change, whatever made it. Random layers
  without a norm grow h by a factor at every layer (`growth`), and the error with it.
- `prenorm_stack`: the same with h = h + moe(rms_norm(h)), as MAGI-2's transformer
  blocks feed their MoE (a norm without weight, in fp32).
- in both, `by_depth`: after layers 1, 2, 4, 8, ...: the relative error of h - x, fp8
  against bf16 and bf16 against float32, the share of (token, head) pairs whose
  set of experts differs between the fp8 and the bf16 stack at that layer (a route
  that flips changes its output by a whole expert's share), and `fp8_layer_rel_err`:
  that layer of the fp8 stack against its bf16 layer on the same input (the fp8
  stack's own), the per-layer error at that depth whatever the stacks' drift.

On the CPU the fp8 layers run their float64 twin (`--backend torch`, the default
there) or the Triton kernel in the interpreter (`--backend triton`, TRITON_INTERPRET=1,
slow); on a GPU the kernel. Numbers: docs/fp8.md ("Measured").
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import mhmoe
from mhmoe.bench import rel_err
from mhmoe.reference import moe_reference_float64


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(),
                                                 dim=0).item()


def rms_norm(h: torch.Tensor) -> torch.Tensor:
    h32 = h.float()
    return (h32 * torch.rsqrt(h32.square().mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def stack(layers, x: torch.Tensor, prenorm: bool, twins=None) -> list[tuple]:
    """(h after the layer, the experts the layer picked, and with `twins` the layer's
    relative error against its twin on the same input) of every layer."""
    h, out = x, []
    for i, layer in enumerate(layers):
        u = rms_norm(h) if prenorm else h
        _, indices = layer.route_heads(u.view(u.shape[0], layer.local_heads, -1))
        y = layer(u)
        err = rel_err(y, twins[i](u)) if twins is not None else None
        h = h + y
        out.append((h, indices.sort(dim=-1).values, err))
    return out


def compare(layers_bf16, layers_fp8, layers_fp32, x: torch.Tensor, prenorm: bool) -> dict:
    s16 = stack(layers_bf16, x, prenorm)
    s8 = stack(layers_fp8, x, prenorm, twins=layers_bf16)
    s32 = stack(layers_fp32, x.float(), prenorm)
    h16, h8, h32 = s16[-1][0], s8[-1][0], s32[-1][0]
    depths = sorted({min(2**i, len(s16)) for i in range(len(s16).bit_length() + 1)})
    by_depth = {
        d: {"fp8_vs_bf16_change_rel_err": rel_err(s8[d - 1][0] - x, s16[d - 1][0] - x),
            "bf16_vs_fp32_change_rel_err": rel_err(s16[d - 1][0] - x, s32[d - 1][0] - x),
            "routes_changed": (s8[d - 1][1] != s16[d - 1][1]).any(-1).double().mean().item(),
            "fp8_layer_rel_err": s8[d - 1][2]}
        for d in depths}
    return {"final_rel_err": rel_err(h8, h16), "final_cosine": cosine(h8, h16),
            "change_rel_err": rel_err(h8 - x, h16 - x),
            "change_cosine": cosine(h8 - x, h16 - x),
            "bf16_vs_fp32_final_rel_err": rel_err(h16, h32),
            "bf16_vs_fp32_change_rel_err": rel_err(h16 - x, h32 - x),
            "growth": ((h16.double().norm() / x.double().norm()).item()
                       ** (1 / len(layers_bf16))),
            "by_depth": by_depth}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    args = ap.parse_args()
    device = torch.device(args.device)
    config = mhmoe.MAGI2_PREVIEW.replace(
        hidden_size=args.heads * args.head_dim, num_heads=args.heads,
        num_experts=args.experts, top_k=min(6, args.experts),
        expert_intermediate_size=args.intermediate)
    bf16, fp8 = [], []
    for i in range(args.layers):
        layer = mhmoe.MultiHeadMoE(config, device=device, backend=args.backend)
        layer.reset_parameters(generator=torch.Generator(device=device).manual_seed(
            args.seed + i))
        bf16.append(layer)
        fp8.append(mhmoe.quantize(layer, "fp8"))
    fp32 = [copy.deepcopy(layer).float() for layer in bf16]
    gen = torch.Generator(device=device).manual_seed(args.seed + 1000)
    x = torch.randn(args.tokens, config.hidden_size, device=device,
                    generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        x_heads = x.view(args.tokens, config.num_heads, config.head_dim)
        probs, indices = bf16[0].route_heads(x_heads)
        ref = moe_reference_float64(x_heads, probs, indices, bf16[0].W_gate, bf16[0].W_up,
                                    bf16[0].W_down).view_as(x).to(device)
        y8, y16 = fp8[0](x), bf16[0](x)
        stacks = {"stack": compare(bf16, fp8, fp32, x, prenorm=False),
                  "prenorm_stack": compare(bf16, fp8, fp32, x, prenorm=True)}
    report = {
        "device": str(device), "backend": args.backend, "tokens": args.tokens,
        "layers": args.layers,
        "config": {"heads": args.heads, "head_dim": args.head_dim, "experts": args.experts,
                   "top_k": config.top_k, "intermediate": args.intermediate},
        "one_layer": {"fp8_rel_err": rel_err(y8, ref), "fp8_cosine": cosine(y8, ref),
                      "bf16_rel_err": rel_err(y16, ref)},
        **stacks,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
