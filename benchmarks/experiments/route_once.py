"""Three logits + route + layout calls at S = 32768, MAGI-2 dims (warm-up, then the ones
to profile), whole rows or shortlists, for ncu:

    ncu --kernel-name regex:_logits_route_kernel --launch-skip 2 --launch-count 1 --set full \\
        python3 benchmarks/experiments/route_once.py --shortlist 1

From the repository root with PYTHONPATH=src.
(NOTES.md routing v11; results/routing_v11_ncu_logits.txt.)
"""
import argparse
import dataclasses

import torch
from router_inputs import E, router_inputs

from mhmoe.kernels import routing as R

parser = argparse.ArgumentParser()
parser.add_argument("--shortlist", type=int, choices=(0, 1), default=1)
args = parser.parse_args()
dev = torch.device("cuda")
x, gate, bias, kw = router_inputs(dev)
cfg = dataclasses.replace(R.logits_route_config(dev), shortlist=bool(args.shortlist))
for _ in range(3):
    probs, indices, _, counts = R.triton_logits_route(x, gate, config=cfg, **kw)
    R.triton_sort_routes(probs, indices, E, block_counts=counts, block_t=64)
torch.cuda.synchronize()
