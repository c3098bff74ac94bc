"""The `mhmoe` command: demo, bench, inspect, make-checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .config import MAGI2_PREVIEW, MultiHeadMoEConfig

console = Console()

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_EXPERTS = 8  # experts per head of the CPU demo: MAGI-2 shapes, 1/32 of the experts
REL_ERR_OK = 2e-2  # bf16 operands land near 1e-3..1e-2 (SPEC section 4)


def _device(name: str | None) -> torch.device:
    if name:
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("mhmoe: --device cuda asked for, but no CUDA device is available")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, with a message naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    """argparse type: a comma list of ints >= 1, e.g. "1024,4096"."""
    return [positive_int(part) for part in text.split(",") if part.strip()] or \
        [positive_int(text)]


def _demo_config(args, device: torch.device) -> MultiHeadMoEConfig:
    if args.full or (args.experts is None and device.type == "cuda"):
        experts = MAGI2_PREVIEW.num_experts
    else:
        experts = CPU_EXPERTS if args.experts is None else args.experts
    return MAGI2_PREVIEW.replace(num_experts=experts, top_k=min(MAGI2_PREVIEW.top_k, experts))


def _seeded_layer(config: MultiHeadMoEConfig, device: torch.device, seed: int, backend: str):
    from .layer import MultiHeadMoE

    # The weights come from a generator on the layer's device (fast for 6 GB on a GPU);
    # the same seed gives the same weights on the same kind of device.
    layer = MultiHeadMoE(config, device=device, backend=backend)
    layer.reset_parameters(generator=torch.Generator(device=device).manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # small biases, different for the two sources, like a trained router
        layer.router.expert_bias.copy_(torch.randn(layer.router.expert_bias.shape,
                                                   generator=gen) * 0.01)
        layer.router.expert_bias_ema.copy_(torch.randn(layer.router.expert_bias_ema.shape,
                                                       generator=gen) * 0.01)
    return layer


PATH_NAMES = {"torch": "torch: the PyTorch path (reference.py)",
              "triton": "triton: the fused expert kernel"}


def _path_name(layer, device: torch.device) -> str:
    from .experts import resolve_backend

    path = resolve_backend(layer.backend, device)
    return PATH_NAMES.get(path, path)


def check_slice(layer, x: torch.Tensor, y: torch.Tensor, tokens: int) -> float:
    """Relative error of y's first `tokens` tokens against the float64 formula."""
    from .reference import moe_reference_float64

    cfg = layer.config
    x_heads = x[:tokens].reshape(-1, cfg.num_heads, cfg.head_dim)
    with torch.no_grad():
        probs, indices = layer.route_heads(x_heads)
    ref = moe_reference_float64(x_heads, probs, indices, layer.W_gate, layer.W_up, layer.W_down)
    out = y[:tokens].reshape(ref.shape).to("cpu", torch.float64)
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def cmd_demo_parallel(args) -> int:
    """`mhmoe demo --nproc N`: the head-parallel layer on N processes against one process."""
    from .launch import spawn_parallel

    device = _device(args.device)
    if args.checkpoint:
        raise ValueError("--nproc runs seeded random weights; --checkpoint is not supported "
                         "with it")
    config = _demo_config(args, device)
    tokens = args.tokens if args.tokens is not None else (8192 if device.type == "cuda"
                                                          else 128)
    backend = "NCCL" if device.type == "cuda" else "gloo"
    with console.status(f"{args.nproc} {backend} processes, {tokens} tokens"):
        points = spawn_parallel(config, args.nproc, tokens, seed=args.seed, runs=args.runs,
                                use_cuda=device.type == "cuda")
    table = Table(title=f"mhmoe demo --nproc {args.nproc}: head-parallel layer over {backend}, "
                  f"{config.num_heads} heads x {config.num_experts} experts (times in ms)")
    for col in ("rank", "tokens", "heads", "dispatch", "experts", "undispatch", "layer",
                "a2a MB", "max |diff|"):
        table.add_column(col, justify="right")
    for p in points:
        table.add_row(str(p.rank), str(p.tokens), str(p.real_heads), f"{p.dispatch_ms:.2f}",
                      f"{p.experts_ms:.2f}", f"{p.undispatch_ms:.2f}", f"{p.layer_ms:.2f}",
                      f"{p.alltoall_bytes / 1e6:.2f}", f"{p.max_abs_diff:.2e}")
    console.print(table)
    worst = max(p.max_abs_diff / max(p.max_abs_ref, 1e-30) for p in points)
    ok = worst < REL_ERR_OK
    console.print(f"largest difference from the one-process layer: {worst:.2e} of its largest "
                  f"output ({'ok' if ok else 'FAILED'})")
    return 0 if ok else 1


def cmd_demo_train(args) -> int:
    """`mhmoe demo --train`: a student layer learns to imitate a seeded teacher layer.

    A smoke test of the backward: the gradients of every trainable parameter
    (router gate and the three expert weights) flow through routing and the
    expert path, and a few Adam steps make the loss visibly fall.
    """
    from .bench import device_name

    device = _device(args.device)
    experts = 4 if args.experts is None else args.experts
    # float32 parameters: Adam on bf16 weights drops small updates, which hides
    # whether the gradients are right.
    config = MAGI2_PREVIEW.replace(num_experts=experts, top_k=min(2, experts),
                                   expert_intermediate_size=256, params_dtype=torch.float32)
    teacher = _seeded_layer(config, device, args.seed, args.backend)
    student = _seeded_layer(config, device, args.seed + 100, args.backend)
    trainable = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trainable, lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens = 64 if args.tokens is None else args.tokens
    losses = []
    from rich.progress import Progress

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("training", total=args.steps)
        for _ in range(args.steps):
            x = torch.randn(tokens, config.hidden_size, generator=gen).to(device)
            with torch.no_grad():
                target = teacher(x)
            loss = (student(x) - target).square().mean() / target.square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            progress.update(task, advance=1, description=f"loss {losses[-1]:.4f}")
    console.print(f"mhmoe demo --train on {device_name(device)}, path "
                  f"{_path_name(student, device)}: a student layer imitates a teacher "
                  f"({config.num_heads} heads x {experts} experts, top-{config.top_k}, "
                  f"{tokens} tokens a step, Adam lr {args.lr})")
    table = Table(title="training loss")
    table.add_column("step", justify="right")
    table.add_column("relative MSE", justify="right")
    marks = sorted({0, len(losses) - 1, *range(0, len(losses), max(1, len(losses) // 8))})
    for step in marks:
        table.add_row(str(step + 1), f"{losses[step]:.4f}")
    console.print(table)
    fell = losses[-1] < 0.8 * losses[0]
    console.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"({100 * (1 - losses[-1] / losses[0]):.0f}% lower): "
                  f"{'ok' if fell else 'FAILED: it did not fall by 20%'}")
    return 0 if fell else 1


def cmd_demo(args) -> int:
    from .bench import device_name, expert_tflops, matmul_peak_tflops, time_fn

    if args.train:
        return cmd_demo_train(args)
    if args.nproc:
        return cmd_demo_parallel(args)
    device = _device(args.device)
    if args.checkpoint:
        from .checkpoint import CheckpointReader, load_layer

        with CheckpointReader(args.checkpoint) as reader:
            config = reader.config or MAGI2_PREVIEW
            with console.status(f"loading layer {args.layer} from {args.checkpoint}"):
                layer = load_layer(reader, args.layer, config, device=device,
                                   backend=args.backend)
            source = f"{args.checkpoint} layer {args.layer}"
    else:
        config = _demo_config(args, device)
        with console.status("building a seeded random layer"):
            layer = _seeded_layer(config, device, args.seed, args.backend)
        source = f"seeded random weights (seed {args.seed})"
    if args.deterministic:
        layer.config = layer.config.replace(deterministic=True)
    config = layer.config
    tokens = args.tokens if args.tokens is not None else (8192 if device.type == "cuda"
                                                          else 256)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(device, DTYPES[args.dtype])

    with torch.no_grad():
        with console.status(f"forward of {tokens} tokens on {device_name(device)}"):
            y = layer(x)
            timing = time_fn(lambda: layer(x), device=device, warmup=1 if device.type == "cuda"
                             else 0, runs=args.runs)
        with console.status("checking against the float64 reference"):
            err = check_slice(layer, x, y, min(args.check_tokens, tokens))
    finite = bool(torch.isfinite(y).all())
    peak = matmul_peak_tflops(device) if device.type == "cuda" else None
    tflops = expert_tflops(config, tokens, timing.median_ms)

    table = Table(title="mhmoe demo: one multi-head MoE layer forward", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("device", device_name(device))
    table.add_row("path", _path_name(layer, device) + (" (deterministic)" if layer.deterministic
                                                         else ""))
    table.add_row("weights", source)
    table.add_row("layer", f"hidden {config.hidden_size}, {config.num_heads} heads x "
                  f"{config.num_experts} experts, top-{config.top_k}, D {config.head_dim}, "
                  f"I {config.expert_intermediate_size}, {config.params_dtype}")
    table.add_row("tokens", f"{tokens} ({args.dtype})")
    table.add_row("time", f"{timing.median_ms:.2f} ms (median of {timing.runs})")
    table.add_row("throughput", f"{tokens / timing.median_ms * 1e3:,.0f} tokens/s, "
                  f"{tflops:.3f} TFLOP/s" + (f" ({100 * tflops / peak:.1f}% of the "
                                             f"{peak:.0f} TFLOP/s bf16 matmul)" if peak else ""))
    verdict = "ok" if finite and err < REL_ERR_OK else "FAILED"
    table.add_row("rel. error", f"{err:.2e} on {min(args.check_tokens, tokens)} tokens vs float64 "
                  f"({verdict}; bf16 lands near 1e-3..1e-2)")
    console.print(table)
    return 0 if verdict == "ok" else 1


def _bench_point(layer, path: str, tokens: int, device: torch.device, runs: int):
    """Route + layout, experts and whole-layer times of one token count, and a check."""
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
    err = check_slice(layer, x, y, min(16, tokens))
    return BenchRow(path, tokens, t_route.median_ms, t_exp.median_ms, t_layer.median_ms,
                    expert_tflops(config, tokens, t_exp.median_ms), err)


def cmd_bench(args) -> int:
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
        paths = args.paths.split(",")
        missing = [p for p in paths if p not in available_backends(device)]
        if missing:
            raise ValueError(f"--paths {missing} cannot run on {device}; available: "
                             f"{available_backends(device)}")
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
    from rich.progress import Progress

    with Progress(console=console) as progress, torch.no_grad():
        task = progress.add_task("bench", total=len(sweep) * len(paths))
        for path in paths:
            layer = _seeded_layer(config, device, args.seed, path)
            for tokens in sweep:
                progress.update(task, description=f"{path}: {tokens} tokens")
                rows.append(_bench_point(layer, path, tokens, device, args.runs))
                progress.advance(task)

    table = Table(title=f"mhmoe bench on {env['device']}")
    for col in ("path", "tokens", "route+CSR ms", "experts ms", "layer ms", "TFLOP/s",
                "rel. err"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.path, str(r.tokens), f"{r.route_ms:.3f}", f"{r.experts_ms:.3f}",
                      f"{r.layer_ms:.3f}", f"{r.tflops:.3f}", f"{r.rel_err:.1e}")
    console.print(table)
    if peaks:
        console.print(f"measured peaks: bf16 8192^3 matmul {peaks['matmul_tflops']:.0f} TFLOP/s, "
                      f"device copy {peaks['copy_tbs']:.2f} TB/s")
    out = Path(args.out)
    write_results(out, config=config, env=env, rows=rows, peaks=peaks)
    plot = out.with_suffix(".png")
    try:
        plot_results(plot, rows=rows, peaks=peaks,
                     title=f"{env['device']}: H={config.num_heads}, E={config.num_experts}, "
                     f"K={config.top_k}, D={config.head_dim}, "
                     f"I={config.expert_intermediate_size}")
        console.print(f"wrote {out} and {plot}")
    except ImportError:
        console.print(f"wrote {out}; no plot: matplotlib is not installed "
                      f"(pip install 'mhmoe[plot]')")
    bad = [r for r in rows if not r.rel_err < REL_ERR_OK]
    return 1 if bad else 0


def cmd_inspect(args) -> int:
    from .checkpoint import inspect_checkpoint

    report = inspect_checkpoint(args.path)
    if report.config is not None:
        console.print(f"config (from metadata): {report.config}")
    table = Table(title=f"MoE layers of {args.path}")
    for col in ("layer", "tensor", "shape", "dtype", "MB", "file"):
        table.add_column(col, justify="right" if col in ("layer", "MB") else "left")
    for row in report.layers:
        table.add_row(str(row.layer), row.name, "x".join(map(str, row.shape)),
                      str(row.dtype).removeprefix("torch."), f"{row.bytes / 1e6:,.1f}",
                      Path(row.file).name)
    console.print(table)
    layers = sorted({row.layer for row in report.layers})
    console.print(f"{len(layers)} MoE layers, {report.total_bytes / 1e9:.3f} GB in "
                  f"{len(report.files)} file(s)")
    if report.problems:
        for problem in report.problems:
            console.print(f"[red]problem:[/red] {problem}")
        return 1
    console.print("[green]no problems found[/green]")
    return 0


def cmd_make_checkpoint(args) -> int:
    from .checkpoint import save_checkpoint

    layers = [int(v) for v in args.layers.split(",") if v.strip()]
    if not layers or any(v < 0 for v in layers):
        raise SystemExit(f"mhmoe: --layers must be a comma list of layer indices, got "
                         f"{args.layers!r}")
    config = MAGI2_PREVIEW.replace(num_experts=args.experts,
                                   top_k=min(MAGI2_PREVIEW.top_k, args.experts))
    modules = {}
    for i, index in enumerate(layers):
        with console.status(f"making layer {index} ({config.expert_weight_bytes() / 1e9:.2f} GB)"):
            modules[index] = _seeded_layer(config, torch.device("cpu"), args.seed + i, "torch")
    shard = int(args.shard_mb * 1e6) if args.shard_mb else None
    files = save_checkpoint(args.path, modules, config=config, max_shard_bytes=shard,
                            prefix=args.prefix, progress=True)
    console.print(f"wrote {len(files)} file(s) to {args.path}: MoE layers {layers}, "
                  f"{config.num_heads} heads x {config.num_experts} experts")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_layer_options(p):
        p.add_argument("--experts", type=positive_int, default=None,
                       help=f"experts per head (default: 256 on a GPU, {CPU_EXPERTS} on the CPU)")
        p.add_argument("--full", action="store_true",
                       help="the full MAGI-2 layer (256 experts per head, 6 GB) even on the CPU")
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--runs", type=positive_int, default=3,
                       help="timed runs (median reported)")

    demo = sub.add_parser("demo", help="run one layer forward, time it, check it against float64")
    add_layer_options(demo)
    demo.add_argument("--tokens", type=positive_int, default=None,
                      help="tokens (default 256 on the CPU, 8192 on a GPU)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype")
    demo.add_argument("--checkpoint", default=None, help="a MAGI-2 format checkpoint")
    demo.add_argument("--layer", type=int, default=2, help="MoE layer index in the checkpoint")
    demo.add_argument("--backend", default="auto", help="auto, torch or triton")
    demo.add_argument("--deterministic", action="store_true")
    demo.add_argument("--train", action="store_true",
                      help="a few optimizer steps on a toy regression (student imitates a "
                      "teacher layer); the loss must fall")
    demo.add_argument("--steps", type=positive_int, default=20,
                      help="optimizer steps of --train")
    demo.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate of --train")
    demo.add_argument("--nproc", type=positive_int, default=None,
                      help="run head-parallel on N processes (gloo on the CPU, NCCL on N GPUs) "
                      "and check against one process")
    demo.add_argument("--check-tokens", type=positive_int, default=16,
                      help="tokens checked against the float64 reference")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="sweep token counts; write JSON and a PNG plot")
    add_layer_options(bench)
    bench.add_argument("--tokens", type=positive_int_list, default=None,
                       help="comma list of token counts")
    bench.add_argument("--out", default="mhmoe-bench.json", help="JSON path (PNG beside it)")
    bench.add_argument("--paths", default=None,
                       help="comma list of expert paths (torch, triton); default: both on a "
                       "GPU, torch on the CPU")
    bench.set_defaults(func=cmd_bench)

    inspect = sub.add_parser("inspect", help="list a checkpoint's MoE layers, report problems")
    inspect.add_argument("path")
    inspect.set_defaults(func=cmd_inspect)

    make = sub.add_parser("make-checkpoint",
                          help="write a synthetic checkpoint in the MAGI-2 format")
    make.add_argument("path", help="output directory")
    make.add_argument("--layers", default="2", help="comma list of MoE layer indices")
    make.add_argument("--experts", type=positive_int, default=CPU_EXPERTS,
                      help="experts per head "
                      f"(default {CPU_EXPERTS}; 256 is the real size, 6 GB per layer)")
    make.add_argument("--shard-mb", type=float, default=None,
                      help="shard into files of at most this many MB (with an index json)")
    make.add_argument("--prefix", default="", choices=["", "transformer."],
                      help="key prefix, as some MAGI-2 exports have")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=cmd_make_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:  # bad input: one clear line, not a traceback
        console.print(f"[red]mhmoe {args.command}: {err}[/red]")
        return 2
