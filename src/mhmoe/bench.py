"""The one timing harness: medians, CUDA graphs, interleaved A/B, result rows, plots.

Every number a benchmark prints comes from here, so the CLI's sweeps and the
scripts in benchmarks/ count FLOPs and time kernels the same way:

    time_fn(fn, device=...)          median of event-timed calls (any device)
    bench_ms(fn)                     triton.testing.do_bench's median (CUDA)
    capture_graph(fn)                fn captured in a CUDA graph (side-stream warm-up)
    graph_ms(fn)                     fn captured once in a CUDA graph, replays timed
    interleaved([(name, fn), ...])   variants taking turns in shuffled rounds, for A/Bs
                                     under the H200's power cap (docs/measuring.md)
    check_unique(names, what)        refuse two variants of one name, before the setup
    append_results(rows)             rows appended to benchmarks/results.jsonl
    script_command(script, argv)     the shell line that reruns a benchmark, for its rows
    rel_err(out, ref)                relative error (Frobenius norms) in float64
    call_peak_bytes(fn, device)      peak CUDA memory one call allocates, and its result

A result row (`result_row`) holds what it takes to trust and reproduce a
number: kernel, variant, tokens, ms, TFLOP/s, GPU, versions, commit and date.
This module imports nothing else of mhmoe at import time, so that
benchmarks/ab_trees.py can load it beside another tree's package.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import MultiHeadMoEConfig

# The append-only results file of the repository (benchmarks/results.jsonl).
RESULTS_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "results.jsonl"


@dataclass
class Timing:
    """Milliseconds of one measured callable: median and spread over `runs` runs."""

    median_ms: float
    min_ms: float
    max_ms: float
    runs: int


def time_fn(fn: Callable[[], object], *, device: torch.device | str = "cpu", warmup: int = 1,
            runs: int = 5, min_seconds: float = 0.0) -> Timing:
    """Median wall time of `fn()`, with device events on CUDA (after `warmup` calls).

    Runs at least `runs` times and, if `min_seconds` > 0, until that much time
    has been spent, so short kernels get enough repeats for a stable median.
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < runs or spent < min_seconds:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        times.append(ms)
        spent += ms / 1e3
        if len(times) >= 10_000:
            break
    return Timing(statistics.median(times), min(times), max(times), len(times))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius norms) in float64 on ref's device; 0 for empty
    tensors."""
    if ref.numel() == 0:
        return 0.0
    ref = ref.detach().double()
    out = out.detach().to(ref.device, torch.float64)
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def call_peak_bytes(fn: Callable[[], object], device: torch.device | str) -> tuple[int, object]:
    """(peak CUDA memory that one call of fn allocates beyond what was allocated before
    it, fn's result). The result's own bytes are part of the peak: a caller that wants
    only workspaces subtracts them."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base, result


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median ms of `fn()` by triton.testing.do_bench (CUDA; L2 flushed between calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def capture_graph(fn: Callable[[], object], *, warmup: int = 3):
    """`fn` captured in a CUDA graph, after `warmup` calls on a side stream (as capture
    needs): (graph, what the captured call returned; it lives in the graph's memory)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def graph_ms(fn: Callable[[], object], *, replays: int = 20, runs: int = 10) -> float:
    """Median ms of one replay of `fn` captured in a CUDA graph (`capture_graph`). The
    launches cost nothing on the host here, so this is the GPU time a model that replays
    graphs sees."""
    graph, _ = capture_graph(fn)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


@dataclass
class Interleaved:
    """One variant of an interleaved A/B: median ms over all calls, and per round."""

    median_ms: float
    round_medians_ms: list[float]


def check_unique(names: Iterable[str], what: str) -> None:
    """ValueError naming the first name given twice: a benchmark times and records each
    variant under its own name, so two variants of one name would be refused by
    `interleaved` (or merged by a dict) only after the setup; benchmarks call this while
    they read their arguments. what: the flags the names come from, for the message."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{what}: two variants are named {name!r}")
        seen.add(name)


def interleaved(variants: Sequence[tuple[str, Callable[[], object]]], *, rounds: int = 20,
                per_round: int = 10, seed: int = 0) -> dict[str, Interleaved]:
    """Time variants that take turns: `rounds` rounds of `per_round` back-to-back calls
    of each, every call timed by its own CUDA events, the order of the variants shuffled
    each round (seeded). Under a power cap the clocks drift for seconds, so variants
    timed one after the other differ by as much as the changes compared; shuffled
    rounds give every variant the same mix of clock states and predecessors
    (docs/measuring.md). Each variant is called once first (compile, warm-up)."""
    names = [name for name, _ in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"interleaved: variant names must be unique, got {names}")
    for _, fn in variants:
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    order = random.Random(seed)
    for _ in range(rounds):
        for name, fn in order.sample(list(variants), len(variants)):
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(per_round)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times[name].append([s.elapsed_time(e) for s, e in events])
    return {name: Interleaved(statistics.median(t for r in rs for t in r),
                              [statistics.median(r) for r in rs])
            for name, rs in times.items()}


def matmul_peak_tflops(device: torch.device | str, n: int = 8192, dtype=torch.bfloat16) -> float:
    """TFLOP/s of an n^3 matmul on random data (never zeros: they run faster)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    t = time_fn(lambda: a @ b, device=device, warmup=3, runs=10)
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def copy_bandwidth_tbs(device: torch.device | str, nbytes: int = 4 << 30) -> float:
    """TB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device=device, warmup=3, runs=10)
    return 2 * nbytes / (t.median_ms * 1e-3) / 1e12


def measured_peaks(device: torch.device | str) -> dict:
    """What a run compares its kernels with, measured in that run: the bf16 8192^3
    matmul's TFLOP/s and a device copy's TB/s ({} off CUDA)."""
    if torch.device(device).type != "cuda":
        return {}
    return {"matmul_tflops": matmul_peak_tflops(device), "copy_tbs": copy_bandwidth_tbs(device)}


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def git_commit() -> str:
    """The checkout's commit; MHMOE_COMMIT where the tree travels without .git (GPU runs)."""
    if os.environ.get("MHMOE_COMMIT"):
        return os.environ["MHMOE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parent, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def environment(device: torch.device | str) -> dict:
    """What a result row needs to be reproduced: machine, versions, commit, date."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass
class BenchRow:
    """One measured point of a sweep."""

    path: str          # which implementation ran: "torch" or "triton"
    tokens: int
    route_ms: float    # route + layout (CSR)
    experts_ms: float  # expert_forward
    layer_ms: float    # the whole module forward
    tflops: float      # expert FLOPs / experts_ms
    rel_err: float | None = None
    extra: dict = field(default_factory=dict)


def result_row(kernel: str, variant: str, tokens: int, ms: float, *, env: dict,
               tflops: float | None = None, **extra) -> dict:
    """One row of the results file: what was timed, the time, and the machine, versions,
    commit and date of `environment()`; `extra` holds anything else worth keeping
    (peaks measured in the same run, errors, memory, the command)."""
    return {"kernel": kernel, "variant": variant, "tokens": int(tokens), "ms": float(ms),
            "tflops": None if tflops is None else float(tflops),
            "gpu": env.get("device"), "torch": env.get("torch"), "triton": env.get("triton"),
            "commit": env.get("commit"), "date": env.get("date"), **extra}


def script_command(script: str, argv: Sequence[str]) -> str:
    """The shell line that reruns benchmarks/`script` with `argv`, as a row's `command`:
    quoted, so that an argument holding ';' or spaces (the sweeps' variant lists) comes
    back as one argument when the line is pasted."""
    return "PYTHONPATH=src python3 " + shlex.join([f"benchmarks/{script}", *argv])


def append_results(rows: Iterable[dict], path: str | os.PathLike | None = None) -> Path:
    """Append `rows` (from `result_row`) to the results file, one JSON object a line.
    The file is append-only: earlier rows are never rewritten."""
    path = Path(path) if path is not None else RESULTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    with open(path, "a") as f:
        f.write(lines)
    return path


def read_results(path: str | os.PathLike | None = None) -> list[dict]:
    """Every row of the results file."""
    path = Path(path) if path is not None else RESULTS_FILE
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def expert_tflops(config: MultiHeadMoEConfig, tokens: int, ms: float) -> float:
    return config.expert_flops(tokens) / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


def write_results(path: Path, *, config: MultiHeadMoEConfig, env: dict, rows: list[BenchRow],
                  peaks: dict) -> None:
    """JSON rows, written atomically."""
    payload = {"environment": env, "config": json.loads(config.to_json()), "peaks": peaks,
               "rows": [asdict(r) for r in rows]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


def plot_results(path: Path, *, rows: list[BenchRow], peaks: dict, title: str) -> None:
    """Time and TFLOP/s of the expert part against tokens, one line per path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(11, 4.2))
    for path_name in sorted({r.path for r in rows}):
        mine = sorted((r for r in rows if r.path == path_name), key=lambda r: r.tokens)
        tokens = [r.tokens for r in mine]
        ax_t.plot(tokens, [r.experts_ms for r in mine], "o-", label=f"{path_name}: experts")
        ax_t.plot(tokens, [r.layer_ms for r in mine], "s--", label=f"{path_name}: whole layer")
        ax_f.plot(tokens, [r.tflops for r in mine], "o-", label=path_name)
    if peaks.get("matmul_tflops"):
        ax_f.axhline(peaks["matmul_tflops"], color="k", ls=":",
                     label=f"bf16 matmul {peaks['matmul_tflops']:.0f} TFLOP/s")
    for ax in (ax_t, ax_f):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens S")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time (ms, median)")
    ax_f.set_ylabel("expert TFLOP/s (6 S H K D I / time)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
