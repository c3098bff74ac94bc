"""Check and time the fused Triton expert kernel at MAGI-2 shapes (run on a GPU machine).

    PYTHONPATH=src python3 benchmarks/bench_expert_kernel.py --out $OUT/expert.json

Steps, in order: ceilings (bf16 8192^3 matmul, device copy); correctness at
S=1024 against a float64 reference of every route; determinism (two runs,
and a token permutation); a CUDA-graph capture with host-sync detection;
then timings over S, routing (uniform / one expert at 30x the mean rows),
mode (default / deterministic) and, with --sweep, tile configs. Prints a
table last and writes JSON rows (GPU, versions, commit) to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import torch
import triton
from triton.testing import do_bench

from mhmoe.kernels.configs import ExpertForwardConfig, expert_forward_config
from mhmoe.kernels.expert_forward import triton_expert_forward
from mhmoe.reference import expert_forward_reference
from mhmoe.routing import sort_routes

H, E, K, D, I = 12, 256, 6, 256, 1280


def flops(S: int) -> float:
    return 6.0 * S * H * K * D * I


def make_weights(gen: torch.Generator):
    F = H * E
    wg = torch.randn(F, D, I, device="cuda", dtype=torch.bfloat16, generator=gen) * D**-0.5
    wu = torch.randn(F, D, I, device="cuda", dtype=torch.bfloat16, generator=gen) * D**-0.5
    wd = torch.randn(F, I, D, device="cuda", dtype=torch.bfloat16, generator=gen) * I**-0.5
    return wg, wu, wd


def make_routes(S: int, gen: torch.Generator, skew: bool):
    """Uniform random top-K per (head, token); skew: expert 0 of head 0 gets 30x the mean."""
    scores = torch.rand(H, S, E, device="cuda", generator=gen)
    if skew:
        share = 30.0 * K / E  # fraction of head 0's tokens that pick expert 0
        pick = torch.rand(S, device="cuda", generator=gen) < share
        scores[0, :, 0] += pick.float() * 2.0
    indices = scores.topk(K, dim=-1).indices
    probs = torch.rand(H, S, K, device="cuda", generator=gen) + 0.1
    probs = probs / probs.sum(-1, keepdim=True) * 4.9
    return probs, indices


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_mm = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    src = torch.randn(2**29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    t_cp = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return {"matmul_bf16_8192_ms": t_mm, "matmul_tflops": 2 * 8192**3 / t_mm / 1e9,
            "copy_ms": t_cp, "copy_tbps": 2 * src.numel() * 4 / t_cp / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="expert_kernel.json")
    parser.add_argument("--sizes", default="1024,4096,16384,32768")
    parser.add_argument("--sweep", default="",
                        help="configs m/i/w/s[/tma[/paired]];... timed at every size")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--commit", default=os.environ.get("MHMOE_COMMIT", ""))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    commit = args.commit
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                             stderr=subprocess.DEVNULL).strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": commit, "python": sys.version.split()[0],
            "shape": {"H": H, "E": E, "K": K, "D": D, "I": I}}
    print(meta, flush=True)
    ceil = ceilings()
    print("ceilings", ceil, flush=True)

    wg, wu, wd = make_weights(gen)
    checks: dict = {}
    if not args.skip_checks:
        # Correctness against float64 (weights upcast per expert by the reference).
        for S in (1024, 4096):
            x = torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            probs, indices = make_routes(S, gen, skew=S == 4096)
            lay = sort_routes(probs, indices, E)
            ref = expert_forward_reference(x.double(), lay.gather_ids, lay.sorted_probs.double(),
                                           lay.offsets, wg, wu, wd)
            for det in (False, True):
                y = triton_expert_forward(x, *lay, wg, wu, wd, deterministic=det)
                torch.cuda.synchronize()
                checks[f"rel_err_S{S}_det{int(det)}"] = rel_err(y, ref)
                checks[f"nan_S{S}_det{int(det)}"] = bool(torch.isnan(y).any())
            fp32 = expert_forward_reference(x, *lay, wg, wu, wd)  # fp32 math, bf16 output
            checks[f"rel_err_torch_fp32_S{S}"] = rel_err(fp32, ref)
            del ref, fp32
        print("accuracy", checks, flush=True)
        # Determinism: run to run and under a token permutation.
        S = 4096
        x = torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        probs, indices = make_routes(S, gen, skew=False)
        lay = sort_routes(probs, indices, E)
        y1 = triton_expert_forward(x, *lay, wg, wu, wd, deterministic=True)
        y2 = triton_expert_forward(x, *lay, wg, wu, wd, deterministic=True)
        perm = torch.randperm(S, device="cuda", generator=gen)
        lay_p = sort_routes(probs[:, perm], indices[:, perm], E)
        y3 = triton_expert_forward(x[perm], *lay_p, wg, wu, wd, deterministic=True)
        d1 = triton_expert_forward(x, *lay, wg, wu, wd)
        d2 = triton_expert_forward(x, *lay, wg, wu, wd)
        checks["det_run_to_run_equal"] = bool(torch.equal(y1, y2))
        checks["det_permutation_equal"] = bool(torch.equal(y3, y1[perm]))
        checks["default_run_to_run_maxdiff"] = (d1.float() - d2.float()).abs().max().item()
        checks["default_vs_det_maxdiff"] = (d1.float() - y1.float()).abs().max().item()
        # CUDA graph capture, with host synchronisation turned into an error.
        for det in (False, True):
            triton_expert_forward(x, *lay, wg, wu, wd, deterministic=det)  # compile first
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    yg = triton_expert_forward(x, *lay, wg, wu, wd, deterministic=det)
                graph.replay()
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
                ref_e = triton_expert_forward(x, *lay, wg, wu, wd, deterministic=det)
                diff = (yg.float() - ref_e.float()).abs().max().item()
                checks[f"graph_det{int(det)}_maxdiff"] = diff
            except Exception as exc:  # report and keep timing
                torch.cuda.set_sync_debug_mode("default")
                checks[f"graph_det{int(det)}_error"] = repr(exc)[:300]
        print("determinism/graph", checks, flush=True)

    # m/i/w/s[/tma[/paired]]: the last two are 0 or 1.
    sweep = [ExpertForwardConfig(*(int(v) if n < 4 else bool(int(v))
                                   for n, v in enumerate(c.split("/"))))
             for c in args.sweep.split(";") if c]

    rows = []
    for S in map(int, args.sizes.split(",")):
        x = torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        for skew in (False, True):
            probs, indices = make_routes(S, gen, skew)
            lay = sort_routes(probs, indices, E)
            configs = [None] + (sweep if not skew else [])
            ref_y = None
            for cfg in configs:
                for det in (False, True):
                    if cfg is not None and det:
                        continue
                    fn = functools.partial(triton_expert_forward, x, *lay, wg, wu, wd,
                                           deterministic=det, config=cfg)
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    y = fn()
                    torch.cuda.synchronize()
                    extra = torch.cuda.max_memory_allocated() - base
                    ok = not bool(torch.isnan(y).any())
                    if ref_y is None:
                        ref_y = y
                    diff = rel_err(y, ref_y)
                    t = do_bench(fn, warmup=30, rep=200 if S <= 4096 else 400,
                                 return_mode="median")
                    t2 = do_bench(fn, warmup=10, rep=100, return_mode="median")
                    used = cfg or expert_forward_config(x.device, lay.gather_ids.numel() / (H * E),
                                                        D, wd.dtype)
                    row = {"S": S, "routing": "skew30" if skew else "uniform",
                           "mode": "det" if det else "default",
                           "config": f"{used.block_m}/{used.block_i}/{used.num_warps}/"
                                     f"{used.num_stages}/{int(used.tma)}/{int(used.paired)}",
                           "forced": cfg is not None, "ms": t, "ms_repeat": t2,
                           "tflops": flops(S) / t / 1e9, "extra_mem_gb": extra / 1e9,
                           "out_gb": y.numel() * y.element_size() / 1e9,
                           "no_nan": ok, "rel_vs_first": diff}
                    rows.append(row)
                    print(row, flush=True)
            del lay, probs, indices
        torch.cuda.empty_cache()

    result = {"meta": meta, "ceilings": ceil, "checks": checks, "rows": rows,
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\nmatmul {ceil['matmul_tflops']:.0f} TFLOP/s, copy {ceil['copy_tbps']:.2f} TB/s")
    for k, v in checks.items():
        print(f"  {k}: {v}")
    print(f"{'S':>6} {'routing':>8} {'mode':>8} {'config':>14} {'ms':>8} {'rep':>8} "
          f"{'TFLOP/s':>8} {'mem GB':>7} ok")
    for r in rows:
        print(f"{r['S']:>6} {r['routing']:>8} {r['mode']:>8} {r['config']:>14} {r['ms']:8.3f} "
              f"{r['ms_repeat']:8.3f} {r['tflops']:8.1f} {r['extra_mem_gb']:7.3f} "
              f"{'ok' if r['no_nan'] and r['rel_vs_first'] < 0.01 else 'BAD'}")


if __name__ == "__main__":
    main()
