"""Check and time the Gluon warp-specialised expert kernel against the Triton kernel (H200).

    PYTHONPATH=src python3 benchmarks/experiments/expert_ws.py OUT.json WHAT

WHAT: check, time, all (both), diag, profile or profile_default1|2. The cluster variant
(ExpertForwardConfig.cluster = 2, forward v6): cluster (check it, time it beside the
one-CTA kernel at S >= 4096), cluster_time (the two at S = 1024 ... 32768, two rounds),
cluster_diag (DIAG 0/1 of both and 3 of the cluster variant at S = 32768) and
cluster_smoke (two small checks). fused_diag (forward v7's fused combine): the one-CTA
kernel at S = 32768, default mode, without it and with it (its finisher taking 2 or 4
rows at a time), two rounds; `fused_diag diags` adds its DIAG 4 (relaxed counts) and 5
(no row finished). skip (forward v8, needs benchmarks/experiments/skip.patch applied):
the empty-half skip on and off, both variants, deterministic outputs compared bitwise,
then timed at S = 32768 (default mode) in three interleaved rounds, with the 256 MiB
default workspace (two launches) and one of 512 MiB (one launch).

check: small problems first (partial tiles, an empty expert, one expert with most rows,
one slice of I, several head groups), then MAGI-2 shapes at S = 4096 and 32768: the
deterministic outputs of both kernels compared bitwise, both modes against a float64
reference (small shapes) or against each other (MAGI-2), a CUDA graph of the new kernel
replayed on new inputs. time: both kernels at S = 1024 ... 32768, uniform routing,
both modes, and a bf16 matmul in the same run.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_expert_kernel as B

from mhmoe.kernels import expert_forward as ef
from mhmoe.kernels.configs import ExpertForwardConfig, expert_forward_config
from mhmoe.kernels.expert_forward import triton_expert_forward
from mhmoe.reference import expert_forward_reference
from mhmoe.routing import sort_routes

WS = ExpertForwardConfig(128, 32, 8, 3, paired=True, warp_specialized=True)
WS2 = ExpertForwardConfig(128, 32, 8, 3, paired=True, warp_specialized=True, cluster=2)


def small_case(name, S, H, E, K, I, gen, skew=False, empty=False, cfg=WS):
    D = 256
    x = torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    wg = torch.randn(H * E, D, I, device="cuda", dtype=torch.bfloat16, generator=gen) * D**-0.5
    wu = torch.randn(H * E, D, I, device="cuda", dtype=torch.bfloat16, generator=gen) * D**-0.5
    wd = torch.randn(H * E, I, D, device="cuda", dtype=torch.bfloat16, generator=gen) * I**-0.5
    scores = torch.rand(H, S, E, device="cuda", generator=gen)
    if skew:
        scores[0, :, 0] += 2.0  # every token of head 0 on expert 0: many tiles of one expert
    if empty:
        scores[:, :, E - 1] -= 5.0  # the last expert of every head gets no rows
    indices = scores.topk(K, dim=-1).indices
    probs = torch.rand(H, S, K, device="cuda", generator=gen) + 0.1
    lay = sort_routes(probs, indices, E)
    ref = expert_forward_reference(x.double(), lay.gather_ids, lay.sorted_probs.double(),
                                   lay.offsets, wg, wu, wd)
    out = {"case": name}
    tri = triton_expert_forward(x, *lay, wg, wu, wd, deterministic=True)
    for det in (False, True):
        y = triton_expert_forward(x, *lay, wg, wu, wd, deterministic=det, config=cfg)
        torch.cuda.synchronize()
        out[f"rel_err_det{int(det)}"] = B.rel_err(y, ref)
        if det:
            out["det_equal_triton_det"] = bool(torch.equal(y, tri))
    out["rel_err_triton_det"] = B.rel_err(tri, ref)
    print(out, flush=True)
    return out


def check(gen, cfg=WS):
    res = {"small": []}
    for args in (("partial", 300, 2, 8, 2, 192), ("one_slice", 200, 2, 4, 2, 64),
                 ("skew_empty", 1000, 3, 16, 4, 320), ("one_tile", 50, 1, 2, 1, 128)):
        kw = {"skew": args[0] == "skew_empty", "empty": args[0] == "skew_empty", "cfg": cfg}
        res["small"].append(small_case(*args, gen, **kw))
    wg, wu, wd = B.make_weights(gen)
    for S in (4096, 32768):
        x = torch.randn(S, B.H, B.D, device="cuda", dtype=torch.bfloat16, generator=gen)
        probs, indices = B.make_routes(S, gen, skew=S == 4096)
        lay = sort_routes(probs, indices, B.E)
        tri = triton_expert_forward(x, *lay, wg, wu, wd, deterministic=True)
        ws_det = triton_expert_forward(x, *lay, wg, wu, wd, deterministic=True, config=cfg)
        ws_def = triton_expert_forward(x, *lay, wg, wu, wd, config=cfg)
        r = {"S": S, "det_equal_triton_det": bool(torch.equal(ws_det, tri)),
             "default_vs_det_rel": B.rel_err(ws_def, ws_det),
             "no_nan": not bool(torch.isnan(ws_def).any())}
        if S == 4096:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                yg = triton_expert_forward(x, *lay, wg, wu, wd, deterministic=True, config=cfg)
            x.copy_(torch.randn(S, B.H, B.D, device="cuda", dtype=torch.bfloat16, generator=gen))
            g.replay()
            torch.cuda.synchronize()
            r["graph_new_input_equal"] = bool(torch.equal(
                yg, triton_expert_forward(x, *lay, wg, wu, wd, deterministic=True)))
        print(r, flush=True)
        res[f"magi2_S{S}"] = r
    return res


def uniform_problem(S, gen):
    """MAGI-2 x [S, H, D] and the layout of uniform random routes, as the timings use."""
    x = torch.randn(S, B.H, B.D, device="cuda", dtype=torch.bfloat16, generator=gen)
    probs, indices = B.make_routes(S, gen, skew=False)
    return x, sort_routes(probs, indices, B.E)


def timing(gen, kernels=None, sizes=(1024, 4096, 16384, 32768)):
    wg, wu, wd = B.make_weights(gen)
    rows = []
    for S in sizes:
        x, lay = uniform_problem(S, gen)
        tri_cfg = expert_forward_config(x.device, lay.gather_ids.numel() / (B.H * B.E), B.D,
                                        wd.dtype)
        tri_cfg = ExpertForwardConfig(tri_cfg.block_m, tri_cfg.block_i, tri_cfg.num_warps,
                                      tri_cfg.num_stages, tri_cfg.tma, tri_cfg.paired)
        for name, cfg in kernels or (("triton", tri_cfg), ("ws", WS)):
            for det in (False, True):
                def fn(cfg=cfg, det=det, x=x, lay=lay):
                    return triton_expert_forward(x, *lay, wg, wu, wd, deterministic=det,
                                                 config=cfg)
                fn()
                t = do_bench(fn, warmup=30, rep=300, return_mode="median")
                row = {"S": S, "kernel": name, "det": det, "ms": t,
                       "tflops": B.flops(S) / t / 1e9}
                rows.append(row)
                print(row, flush=True)
    return rows


def diag(gen, cfg=WS, diags=(0, 1, 2), sizes=(16384, 32768), dets=(False, True)):
    """Timing diagnostics at S = 16384 and 32768: DIAG 1 (no weight bytes move) and 2 (no
    wgmma) beside the real kernel (DIAG 0); their outputs are wrong by design."""
    import functools

    from mhmoe.kernels import expert_forward_ws as ws

    launch = ws.launch_ws
    wg, wu, wd = B.make_weights(gen)
    rows = []
    for S in sizes:
        x, lay = uniform_problem(S, gen)
        for d in diags:
            ws.launch_ws = functools.partial(launch, diag=d)
            for det in dets:
                def fn(det=det, x=x, lay=lay):
                    return triton_expert_forward(x, *lay, wg, wu, wd, deterministic=det,
                                                 config=cfg)
                fn()
                t = do_bench(fn, warmup=20, rep=200, return_mode="median")
                row = {"S": S, "diag": d, "det": det, "cluster": cfg.cluster, "ms": t,
                       "tflops": B.flops(S) / t / 1e9}
                rows.append(row)
                print(row, flush=True)
    ws.launch_ws = launch
    return rows


def half_tails(lay, E):
    """Experts whose last tile holds 1..64 rows (a half skipped), of all experts."""
    counts = (lay.offsets[1:] - lay.offsets[:-1]).cpu()
    tail = counts % 128
    return int(((tail > 0) & (tail <= 64)).sum()), counts.numel()


def skip_ab(gen):
    """Forward v8: the empty-half skip on and off (module switch), bitwise in the
    deterministic mode, then timed."""
    from mhmoe.kernels import expert_forward_ws as ws

    wg, wu, wd = B.make_weights(gen)
    S = 32768
    x, lay = uniform_problem(S, gen)
    res = {"half_tails": half_tails(lay, B.E), "check": [], "rows": []}
    print(res["half_tails"], flush=True)
    for cfg in (WS, WS2):
        outs = {}
        for skip in (False, True):
            ws.SKIP_EMPTY_HALVES = skip
            outs[skip] = [triton_expert_forward(x, *lay, wg, wu, wd, deterministic=det,
                                                config=cfg) for det in (True, False)]
        r = {"cluster": cfg.cluster, "det_bitwise": bool(torch.equal(outs[False][0],
                                                                     outs[True][0])),
             "default_rel": B.rel_err(outs[True][1], outs[False][0])}
        print(r, flush=True)
        res["check"].append(r)
    del outs
    base = ef.DEFAULT_WORKSPACE_BYTES
    for _ in range(3):
        for skip in (False, True):
            for cfg in (WS, WS2):
                for wsb in (base, 2 * base):
                    ws.SKIP_EMPTY_HALVES = skip
                    ef.DEFAULT_WORKSPACE_BYTES = wsb

                    def fn(cfg=cfg):
                        return triton_expert_forward(x, *lay, wg, wu, wd, config=cfg)
                    fn()
                    t = do_bench(fn, warmup=20, rep=200, return_mode="median")
                    row = {"S": S, "skip": skip, "cluster": cfg.cluster,
                           "workspace_mib": wsb >> 20, "ms": t,
                           "tflops": B.flops(S) / t / 1e9}
                    res["rows"].append(row)
                    print(row, flush=True)
    ws.SKIP_EMPTY_HALVES, ef.DEFAULT_WORKSPACE_BYTES = True, base
    return res


def profile_once(gen, det=True, cfg=WS):
    """One call at S = 32768 (for ncu -k regex:_expert_forward_ws -c 1): deterministic on
    one CTA, or (profile_default1|2) the default mode on one CTA or in clusters of two."""
    wg, wu, wd = B.make_weights(gen)
    S = 32768
    x, lay = uniform_problem(S, gen)
    triton_expert_forward(x, *lay, wg, wu, wd, deterministic=det, config=cfg)
    torch.cuda.synchronize()


def main():
    out_path, what = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "all"
    gen = torch.Generator(device="cuda").manual_seed(4321)
    res = {"gpu": torch.cuda.get_device_name()}
    if what in ("check", "all"):
        res["check"] = check(gen)
    if what == "profile":
        profile_once(gen)
        return
    if what in ("profile_default1", "profile_default2"):
        from mhmoe.kernels import expert_forward_ws as ws

        # Session 14's experiment: read only with benchmarks/experiments/l2_hints.patch.
        ws.L2_HINTS = int(os.environ.get("L2_HINTS", "0"))
        profile_once(gen, False, WS2 if what.endswith("2") else WS)
        return
    if what == "diag":
        res["diag"] = diag(gen)
    if what == "cluster_time":
        res["ceilings"] = B.ceilings()
        print(res["ceilings"], flush=True)
        res["rows"] = []
        for _ in range(2):
            res["rows"] += timing(gen, (("ws", WS), ("ws_cluster", WS2)))
    if what == "cluster_diag":
        res["diag"] = (diag(gen, WS, (0, 1), (32768,), (False,))
                       + diag(gen, WS2, (0, 1, 3), (32768,), (False,)))
    if what == "fused_diag":
        res["ceilings"] = B.ceilings()
        print(res["ceilings"], flush=True)
        res["rows"] = []
        from mhmoe.kernels import expert_forward_ws as ws

        variants = [(False, 0, 2), (True, 0, 2), (True, 0, 4)]
        if len(sys.argv) > 3 and sys.argv[3] == "diags":
            variants += [(True, 4, 2), (True, 5, 2)]
        for _ in range(2):
            for fused, d, finish_rows in variants:
                ef.FUSED_COMBINE, ws.FINISH_ROWS = fused, finish_rows
                rows = diag(gen, WS, (d,), (32768,), (False,))
                ef.release_zeroed_workspaces()  # DIAG 5 leaves it dirty
                for row in rows:
                    row["fused"], row["finish_rows"] = fused, finish_rows
                res["rows"] += rows
        ef.FUSED_COMBINE, ws.FINISH_ROWS = False, 2
    if what == "skip":
        res["ceilings"] = B.ceilings()
        print(res["ceilings"], flush=True)
        res["skip"] = skip_ab(gen)
    if what == "cluster_smoke":  # the small cases alone (a hang shows here first)
        res["small"] = [small_case("partial", 300, 2, 8, 2, 192, gen, cfg=WS2),
                        small_case("skew_empty", 1000, 3, 16, 4, 320, gen, skew=True,
                                   empty=True, cfg=WS2)]
    if what == "cluster":
        from mhmoe.kernels import expert_forward_ws as ws

        res["check_cluster"] = check(gen, WS2)
        res["max_active_clusters"] = {str(k): v for k, v in ws._CLUSTERS.items()}
        print(res["max_active_clusters"], flush=True)
        res["ceilings"] = B.ceilings()
        print(res["ceilings"], flush=True)
        res["rows"] = []
        for _ in range(2):  # two rounds, the kernels interleaved in each
            res["rows"] += timing(gen, (("ws", WS), ("ws_cluster", WS2)), (4096, 16384, 32768))
    if what in ("time", "all"):
        res["ceilings"] = B.ceilings()
        print(res["ceilings"], flush=True)
        res["rows"] = timing(gen)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
