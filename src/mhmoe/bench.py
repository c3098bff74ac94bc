"""Timing harness: medians of repeated runs, FLOP and byte counts, measured peaks, plots.

Every number a benchmark prints comes from here, so CLI sweeps and the scripts
in benchmarks/ count FLOPs and time kernels the same way.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .config import MultiHeadMoEConfig


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
