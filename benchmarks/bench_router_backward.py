"""The router logits' backward: PyTorch's fp32 GEMMs against the tensor-core kernels
(kernels/router_backward.py), side by side, MAGI-2 dims, one GPU.

    PYTHONPATH=src python3 benchmarks/bench_router_backward.py [--tokens 1024,32768] [--no-record]

For each token count: d logits [H, S, E] fp32, bf16 x and the fp32 gate as Gaussians;
dx and d gate by PyTorch (`torch.bmm` in fp32, as `routing._router_logits_backward` ran
them before the kernels and still does where they do not apply) and by the kernels, in
the default order and in the deterministic content order (the keys included), timed in
interleaved rounds (mhmoe.bench.interleaved); each result's relative error against
float64 on head 0 (dx also in fp32, before its rounding to bf16). The bf16 8192^3 matmul
is measured in the same run.
"""

from __future__ import annotations

import argparse

import torch

from mhmoe import MAGI2_PREVIEW as M
from mhmoe.bench import (
    append_results,
    environment,
    interleaved,
    matmul_peak_tflops,
    rel_err,
    result_row,
)
from mhmoe.kernels.router_backward import triton_router_dgate, triton_router_dx
from mhmoe.reference import exact_precision
from mhmoe.routing import content_keys


@exact_precision
def torch_fp32(grad, gate, x):
    """(dx, d gate) as the PyTorch path computes them."""
    dx = torch.bmm(grad, gate).transpose(0, 1).to(x.dtype)
    return dx, torch.bmm(grad.transpose(1, 2), x.transpose(0, 1).to(gate.dtype))


def kernels(grad, gate, x, deterministic=False):
    order = (torch.argsort(content_keys(x, grad.transpose(0, 1)), dim=1, stable=True)
             if deterministic else None)
    return triton_router_dx(grad, gate, x), triton_router_dgate(grad, x, order)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,32768")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    H, E, D = M.num_heads, M.num_experts, M.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)
    gate = torch.randn(H, E, D, device=dev, generator=gen) * D**-0.5
    env = environment(dev)
    peak = matmul_peak_tflops(dev)
    rows = []
    for S in [int(t) for t in args.tokens.split(",")]:
        grad = torch.randn(H, S, E, device=dev, generator=gen)
        x = torch.randn(S, H, D, device=dev, generator=gen).bfloat16()
        variants = [("torch fp32", lambda g=grad, xx=x: torch_fp32(g, gate, xx)),
                    ("kernels", lambda g=grad, xx=x: kernels(g, gate, xx)),
                    ("kernels deterministic", lambda g=grad, xx=x: kernels(g, gate, xx, True))]
        times = interleaved(variants, rounds=args.rounds, per_round=5)
        ref_dx = (grad[0].double() @ gate[0].double())
        ref_dgate = grad[0].double().t() @ x[:, 0].double()
        flops = 2 * 2 * H * S * E * D  # the two GEMMs
        print(f"S={S}: bf16 matmul {peak:.0f} TFLOP/s in the same run")
        for name, fn in variants:
            dx, dgate = fn()
            dx32 = (triton_router_dx(grad, gate, x.float()) if name.startswith("kernels")
                    else exact_precision(torch.bmm)(grad, gate).transpose(0, 1))
            ms = times[name].median_ms
            extra = {"matmul_tflops": peak, "rounds_ms": times[name].round_medians_ms,
                     "rel_err_dx": rel_err(dx[:, 0], ref_dx),
                     "rel_err_dx_fp32": rel_err(dx32[:, 0], ref_dx),
                     "rel_err_dgate": rel_err(dgate[0], ref_dgate)}
            print(f"  {name:>22}: {ms:7.3f} ms  dx {extra['rel_err_dx']:.2e} (fp32 "
                  f"{extra['rel_err_dx_fp32']:.2e})  d gate {extra['rel_err_dgate']:.2e}")
            rows.append(result_row("router_backward", name, S, ms, env=env,
                                   tflops=flops / ms / 1e9,
                                   command="PYTHONPATH=src python3 "
                                           "benchmarks/bench_router_backward.py", **extra))
    if not args.no_record:
        print(f"rows appended to {append_results(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
