"""Routing v16: the listed experts' logits beside their keys (`LogitsRouteConfig.listed_logits`)
against the shipped shortlists of keys alone, at MAGI-2's dims, S = 32768 (the router inputs
of router_inputs.py).

    git apply benchmarks/experiments/listed_reload.patch     # the variant itself
    python3 benchmarks/experiments/listed_logits.py --compile-only     # here, no GPU
    PYTHONPATH=src python3 benchmarks/experiments/listed_logits.py OUT.json   # on the GPU

Compile-only: registers, spills and shared memory of the logits kernel and the shortlist
route kernel both ways (sm_90).

GPU: (1) checks, at S and S - 5: probs, indices, counts and layout bitwise equal both ways;
the listed logits bitwise the logits of the listed experts wherever the row is sure; 20
repeats bitwise; a graph of each replayed on new inputs equal to an eager call on them.
(2) timing: graphs of route + layout each way (and the keys-only graph again as a control)
in ROUNDS shuffled rounds of REPLAYS replays, then each graph's kernels under the profiler.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

ROUNDS, REPLAYS = 12, 40


def _configs():
    from router_inputs import logits_configs

    return logits_configs("listed_logits", "keys", "listed")


def compile_only() -> None:
    from logits_gluon_ws import ptxas_info
    from router_inputs import logits_audit_case

    from mhmoe.kernels import routing as R
    from mhmoe.kernels import sass_audit as A

    name, fn, sig, cx, warps, stages, div, maxnreg = logits_audit_case()
    route_sig = {"short_ptr": "*i32", "logits_ptr": "*fp32", "bias_ptr": "*fp32",
                 "probs_ptr": "*fp32", "indices_ptr": "*i64", "counts_ptr": "*i32", "S": "i32",
                 "NB": "i32", "norm_eps": "fp32", "route_scale": "fp32"}
    route_cx = dict(E=256, TOP_K=6, HAS_BIAS=True, ROUTE_NORM=True, C=16, BLOCK_ROWS=16,
                    BLOCK_E=256, BLOCK_K=8, FALLBACK_ROWS=2, INTERPRET=False, COUNT_T=64)
    for listed in (False, True):
        extra = {"listed_ptr": "*fp32"} if listed else {}
        k = A.compile_sm90(fn, {**sig, **extra}, cx, warps, stages, div, maxnreg)
        print(f"{name} listed={listed}: shared {k.metadata.shared} B; {ptxas_info(k)}")
        k = A.compile_sm90(R._shortlist_route_kernel, {**route_sig, **extra}, route_cx, 1, 3,
                           ("S",))
        print(f"shortlist route 16/1 listed={listed}: {ptxas_info(k)}")


def gpu(out: str) -> None:
    import torch
    from router_inputs import S, graph_of, report_replays, router_inputs, shuffled_replays

    from mhmoe.kernels import routing as R

    dev = torch.device("cuda")
    x, gate, _, kw = router_inputs(dev)
    E, K = gate.shape[1], kw["top_k"]
    cfgs = _configs()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "S": S,
           "checks": {}}

    def route_layout(xx, cfg, return_logits=False):
        p, i, logits, c = R.triton_logits_route(xx, gate, config=cfg,
                                                return_logits=return_logits, **kw)
        return (p, i, c, *R.triton_sort_routes(p, i, E, block_counts=c, block_t=64)), logits

    def bitwise(a, b):
        return all(torch.equal(u.view(torch.int32) if u.dtype == torch.float32 else u,
                               v.view(torch.int32) if v.dtype == torch.float32 else v)
                   for u, v in zip(a, b, strict=True))

    # The lists each way: the route launch sees them.
    seen = {}
    real_launch = R._launch_shortlist_route

    def keep(short, *a, listed=None, **k):
        seen["short"], seen["listed"] = short.clone(), None if listed is None else listed.clone()
        return real_launch(short, *a, listed=listed, **k)

    R._launch_shortlist_route = keep
    for s in (S, S - 5):
        ref, _ = route_layout(x[:s], cfgs["keys"])
        got, logits = route_layout(x[:s], cfgs["listed"], return_logits=True)
        short, listed = seen["short"], seen["listed"]
        lists = short.view(*short.shape[:2], -1, 8)
        sure = (lists != 0).all(-1, keepdim=True).expand_as(lists).reshape(short.shape)
        ids = (E - 1) - (short.long() & (E - 1))
        want = torch.gather(logits, 2, ids)
        res["checks"][s] = {
            "probs_indices_counts_layout_bitwise": bitwise(got, ref),
            "listed_logits_bitwise_where_sure": bool(torch.equal(
                listed[sure].view(torch.int32), want[sure].view(torch.int32))),
            "sure_rows": round(float(sure.float().mean()), 6),
            "tied_rows": int(R.shortlist_tied_rows(short, K, E).sum()),
        }
        print(s, json.dumps(res["checks"][s]), flush=True)
    R._launch_shortlist_route = real_launch

    ref, _ = route_layout(x, cfgs["listed"])
    res["checks"]["repeats_bitwise"] = all(bitwise(route_layout(x, cfgs["listed"])[0], ref)
                                           for _ in range(20))

    graphs = {}
    x_in = x.clone()
    x_new = torch.randn_like(x, dtype=torch.float32).bfloat16()
    for name, cfg in cfgs.items():
        g, (outs, _) = graph_of(lambda cfg=cfg: route_layout(x_in, cfg))
        x_in.copy_(x_new)
        g.replay()
        res["checks"][f"graph_{name}_new_inputs_bitwise"] = bitwise(
            outs, route_layout(x_new, cfg)[0])
        x_in.copy_(x)
        graphs[name] = g
    print(json.dumps({k: v for k, v in res["checks"].items() if not isinstance(k, int)}),
          flush=True)
    graphs["keys_control"] = graphs["keys"]
    res["timing"] = report_replays(graphs, shuffled_replays(graphs, ROUNDS, REPLAYS),
                                   controls=("keys_control",))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    from router_inputs import experiment_main

    experiment_main(compile_only, gpu)
