"""Experiment (timing only, wrong results on purpose): how much of the fp8 Gluon expert
forward's time each part of its MMA warpgroups' window holds (docs/fp8.md, "What the
window costs").

    PYTHONPATH=src python3 benchmarks/experiments/fp8_window.py [--no-record]

Each variant is a copy of `kernels/expert_forward_fp8_sm90.py` with one step of
`_activation` removed: the down accumulator's rescale, the gate and up scaling (x row
scale and channel scales), the SwiGLU7 itself (a = g + u, unscaled). The copies are
written beside the module as `_window_<name>.py` (deleted at the end), imported, and
swapped in for the launcher's import; all run the table's config of the token count, in
the same interleaved rounds (mhmoe.bench.interleaved). Rows go to the results file.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

import mhmoe.kernels as kernels
from mhmoe import MAGI2_PREVIEW as M
from mhmoe.bench import append_results, environment, interleaved, matmul_peak_tflops, result_row
from mhmoe.fp8 import quantize_weights
from mhmoe.kernels.expert_forward_fp8 import triton_expert_forward_fp8
from mhmoe.kernels.tuning import fp8_forward_config
from mhmoe.reference import sort_routes_reference

MODULE = "expert_forward_fp8_sm90"
RESCALE = ("return acc * _divide(s_prev, s_a, RCP)[:, None], s_a", "return acc, s_a")
SCALES = ("a = _swiglu7_fp32(g * s_x[:, None] * sg, u * s_x[:, None] * su, RCP)",
          "a = _swiglu7_fp32(g, u, RCP)")
SWIGLU = (SCALES[0], "a = g + u")
EDITS = {"base": [], "no rescale": [RESCALE], "no scaling": [SCALES],
         "no rescale, no scaling": [RESCALE, SCALES], "no swiglu, no scaling": [SWIGLU],
         "no swiglu, no scaling, no rescale": [SWIGLU, RESCALE]}


def variant_modules(names) -> tuple[dict, list[Path]]:
    src_path = Path(kernels.__file__).parent / f"{MODULE}.py"
    src = src_path.read_text()
    mods, paths = {}, []
    for i, name in enumerate(names):
        text = src
        for old, new in EDITS[name]:
            if text.count(old) != 1:
                raise SystemExit(f"{name}: '{old}' is not once in {src_path}")
            text = text.replace(old, new)
        path = src_path.parent / f"_window_{i}.py"
        path.write_text(text)
        paths.append(path)
        mods[name] = importlib.import_module(f"mhmoe.kernels._window_{i}")
    return mods, paths


def use(module) -> None:
    """The fp8 launcher imports the Gluon module at call time (`from . import ...`)."""
    setattr(kernels, MODULE, module)
    sys.modules[f"mhmoe.kernels.{MODULE}"] = module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="32768,1024")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    original = sys.modules[f"mhmoe.kernels.{MODULE}"] if f"mhmoe.kernels.{MODULE}" in \
        sys.modules else importlib.import_module(f"mhmoe.kernels.{MODULE}")
    mods, paths = variant_modules(list(EDITS))
    try:
        H, E, K, D, I = (M.num_heads, M.num_experts, M.top_k, M.head_dim,
                         M.expert_intermediate_size)
        gen = torch.Generator(device=dev).manual_seed(0)
        w = [(torch.randn(H * E, D, I, device=dev, generator=gen) * D**-0.5).bfloat16(),
             (torch.randn(H * E, D, I, device=dev, generator=gen) * D**-0.5).bfloat16(),
             (torch.randn(H * E, I, D, device=dev, generator=gen) * I**-0.5).bfloat16()]
        q = quantize_weights(*w)
        del w
        fp8_args = (q.w_gate.transpose(1, 2), q.w_up.transpose(1, 2),
                    q.w_down.transpose(1, 2), q.gate_scale, q.up_scale, q.down_scale)
        env, peak, rows = environment(dev), matmul_peak_tflops(dev), []
        for S in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(S, H, D, device=dev, generator=gen).bfloat16()
            idx = torch.argsort(torch.rand(H, S, E, device=dev, generator=gen), dim=-1)[..., :K]
            layout = sort_routes_reference(torch.rand(H, S, K, device=dev, generator=gen),
                                           idx, E)
            config = fp8_forward_config(dev, S * K / E)

            def run(module, x=x, layout=layout, config=config):
                use(module)
                return triton_expert_forward_fp8(x, *layout, *fp8_args, config=config)

            times = interleaved([(name, lambda m=m: run(m)) for name, m in mods.items()],
                                rounds=args.rounds, per_round=5, seed=S)
            print(f"S={S}: {config}; bf16 matmul {peak:.0f} TFLOP/s in the same run")
            for name in mods:
                t = times[name]
                print(f"  {name:>34}: {t.median_ms:7.3f} ms")
                rows.append(result_row(
                    "experts_fwd", f"fp8 ws (Gluon) window experiment: {name}", S, t.median_ms,
                    env=env, matmul_tflops=peak, rounds_ms=t.round_medians_ms,
                    config=repr(config), command="PYTHONPATH=src python3 "
                    "benchmarks/experiments/fp8_window.py " + " ".join(sys.argv[1:])))
        if not args.no_record:
            print(f"rows appended to {append_results(rows)}")
    finally:
        use(original)
        for path in paths:
            path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
