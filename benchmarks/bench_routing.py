"""Check and time the Triton routing and layout kernels at MAGI-2 dims (run on a GPU machine).

    PYTHONPATH=src python3 benchmarks/bench_routing.py --out $OUT/routing.json

Steps, in order: device-copy ceiling; correctness at S=4096 against
`mhmoe.reference` (indices equal except near-ties, probs within 1e-6,
sigmoid scores bitwise against torch.sigmoid, layouts exactly equal, NaN/inf
rows, two runs identical, other tile sizes identical, no host sync); a tile
sweep at S=32768; then timings over S of the published-style torch routing,
the reference path and the Triton path, with and without the fp32 logits
GEMM. Prints a table last, writes JSON rows (GPU, versions, commit) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from mhmoe.kernels import routing as R
from mhmoe.kernels.routing import triton_route, triton_sort_routes
from mhmoe.reference import route_reference, sort_routes_reference

H, E, K, D = 12, 256, 6, 256
SCALE = 4.9
SIZES = (1024, 4096, 16384, 32768)


def make_inputs(S: int, gen: torch.Generator):
    """x [S, H, D] bf16, gate [H*E, D] fp32, bias [H, E] fp32 (EMA-sized)."""
    x = torch.randn(S, H, D, device="cuda", generator=gen).to(torch.bfloat16)
    gate = torch.randn(H * E, D, device="cuda", generator=gen) * D**-0.5
    bias = torch.randn(H, E, device="cuda", generator=gen) * 0.02
    return x, gate, bias


def logits_gemm(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """fp32 logits [H, S, E], as layer.route_heads computes them (cuBLAS, no tf32)."""
    g = gate.view(H, E, D)
    return torch.bmm(x.transpose(0, 1).to(torch.float32), g.transpose(1, 2))


def published_route_layout(logits: torch.Tensor, bias: torch.Tensor):
    """The published MAGI-2 style: sigmoid, bias, torch.topk, normalise, argsort + bincount."""
    scores = torch.sigmoid(logits)
    _, idx = torch.topk(scores + bias.view(H, 1, E), K, dim=-1)
    probs = scores.gather(-1, idx)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12) * SCALE
    flat = (idx + torch.arange(H, device=idx.device).view(H, 1, 1) * E).reshape(-1)
    order = torch.argsort(flat, stable=True)
    gather_ids = (order // K % logits.shape[1]).to(torch.int32)
    sorted_probs = probs.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=H * E)
    offsets = torch.zeros(H * E + 1, device=idx.device, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return gather_ids, sorted_probs, offsets


def reference_route_layout(logits, bias):
    p, i = route_reference(logits, K, "sigmoid", bias, True, 1e-12, SCALE)
    return sort_routes_reference(p, i, E)


def triton_route_sort(logits, bias, **kw):
    p, i = triton_route(logits, K, "sigmoid", bias, True, 1e-12, SCALE, **kw)
    return triton_sort_routes(p, i, E)


def same(xs, ys) -> bool:
    """Every pair of tensors bitwise equal (shapes, dtypes and values)."""
    return all(torch.equal(a, b) for a, b in zip(xs, ys, strict=True))


def near_tie_rows(logits, bias, score_func="sigmoid", tol=1e-6):
    """Rows whose reference selection has two adjacent scores (top K+1) within tol relative."""
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, -1)
    sel = scores + bias.view(H, 1, E)
    top = torch.sort(sel, dim=-1, descending=True).values[..., :K + 1]
    gap = (top[..., :-1] - top[..., 1:]).abs() <= tol * top[..., :-1].abs()
    return gap.any(-1)


def check(gen: torch.Generator) -> dict:
    S = 4096
    x, gate, bias = make_inputs(S, gen)
    logits = logits_gemm(x, gate)
    res = {}
    for sf in ("sigmoid", "softmax"):
        pr, ir = route_reference(logits, K, sf, bias, True, 1e-12, SCALE)
        p, i = triton_route(logits, K, sf, bias, True, 1e-12, SCALE)
        ties = near_tie_rows(logits, bias, sf)
        bad = ((i != ir).any(-1) & ~ties).sum().item()
        rel = ((p - pr).abs() / pr.abs()).max().item()
        res[sf] = {"rows": H * S, "near_tie_rows": int(ties.sum()), "index_mismatch": bad,
                   "index_mismatch_any": int((i != ir).any(-1).sum()), "probs_max_rel": rel}
        assert bad == 0 and rel <= 1e-6, (sf, res[sf])
    # Sigmoid bitwise: no norm, scale 1 -> probs are the gathered scores.
    p, i = triton_route(logits, K, "sigmoid", None, False, 1e-12, 1.0)
    ref = torch.sigmoid(logits).gather(-1, i)
    res["sigmoid_bitwise_mismatch"] = int((p.view(torch.int32) != ref.view(torch.int32)).sum())
    # Groups (training recipes): 8 groups, keep 4.
    pr, ir = route_reference(logits, K, "sigmoid", bias, True, 1e-12, SCALE, 8, 4)
    p, i = triton_route(logits, K, "sigmoid", bias, True, 1e-12, SCALE, 8, 4)
    res["groups_index_mismatch_any"] = int((i != ir).any(-1).sum())
    res["groups_probs_max_rel"] = ((p - pr).abs() / pr.abs()).max().item()
    # Layout, exact, at several block sizes; and a skewed case (one expert takes every token).
    p, i = triton_route(logits, K, "sigmoid", bias, True, 1e-12, SCALE)
    ref = sort_routes_reference(p, i, E)
    out = triton_sort_routes(p, i, E)
    res["layout_equal"] = same(out, ref)
    for bt in (1, 4, 8, 32):  # other block sizes: the same layout
        res[f"layout_equal_block_t{bt}"] = same(triton_sort_routes(p, i, E, block_t=bt), ref)
    for br, nw in ((1, 1), (8, 1), (16, 4), (64, 8)):  # other tiles: the same routes
        res[f"route_equal_rows{br}_warps{nw}"] = same(
            triton_route(logits, K, "sigmoid", bias, True, 1e-12, SCALE, block_rows=br,
                         num_warps=nw), (p, i))
    skew = i.clone()
    skew[0, :, 0] = 3
    skew[0, :, 1:] = torch.randint(4, E, (S, K - 1), device="cuda", generator=gen)
    out = triton_sort_routes(p, skew, E)
    res["layout_skew_equal"] = same(out, sort_routes_reference(p, skew, E))
    # Deterministic: a second run is bitwise identical.
    first, second = triton_sort_routes(p, i, E), triton_sort_routes(p, i, E)
    res["layout_repeat_equal"] = same(first, second)
    # NaN / inf rows behave as the reference and leave other rows alone.
    bad_logits = logits.clone()
    bad_logits[0, 0, 5] = float("nan")
    bad_logits[1, 1, :] = float("nan")
    bad_logits[2, 2, 7] = float("inf")
    bad_logits[3, 3, :] = float("-inf")
    pr, ir = route_reference(bad_logits, K, "sigmoid", bias, True, 1e-12, SCALE)
    p, i = triton_route(bad_logits, K, "sigmoid", bias, True, 1e-12, SCALE)
    res["nan_indices_equal"] = bool(torch.equal(i, ir))
    res["nan_probs_equal"] = bool(torch.allclose(p, pr, rtol=1e-6, atol=0, equal_nan=True))
    # No host synchronisation in the Triton path.
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_route_sort(logits, bias)
        res["no_host_sync"] = True
    except RuntimeError as err:
        res["no_host_sync"] = f"failed: {err}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for key, value in res.items():
        assert value is not False, (key, res)
    return res


def copy_bandwidth() -> float:
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * 4 / ms / 1e9  # TB/s


def bench(fn, inputs, graph=False) -> float:
    """Median ms of fn over rotating input sets (so small S does not just time L2)."""
    state = {"n": 0}

    def step():
        args = inputs[state["n"] % len(inputs)]
        state["n"] += 1
        return fn(*args)

    if graph:
        # Capture needs a fixed input: replays then time the launch-free GPU work.
        return do_bench_cudagraph(lambda: fn(*inputs[0]), rep=50, return_mode="median")
    return do_bench(step, warmup=10, rep=60, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="routing.json")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the spec: fp32 logits
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                         stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("MHMOE_COMMIT", "unknown")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": commit + "+uncommitted",
            "python": sys.version.split()[0], "dims": {"H": H, "E": E, "K": K, "D": D}}
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    meta["copy_TBps"] = copy_bandwidth()
    print(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  "
          f"copy {meta['copy_TBps']:.2f} TB/s", flush=True)
    meta["check"] = check(gen)
    print("check:", json.dumps(meta["check"]), flush=True)

    rows = []
    sizes = [int(s) for s in args.sizes.split(",")]
    if not args.no_sweep:
        S = 32768
        x, gate, bias = make_inputs(S, gen)
        logits = logits_gemm(x, gate)
        sets = [(logits, bias)]
        for br, nw, it in ((2, 1, 1), (2, 1, 4), (2, 1, 8), (4, 1, 1), (4, 1, 4), (4, 1, 8),
                           (8, 1, 4), (16, 4, 1)):
            ms = bench(lambda lg, b, br=br, nw=nw, it=it: triton_route(
                lg, K, "sigmoid", b, True, 1e-12, SCALE, block_rows=br, num_warps=nw,
                iters=it), sets)
            rows.append({"what": "sweep_route", "S": S, "block_rows": br, "num_warps": nw,
                         "iters": it, "ms": ms})
            print(f"sweep route block_rows={br} warps={nw} iters={it}: {ms:.4f} ms", flush=True)
        p, i = triton_route(logits, K, "sigmoid", bias, True, 1e-12, SCALE)
        for bt in (4, 8, 16):
            ms = bench(lambda pp, ii, bt=bt: triton_sort_routes(pp, ii, E, block_t=bt), [(p, i)])
            rows.append({"what": "sweep_sort", "S": S, "block_t": bt, "ms": ms})
            print(f"sweep sort block_t={bt}: {ms:.4f} ms", flush=True)
        # The four layout steps one by one (block_t = 8).
        gid, sp = torch.empty(H * S * K, device="cuda", dtype=torch.int32), torch.empty(
            H * S * K, device="cuda")
        pos = torch.empty_like(gid)
        hist, rank = R._layout_count(i, E, 8)
        base, totals = R._layout_scan(hist)
        offsets = R._layout_offsets(totals, S, K)
        steps = {
            "count": lambda: R._layout_count(i, E, 8),
            "scan_ec32": lambda: R._layout_scan(hist, 32),
            "scan_ec8": lambda: R._layout_scan(hist, 8),
            "offsets": lambda: R._layout_offsets(totals, S, K),
            "scatter": lambda: R._layout_scatter(i, p, rank, base, offsets, gid, sp, pos, 8),
        }
        for name, fn in steps.items():
            ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
            rows.append({"what": "sort_step", "S": S, "step": name, "ms": ms})
            print(f"sort step {name}: {ms:.4f} ms", flush=True)
        del x, gate, logits, sets, p, i, hist, rank, base, totals, offsets, gid, sp

    table = []
    for S in sizes:
        n_sets = max(1, min(4, (256 * 2**20) // (H * S * E * 4)))
        data = [make_inputs(S, gen) for _ in range(n_sets)]
        xs = [(x, g, b) for x, g, b in data]
        lgs = [(logits_gemm(x, g), b) for x, g, b in data]
        r = {"S": S, "input_sets": n_sets}
        r["gemm"] = bench(lambda x, g, b: logits_gemm(x, g), xs)
        r["published"] = bench(published_route_layout, lgs)
        r["reference"] = bench(reference_route_layout, lgs)
        r["triton_route"] = bench(
            lambda lg, b: triton_route(lg, K, "sigmoid", b, True, 1e-12, SCALE), lgs)
        pi = [triton_route(lg, K, "sigmoid", b, True, 1e-12, SCALE) for lg, b in lgs]
        r["triton_sort"] = bench(lambda p, i: triton_sort_routes(p, i, E), pi)
        r["triton"] = bench(triton_route_sort, lgs)
        r["triton_graph"] = bench(triton_route_sort, lgs, graph=True)
        r["published+gemm"] = bench(
            lambda x, g, b: published_route_layout(logits_gemm(x, g), b), xs)
        r["triton+gemm"] = bench(lambda x, g, b: triton_route_sort(logits_gemm(x, g), b), xs)
        r["route_logits_GBps"] = H * S * E * 4 / r["triton_route"] / 1e6
        rows.append({"what": "time", **r})
        table.append(r)
        print(json.dumps(r), flush=True)
        del data, xs, lgs, pi

    cols = ["gemm", "published", "reference", "triton_route", "triton_sort", "triton",
            "triton_graph", "published+gemm", "triton+gemm"]
    print("\nms (median, do_bench); triton = triton_route + triton_sort_routes; _graph: "
          "CUDA-graph replay; +gemm includes the fp32 logits bmm")
    print(f"{'S':>6} " + " ".join(f"{c:>15}" for c in cols))
    for r in table:
        print(f"{r['S']:>6} " + " ".join(f"{r[c]:>15.4f}" for c in cols))
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
