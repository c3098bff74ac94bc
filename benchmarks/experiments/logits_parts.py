"""Routing v16: where the logits kernel's time goes, by leaving parts out (DIAG bits of
`_logits_route_kernel`: 1 no tile store, 2 no shortlist epilogue, 4 no counts zeroing), at
MAGI-2's dims, S = 32768 (the router inputs of router_inputs.py). Outputs are wrong whenever
a part is left out: times only.

    git apply benchmarks/experiments/logits_diag.patch
    PYTHONPATH=src python3 benchmarks/experiments/logits_parts.py OUT.json   # on the GPU

Graphs of the routing (weight split, logits kernel, shortlist route) for each DIAG value, in
ROUNDS shuffled rounds of REPLAYS replays, then each graph's kernels under the profiler (the
logits kernel's time is the number to read). With both the store and the lists left out
(DIAG 3, 7) nothing reads the products and the compiler drops them (4.4 us in the v16 run):
those rows measure nothing.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

ROUNDS, REPLAYS = 8, 40
DIAGS = {"shipped": 0, "no_store": 1, "no_lists": 2, "no_zeroing": 4, "mma_and_zeroing": 3,
         "mma_only": 7}


def gpu(out: str) -> None:
    import torch
    from router_inputs import graph_of, report_replays, router_inputs, shuffled_replays

    from mhmoe.kernels import routing as R

    dev = torch.device("cuda")
    x, gate, _, kw = router_inputs(dev)
    graphs = {}
    for name, diag in DIAGS.items():
        R.LOGITS_DIAG = diag
        graphs[name] = graph_of(lambda: R.triton_logits_route(x, gate, **kw))[0]
    R.LOGITS_DIAG = 0
    res = report_replays(graphs, shuffled_replays(graphs, ROUNDS, REPLAYS))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    from router_inputs import experiment_main

    experiment_main(None, gpu)
