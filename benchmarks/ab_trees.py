"""Interleaved A/B of two source trees on the GPU: the MAGI-2 layer forward and
forward+backward, each tree in its own processes, the runs in shuffled order.

    python3 benchmarks/ab_trees.py OLD_SRC NEW_SRC [--tokens 1024,32768] [--rounds 3]

OLD_SRC / NEW_SRC: directories holding an `mhmoe` package (for example the `src/` of
`git worktree add /tmp/old <commit>`, and `src/`). Why processes and rounds: two trees
cannot share one interpreter, and under the H200's power cap a kernel's time drifts
between runs by as much as a small change moves it (docs/measuring.md), so each tree
runs `--rounds` times, in an order shuffled with a fixed seed, and the medians of its
runs are compared. A child uses only the public API that every tree has
(`mhmoe.MAGI2_PREVIEW`, `mhmoe.MultiHeadMoE`), and this tree's harness (src/mhmoe/bench.py,
loaded by path) times both, so a difference is the trees' and not the timers'.

Rows go to benchmarks/results.jsonl (kernel "layer" / "layer_fwd_bwd", variant
"ab:old" / "ab:new", with both trees' commits), `--no-record` to skip.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = HERE.parent / "src" / "mhmoe" / "bench.py"
KEYS = ("layer_ms", "layer_fwd_bwd_ms")


def load_harness():
    """This tree's mhmoe/bench.py as a module of its own (it imports no other mhmoe code)."""
    spec = importlib.util.spec_from_file_location("mhmoe_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def child(src: str, tokens: list[int], out: str) -> None:
    """One run of one tree: medians of the forward and forward+backward at each S."""
    sys.path.insert(0, src)
    import torch

    import mhmoe

    harness = load_harness()
    if not Path(mhmoe.__file__).resolve().is_relative_to(Path(src).resolve()):
        raise SystemExit(f"ab_trees: imported mhmoe from {mhmoe.__file__}, not from {src}")
    device = torch.device("cuda")
    cfg = mhmoe.MAGI2_PREVIEW
    layer = mhmoe.MultiHeadMoE(cfg, device=device)
    layer.reset_parameters(generator=torch.Generator(device=device).manual_seed(0))
    params = [p for p in layer.parameters() if p.requires_grad]
    rows = []
    for S in tokens:
        gen = torch.Generator(device=device).manual_seed(S)
        x = torch.randn(S, cfg.hidden_size, device=device, generator=gen).bfloat16()
        dy = torch.randn(S, cfg.hidden_size, device=device, generator=gen).bfloat16()
        xg = x.clone().requires_grad_(True)
        with torch.no_grad():
            fwd = harness.bench_ms(lambda x=x: layer(x))

        def fwd_bwd(xg=xg, dy=dy):
            y = layer(xg)
            return torch.autograd.grad(y, [xg, *params], dy)

        both = harness.bench_ms(fwd_bwd, rep=500)
        rows.append({"tokens": S, "layer_ms": fwd, "layer_fwd_bwd_ms": both})
    Path(out).write_text(json.dumps({"env": harness.environment(device), "rows": rows}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--tokens", default="1024,32768")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--commits", default=None, metavar="OLD,NEW",
                    help="the trees' commits, for the rows (where the trees carry no .git)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.child:
        child(args.child[0], tokens, args.child[1])
        return 0
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    envs: dict[str, dict] = {}
    order = random.Random(0)
    for _ in range(args.rounds):
        for name in order.sample(["old", "new"], 2):
            src = {"old": args.old, "new": args.new}[name]
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "run.json")
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                if args.commits:
                    env["MHMOE_COMMIT"] = args.commits.split(",")[name == "new"]
                done = subprocess.run([sys.executable, __file__, args.old, args.new,
                                       "--tokens", args.tokens, "--child", src, out],
                                      env=env, capture_output=True, text=True)
                if done.returncode:
                    print(done.stderr[-4000:], file=sys.stderr)
                    return 1
                result = json.loads(Path(out).read_text())
            envs[name] = result["env"]
            runs[name].append({r["tokens"]: r for r in result["rows"]})
            print(name, json.dumps(result["rows"]), flush=True)
    print(f"\n{'S':>7} {'what':>18} {'old ms (runs)':>32} {'new ms (runs)':>32} {'new/old':>8}")
    rows = []
    harness = load_harness()
    for S in tokens:
        for key in KEYS:
            times = {n: [r[S][key] for r in runs[n]] for n in runs}
            med = {n: statistics.median(t) for n, t in times.items()}
            print(f"{S:>7} {key:>18} "
                  + " ".join(f"{med[n]:>8.3f} ({', '.join(f'{t:.3f}' for t in times[n])})"
                             .rjust(32) for n in ("old", "new"))
                  + f" {med['new'] / med['old']:>8.3f}")
            for n in runs:
                rows.append(harness.result_row(
                    key.removesuffix("_ms"), f"ab:{n}", S, med[n], env=envs[n],
                    runs_ms=times[n], other_commit=envs["new" if n == "old" else "old"]["commit"],
                    command="python3 benchmarks/ab_trees.py OLD_SRC NEW_SRC"))
    if not args.no_record:
        print(f"rows appended to {harness.append_results(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
