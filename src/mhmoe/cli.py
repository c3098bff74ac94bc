"""The `mhmoe` command: demo, bench, inspect, make-checkpoint, quantize.

Results go to stdout, errors to stderr: one line for a usage or input error
(`UsageError`, `InputError`), the traceback for anything else (a bug). Every command
ends with the same exit statuses (`EXIT_STATUS`, shown by `mhmoe --help`).

Nothing heavy (torch, triton, rich) is imported before the arguments are parsed and
checked, so `mhmoe --help`, `--version` and usage errors answer at once; each command
imports what it needs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import re
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .config import MultiHeadMoEConfig
    from .launch import ParallelPoint

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_STATUS = """\
exit status (every command):
  0  done, and every check passed
  1  a check failed: demo's or bench's error against float64, demo --train's loss, the
     head-parallel layer against one process, an fp8 layer against float64 (its float64
     twin on the triton path), or problems that inspect found
  2  usage or input error: bad flags or flag combinations, a path that is not a
     checkpoint or cannot be written, an unusable --device or --backend, out of memory
  3  internal error (a bug): the traceback is printed
Errors go to stderr, results to stdout."""

DTYPE_NAMES = ("bf16", "fp16", "fp32")
BACKEND_NAMES = ("auto", "torch", "triton")  # mhmoe.backends.BACKENDS (a test checks)
CPU_EXPERTS = 8  # experts per head of the CPU demo: MAGI-2 shapes, 1/32 of the experts
REL_ERR_OK = 2e-2  # bf16 operands land near 1e-3..1e-2 (docs/contract.md section 4)
# The fp8 kernel against its float64 twin (the same quantization): the bf16 rounding of
# y and, now and then, an activation rounded to the neighbouring e4m3 value (docs/fp8.md;
# the kernel tests hold it under 4e-3).
FP8_TWIN_ERR_OK = 1e-2
# An fp8 layer against float64 math on its dequantized weights: the contract's fp8
# budget (docs/fp8.md: 5.7e-2 measured against the bf16 layer, weights' rounding included).
FP8_ERR_OK = 6.5e-2
SEED_LIMIT = 2 ** 62  # torch.Generator takes < 2**64; the demos add small offsets
MAGI2_LAYER_COUNT = 36  # MoE layers of MAGI-2 Preview (config.MAGI2_MOE_LAYERS)


class UsageError(Exception):
    """Flags that cannot work together or a flag value that cannot be used: exit 2,
    with the command's usage line."""


class InputError(Exception):
    """Input that cannot be used (a path, a checkpoint, a device, a backend): exit 2, one
    line. Raised, or wrapped (`_as_input_error`), where the input is checked; any other
    exception is a bug (exit 3, with the traceback)."""


@contextlib.contextmanager
def _as_input_error(*errors: type[BaseException]) -> Iterator[None]:
    """An error of one of these types raised inside is the input's fault (the library's
    `CheckpointError`; an OSError of a path the user gave): InputError, one line."""
    try:
        yield
    except errors as e:
        raise InputError(str(e)) from e


# ---------------------------------------------------------------------------------------
# Output. Text is printed as it is: rich's markup and emoji codes are off, so that a
# path with "[...]" or ":name:" in it, or "pip install 'mhmoe[plot]'", prints unchanged.
# ---------------------------------------------------------------------------------------


@functools.cache
def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, markup=False, emoji=False, highlight=False)


def _say(*parts: str | tuple[str, str]) -> None:
    """One line on stdout; a part may be (text, style)."""
    from rich.text import Text

    _console().print(Text.assemble(*parts), soft_wrap=True)


def _status(message: str):
    from rich.text import Text

    return _console().status(Text(message))


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                    MofNCompleteColumn(), console=_console(), transient=True)


def _table(title: str, columns: list[str], *, right: set[str] | None = None, **kwargs):
    from rich.table import Table

    table = Table(title=title, **kwargs)
    for col in columns:
        table.add_column(col, justify="right" if right is None or col in right else "left")
    return table


def _error(command: str | None, message: str) -> None:
    where = f"mhmoe {command}" if command else "mhmoe"
    rank = os.environ.get("RANK") if "WORLD_SIZE" in os.environ else None
    if rank is not None:
        where += f" (rank {rank})"
    _console(stderr=True).print(f"{where}: error: {message}", style="red", soft_wrap=True)


# ---------------------------------------------------------------------------------------
# Argument types and checks.
# ---------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, with a message naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def process_count(text: str) -> int:
    """argparse type of --nproc: an int >= 2 (one process is the one-process demo)."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("the head-parallel demo needs at least 2 processes "
                                         "(without --nproc, demo runs on one)")
    return value


def positive_int_list(text: str) -> list[int]:
    """argparse type: a comma list of ints >= 1, e.g. "1024,4096"."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers")
    return [positive_int(part) for part in parts]


def layer_list(text: str) -> list[int]:
    """argparse type: a comma list of distinct layer indices >= 0, e.g. "2,3"."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts) or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected a comma list of layer indices (integers "
                                         f">= 0) such as 2,3; got {text!r}")
    layers = [int(part) for part in parts]
    repeated = sorted({v for v in layers if layers.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"layer {repeated[0]} is given more than once in "
                                         f"{text!r}")
    return layers


def layer_count(text: str) -> int:
    """argparse type of demo --layers: 1 to MAGI2_LAYER_COUNT."""
    value = positive_int(text)
    if value > MAGI2_LAYER_COUNT:
        raise argparse.ArgumentTypeError(f"MAGI-2 has {MAGI2_LAYER_COUNT} MoE layers; give at "
                                         f"most {MAGI2_LAYER_COUNT}, got {value}")
    return value


def seed_value(text: str) -> int:
    """argparse type of --seed: an int from 0 to SEED_LIMIT - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**62 - 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


# The five demos, and the options that apply to each: an option given to a demo it
# does not apply to is refused (a usage error), never silently ignored. --device,
# --seed and --tokens apply to all five.
DEMOS = {
    "random": "the demo with seeded random weights",
    "checkpoint": "--checkpoint",
    "train": "--train",
    "parallel": "the head-parallel demo (--nproc, or a launcher's group)",
    "fp8": "--fp8",
}
DEMO_OPTIONS = {
    "experts": ("random", "train", "parallel", "fp8"),
    "full": ("random", "parallel", "fp8", "train"),
    "dtype": ("random", "checkpoint"),
    "layer": ("checkpoint",),
    "layers": ("fp8",),
    "config": ("checkpoint",),
    "backend": ("random", "checkpoint", "train", "fp8"),
    "deterministic": ("random", "checkpoint", "parallel", "fp8"),
    "steps": ("train",),
    "lr": ("train",),
    "check_tokens": ("random", "checkpoint", "fp8"),
    "runs": ("random", "checkpoint", "parallel", "fp8"),
}


def _demo_kind(given: set[str], world: int) -> str:
    """Which demo the flags ask for; UsageError for flags that do not go together."""
    picks = [dest for dest in ("train", "nproc", "checkpoint", "fp8") if dest in given]
    if world > 1:
        if picks:
            raise UsageError(f"{_flag(picks[0])} cannot be used under a launcher (WORLD_SIZE="
                             f"{world}): there demo runs the head-parallel layer on the "
                             f"launched group")
        kind = "parallel"
    elif len(picks) > 1:
        raise UsageError(f"{_flag(picks[0])} and {_flag(picks[1])} choose different demos; "
                         f"give one of them")
    else:
        kind = {"train": "train", "nproc": "parallel", "checkpoint": "checkpoint",
                "fp8": "fp8"}.get(picks[0] if picks else "", "random")
    for dest, kinds in DEMO_OPTIONS.items():
        if dest in given and kind not in kinds:
            applies = " or ".join(DEMOS[k] for k in kinds)
            raise UsageError(f"{_flag(dest)} does nothing in {DEMOS[kind]}; it applies to "
                             f"{applies}")
    return kind


def _check_flags(args: argparse.Namespace, world: int) -> None:
    given = args.given
    if "experts" in given and "full" in given:
        raise UsageError("--full means 256 experts per head; give --full or --experts, "
                         "not both")
    if world > 1 and args.command != "demo":
        raise UsageError(f"only demo runs on a launched group (WORLD_SIZE={world}); run "
                         f"mhmoe {args.command} as one process")
    if args.command == "demo":
        args.kind = _demo_kind(given, world)


def _device(name: str | None) -> torch.device:
    """--device as a torch.device; InputError (one line) for a device mhmoe cannot use."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise InputError(f"--device {name!r} is not a device: use cpu, cuda or cuda:N") \
            from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InputError(f"--device {name}: no CUDA device is available on this machine")
        if device.index is not None and device.index >= count:
            raise InputError(f"--device {name}: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    elif device.type != "cpu":
        raise InputError(f"--device {name}: mhmoe runs on cpu or cuda devices, not "
                         f"{device.type}")
    return device


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _out_path(text: str) -> Path:
    """bench --out, checked before the sweep: a file name (not a directory, not ending
    in a slash), in a directory that exists (or can be made) and can be written."""
    if text.endswith("/") or (os.altsep and text.endswith(os.altsep)) or text.endswith(os.sep):
        raise InputError(f"--out {text}: names a directory; give a file name such as "
                         f"{text}mhmoe-bench.json")
    out = Path(text)
    if out.is_dir():
        raise InputError(f"--out {text} is a directory; give a file name such as "
                         f"{out / 'mhmoe-bench.json'}")
    if out.suffix == ".png" or out.with_suffix(".png").is_dir():
        raise InputError(f"--out {text}: the plot is written beside the JSON, as "
                         f"{out.with_suffix('.png')}; give a .json name")
    existing = out.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"--out {text}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--out {text}: {existing} cannot be written")
    if out.exists() and not os.access(out, os.W_OK):
        raise InputError(f"--out {text}: the file exists and cannot be written")
    return out


def _config_option(text: str) -> MultiHeadMoEConfig:
    """--config: a preset name (`MultiHeadMoEConfig.from_name`) or a JSON file
    (`MultiHeadMoEConfig.from_json`)."""
    from .config import PRESETS, MultiHeadMoEConfig

    path = Path(text)
    if path.is_file():
        try:
            return MultiHeadMoEConfig.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError) as e:
            raise InputError(f"--config {text}: not a MultiHeadMoEConfig JSON file: {e}") \
                from None
    if path.suffix == ".json" or os.sep in text:
        raise InputError(f"--config {text}: no such file")
    try:
        return MultiHeadMoEConfig.from_name(text)
    except ValueError:
        raise InputError(f"--config {text!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                         f"nor a JSON file") from None


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def _memory_message(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[enforce fail at [^\]]*\][^.]*\.\s*", "", text)
    text = text.removeprefix("DefaultCPUAllocator: ")
    return f"out of memory ({text[:200]}); ask for less, e.g. fewer --tokens"


# ---------------------------------------------------------------------------------------
# The layers the commands run.
# ---------------------------------------------------------------------------------------


def _demo_config(args, device: torch.device) -> MultiHeadMoEConfig:
    from .config import MAGI2_PREVIEW

    if args.full or (args.experts is None and device.type == "cuda"):
        experts = MAGI2_PREVIEW.num_experts
    else:
        experts = CPU_EXPERTS if args.experts is None else args.experts
    return MAGI2_PREVIEW.replace(num_experts=experts, top_k=min(MAGI2_PREVIEW.top_k, experts))


def _seeded_layer(config: MultiHeadMoEConfig, device: torch.device, seed: int, backend: str):
    import torch

    from .layer import MultiHeadMoE

    # The weights come from a generator on the layer's device (fast for 6 GB on a GPU);
    # the same seed gives the same weights on the same kind of device. Built on the meta
    # device first, so that they are drawn once (fp8 experts: drawn and quantized a
    # chunk at a time on the device).
    layer = MultiHeadMoE(config, device="meta", backend=backend)
    layer.to_empty(device=device)
    layer.reset_parameters(generator=torch.Generator(device=device).manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # small biases, different for the two sources, like a trained router
        layer.router.expert_bias.copy_(torch.randn(layer.router.expert_bias.shape,
                                                   generator=gen) * 0.01)
        layer.router.expert_bias_ema.copy_(torch.randn(layer.router.expert_bias_ema.shape,
                                                       generator=gen) * 0.01)
    return layer


def _check_backend(backend: str, device: torch.device, config: MultiHeadMoEConfig) -> None:
    """--backend, before any work: InputError where the path asked for cannot run."""
    from .backends import resolve_backend
    from .experts import fp8_kernel_problem, kernel_shape_problem

    try:
        resolve_backend(backend, device, op="--backend")
    except ValueError as e:
        raise InputError(str(e)) from None
    if backend == "triton":
        problem = fp8_kernel_problem if config.is_fp8 else kernel_shape_problem
        why = problem(device, config.head_dim, config.expert_intermediate_size)
        if why is not None:
            raise InputError(f"--backend triton: {why}")


def _expert_path(layer, device: torch.device) -> str:
    """The expert path ("torch" or "triton") the layer's forward takes on `device`: its
    backend, and the kernel's rule of shapes and device (under "auto" the PyTorch path
    runs where the kernel cannot)."""
    from .backends import resolve_backend
    from .experts import fp8_kernel_problem, kernel_shape_problem

    path = resolve_backend(layer.backend, device)
    problem = fp8_kernel_problem if layer.config.is_fp8 else kernel_shape_problem
    if path == "triton" and problem(device, *layer.W_gate.shape[1:]) is not None:
        return "torch"
    return path


PATH_NAMES = {"torch": "torch: the PyTorch path (reference.py)",
              "triton": "triton: the fused expert kernel"}
FP8_PATH_NAMES = {"torch": "torch: the float64 twin of the fp8 kernel (mhmoe.fp8; slow)",
                  "triton": "triton: the fp8 expert kernel (kernels/expert_forward_fp8.py)"}


def _path_name(layer, device: torch.device) -> str:
    path = _expert_path(layer, device)
    return (FP8_PATH_NAMES if layer.config.is_fp8 else PATH_NAMES).get(path, path)


@dataclass(frozen=True)
class SliceCheck:
    """`check_slice`'s answer."""

    error: float    # relative error (Frobenius norm) of the checked tokens
    bound: float    # the error it must stay under
    against: str    # what it was checked against, for the output
    note: str       # why that bound


class _DequantizedExperts:
    """W_fp8 * scale of an fp8 expert weight [F, K, N] (scale [F, N]) as
    `moe_reference_float64` reads a weight (its shape, device, and [f]): one expert at a
    time, in float64, never the whole layer (8x its fp8 bytes)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        self.weight, self.scale = weight, scale
        self.shape, self.device = weight.shape, weight.device

    def __getitem__(self, f: int) -> torch.Tensor:
        import torch

        return self.weight[f].to(torch.float64) * self.scale[f].to(torch.float64)


def check_slice(layer, x: torch.Tensor, y: torch.Tensor, tokens: int) -> SliceCheck:
    """y = layer(x) on its first `tokens` tokens against float64 math: the float64
    formula (docs/contract.md section 4) on the layer's weights, on an fp8 layer's
    dequantized weights (the contract's fp8 budget), or, for the fp8 kernel, its float64
    twin (the same quantization, `fp8_twin_error`). Routing is per token, so a slice of
    a larger run checks that run."""
    import torch

    from .bench import rel_err
    from .fp8 import SCALE_NAMES
    from .reference import moe_reference_float64

    cfg = layer.config
    x_heads = x[:tokens].reshape(-1, cfg.num_heads, cfg.head_dim)
    y_heads = y[:tokens].reshape(x_heads.shape)
    if cfg.is_fp8 and _expert_path(layer, x.device) == "triton":
        return SliceCheck(fp8_twin_error(layer, x_heads, y_heads), FP8_TWIN_ERR_OK,
                          "its float64 twin", "the same fp8 quantization")
    with torch.no_grad():
        probs, indices = layer.route_heads(x_heads)
    if cfg.is_fp8:
        # The PyTorch path of an fp8 layer is the twin itself: checked against the
        # formula, on the weights the fp8 ones stand for.
        weights = [_DequantizedExperts(getattr(layer, name), getattr(layer, scale))
                   for name, scale in SCALE_NAMES.items()]
        against, bound, note = ("float64 of the dequantized weights", FP8_ERR_OK,
                                "the fp8 budget; activations rounded to e4m3")
    else:
        weights = [layer.W_gate, layer.W_up, layer.W_down]
        against, bound, note = "float64", REL_ERR_OK, "bf16 lands near 1e-3..1e-2"
    ref = moe_reference_float64(x_heads, probs, indices, *weights)
    return SliceCheck(rel_err(y_heads, ref), bound, against, note)


def fp8_twin_error(layer, x_heads: torch.Tensor, y_heads: torch.Tensor) -> float:
    """Relative error of an fp8 layer's output y_heads [S, H, D] for x_heads against the
    float64 twin of its quantized computation (`mhmoe.fp8.fp8_expert_reference`)."""
    import torch

    from .bench import rel_err
    from .fp8 import Fp8Weights, fp8_expert_reference

    with torch.no_grad():
        layout = layer.route_layout(x_heads)
        weights = Fp8Weights(layer.W_gate, layer.W_up, layer.W_down, layer.W_gate_scale,
                             layer.W_up_scale, layer.W_down_scale)
        twin = fp8_expert_reference(x_heads, *layout, weights)
    return rel_err(y_heads, twin)


# ---------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------


def cmd_demo(args) -> int:
    if args.kind == "train":
        return _demo_train(args)
    if args.kind == "fp8":
        return _demo_fp8(args)
    if args.kind == "parallel":
        if _launched_world() > 1:
            return _demo_group(args)
        return _demo_nproc(args)
    return _demo_one(args)


def _parallel_setup(args, device: torch.device) -> tuple[MultiHeadMoEConfig, int]:
    config = _demo_config(args, device)
    if args.deterministic:
        config = config.replace(deterministic=True)
    tokens = args.tokens if args.tokens is not None else (8192 if device.type == "cuda"
                                                          else 128)
    return config, tokens


def _demo_nproc(args) -> int:
    """`mhmoe demo --nproc N`: this command on N processes of one group (torch's
    launcher, as torchrun does); rank 0 prints the table."""
    import torch

    from .launch import launch_local

    device = _device(args.device)
    if device.index is not None:
        raise InputError(f"--device {args.device}: with --nproc, rank r runs on cuda:r; "
                         f"give --device cuda")
    if device.type == "cuda" and torch.cuda.device_count() < args.nproc:
        raise InputError(f"--nproc {args.nproc} needs {args.nproc} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    worker = ["-m", "mhmoe", "demo", "--device", device.type, "--seed", str(args.seed),
              "--runs", str(args.runs)]
    for dest in ("tokens", "experts"):
        if getattr(args, dest) is not None:
            worker += [_flag(dest), str(getattr(args, dest))]
    worker += [_flag(dest) for dest in ("full", "deterministic") if getattr(args, dest)]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    status = launch_local(args.nproc, worker, cpu_threads=max(1, cpus // args.nproc))
    if status in (EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERNAL, 130):
        return status  # the process said why, on stderr
    how = f"signal {-status}" if status < 0 else f"exit status {status}"
    _error("demo", f"a process of the group died ({how})")
    return EXIT_INTERNAL


def _demo_group(args) -> int:
    """The head-parallel demo as one rank of a launched group (torchrun, --nproc)."""
    import torch.distributed as dist

    from .launch import gather_points, join_launched_group, measure_rank

    device = _device(args.device)
    if device.index is not None:
        raise InputError(f"--device {args.device}: under a launcher rank r runs on "
                         f"cuda:LOCAL_RANK; give --device cuda")
    with _as_input_error(ValueError):  # the launcher's LOCAL_RANK names no GPU here
        device = join_launched_group(device.type)
    try:
        config, tokens = _parallel_setup(args, device)
        point = measure_rank(config, tokens, args.seed, args.runs, device)
        points = gather_points(point)
    finally:
        dist.destroy_process_group()
    worst = max(p.max_abs_diff / max(p.max_abs_ref, 1e-30) for p in points)
    ok = worst < REL_ERR_OK
    if point.rank == 0:
        _print_parallel(points, config, worst, ok)
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def _print_parallel(points: list[ParallelPoint], config: MultiHeadMoEConfig, worst: float,
                    ok: bool) -> None:
    backend = points[0].backend
    table = _table(f"mhmoe demo on {len(points)} processes: head-parallel layer over {backend}, "
                   f"{config.num_heads} heads x {config.num_experts} experts"
                   f"{', deterministic' if config.deterministic else ''} (times in ms)",
                   ["rank", "tokens", "heads", "dispatch", "experts", "undispatch", "layer",
                    "a2a MB", "max |diff|"])
    for p in points:
        table.add_row(str(p.rank), str(p.tokens), str(p.real_heads), f"{p.dispatch_ms:.2f}",
                      f"{p.experts_ms:.2f}", f"{p.undispatch_ms:.2f}", f"{p.layer_ms:.2f}",
                      f"{p.alltoall_bytes / 1e6:.2f}", f"{p.max_abs_diff:.2e}")
    _console().print(table)
    _say(f"largest difference from the one-process layer: {worst:.2e} of its largest output ",
         ("(ok)", "green") if ok else ("(FAILED)", "red"))


def _demo_train(args) -> int:
    """`mhmoe demo --train`: a student layer learns to imitate a seeded teacher layer.

    A smoke test of the backward: the gradients of every trainable parameter
    (router gate and the three expert weights) flow through routing and the
    expert path, and a few Adam steps make the loss visibly fall. Each step is timed
    (forward, backward, optimizer step); the median of the steps after the first two
    (which compile the kernels) gives the step time and its TFLOP/s, counted as three
    times the experts' forward FLOPs.

    The default layer is small, with float32 parameters (Adam on bf16 weights drops
    small updates, which would hide whether the gradients are right); --full trains
    the MAGI-2 layer itself, in bf16.
    """
    import statistics
    import time

    import torch

    from .bench import device_name
    from .config import MAGI2_PREVIEW

    device = _device(args.device)
    cuda = device.type == "cuda"
    if args.full:
        config = MAGI2_PREVIEW
    else:
        experts = 4 if args.experts is None else args.experts
        config = MAGI2_PREVIEW.replace(num_experts=experts, top_k=min(2, experts),
                                       expert_intermediate_size=256,
                                       params_dtype=torch.float32)
    _check_backend(args.backend, device, config)
    with _status("building the teacher and student layers"):
        teacher = _seeded_layer(config, device, args.seed, args.backend)
        student = _seeded_layer(config, device, args.seed + 100, args.backend)
    trainable = [p for p in student.parameters() if p.requires_grad]
    # One fused kernel a step on a GPU, as a user training there would ask for.
    opt = torch.optim.Adam(trainable, lr=args.lr, fused=cuda)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    tokens = args.tokens if args.tokens is not None else (4096 if args.full and cuda else 64)
    losses, step_ms = [], []
    with _progress() as progress:
        task = progress.add_task("training", total=args.steps)
        for _ in range(args.steps):
            x = torch.randn(tokens, config.hidden_size, device=device, generator=gen)
            x = x.to(config.params_dtype)
            with torch.no_grad():
                target = teacher(x)
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            y = student(x)
            loss = (y.float() - target.float()).square().mean() / target.float().square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())  # waits for the step
            step_ms.append((time.perf_counter() - start) * 1e3)
            progress.update(task, advance=1, description=f"loss {losses[-1]:.4f}")
    dtype = str(config.params_dtype).removeprefix("torch.")
    _say(f"mhmoe demo --train on {device_name(device)}, path {_path_name(student, device)}: a "
         f"student layer imitates a teacher ({config.num_heads} heads x "
         f"{config.num_experts} experts, top-{config.top_k}, I "
         f"{config.expert_intermediate_size}, {dtype} parameters, {tokens} tokens a step, "
         f"Adam lr {args.lr})")
    table = _table("training loss", ["step", "relative MSE"])
    marks = sorted({0, len(losses) - 1, *range(0, len(losses), max(1, len(losses) // 8))})
    for step in marks:
        table.add_row(str(step + 1), f"{losses[step]:.4f}")
    _console().print(table)
    timed = step_ms[2:] or step_ms
    median = statistics.median(timed)
    tflops = 3 * config.expert_flops(tokens) / (median * 1e-3) / 1e12
    _say(f"step time {median:.2f} ms (median of {len(timed)} steps: forward, backward, Adam), "
         f"{tflops:.4g} TFLOP/s counted as 3x the experts' forward FLOPs")
    fell = losses[-1] < 0.8 * losses[0]
    _say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} "
         f"({100 * (1 - losses[-1] / losses[0]):.0f}% lower): ",
         ("ok", "green") if fell else ("FAILED: it did not fall by 20%", "red"))
    return EXIT_OK if fell else EXIT_CHECK_FAILED


NO_METADATA = "MAGI2_PREVIEW (the checkpoint has no mhmoe metadata)"


def _checkpoint_config(reader, option: str | None) -> tuple[MultiHeadMoEConfig, str]:
    """The layer config of a checkpoint command, and where it came from: --config (which
    must agree with the checkpoint's own metadata, if any), else the metadata, else
    MAGI2_PREVIEW (`NO_METADATA`)."""
    from .config import MAGI2_PREVIEW

    stored = reader.config
    if option is not None:
        config = _config_option(option)
        if stored is not None and stored != config:
            raise InputError(f"--config {option}: the checkpoint's own metadata holds another "
                             f"config ({stored.to_json()}); drop --config to use it")
        return config, f"--config {option}"
    if stored is not None:
        return stored, "the checkpoint's metadata"
    return MAGI2_PREVIEW, NO_METADATA


@contextlib.contextmanager
def _checkpoint_errors(origin: str) -> Iterator[None]:
    """CheckpointError inside: InputError, with the way out where the config was
    assumed (`_checkpoint_config` gave `NO_METADATA`): the shapes are likely not
    MAGI2_PREVIEW's."""
    from .checkpoint import CheckpointError

    try:
        yield
    except CheckpointError as e:
        if origin == NO_METADATA:
            raise InputError(f"{e} (the checkpoint has no mhmoe metadata, so the "
                             f"MAGI2_PREVIEW config was assumed; --config NAME or --config "
                             f"FILE.json gives the right one)") from e
        raise InputError(str(e)) from e


def _checkpoint_layer(args, device: torch.device):
    """The layer of `demo --checkpoint`, and where its config came from."""
    from .checkpoint import CheckpointError, CheckpointReader, load_layer

    layer_index = 2 if args.layer is None else args.layer
    with _as_input_error(CheckpointError), CheckpointReader(args.checkpoint) as reader:
        config, origin = _checkpoint_config(reader, args.config)
        _check_backend(args.backend, device, config)
        with _status(f"loading layer {layer_index} from {args.checkpoint}"), \
                _checkpoint_errors(origin):
            layer = load_layer(reader, layer_index, config, device=device,
                               backend=args.backend)
    return layer, f"{args.checkpoint} layer {layer_index}", origin


def _demo_one(args) -> int:
    """One layer forward on this process: seeded random weights or --checkpoint."""
    import torch

    from .bench import device_name, expert_tflops, matmul_peak_tflops, time_fn

    device = _device(args.device)
    if args.checkpoint:
        layer, source, origin = _checkpoint_layer(args, device)
    else:
        config = _demo_config(args, device)
        _check_backend(args.backend, device, config)
        with _status("building a seeded random layer"):
            layer = _seeded_layer(config, device, args.seed, args.backend)
        source, origin = f"seeded random weights (seed {args.seed})", None
    if args.deterministic:
        layer.config = layer.config.replace(deterministic=True)
    config = layer.config
    tokens = args.tokens if args.tokens is not None else (8192 if device.type == "cuda"
                                                          else 256)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(device,
                                                                  _torch_dtype(args.dtype))

    with torch.no_grad():
        with _status(f"forward of {tokens} tokens on {device_name(device)}"):
            y = layer(x)
            timing = time_fn(lambda: layer(x), device=device, warmup=1 if device.type == "cuda"
                             else 0, runs=args.runs)
        with _status("checking against the float64 reference"):
            check = check_slice(layer, x, y, min(args.check_tokens, tokens))
        finite = bool(torch.isfinite(y).all())
        graph = _graph_time(lambda: layer(x), device)
    peak = matmul_peak_tflops(device) if device.type == "cuda" else None
    tflops = expert_tflops(config, tokens, timing.median_ms)

    table = _table("mhmoe demo: one multi-head MoE layer forward", ["", ""], right=set(),
                   show_header=False)
    table.add_row("device", device_name(device))
    table.add_row("path", _path_name(layer, device) + (" (deterministic)" if layer.deterministic
                                                         else ""))
    table.add_row("weights", source)
    if origin:
        table.add_row("config", origin)
    table.add_row("layer", f"hidden {config.hidden_size}, {config.num_heads} heads x "
                  f"{config.num_experts} experts, top-{config.top_k}, D {config.head_dim}, "
                  f"I {config.expert_intermediate_size}, {config.params_dtype}")
    table.add_row("tokens", f"{tokens} ({args.dtype})")
    waited = ", each call waited for: the host's launches included" if graph else ""
    table.add_row("time", f"{timing.median_ms:.2f} ms (median of {timing.runs}{waited})")
    if graph is not None:
        table.add_row("time (CUDA graph)", graph)
    table.add_row("throughput", f"{tokens / timing.median_ms * 1e3:,.0f} tokens/s, "
                  f"{tflops:.3f} TFLOP/s" + (f" ({100 * tflops / peak:.1f}% of the "
                                             f"{peak:.0f} TFLOP/s bf16 matmul)" if peak else ""))
    verdict = "ok" if finite and check.error < check.bound else "FAILED"
    table.add_row("rel. error", f"{check.error:.2e} on {min(args.check_tokens, tokens)} tokens "
                  f"vs {check.against} ({verdict}: under {check.bound:g}; {check.note})"
                  f"{'' if finite else ': the output is not finite'}")
    _console().print(table)
    return EXIT_OK if verdict == "ok" else EXIT_CHECK_FAILED


def _graph_time(fn, device, layers: int | None = None) -> str | None:
    """The demos' GPU time: `fn` replayed from a CUDA graph, so that the host's launches
    drop out (on an H100 about 1.4 ms of them a layer call at 1,024 tokens, more than
    the fp8 layer's GPU time there: docs/fp8.md); None off CUDA. `layers`: a pass of
    that many layers. A capture that fails is reported in the row, not raised: the eager
    time above it stands."""
    if device.type != "cuda":
        return None
    from .bench import graph_ms

    try:
        with _status("timing the same work replayed from a CUDA graph"):
            ms = graph_ms(fn, replays=3, runs=5)
    except RuntimeError as error:
        return f"not captured ({(str(error).splitlines() or [type(error).__name__])[0][:120]})"
    per_pass = "" if layers is None else f" a pass, {ms / layers:.2f} ms a layer"
    return f"{ms:.2f} ms{per_pass} (median of 5 x 3 replays: GPU time)"


def _demo_fp8(args) -> int:
    """`mhmoe demo --fp8`: N fp8 MoE layers with seeded random weights built on the
    device (no files), one forward through all of them (a residual stack, x + moe(x)),
    the device memory they hold and the time per pass; the first layer's output in that
    forward checked against float64 (`check_slice`)."""
    import torch

    from .bench import device_name, time_fn
    from .fp8 import FP8

    device = _device(args.device)
    cuda = device.type == "cuda"
    count = args.layers or 1
    config = _demo_config(args, device).replace(params_dtype=FP8,
                                                deterministic=bool(args.deterministic))
    _check_backend(args.backend, device, config)
    tokens = args.tokens if args.tokens is not None else (8192 if cuda else 256)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    layers = []
    with _progress() as progress:
        task = progress.add_task(f"building {count} fp8 layers on {device}", total=count)
        for i in range(count):
            layers.append(_seeded_layer(config, device, args.seed + i, args.backend))
            progress.advance(task)
    held_bytes = sum(p.numel() * p.element_size() for layer in layers
                     for p in layer.parameters())
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(device, torch.bfloat16)

    def one_pass():
        h = x
        for layer in layers:
            h = h + layer(h)
        return h

    checked = min(args.check_tokens, tokens)
    first = layers[0]
    with torch.no_grad():
        with _status(f"{count} layer(s) forward, {tokens} tokens on {device_name(device)}"):
            # The first pass by hand, to keep the first layer's output for the check.
            y_first = first(x)
            out = x + y_first
            for layer in layers[1:]:
                out = out + layer(out)
            timing = time_fn(one_pass, device=device, warmup=1 if cuda else 0, runs=args.runs)
        with _status("checking the first layer against float64"):
            check = check_slice(first, x, y_first, checked)
    if cuda:
        held = torch.cuda.memory_allocated(device) - before
        peak = torch.cuda.max_memory_allocated(device) - before
    finite = bool(torch.isfinite(out).all())
    with torch.no_grad():
        graph = _graph_time(one_pass, device, count)  # after the memory: its pool is extra

    table = _table("mhmoe demo --fp8: a stack of fp8 multi-head MoE layers", ["", ""],
                   right=set(), show_header=False)
    table.add_row("device", device_name(device))
    table.add_row("path", _path_name(first, device) + (" (deterministic)" if first.deterministic
                                                         else ""))
    table.add_row("weights", f"seeded random (seeds {args.seed}..{args.seed + count - 1}), "
                  f"e4m3 with per-output-channel fp32 scales, built on the device")
    table.add_row("layers", f"{count} x (hidden {config.hidden_size}, {config.num_heads} heads "
                  f"x {config.num_experts} experts, top-{config.top_k}, D {config.head_dim}, "
                  f"I {config.expert_intermediate_size}), run as h + moe(h)")
    table.add_row("parameters", f"{held_bytes / 1e9:.3f} GB ({held_bytes / count / 1e9:.3f} GB "
                  f"a layer)")
    if cuda:
        table.add_row("device memory", f"{held / 1e9:.3f} GB held after the pass "
                      f"(torch.cuda.memory_allocated), peak {peak / 1e9:.3f} GB "
                      f"(max_memory_allocated, build and forward)")
    else:
        table.add_row("device memory", "not measured on the CPU")
    table.add_row("tokens", f"{tokens} (bf16)")
    waited = ", each pass waited for: the host's launches included" if graph else ""
    table.add_row("time", f"{timing.median_ms:.2f} ms a pass, {timing.median_ms / count:.2f} "
                  f"ms a layer (median of {timing.runs}{waited})")
    if graph is not None:
        table.add_row("time (CUDA graph)", graph)
    verdict = "ok" if finite and check.error < check.bound else "FAILED"
    table.add_row("rel. error", f"{check.error:.2e} on {checked} of the {tokens} tokens of layer "
                  f"1 vs {check.against} ({verdict}: under {check.bound:g}; {check.note})"
                  f"{'' if finite else ': the output is not finite'}")
    _console().print(table)
    return EXIT_OK if verdict == "ok" else EXIT_CHECK_FAILED


# ---------------------------------------------------------------------------------------
# bench, inspect, make-checkpoint, quantize
# ---------------------------------------------------------------------------------------


def _bench_point(layer, path: str, tokens: int, device: torch.device, runs: int):
    """Route + layout, experts and whole-layer times of one token count, and a check."""
    import torch

    from .bench import BenchRow, expert_tflops, time_fn
    from .experts import expert_forward

    config = layer.config
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(device, torch.bfloat16)
    x_heads = x.view(tokens, config.num_heads, config.head_dim)
    layout = layer.route_layout(x_heads)
    run = dict(device=device, warmup=1, runs=runs)
    t_route = time_fn(lambda: layer.route_layout(x_heads), **run)
    t_exp = time_fn(lambda: expert_forward(x_heads, *layout, layer.W_gate, layer.W_up,
                                           layer.W_down, backend=path), **run)
    y = layer(x)
    t_layer = time_fn(lambda: layer(x), **run)
    err = check_slice(layer, x, y, min(16, tokens)).error
    return BenchRow(path, tokens, t_route.median_ms, t_exp.median_ms, t_layer.median_ms,
                    expert_tflops(config, tokens, t_exp.median_ms), err)


def cmd_bench(args) -> int:
    out = _out_path(args.out)  # before the sweep: a bad path must not cost a long run

    import torch

    from .backends import available_backends
    from .bench import (
        copy_bandwidth_tbs,
        environment,
        matmul_peak_tflops,
        plot_results,
        write_results,
    )

    device = _device(args.device)
    config = _demo_config(args, device)
    if args.tokens:
        sweep = args.tokens
    elif device.type == "cuda":
        sweep = [1024, 4096, 16384, 32768]
    else:
        sweep = [64, 128, 256, 512]
    if args.paths:
        paths = [p.strip() for p in args.paths.split(",")]
        missing = [p for p in paths if p not in available_backends(device)]
        if missing:
            raise InputError(f"--paths {','.join(missing)} cannot run on {device}; available: "
                             f"{','.join(available_backends(device))}")
    elif device.type == "cuda":
        paths = available_backends(device)
    else:
        paths = ["torch"]  # on the CPU the kernels only run in the (slow) interpreter
    env = environment(device)
    peaks = {}
    if device.type == "cuda":
        peaks = {"matmul_tflops": matmul_peak_tflops(device),
                 "copy_tbs": copy_bandwidth_tbs(device)}
    rows = []
    with _progress() as progress, torch.no_grad():
        task = progress.add_task("bench", total=len(sweep) * len(paths))
        for path in paths:
            layer = _seeded_layer(config, device, args.seed, path)
            for tokens in sweep:
                progress.update(task, description=f"{path}: {tokens} tokens")
                rows.append(_bench_point(layer, path, tokens, device, args.runs))
                progress.advance(task)

    table = _table(f"mhmoe bench on {env['device']}", ["path", "tokens", "route+CSR ms",
                                                      "experts ms", "layer ms", "TFLOP/s",
                                                      "rel. err"])
    for r in rows:
        table.add_row(r.path, str(r.tokens), f"{r.route_ms:.3f}", f"{r.experts_ms:.3f}",
                      f"{r.layer_ms:.3f}", f"{r.tflops:.3f}", f"{r.rel_err:.1e}")
    _console().print(table)
    if peaks:
        _say(f"measured peaks: bf16 8192^3 matmul {peaks['matmul_tflops']:.0f} TFLOP/s, "
             f"device copy {peaks['copy_tbs']:.2f} TB/s")
    with _as_input_error(OSError):  # --out was checked, but the disk may be full
        write_results(out, config=config, env=env, rows=rows, peaks=peaks)
    plot = out.with_suffix(".png")
    try:
        with _as_input_error(OSError):
            plot_results(plot, rows=rows, peaks=peaks,
                         title=f"{env['device']}: H={config.num_heads}, "
                         f"E={config.num_experts}, K={config.top_k}, D={config.head_dim}, "
                         f"I={config.expert_intermediate_size}")
        _say(f"wrote {out} and {plot}")
    except ImportError:
        _say(f"wrote {out}; no plot: matplotlib is not installed (pip install 'mhmoe[plot]')")
    bad = [r for r in rows if not r.rel_err < REL_ERR_OK]
    return EXIT_CHECK_FAILED if bad else EXIT_OK


def cmd_inspect(args) -> int:
    from .checkpoint import CheckpointError, inspect_checkpoint

    path = Path(args.path)
    if not path.exists():
        raise InputError(f"{args.path}: no such file or directory")
    with _status("reading every MoE tensor to check for NaN / inf" if args.finite_check
                 else f"reading the headers of {args.path}"), \
            _as_input_error(CheckpointError, OSError):
        report = inspect_checkpoint(path, check_finite=args.finite_check)
    if not report.files:  # not a checkpoint at all: nothing to report on
        raise InputError(report.problems[0] if report.problems else
                         f"{args.path}: no checkpoint found")
    if report.config is not None:
        _say(f"config (from metadata): {report.config}")
    if report.scheme is not None:
        _say(f"quantization (from metadata): {report.scheme}")
    _say(f"MoE layers of {args.path}:")  # a line of its own: a table title would wrap it
    table = _table("", ["layer", "tensor", "shape", "dtype", "MB", "file"],
                   right={"layer", "MB"})
    for row in report.layers:
        table.add_row(str(row.layer), row.name, "x".join(map(str, row.shape)),
                      str(row.dtype).removeprefix("torch."), f"{row.bytes / 1e6:,.1f}",
                      Path(row.file).name)
    _console().print(table)
    _say(f"{len(report.layer_indices)} MoE layers, {report.total_bytes / 1e9:.3f} GB in "
         f"{len(report.files)} file(s)")
    checked = "values checked for NaN / inf" if report.checked_finite else \
        "values not checked for NaN / inf (--no-finite-check)"
    if report.problems:
        for problem in report.problems:
            _say(("problem: ", "red"), problem)
        _say(f"{len(report.problems)} problem(s) found; {checked}")
        return EXIT_CHECK_FAILED
    _say(("no problems found", "green"), f"; {checked}")
    return EXIT_OK


def cmd_make_checkpoint(args) -> int:
    import torch

    from .checkpoint import CheckpointError, save_checkpoint
    from .config import MAGI2_PREVIEW

    config = MAGI2_PREVIEW.replace(num_experts=args.experts,
                                   top_k=min(MAGI2_PREVIEW.top_k, args.experts))
    modules = {}
    for i, index in enumerate(args.layers):
        with _status(f"making layer {index} ({config.expert_weight_bytes() / 1e9:.2f} GB)"):
            modules[index] = _seeded_layer(config, torch.device("cpu"), args.seed + i, "torch")
    # At least one byte: a limit below the smallest tensor gives each tensor its own shard.
    shard = max(1, int(args.shard_mb * 1e6)) if args.shard_mb is not None else None
    with _as_input_error(CheckpointError, OSError):
        files = save_checkpoint(args.path, modules, config=config, max_shard_bytes=shard,
                                prefix=args.prefix, progress=True, overwrite=args.overwrite)
    _say(f"wrote {len(files)} file(s) to {args.path}: MoE layers {args.layers}, "
         f"{config.num_heads} heads x {config.num_experts} experts")
    return EXIT_OK


def _source_root(src: Path) -> Path:
    """The directory a checkpoint path (a directory, a .safetensors or an index) lives in."""
    return (src if src.is_dir() else src.parent).resolve()


def cmd_quantize(args) -> int:
    """`mhmoe quantize SRC DST`: the fp8 checkpoint of a bf16 one, a layer at a time."""
    src, dst = Path(args.src), Path(args.dst)
    if not src.exists():
        raise InputError(f"{args.src}: no such file or directory")
    root, target = _source_root(src), dst.resolve()
    if target == root or root in target.parents:
        where = "is" if target == root else "is inside"
        raise InputError(f"{args.dst} {where} the source checkpoint's directory {root}; "
                         f"quantize never writes there: give another directory")
    if dst.exists() and not dst.is_dir():
        raise InputError(f"{args.dst} is a file; the fp8 checkpoint is a directory")

    import math

    import torch

    from .checkpoint import CheckpointError, CheckpointReader, save_checkpoint_layers
    from .checkpoint.inspect import require_finite
    from .checkpoint.load import checked_layer
    from .fp8 import FP8, SCALE_NAMES, SCHEME, quantize_into, row_chunks
    from .parallel import HeadPartition

    with _as_input_error(CheckpointError, OSError), CheckpointReader(src) as reader:
        config, origin = _checkpoint_config(reader, args.config)
        if config.is_fp8:
            raise InputError(f"{args.src} already holds fp8 experts ({reader.quant_scheme})")
        available = reader.moe_layers()
        layers = args.layers if args.layers is not None else available
        absent = [layer for layer in layers if layer not in available]
        if not layers or absent:
            raise InputError(f"{args.src} has no MoE layer(s) {absent}; its MoE layers are "
                             f"{available}")
        partition = reader.partition or HeadPartition(config.num_heads)
        # Every key, shape and dtype of every layer before anything is written.
        with _checkpoint_errors(origin):
            checked = {layer: checked_layer(reader, layer, config, partition)[0]
                       for layer in layers}

        def make(layer: int) -> dict[str, torch.Tensor]:
            tensors = {}
            for name, (key, file, shape, _dtype) in checked[layer].items():
                if name not in SCALE_NAMES:  # the router, fp32 (a float64 layer's too)
                    tensors[key] = reader.read_key(key).to(torch.float32)
                    require_finite(tensors[key], file, key, 0)
                    continue
                weight = torch.empty(shape, dtype=FP8)
                scale = torch.empty(shape[0], shape[2], dtype=torch.float32)
                for begin, end in row_chunks(shape[0], math.prod(shape[1:])):
                    rows = reader.read_key(key, (begin, end))
                    require_finite(rows, file, key, begin)
                    quantize_into(rows, weight[begin:end], scale[begin:end])
                tensors[key], tensors[key + "_scale"] = weight, scale
            return tensors

        files = save_checkpoint_layers(dst, layers, make, config=config.replace(
            params_dtype=FP8), partition=reader.partition, progress=True,
            overwrite=args.overwrite)
    size = sum(f.stat().st_size for f in files)
    _say(f"wrote {len(files)} file(s), {size / 1e9:.3f} GB, to {args.dst}: MoE layers {layers} "
         f"of {args.src}, {config.num_heads} heads x {config.num_experts} experts, "
         f"float8_e4m3fn with fp32 scales ({SCHEME})")
    return EXIT_OK


# ---------------------------------------------------------------------------------------
# The parser and main.
# ---------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help, except where there is none to show (a
    flag, or a default that depends on the machine or the mode: its help says it)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == "" \
                or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class _VersionAction(argparse.Action):
    """--version: the installed distribution's version, looked up only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show mhmoe's version and exit"):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("mhmoe")
        except PackageNotFoundError:
            text = "(not installed)"
        print(f"mhmoe {text}")
        parser.exit()


def build_parser(*, probe: bool = False) -> argparse.ArgumentParser:
    """The `mhmoe` parser. probe=True: every option's default is left out, so that the
    parsed namespace holds only the options given on the command line (`main` uses it
    to refuse options that would be ignored)."""

    def default(value):
        return argparse.SUPPRESS if probe else value

    parser = argparse.ArgumentParser(prog="mhmoe", description=__doc__.split("\n\n")[0],
                                     epilog=EXIT_STATUS, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str = ""):
        p = sub.add_parser(name, help=help, description=description or help,
                           epilog=EXIT_STATUS, formatter_class=_HelpFormatter)
        p.set_defaults(parser=None if probe else p)
        return p

    def add_layer_options(p, what: str):
        p.add_argument("--experts", type=positive_int, default=default(None),
                       help=f"experts per head{what} (default: 256 on a GPU, {CPU_EXPERTS} on "
                       f"the CPU)")
        p.add_argument("--full", action="store_true", default=default(False),
                       help="the full MAGI-2 layer (256 experts per head, 6 GB) even on the "
                       "CPU; not with --experts")
        p.add_argument("--device", default=default(None),
                       help="cpu, cuda or cuda:N (default: cuda if present, else cpu)")
        p.add_argument("--seed", type=seed_value, default=default(0),
                       help="seed of weights and inputs")

    demo = command(
        "demo", "run one layer forward, time it, check it against float64",
        "Run one multi-head MoE layer forward, time it and check it against a float64\n"
        "evaluation. Five demos: seeded random weights (the default), --checkpoint PATH,\n"
        "--train, the head-parallel layer on N processes (--nproc N, or under a\n"
        "launcher: torchrun --nproc-per-node N -m mhmoe demo), and --fp8: a stack of N fp8\n"
        "layers built on the device (--full --fp8 --layers 36: MAGI-2's 36 on one GPU).\n"
        "An option that does not apply to the chosen demo is refused, never ignored.")
    add_layer_options(demo, " (not with --checkpoint; 4 with --train)")
    demo.add_argument("--runs", type=positive_int, default=default(3),
                      help="timed runs, the median reported (not with --train)")
    demo.add_argument("--tokens", type=positive_int, default=default(None),
                      help="tokens (default: 256 on the CPU, 8192 on a GPU; 128 on the CPU "
                      "and 8192 on GPUs for the head-parallel demo; 64 a step for --train)")
    demo.add_argument("--dtype", choices=DTYPE_NAMES, default=default("bf16"),
                      help="input dtype (one-process demos)")
    demo.add_argument("--checkpoint", default=default(None), metavar="PATH",
                      help="run a layer of this MAGI-2 format checkpoint")
    demo.add_argument("--layer", type=int, default=default(None),
                      help="MoE layer index in the checkpoint (default: 2; only with "
                      "--checkpoint)")
    demo.add_argument("--config", default=default(None), metavar="NAME_OR_JSON",
                      help="the layer config of a checkpoint without mhmoe's metadata: a "
                      "preset name (magi2_preview) or a MultiHeadMoEConfig JSON file "
                      "(default: the checkpoint's metadata, else magi2_preview; only with "
                      "--checkpoint)")
    demo.add_argument("--backend", choices=BACKEND_NAMES, default=default("auto"),
                      help="expert path (not with --nproc)")
    demo.add_argument("--deterministic", action="store_true", default=default(False),
                      help="the deterministic expert kernel (also honoured by --nproc; not "
                      "with --train)")
    demo.add_argument("--train", action="store_true", default=default(False),
                      help="a few optimizer steps on a toy regression (student imitates a "
                      "teacher layer); the loss must fall")
    demo.add_argument("--steps", type=positive_int, default=default(20),
                      help="optimizer steps (only with --train)")
    demo.add_argument("--lr", type=positive_float, default=default(5e-3),
                      help="Adam learning rate (only with --train)")
    demo.add_argument("--nproc", type=process_count, default=default(None), metavar="N",
                      help="run head-parallel on N processes started by torch's launcher "
                      "(gloo on the CPU, NCCL on N GPUs) and check against one process; "
                      "not with --train or --checkpoint")
    demo.add_argument("--fp8", action="store_true", default=default(False),
                      help="build --layers fp8 layers (e4m3 experts, seeded random weights) "
                      "on the device, run one forward through them, print the device memory "
                      "and the time a pass; the first layer is checked against its float64 "
                      "twin")
    demo.add_argument("--layers", type=layer_count, default=default(None), metavar="N",
                      help=f"fp8 layers to build (1 to {MAGI2_LAYER_COUNT}; default 1; only "
                      f"with --fp8)")
    demo.add_argument("--check-tokens", type=positive_int, default=default(16),
                      help="tokens checked against the float64 reference (one-process demos)")
    demo.set_defaults(func=cmd_demo)

    bench = command("bench", "sweep token counts; write JSON and a PNG plot")
    add_layer_options(bench, "")
    bench.add_argument("--runs", type=positive_int, default=default(3),
                       help="timed runs, the median reported")
    bench.add_argument("--tokens", type=positive_int_list, default=default(None),
                       help="comma list of token counts (default: 64,128,256,512 on the CPU, "
                       "1024,4096,16384,32768 on a GPU)")
    bench.add_argument("--out", default=default("mhmoe-bench.json"), metavar="FILE",
                       help="JSON file (the PNG plot is written beside it); checked before "
                       "the sweep")
    bench.add_argument("--paths", default=default(None),
                       help="comma list of expert paths (torch, triton) (default: both on a "
                       "GPU, torch on the CPU)")
    bench.set_defaults(func=cmd_bench)

    inspect = command("inspect", "list a checkpoint's MoE layers, report problems",
                      "List a checkpoint's MoE layers with shapes, dtypes and sizes, and "
                      "report its\nproblems (exit status 1), NaN / inf values included.")
    inspect.add_argument("path", help="checkpoint directory, .safetensors or index .json")
    inspect.add_argument("--no-finite-check", dest="finite_check", action="store_false",
                         default=default(True),
                         help="skip reading every MoE tensor for NaN / inf (fast, headers only)")
    inspect.set_defaults(func=cmd_inspect)

    make = command("make-checkpoint", "write a synthetic checkpoint in the MAGI-2 format")
    make.add_argument("path", help="output directory")
    make.add_argument("--layers", type=layer_list, default=default([2]),
                      help="comma list of distinct MoE layer indices, e.g. 2,3")
    make.add_argument("--experts", type=positive_int, default=default(CPU_EXPERTS),
                      help="experts per head (256 is the real size, 6 GB per layer)")
    make.add_argument("--shard-mb", type=positive_float, default=default(None), metavar="MB",
                      help="shard into files of at most this many MB of tensors, with an "
                      "index json; a tensor larger than that gets a file of its own "
                      "(default: one file)")
    make.add_argument("--prefix", default=default(""), choices=["", "transformer."],
                      help="key prefix, as some MAGI-2 exports have (default: none)")
    make.add_argument("--seed", type=seed_value, default=default(0), help="seed of the weights")
    make.add_argument("--overwrite", action="store_true", default=default(False),
                      help="replace a checkpoint the directory already holds (files mhmoe did "
                      "not write are replaced only where a new file takes their name, never "
                      "removed)")
    make.set_defaults(func=cmd_make_checkpoint)

    quantize = command(
        "quantize", "write the fp8 checkpoint of a bf16 checkpoint",
        "Write the fp8 checkpoint of a bf16 MAGI-2 format checkpoint: W_gate, W_up and\n"
        "W_down as float8_e4m3fn with one fp32 scale per output channel (NAME_scale),\n"
        "the router as it is, the scheme in the metadata. Reads one layer at a time,\n"
        "writes one file per layer under temporary names, renamed into place once all\n"
        "are written (the index last). SRC is never written to.")
    quantize.add_argument("src", help="bf16 checkpoint: directory, .safetensors or index .json")
    quantize.add_argument("dst", help="output directory (not SRC's directory, nor inside it)")
    quantize.add_argument("--layers", type=layer_list, default=default(None),
                          help="comma list of MoE layer indices, e.g. 2,3 (default: every MoE "
                          "layer of SRC)")
    quantize.add_argument("--config", default=default(None), metavar="NAME_OR_JSON",
                          help="the layer config of a checkpoint without mhmoe's metadata: a "
                          "preset name or a MultiHeadMoEConfig JSON file (default: SRC's "
                          "metadata, else magi2_preview)")
    quantize.add_argument("--overwrite", action="store_true", default=default(False),
                          help="replace a checkpoint DST already holds (as make-checkpoint "
                          "--overwrite)")
    quantize.set_defaults(func=cmd_quantize)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)  # argparse: usage errors exit 2, on stderr
    args.given = set(vars(build_parser(probe=True).parse_args(argv))) - \
        {"command", "func", "parser", "path", "src", "dst"}
    try:
        _check_flags(args, _launched_world())
        return args.func(args)
    except UsageError as e:
        args.parser.print_usage(sys.stderr)
        _error(args.command, str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _error(args.command, "interrupted")
        return 130
    except Exception as e:
        if _is_out_of_memory(e):
            _error(args.command, _memory_message(e))
            return EXIT_USAGE
        if isinstance(e, InputError):  # bad input: one clear line
            _error(args.command, str(e))
            return EXIT_USAGE
        traceback.print_exc()
        _error(args.command, f"internal error ({type(e).__name__}: {e}); please report it "
                             f"with the traceback above")
        return EXIT_INTERNAL


def _launched_world() -> int:
    """WORLD_SIZE under a launcher (RANK and WORLD_SIZE set), else 1; read here, not via
    mhmoe.launch, which imports torch."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 1
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise UsageError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") \
            from None
