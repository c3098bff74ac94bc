"""Interleaved A/B of two source trees on the GPU: bench_layer.py at one S, run ROUNDS times
from each tree, in a shuffled (seeded) order, one process a run.

    python3 benchmarks/experiments/ab_trees.py OUT.json OLD_SRC NEW_SRC [S] [ROUNDS]

OLD_SRC / NEW_SRC: directories holding the `mhmoe` package (e.g. a `git archive` of the
last commit's src/, and src/). Reports each tree's runs of route + layout (eager and from a
CUDA graph), experts and the layer, and their medians. Used in routing v15 (NOTES.md), where
the two trees differed in kernels that bench_layer's whole-layer numbers could not separate
from the H200's run-to-run drift.
"""
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

KEYS = ("route_layout_ms", "route_layout_graph_ms", "experts_ms", "layer_ms", "layer_graph_ms")


def main() -> None:
    out, old, new = sys.argv[1:4]
    S = int(sys.argv[4]) if len(sys.argv) > 4 else 32768
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    bench = os.path.join(os.path.dirname(__file__), "..", "bench_layer.py")
    runs = {"old": [], "new": []}
    order = random.Random(0)
    for _ in range(rounds):
        for name in order.sample(["old", "new"], 2):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "r.json")
                env = {**os.environ, "PYTHONPATH": {"old": old, "new": new}[name]}
                subprocess.run([sys.executable, bench, "--tokens", str(S), "--out", path],
                               check=True, env=env, capture_output=True, text=True)
                with open(path) as f:
                    row = json.load(f)
            row = row["rows"][0]
            runs[name].append({k: row[k] for k in KEYS if k in row})
            print(name, json.dumps(runs[name][-1]), flush=True)
    res = {"S": S, "runs": runs, "medians": {
        name: {k: statistics.median(r[k] for r in rs) for k in KEYS if k in rs[0]}
        for name, rs in runs.items()}}
    print(json.dumps(res["medians"]), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
