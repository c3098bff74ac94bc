"""Routing v15: the shortlists by sorting networks (`_shortlist_merged`) against the rounds
(`_shortlist`), at MAGI-2's dims, S = 32768 (the router inputs of router_inputs.py).

    python3 benchmarks/experiments/merged_lists.py --compile-only     # here, no GPU
    PYTHONPATH=src python3 benchmarks/experiments/merged_lists.py OUT.json   # on the GPU

Compile-only: the logits kernel of the sm_90 default config both ways: SASS instructions
(all, and the integer min/max and adds that the selection is made of), shuffles, shared
memory, registers and spills.

GPU: (1) checks, for S and S - 5: probs, indices, counts and the layout bitwise equal both
ways; the lists equal wherever both are sure, never sure where the rounds' are not; how many
rows each leaves unsure. (2) timing: CUDA graphs of route + layout (logits kernel, shortlist
route, scan, rank scatter; the layer's routing) of each variant, in ROUNDS rounds whose order
is shuffled (seeded), REPLAYS replays a round each timed by its own events; then each graph's
kernels under the profiler.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))

ROUNDS, REPLAYS = 12, 40


def _configs():
    from router_inputs import logits_configs

    return logits_configs("merged_lists", "rounds", "merged")


def compile_only() -> None:
    from logits_gluon_ws import ptxas_info
    from router_inputs import logits_audit_case

    from mhmoe.kernels import sass_audit as A

    name, fn, sig, cx, warps, stages, div, maxnreg = logits_audit_case()
    for merged in (False, True):
        kx = {**cx, "MERGED": merged}
        k = A.compile_sm90(fn, sig, kx, warps, stages, div, maxnreg)
        sass = A.compile_sass(fn, sig, kx, warps, stages, div, maxnreg)
        ops = collections.Counter(m.split(".")[0] for m in
                                  re.findall(r"/\*[0-9a-f]+\*/\s+([A-Z][A-Z0-9_.]*)", sass))
        sel = sum(ops[o] for o in ("VIMNMX", "VIMNMX3", "VIADDMNMX", "IMAD"))
        label = name.replace(" merged", "")
        print(f"{label} merged={merged}: {sum(ops.values())} SASS, {sel} int min/max/add, "
              f"{ops['SHFL']} SHFL, {ops['LDS'] + ops['STS']} LDS/STS, shared "
              f"{k.metadata.shared} B; {ptxas_info(k)}")


def gpu(out: str) -> None:
    import torch
    from router_inputs import S, graph_of, report_replays, router_inputs, shuffled_replays

    from mhmoe.kernels import routing as R

    dev = torch.device("cuda")
    x, gate, _, kw = router_inputs(dev)
    cfgs = _configs()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "S": S,
           "checks": {}, "timing": {}}

    # The lists themselves: capture the shortlist buffer each way.
    lists = {}
    real_launch = R._launch_shortlist_route

    def keep(short, *a, **k):
        lists["last"] = short.clone()
        return real_launch(short, *a, **k)

    R._launch_shortlist_route = keep
    for s in (S, S - 5):
        outs = {}
        for name, cfg in cfgs.items():
            p, i, _, c = R.triton_logits_route(x[:s], gate, config=cfg, **kw)
            layout = R.triton_sort_routes(p, i, gate.shape[1], block_counts=c, block_t=64)
            outs[name] = (p, i, c, *layout, lists["last"])
        a, b = outs["rounds"], outs["merged"]
        same = all(torch.equal(u.nan_to_num(7.0) if u.is_floating_point() else u,
                               v.nan_to_num(7.0) if v.is_floating_point() else v)
                   for u, v in zip(a[:6], b[:6], strict=True))
        E = gate.shape[1]
        short = R.shortlist_size(kw["top_k"], 128)
        ra, rb = a[6].view(*a[6].shape[:2], -1, short), b[6].view(*b[6].shape[:2], -1, short)
        sure_a, sure_b = (ra != 0).all(-1), (rb != 0).all(-1)
        res["checks"][s] = {
            "probs_indices_counts_layout_bitwise": same,
            "lists_equal_where_both_sure": bool(torch.equal(rb[sure_b], ra[sure_b])),
            "merged_never_sure_where_rounds_unsure": not bool((sure_b & ~sure_a).any()),
            "unsure_lists_rounds": int((~sure_a).sum()),
            "unsure_lists_merged": int((~sure_b).sum()),
            "tied_rows_rounds": int(R.shortlist_tied_rows(a[6], kw["top_k"], E).sum()),
            "tied_rows_merged": int(R.shortlist_tied_rows(b[6], kw["top_k"], E).sum()),
        }
        print(s, json.dumps(res["checks"][s]), flush=True)
    R._launch_shortlist_route = real_launch

    # Repeats: the merged variant bitwise the same 20 times.
    p0, i0, _, c0 = R.triton_logits_route(x, gate, config=cfgs["merged"], **kw)
    res["checks"]["repeats_bitwise"] = all(
        torch.equal(p0, q[0]) and torch.equal(i0, q[1]) and torch.equal(c0, q[3])
        for q in (R.triton_logits_route(x, gate, config=cfgs["merged"], **kw)
                  for _ in range(20)))

    graphs = {}
    for name, cfg in cfgs.items():
        def step(cfg=cfg):
            p, i, _, c = R.triton_logits_route(x, gate, config=cfg, **kw)
            return R.triton_sort_routes(p, i, gate.shape[1], block_counts=c, block_t=64)
        graphs[name], _ = graph_of(step)
    # A control: the rounds graph a second time under another name.
    graphs["rounds_control"] = graphs["rounds"]
    res["timing"] = report_replays(graphs, shuffled_replays(graphs, ROUNDS, REPLAYS),
                                   controls=("rounds_control",))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    from router_inputs import experiment_main

    experiment_main(compile_only, gpu)
