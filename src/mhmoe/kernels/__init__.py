"""GPU kernels of mhmoe: one module per kernel family, tiles in tuning.py.

    router_logits.py        router logits on tensor cores (+ shortlists)
    router_backward.py      their backward (d x, d gate) on tensor cores
    topk.py                 top-k selection: the route kernels
    layout.py               the route layout (counting sort)
    expert_forward.py       the fused expert forward (Triton)
    expert_forward_sm90.py  the same contract in Gluon, warp-specialised (sm_90 only)
    expert_forward_fp8.py   the expert forward with fp8 (e4m3) weights (sm_89 and later)
    expert_forward_fp8_sm90.py  the same contract in Gluon, warp-specialised (sm_90 only)
    expert_backward.py      the expert backward (dx, dprobs, weight gradients)
    expert_panels_sm90.py   its panel kernel (g, u, t, dprobs, panels) in Gluon (sm_90 only)
    panel_dw_sm90.py        its weight gradients from the panels in Gluon (sm_90 only)
    row_keys.py             content keys of (token, head) rows (deterministic sums)
    tuning.py               every per-architecture tile table

`sm90_compile_cases()` lists each tensor-core kernel (and the content-key kernel,
whose 64-bit integer code the interpreter does not compile) with the arguments its
launcher gives it on an H100/H200 at MAGI-2's dims (and a GPU-only kernel no table runs,
the Gluon dW GEMM, at its named tiles), so that a developer tool
(tools/sass_audit.py) can compile it for sm_90 without a GPU: a GPU-only kernel
that stops compiling then fails `make test`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class CompileCase:
    """One kernel as its launcher compiles it.

    kernel:     the @triton.jit or @gluon.jit function.
    signature:  argument name -> Triton type ("*bf16", "i32", "tensordesc<bf16[64, 32]>").
    constexprs: constexpr argument -> value (arguments left out take their defaults).
    divisible:  integer arguments the JIT sees as multiples of 16 (aligned strides).
    maxnreg:    the launch's register limit, or None.
    num_ctas:   CTAs a cluster.
    """

    name: str
    kernel: object
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int
    divisible: tuple[str, ...] = ()
    maxnreg: int | None = None
    num_ctas: int = 1


def sm90_compile_cases() -> list[CompileCase]:
    """Every tensor-core kernel, and the content-key kernel, at the tiles its launcher
    picks on sm_90 (MAGI-2 dims); the Gluon dW GEMM, which no table runs, at its named
    tiles."""
    from . import (
        expert_backward,
        expert_forward,
        expert_forward_fp8,
        expert_forward_fp8_sm90,
        expert_forward_sm90,
        expert_panels_sm90,
        router_backward,
        router_logits,
        row_keys,
    )

    cases = [*router_logits.sm90_compile_cases(), *expert_forward.sm90_compile_cases(),
             *expert_forward_sm90.sm90_compile_cases(), *expert_forward_fp8.sm90_compile_cases(),
             *expert_forward_fp8_sm90.sm90_compile_cases(),
             *expert_backward.sm90_compile_cases(), *expert_panels_sm90.sm90_compile_cases(),
             *router_backward.sm90_compile_cases(),
             *row_keys.sm90_compile_cases()]
    # Tables whose rows share a tile list it once per row; each compile takes seconds of
    # `make test`, so a case equal to an earlier one (same kernel, arguments, options) is
    # left out.
    unique, seen = [], set()
    for case in cases:
        key = tuple(repr(sorted(v.items())) if isinstance(v, dict) else v
                    for v in (getattr(case, f.name) for f in fields(case)))
        if key not in seen:
            seen.add(key)
            unique.append(case)
    return unique
