"""The router inputs the routing experiments share: MAGI-2's dims at S = 32768, seed 0.

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


def experiment_main(compile_only, gpu) -> None:
    """The command line of the experiment scripts with a compile-only mode:
    `--compile-only` compiles for sm_90 here (no GPU), else `OUT.json` runs on the GPU."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    p.add_argument("--compile-only", action="store_true")
    a = p.parse_args()
    if a.compile_only:
        compile_only()
    elif a.out is None:
        p.error("give the output path (or --compile-only)")
    else:
        gpu(a.out)
