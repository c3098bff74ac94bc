"""Routing v15: the layout's rank scatter writing 8-byte records {token, probability} (one
scattered store a route instead of two), with int64 or int32 expert ids, with and without the
positions output; against the shipped kernel. MAGI-2 dims, S = 32768, the router inputs of
router_inputs.py, counts from the default logits + route.

    PYTHONPATH=src python3 benchmarks/experiments/layout_records.py OUT.json   # GPU

Checks: the records' tokens and probabilities bitwise the shipped gather_ids and
sorted_probs, positions and offsets equal. Timing: a CUDA graph of the scatter alone a
variant, REPLAYS replays a round each timed by its own events, ROUNDS rounds in shuffled
(seeded) order, then each graph's kernel under the profiler. Only the last step is timed:
route, counts and scan are the same for every variant.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))

from mhmoe.kernels.routing import _block_ranks

ROUNDS, REPLAYS = 12, 40


@triton.jit
def _rank_scatter_records_kernel(
    indices_ptr, probs_ptr, base_ptr, totals_ptr, offsets_ptr,
    records_ptr,  # output [H*S*K] int64: token in the low word, the probability's bits high
    positions_ptr, S, NB,
    E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr, WRITE_POS: tl.constexpr,
):
    """`routing._layout_rank_scatter_kernel` with one 8-byte store a route in place of the
    gather_ids and sorted_probs stores (the same places, the same ranks)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    col = tl.arange(0, BLOCK_E)
    col_ok = col < E
    routes = S * TOP_K
    head_start = h.to(tl.int64) * routes
    totals = tl.load(totals_ptr + h * E + col, mask=col_ok, other=0)
    start = tl.cumsum(totals, 0) - totals
    if b == 0:
        tl.store(offsets_ptr + h * E + col, head_start + start.to(tl.int64), mask=col_ok)
        tl.store(offsets_ptr + tl.num_programs(1) * E + col,
                 head_start + tl.sum(totals, 0).to(tl.int64),
                 mask=(col == 0) & (h == tl.num_programs(1) - 1))
    cursor = start + tl.load(base_ptr + (h * NB + b).to(tl.int64) * E + col, mask=col_ok,
                             other=0)
    r = tl.arange(0, BLOCK_R)
    first = b * (BLOCK_T * TOP_K)
    end = tl.minimum((b + 1) * BLOCK_T, S) * TOP_K
    e_next = tl.load(indices_ptr + head_start + first + r, mask=first + r < end, other=-1)
    for r0 in range(0, BLOCK_T * TOP_K, BLOCK_R):
        rr = first + r0 + r
        ok = rr < end
        e = e_next
        e_next = tl.load(indices_ptr + head_start + rr + BLOCK_R, mask=rr + BLOCK_R < end,
                         other=-1)
        p = tl.load(probs_ptr + head_start + rr, mask=ok, other=0.0)
        ok = ok & (e >= 0) & (e < E)
        e = tl.where(ok, e, 0).to(tl.int32)
        pos = tl.gather(cursor, e, 0) + _block_ranks(e, ok, BLOCK_R)
        write = ok & (pos >= 0) & (pos < routes)
        token = (rr // TOP_K).to(tl.int64)
        bits = p.to(tl.int32, bitcast=True).to(tl.int64) << 32
        tl.store(records_ptr + head_start + pos, bits | token, mask=write)
        if WRITE_POS:
            tl.store(positions_ptr + head_start + rr, (head_start + pos).to(tl.int32),
                     mask=write)
        cursor += tl.histogram(e, BLOCK_E, mask=ok)


def gpu(out: str) -> None:
    from router_inputs import graph_of, report_replays, router_inputs, shuffled_replays

    from mhmoe.kernels import routing as R

    dev = torch.device("cuda")
    x, gate, _, kw = router_inputs(dev)
    p, i, _, counts = R.triton_logits_route(x, gate, **kw)
    H, S, K = i.shape
    E = gate.shape[1]
    base, totals = R._layout_scan(counts)
    i32 = i.to(torch.int32)
    R_ = H * S * K
    ref = {"gather_ids": torch.empty(R_, device=dev, dtype=torch.int32),
           "sorted_probs": torch.empty(R_, device=dev), "positions":
           torch.empty(R_, device=dev, dtype=torch.int32),
           "offsets": torch.empty(H * E + 1, device=dev, dtype=torch.int64)}

    def shipped():
        R._layout_rank_scatter(i, p, base, totals, ref["offsets"], ref["gather_ids"],
                               ref["sorted_probs"], ref["positions"], 64, 64)

    bufs = {}

    def records(ids, write_pos, name):
        rec = torch.empty(R_, device=dev, dtype=torch.int64)
        pos = torch.full((R_,), -1, device=dev, dtype=torch.int32)
        off = torch.empty(H * E + 1, device=dev, dtype=torch.int64)
        bufs[name] = (rec, pos, off, write_pos)

        def run():
            _rank_scatter_records_kernel[(triton.cdiv(S, 64), H)](
                ids, p, base, totals, off, rec, pos, S, base.shape[1], E=E, TOP_K=K,
                BLOCK_T=64, BLOCK_R=64, BLOCK_E=triton.next_power_of_2(E),
                WRITE_POS=write_pos, num_warps=2)
        return run

    variants = {"shipped": shipped,
                "records_i64": records(i, True, "records_i64"),
                "records_i32": records(i32, True, "records_i32"),
                "records_i32_nopos": records(i32, False, "records_i32_nopos")}
    for fn in variants.values():
        fn()
    torch.cuda.synchronize()
    res = {"device": torch.cuda.get_device_name(), "checks": {}, "timing": {}}
    for name, (rec, pos, off, write_pos) in bufs.items():
        words = rec.view(torch.int32).view(R_, 2)
        res["checks"][name] = {
            "tokens": torch.equal(words[:, 0], ref["gather_ids"]),
            "probs": torch.equal(words[:, 1].view(torch.float32), ref["sorted_probs"]),
            "offsets": torch.equal(off, ref["offsets"]),
            "positions": torch.equal(pos, ref["positions"]) if write_pos else None}
    print(json.dumps(res["checks"]), flush=True)
    graphs = {name: graph_of(fn)[0] for name, fn in variants.items()}
    graphs["shipped_control"] = graphs["shipped"]
    res["timing"] = report_replays(graphs, shuffled_replays(graphs, ROUNDS, REPLAYS),
                                   controls=("shipped_control",), unit="us")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    gpu(sys.argv[1])
