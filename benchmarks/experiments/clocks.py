"""Does the MAGI-2 layer at S = 32768 slow down under sustained load, and with what clocks?

    PYTHONPATH=src python3 benchmarks/experiments/clocks.py OUT.json

For each expert-kernel variant (the Hopper table with cluster 1, then 2), after 3 s idle:
N eager forwards back to back, each timed with its own pair of CUDA events, while
`nvidia-smi` samples the SM clock, power, temperature and the active clock-event
(throttle) reasons every 50 ms. Writes the per-forward times (ms, in order), their
first/last-50 medians, and the samples.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from layer_profile import magi2_layer, table

from mhmoe.bench import matmul_peak_tflops
from mhmoe.kernels import configs

N = 400
QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,{}.active"


def query():
    """QUERY with the throttle-reasons field under the name this driver knows."""
    for name in ("clocks_event_reasons", "clocks_throttle_reasons"):
        q = QUERY.format(name)
        if subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"],
                          capture_output=True).returncode == 0:
            return q
    return QUERY.format("clocks_throttle_reasons").rsplit(",", 1)[0]


def sustained(layer, x):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(N)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(N)]
    with tempfile.NamedTemporaryFile("r", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query()}", "--format=csv,noheader",
                                "-lms", "50", "-f", log.name])
        try:
            time.sleep(3.0)
            for i in range(N):
                starts[i].record()
                layer(x)
                ends[i].record()
            torch.cuda.synchronize()
            time.sleep(0.5)
        finally:
            smi.terminate()
            smi.wait()
        samples = [line.strip() for line in open(log.name) if line.strip()]
    ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return {"ms": ms, "first50_median": statistics.median(ms[:50]),
            "last50_median": statistics.median(ms[-50:]), "samples": samples}


def main():
    out_path = sys.argv[1]
    device = torch.device("cuda")
    layer, x = magi2_layer(device)
    res = {"matmul_tflops": matmul_peak_tflops(device), "N": N, "runs": []}
    with torch.no_grad():
        for c in (1, 2):
            configs._TABLES[(9, 0)] = table(c)
            layer(x)
            torch.cuda.synchronize()
            run = dict(cluster=c, **sustained(layer, x))
            res["runs"].append(run)
            print({k: v for k, v in run.items() if k not in ("ms", "samples")}, flush=True)
            print("  every 40th forward, ms:", [round(t, 3) for t in run["ms"][::40]],
                  flush=True)
            for s in run["samples"][::10]:
                print("  ", s, flush=True)
    configs._TABLES[(9, 0)] = configs._HOPPER
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
