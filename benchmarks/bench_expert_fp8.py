"""The fp8 expert forward against the bf16 one, side by side, MAGI-2 dims, one GPU.

    PYTHONPATH=src python3 benchmarks/bench_expert_fp8.py [--tokens 1024,32768] [--reciprocals]
        [--tiles "64/64/4/2;64/64/8/2"] [--skip-empty] [--gluon "rcp,skip;rcp,chk"]
        [--no-record]

For each token count: uniform random routes (top-6 of 256 per head), bf16 Gaussian
weights and their fp8 quantization (mhmoe.fp8); the bf16 kernel, the fp8 kernel at its
default tiles and, on sm_90, the fp8 Gluon kernel (kernels/expert_forward_fp8_sm90.py)
timed in interleaved rounds (mhmoe.bench.interleaved), and each fp8 result's relative
error against the bf16 kernel's and, on the first 64 experts,
against the float64 twin of the quantized computation. The bf16 8192^3 matmul is
measured in the same run. --reciprocals: each fp8 kernel also with
`Fp8ForwardConfig.reciprocals`, in the same rounds (docs/fp8.md, "Reciprocals").
--tiles: the Triton fp8 kernel also at these block_m/block_i/num_warps/num_stages, in the
same rounds (block_i must be the scheme's ACT_BLOCK, 64). --skip-empty: the Gluon kernel
also with `Fp8ForwardConfig.skip_empty_halves` (sm_90). --gluon: the Gluon kernel (sm_90)
also with each ';'-separated set of its options, in the same rounds: rcp (reciprocals),
skip (skip_empty_halves), chk (chunked_x); with --gluon-only, those
alone beside the bf16 kernel (for a profiler's launch count: `ncu --launch-skip`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from mhmoe import MAGI2_PREVIEW as M
from mhmoe.bench import (
    append_results,
    check_unique,
    environment,
    interleaved,
    matmul_peak_tflops,
    rel_err,
    result_row,
    script_command,
)
from mhmoe.fp8 import fp8_expert_reference, quantize_weights
from mhmoe.kernels.expert_forward import triton_expert_forward
from mhmoe.kernels.expert_forward_fp8 import triton_expert_forward_fp8
from mhmoe.kernels.tuning import Fp8ForwardConfig, fp8_forward_config
from mhmoe.reference import sort_routes_reference


def parse_tiles(spec: str) -> Fp8ForwardConfig:
    """'64/64/4/2' -> the Triton fp8 kernel at block_m/block_i/num_warps/num_stages."""
    try:
        return Fp8ForwardConfig(*(int(v) for v in spec.split("/", 3)))
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--tiles: '{spec}' is not m/i/w/s tiles the kernel takes: {e}") from None


GLUON_OPTIONS = {"rcp": "reciprocals", "skip": "skip_empty_halves", "chk": "chunked_x"}


def parse_gluon(spec: str) -> Fp8ForwardConfig:
    """'rcp,chk' -> the Gluon kernel with Fp8ForwardConfig.reciprocals and .chunked_x."""
    names = [n for n in spec.split(",") if n]
    unknown = [n for n in names if n not in GLUON_OPTIONS]
    if unknown or not names:
        raise SystemExit(f"--gluon: '{spec}' is not a set of {', '.join(GLUON_OPTIONS)}")
    return Fp8ForwardConfig(128, 64, 4, 1, warp_specialized=True,
                            **{GLUON_OPTIONS[n]: True for n in names})


def fp8_variants(default: Fp8ForwardConfig | None, sm90: bool, gluon: list, tiles: list,
                 skip_empty: bool, reciprocals: bool) -> dict[str, Fp8ForwardConfig]:
    """The fp8 configs timed beside the bf16 kernel, by name: `default` (the table's;
    None with --gluon-only, which leaves out it and "ws"), on sm_90 the Gluon kernel
    "ws" (and "ws skip"), the --gluon sets ("ws SPEC", pairs from `parse_gluon`; with
    --gluon-only on any card), the --tiles ("m/i/w/s"), and with --reciprocals an " rcp"
    copy of each. ValueError where two share a name (e.g. --gluon rcp beside
    --reciprocals' copy of "ws"), which a dict would merge, timing one under the other's
    label."""
    pairs = [] if default is None else [("default", default)]
    if default is not None and sm90:
        pairs.append(("ws", Fp8ForwardConfig(128, 64, 4, 1, warp_specialized=True)))
        if skip_empty:
            pairs.append(("ws skip", Fp8ForwardConfig(128, 64, 4, 1, warp_specialized=True,
                                                      skip_empty_halves=True)))
    if default is None or sm90:
        pairs += [(f"ws {spec}", c) for spec, c in gluon]
    pairs += [(f"{c.block_m}/{c.block_i}/{c.num_warps}/{c.num_stages}", c) for c in tiles]
    if reciprocals:
        pairs += [(f"{name} rcp", dataclasses.replace(c, reciprocals=True)) for name, c in pairs]
    check_unique((name for name, _ in pairs), "--gluon, --tiles, --reciprocals")
    return dict(pairs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,32768")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reciprocals", action="store_true")
    ap.add_argument("--tiles", default="", help="Triton fp8 tiles m/i/w/s, ';'-separated")
    ap.add_argument("--skip-empty", action="store_true")
    ap.add_argument("--gluon", default="", help="Gluon kernel option sets, ';'-separated")
    ap.add_argument("--gluon-only", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    tiles = [parse_tiles(t.strip()) for t in args.tiles.split(";") if t.strip()]
    gluon = [(spec.strip(), parse_gluon(spec.strip())) for spec in args.gluon.split(";")
             if spec.strip()]
    if args.gluon_only and not gluon:
        raise SystemExit("--gluon-only: name the option sets with --gluon")
    # The names, checked before any GPU work (any config stands in for the table's; with
    # no GPU visible, as if on sm_90, whose names include the others').
    sm90 = not torch.cuda.is_available() or torch.cuda.get_device_capability() == (9, 0)
    try:
        fp8_variants(None if args.gluon_only else Fp8ForwardConfig(64, 64, 4, 3), sm90,
                     gluon, tiles, args.skip_empty, args.reciprocals)
    except ValueError as exc:
        ap.error(str(exc))
    dev = torch.device("cuda")
    H, E, K, D, I = M.num_heads, M.num_experts, M.top_k, M.head_dim, M.expert_intermediate_size
    gen = torch.Generator(device=dev).manual_seed(0)
    w = [(torch.randn(H * E, D, I, device=dev, generator=gen) * D**-0.5).bfloat16(),
         (torch.randn(H * E, D, I, device=dev, generator=gen) * D**-0.5).bfloat16(),
         (torch.randn(H * E, I, D, device=dev, generator=gen) * I**-0.5).bfloat16()]
    q = quantize_weights(*w)
    fp8_args = (q.w_gate.transpose(1, 2), q.w_up.transpose(1, 2), q.w_down.transpose(1, 2),
                q.gate_scale, q.up_scale, q.down_scale)
    env = environment(dev)
    peak = matmul_peak_tflops(dev)
    rows = []
    for S in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(S, H, D, device=dev, generator=gen).bfloat16()
        idx = torch.argsort(torch.rand(H, S, E, device=dev, generator=gen), dim=-1)[..., :K]
        probs = torch.rand(H, S, K, device=dev, generator=gen)
        layout = sort_routes_reference(probs, idx, E)
        modes = fp8_variants(None if args.gluon_only else fp8_forward_config(dev, S * K / E),
                             sm90, gluon, tiles, args.skip_empty, args.reciprocals)
        variants = [("bf16", lambda x=x, lay=layout: triton_expert_forward(x, *lay, *w))]
        variants += [(name, lambda c=c, x=x, lay=layout:
                      triton_expert_forward_fp8(x, *lay, *fp8_args, config=c))
                     for name, c in modes.items()]
        bf16 = variants[0][1]()
        times = interleaved(variants, rounds=args.rounds, per_round=5)
        flops = M.expert_flops(S)
        print(f"S={S}: bf16 matmul {peak:.0f} TFLOP/s in the same run")
        gather_ids, sorted_probs, offsets = layout
        n = int(offsets[64])  # the twin on the first 64 experts (head 0)
        sub = (gather_ids[:n], sorted_probs[:n], offsets[:65])
        q_sub = type(q)(*(t[:64] for t in q))
        for name, _ in variants:
            ms = times[name].median_ms
            extra = {"matmul_tflops": peak, "rounds_ms": times[name].round_medians_ms}
            if name != "bf16":
                c = modes[name]
                y = triton_expert_forward_fp8(x, *layout, *fp8_args, config=c)
                twin = fp8_expert_reference(x[:, :1], *sub, q_sub)
                mine = triton_expert_forward_fp8(x[:, :1], *sub, *(t[:64] for t in fp8_args),
                                                 config=c)
                extra.update(rel_err_vs_bf16_kernel=rel_err(y, bf16),
                             rel_err_vs_twin=rel_err(mine, twin))
            print(f"  {name:>12}: {ms:7.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  "
                  + "  ".join(f"{k} {v:.3e}" for k, v in extra.items() if k.startswith("rel")))
            if name == "bf16":
                variant = "bf16"
            elif modes[name].warp_specialized:
                variant = "fp8 ws (Gluon)" + (" skip empty halves"
                                              if modes[name].skip_empty_halves else "")
                variant += " chunked x" if modes[name].chunked_x else ""
            else:
                c = modes[name]
                variant = f"fp8 {c.block_m}/{c.block_i}/{c.num_warps}/{c.num_stages}"
            if name != "bf16" and modes[name].reciprocals:
                variant += " reciprocals"
            rows.append(result_row("experts_fwd", variant,
                                   S, ms, env=env, tflops=flops / ms / 1e9,
                                   command=script_command("bench_expert_fp8.py",
                                                          sys.argv[1:]), **extra))
    if not args.no_record:
        print(f"rows appended to {append_results(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
