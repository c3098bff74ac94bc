"""Routing v16: what the route kernel's count atomics, the indices' int64 and the heads'
order cost, at MAGI-2's dims, S = 32768 (the router inputs of router_inputs.py).

    git apply benchmarks/experiments/count_store.patch     # the variants' switches
    PYTHONPATH=src python3 benchmarks/experiments/route_parts.py OUT.json   # on the GPU

(The first run, results/route_parts_v16.json, had the variants atomics, its control,
atomics_i32 and no_counts, under the names i64, i64_again, i32 and no_counts; the second,
route_parts_v16b.json, the others.)

Graphs of route + layout (the layer's routing: logits kernel, shortlist route, scan, rank
scatter), each variant in ROUNDS rounds in a shuffled (seeded) order, REPLAYS replays a round
timed by their own events, then each graph's kernels under the profiler:
- "atomics": the route kernel adds its picks to counts the logits kernel zeroed (v15);
- "atomics_again": the same, captured again (the control);
- "atomics_i32": the same with int32 indices from the route kernel, read so by the layout;
- "no_counts": the route kernel without counts, the layout counting for itself (one kernel
  more): the route kernel's time here prices its atomics;
- "store": a route program owns a count block and stores its row (v16), no zeroing;
- "store_r96": the same at the atomics' 96 registers a thread (128 unbounded: 16 warps an
  SM, not 20);
- "store_rev": the same as "store", the route programs of the last head first (the logits kernel
  writes it last: the likeliest in L2);
- "store_i32", "store_i32_rev": with int32 indices.
Checks first: every variant's probs, indices and layout equal to the first's, bitwise.
"""

from __future__ import annotations

import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

ROUNDS, REPLAYS = 12, 40


def gpu(out: str) -> None:
    import torch
    from router_inputs import E, graph_of, report_replays, router_inputs, shuffled_replays

    from mhmoe.kernels import routing as R

    dev = torch.device("cuda")
    x, gate, _, kw = router_inputs(dev)

    def variant(name):
        if name == "no_counts":
            def run():
                probs, idx = R.triton_logits_route(
                    x, gate, **{k: v for k, v in kw.items() if k != "count_block_t"})[:2]
                return (probs, idx, None, *R.triton_sort_routes(probs, idx, E, block_t=64))
            return run
        store = not name.startswith("atomics")
        dtype = torch.int32 if "i32" in name else torch.int64
        launch = functools.partial(R._launch_shortlist_route, reverse_heads="rev" in name,
                                   maxnreg=96 if "r96" in name else None)

        def run():
            saved = R.shortlist_counts_stored, R._launch_shortlist_route
            if not store:
                R.shortlist_counts_stored = lambda *a: False
            R._launch_shortlist_route = launch
            try:
                probs, idx, _, counts = R.triton_logits_route(x, gate, index_dtype=dtype, **kw)
                return (probs, idx, counts,
                        *R.triton_sort_routes(probs, idx, E, block_counts=counts, block_t=64))
            finally:
                R.shortlist_counts_stored, R._launch_shortlist_route = saved
        return run

    names = ("atomics", "atomics_again", "atomics_i32", "no_counts", "store", "store_r96",
             "store_rev", "store_i32", "store_i32_rev")
    runs = {n: variant(n) for n in names}
    res = {"checks": {}}
    ref = runs[names[0]]()
    for n in names[1:]:
        got = runs[n]()
        same = [None if a is None else
                bool(torch.equal(a.long() if a.dtype == torch.int32 and b.dtype == torch.int64
                                 else a, b)) for a, b in zip(got, ref, strict=True)]
        res["checks"][n] = {"bitwise_equal (probs, indices, counts, gather_ids, "
                            "sorted_probs, offsets)": same, "index_dtype": str(got[1].dtype)}
        print(n, res["checks"][n], flush=True)
    graphs = {n: graph_of(runs[n])[0] for n in names}
    times = shuffled_replays(graphs, ROUNDS, REPLAYS)
    res["route_layout_graph"] = report_replays(graphs, times, controls=("atomics_again",))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    from router_inputs import experiment_main

    experiment_main(None, gpu)
