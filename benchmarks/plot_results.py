"""The README's plots, drawn from benchmarks/results.jsonl alone (CPU, no GPU, no mhmoe).

    python benchmarks/plot_results.py [--results FILE] [--out DIR]

Writes DIR/*.png (default benchmarks/plots/):

    layer_forward.png     the whole layer forward against tokens (newest run, and the
                          newest run with the most token counts), next to the published
                          route + layout; and the layer forward at each token count, run by run
    experts_forward.png   expert forward TFLOP/s against tokens, each run with the bf16
                          8192^3 matmul measured in the same run
    route_layout.png      route + layout against tokens (newest bench_routing-style run),
                          eager and from a CUDA graph, against the published recipe
    experts_backward.png  expert forward, backward and forward + backward against tokens;
                          and forward + backward at the largest token count, run by run

A run is the rows that share source, date, commit and GPU. Tile-sweep rows (those with a
"sweep" field) are left out. Each plot keeps to the GPU of its newest run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

HERE = Path(__file__).resolve().parent


def load(path: Path) -> list[dict]:
    with open(path) as f:
        return [row for line in f if line.strip()
                if "sweep" not in (row := json.loads(line))]


def when(row: dict) -> dt.datetime:
    """The row's date (a file without one: the date its commit entered git); a date
    without a zone is read as UTC, the clock of the machines that measured it."""
    stamp = dt.datetime.fromisoformat(row.get("date") or row["date_committed"])
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.timezone.utc)


def runs(rows: list[dict]) -> list[list[dict]]:
    """Rows grouped by run, oldest run first."""
    groups = defaultdict(list)
    for row in rows:
        groups[(row.get("source"), row["date"], row["commit"], row["gpu"])].append(row)
    return sorted(groups.values(), key=lambda rs: when(rs[0]))


def series(run: list[dict], kernel: str, variant: str) -> dict[int, dict]:
    return {r["tokens"]: r for r in run if r["kernel"] == kernel and r["variant"] == variant}


def pick(all_runs: list[list[dict]], kernel: str, variant: str) -> list[list[dict]]:
    """The newest run with `kernel`/`variant` at two token counts or more, and the newest
    of those with the most token counts when that is another run (same GPU)."""
    having = [r for r in all_runs if len(series(r, kernel, variant)) >= 2]
    if not having:
        return []
    newest = having[-1]
    gpu = newest[0]["gpu"]
    having = [r for r in having if r[0]["gpu"] == gpu]
    most = max(len(series(r, kernel, variant)) for r in having)
    widest = [r for r in having if len(series(r, kernel, variant)) == most][-1]
    return [newest] if widest is newest else [newest, widest]


def label(run: list[dict]) -> str:
    row = run[0]
    name = Path((row.get("source") or row.get("script") or "?").split("@")[0]).stem
    return f"{row['commit'] or 'commit ?'}, {when(row):%Y-%m-%d} ({name})"


def style_tokens(ax, ylabel: str, logy: bool = True) -> None:
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=6)
    ax.set_xlabel("tokens S")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def line(ax, points: dict[int, dict], fmt: str, text: str, *, key: str = "ms",
         alpha: float = 1.0, color=None) -> None:
    tokens = sorted(points)
    if tokens:
        ax.plot(tokens, [points[t][key] for t in tokens], fmt, label=text, alpha=alpha,
                color=color)


def history(ax, all_runs, kernel: str, variant: str, tokens: int, fmt: str, text: str):
    """One point per run that measured kernel/variant at `tokens`, against the run's date."""
    pts = [(when(r[0]), series(r, kernel, variant)[tokens]["ms"]) for r in all_runs
           if tokens in series(r, kernel, variant) and "H200" in (r[0]["gpu"] or "")]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], fmt, label=text)


def style_history(ax, ylabel: str) -> None:
    ax.set_ylabel(ylabel)
    ax.set_xlabel("date of the run, or of its commit where the file kept none (H200)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)


def plot_layer(all_runs, out: Path) -> None:
    fig, (ax, ax_h) = plt.subplots(1, 2, figsize=(12, 4.6))
    chosen = pick(all_runs, "layer", "default")
    for n, run in enumerate(chosen):
        alpha, at = (1.0, "") if n == 0 else (0.4, f" ({run[0]['commit']})")
        line(ax, series(run, "layer", "default"), "o-", f"layer{at}", alpha=alpha, color="C0")
        line(ax, series(run, "layer", "graph"), "s--", f"layer from a CUDA graph{at}",
             alpha=alpha, color="C1")
        line(ax, series(run, "route_layout", "graph"), "^:",
             f"route + layout from a CUDA graph{at}", alpha=alpha, color="C2")
        line(ax, series(run, "published_route_layout", "default"), "x-",
             f"published route + layout (torch){at}", alpha=alpha, color="C3")
    style_tokens(ax, "forward time (ms, median)")
    ax.set_title("MultiHeadMoE forward (MAGI-2 dims, bf16)\n"
                 + "; faded: ".join(label(r) for r in chosen), fontsize=8)
    for tokens, fmt in ((1024, "o-"), (32768, "s-")):
        history(ax_h, all_runs, "layer", "default", tokens, fmt, f"layer, S={tokens:,}")
    style_history(ax_h, "forward time (ms, median)")
    ax_h.set_ylim(bottom=0)
    ax_h.set_title("layer forward, run by run", fontsize=9)
    save(fig, out / "layer_forward.png")


def plot_experts(all_runs, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for n, run in enumerate(pick(all_runs, "experts_fwd", "default")):
        color = f"C{n}"
        pts = series(run, "experts_fwd", "default")
        line(ax, pts, "o-", f"expert forward, {label(run)}", key="tflops", color=color)
        line(ax, series(run, "experts_fwd", "deterministic"), "s--", "deterministic",
             key="tflops", color=color, alpha=0.6)
        peak = next((r["tflops"] for r in run if r["kernel"] == "bf16_matmul"), None)
        if peak:
            ax.axhline(peak, color=color, ls=":",
                       label=f"bf16 8192^3 matmul, same run: {peak:.0f} TFLOP/s")
    style_tokens(ax, "TFLOP/s (6 S H K D I / time)", logy=False)
    ax.set_ylim(bottom=0)
    ax.set_title("Fused expert forward (MAGI-2 dims, bf16, uniform routing)", fontsize=9)
    save(fig, out / "experts_forward.png")


def plot_route_layout(all_runs, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    chosen = pick(all_runs, "route_layout", "fused_total_counts")[:1]
    for run in chosen:
        line(ax, series(run, "route_layout", "fused_total_counts"), "o-",
             f"mhmoe route + layout, {label(run)}")
        line(ax, series(run, "route_layout", "fused_total_counts_graph"), "s--",
             "mhmoe, CUDA graph")
        line(ax, series(run, "route_layout", "unfused_total"), "^:",
             "cuBLAS fp32 logits + Triton route + layout")
        line(ax, series(run, "published_route_layout", "default"), "x-",
             "published recipe (fp32 logits, topk, argsort + bincount)")
    style_tokens(ax, "time (ms, median)")
    ax.set_title("Routing + layout (MAGI-2 dims: H=12, E=256, K=6, D=256)", fontsize=9)
    save(fig, out / "route_layout.png")


def plot_backward(all_runs, out: Path) -> None:
    fig, (ax, ax_h) = plt.subplots(1, 2, figsize=(12, 4.6))
    chosen = pick(all_runs, "experts_bwd", "default")
    for run in chosen[-1:]:  # the widest
        line(ax, series(run, "experts_fwd", "default"), "o-", f"forward, {label(run)}")
        line(ax, series(run, "experts_bwd", "default"), "s-", "backward")
        line(ax, series(run, "experts_fwd_bwd", "default"), "^-", "forward + backward")
    style_tokens(ax, "time (ms, median)")
    ax.set_title("Fused expert forward and backward (MAGI-2 dims, bf16)", fontsize=9)
    largest = max((t for r in chosen for t in series(r, "experts_bwd", "default")),
                  default=32768)
    history(ax_h, all_runs, "experts_bwd", "default", largest, "s-", f"backward, S={largest:,}")
    history(ax_h, all_runs, "experts_fwd_bwd", "default", largest, "^-",
            f"forward + backward, S={largest:,}")
    style_history(ax_h, "time (ms, median)")
    ax_h.set_ylim(bottom=0)
    ax_h.set_title("expert backward, run by run", fontsize=9)
    save(fig, out / "experts_backward.png")


def save(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(HERE / "results.jsonl"))
    parser.add_argument("--out", default=str(HERE / "plots"))
    args = parser.parse_args()
    all_runs = runs(load(Path(args.results)))
    out = Path(args.out)
    plot_layer(all_runs, out)
    plot_experts(all_runs, out)
    plot_route_layout(all_runs, out)
    plot_backward(all_runs, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
