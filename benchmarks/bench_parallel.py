"""Head-parallel layer on several GPUs (NCCL): times by part, checks, bandwidth, loading.

One world size per torchrun (benchmarks/run_parallel.sh loops over them):

    torchrun --standalone --nproc-per-node 8 benchmarks/bench_parallel.py \
        --tokens-per-rank 4096,32768 --out OUT/parallel_w8.json [--checkpoint CKPT]
    python3 benchmarks/bench_parallel.py --summarize OUT      # the scaling table

Sequence-parallel input, S tokens on every rank (`--tokens-per-rank`). For each S, per
rank (medians of `--runs` timed runs, every rank synchronised around each run):

- forward: dispatch, experts (`forward_heads`), undispatch, the whole layer;
- forward+backward of each of the same parts (`torch.autograd.grad` of its inputs and,
  for the experts and the layer, the trainable parameters);
- the bytes one dispatch sends and the bandwidth reached, against a bare NCCL
  all_to_all_single of the same splits timed alone;
- checks against one process holding every head, on the same tokens (every rank's): the
  forward at S tokens a rank (default mode: largest difference over the largest
  output; deterministic mode: bitwise), and the gradients (dx of this rank's tokens,
  this rank's rows of each trainable parameter's gradient; relative error, and bitwise
  in deterministic mode) at `--check-tokens` tokens a rank, in both modes.

`--checkpoint PATH` adds loading: `load_layers(PATH, group=...)` on every rank, its bytes
read and time (a checkpoint written just before sits in the page cache: the time is then
that of reading memory, not the disk). Rank 0 prints the tables, writes `--out` and
appends rows to benchmarks/results.jsonl (unless --no-record). `--cpu` runs it over gloo
on CPU processes: a dry run of the script (tests/test_parallel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mhmoe import MAGI2_PREVIEW, MultiHeadMoE
from mhmoe.bench import append_results, environment, rel_err, result_row
from mhmoe.parallel import HeadPartition, dispatch, shard_state_dict, undispatch

PARTS = ("dispatch", "experts", "undispatch", "layer")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, runs: int, warmup: int = 2) -> float:
    """Median wall time of fn over `runs`, every rank entering each run together."""
    times = []
    for i in range(warmup + runs):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def seeded_layer(config, seed: int, device: torch.device) -> MultiHeadMoE:
    """The one-process layer (every head) on `device`, the same on every rank: drawn by
    a generator on the device (fast for 6 GB; the same on every GPU), built on the meta
    device first so that it is drawn once."""
    full = MultiHeadMoE(config, device="meta")
    full.to_empty(device=device)
    full.reset_parameters(generator=torch.Generator(device=device).manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        full.router.expert_bias_ema.copy_(
            torch.randn(full.router.expert_bias_ema.shape, generator=gen) * 0.01)
    return full


def rank_layer(full: MultiHeadMoE, config, partition: HeadPartition,
               device: torch.device) -> MultiHeadMoE:
    """This rank's shard of `full` on `device`, head-parallel over the default group."""
    layer = MultiHeadMoE(config, group=dist.group.WORLD, device="meta")
    state = shard_state_dict(full.state_dict(), partition, config.num_experts)
    layer.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=True)
    return layer


def inputs(seed: int, tokens: int, width: int, device: torch.device, dtype) -> torch.Tensor:
    """Seeded inputs drawn on `device` (the same on every rank)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tokens, width, device=device, generator=gen).to(dtype)


def time_parts(layer: MultiHeadMoE, x: torch.Tensor, counts: list[int], device, runs: int):
    """Forward and forward+backward medians of each part (`PARTS`), in ms."""
    partition, group = layer.partition, dist.group.WORLD
    params = [p for p in layer.parameters() if p.requires_grad]
    with torch.no_grad():
        local = dispatch(x, partition, counts, group)
        y_local = layer.forward_heads(local)
        y = undispatch(y_local, partition, counts, group)
    g_local, g_y_local, dy = (torch.randn_like(t) for t in (local, y_local, y))
    forward = {
        "dispatch": lambda: dispatch(x, partition, counts, group),
        "experts": lambda: layer.forward_heads(local),
        "undispatch": lambda: undispatch(y_local, partition, counts, group),
        "layer": lambda: layer(x, token_counts=counts),
    }
    xg, local_g, y_local_g = (t.detach().clone().requires_grad_(True)
                              for t in (x, local, y_local))
    backward = {
        "dispatch": lambda: torch.autograd.grad(dispatch(xg, partition, counts, group), xg,
                                                g_local),
        "experts": lambda: torch.autograd.grad(layer.forward_heads(local_g),
                                               [local_g, *params], g_y_local),
        "undispatch": lambda: torch.autograd.grad(
            undispatch(y_local_g, partition, counts, group), y_local_g, dy),
        "layer": lambda: torch.autograd.grad(layer(xg, token_counts=counts), [xg, *params],
                                             dy),
    }
    times = {}
    with torch.no_grad():
        for part in PARTS:
            times[f"{part}_ms"] = median_ms(forward[part], device, runs)
    for part in PARTS:
        times[f"{part}_fwd_bwd_ms"] = median_ms(backward[part], device, runs)
    return times


def plain_alltoall_ms(counts: list[int], width: int, device: torch.device, runs: int,
                      dtype) -> float:
    """A bare all_to_all_single with the splits of one dispatch: rank r sends counts[r]
    rows of `width` values to every rank and gets counts[j] rows from rank j."""
    world, rank = dist.get_world_size(), dist.get_rank()
    send = torch.randn(world * counts[rank], width, device=device).to(dtype)
    recv = torch.empty(sum(counts), width, device=device, dtype=dtype)
    return median_ms(lambda: dist.all_to_all_single(recv, send, counts, [counts[rank]] * world),
                     device, runs)


def forward_check(full: MultiHeadMoE, layer: MultiHeadMoE, x_all: torch.Tensor,
                  counts: list[int], deterministic: bool) -> dict:
    """This rank's outputs against the one-process layer on all ranks' tokens (the same
    tokens, so the kernels see the same routes per expert and pick the same tiles)."""
    partition = layer.partition
    begin = sum(counts[:partition.rank])
    mine = slice(begin, begin + counts[partition.rank])
    for m in (full, layer):
        m.config = m.config.replace(deterministic=deterministic)
    with torch.no_grad():
        y = layer(x_all[mine], token_counts=counts)
        y_ref = full(x_all)[mine]
    if deterministic:
        return {"det_y_bitwise": bool(torch.equal(y, y_ref))}
    diff = (y.float() - y_ref.float()).abs().max().item() if y.numel() else 0.0
    ref = y_ref.float().abs().max().item() if y.numel() else 0.0
    return {"max_abs_diff": diff, "max_abs_ref": ref}


def gradient_check(full: MultiHeadMoE, layer: MultiHeadMoE, x_all: torch.Tensor,
                   dy_all: torch.Tensor, counts: list[int], deterministic: bool) -> dict:
    """dx of this rank's tokens and this rank's rows of every trainable parameter's
    gradient against the one-process layer on all ranks' tokens: relative errors, and
    in deterministic mode whether each is bitwise equal."""
    partition = layer.partition
    for m in (full, layer):
        m.config = m.config.replace(deterministic=deterministic)
    begin = sum(counts[:partition.rank])
    mine = slice(begin, begin + counts[partition.rank])
    x_ref = x_all.clone().requires_grad_(True)
    ref_params = dict(full.named_parameters())
    names = [n for n, p in layer.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(full(x_ref), [x_ref, *(ref_params[n] for n in names)], dy_all)
    want = {"x": grads[0][mine]} | shard_state_dict(dict(zip(names, grads[1:], strict=True)),
                                                    partition, layer.config.num_experts)
    x = x_all[mine].clone().requires_grad_(True)
    params = dict(layer.named_parameters())
    got = torch.autograd.grad(layer(x, token_counts=counts), [x, *(params[n] for n in names)],
                              dy_all[mine])
    tag = "det_" if deterministic else ""
    out = {}
    for name, g in zip(["x", *names], got, strict=True):
        out[f"{tag}d{name}_rel_err"] = rel_err(g, want[name])
        if deterministic:
            out[f"{tag}d{name}_bitwise"] = bool(torch.equal(g, want[name].to(g.dtype)))
    return out


def measure_loading(path: str, device: torch.device) -> dict:
    """Every MoE layer of the checkpoint at `path` for this rank: bytes read, time."""
    from mhmoe.checkpoint import load_layers

    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    modules, nbytes = load_layers(path, group=dist.group.WORLD, device=device)
    _sync(device)
    seconds = time.perf_counter() - t0
    return {"load_layers": sorted(modules), "load_bytes": nbytes, "load_s": seconds,
            "load_GBps": nbytes / seconds / 1e9 if seconds > 0 else None}


def measure(full: MultiHeadMoE, layer: MultiHeadMoE, S: int, args,
            device: torch.device) -> dict:
    """Every number of one S on this rank: `full` is the one-process layer, `layer` this
    rank's shard of it."""
    for m in (full, layer):  # the checks of the previous S left deterministic mode on
        m.config = m.config.replace(deterministic=False)
    config, partition = layer.config, layer.partition
    world, rank = partition.world_size, partition.rank
    counts = [S] * world
    width = config.hidden_size
    x_all = inputs(args.seed + 1000, S * world, width, device, config.params_dtype)
    x = x_all[rank * S:(rank + 1) * S]
    row = {"rank": rank, "world": world, "backend": dist.get_backend(), "tokens": S,
           "real_heads": partition.real_heads, "local_heads": partition.local_heads,
           "padded_heads": partition.padded_heads}
    row |= time_parts(layer, x, counts, device, args.runs)
    row["alltoall_bytes"] = S * partition.padded_heads * config.head_dim * x.element_size()
    row["plain_alltoall_ms"] = plain_alltoall_ms(counts, partition.local_heads * config.head_dim,
                                                 device, args.runs, config.params_dtype)
    row["dispatch_GBps"] = row["alltoall_bytes"] / row["dispatch_ms"] / 1e6
    row["plain_GBps"] = row["alltoall_bytes"] / row["plain_alltoall_ms"] / 1e6
    for det in (False, True):
        row |= forward_check(full, layer, x_all, counts, det)
    del x_all
    C = min(args.check_tokens, S)
    x_check = inputs(args.seed + 2000, C * world, width, device, config.params_dtype)
    dy_check = inputs(args.seed + 3000, C * world, width, device, config.params_dtype)
    for det in (False, True):
        row |= gradient_check(full, layer, x_check, dy_check, [C] * world, det)
    row["check_tokens"] = C
    return row


def print_tables(rows: list[dict]) -> None:
    print(f"{'S':>6} {'rank':>4} {'heads':>5} " + " ".join(f"{p[:8]:>8}" for p in PARTS)
          + " | " + " ".join(f"{p[:8]:>8}" for p in PARTS)
          + f" | {'a2a MB':>7} {'GB/s':>6} {'bare':>6} {'y diff':>8} {'det y':>5} {'grad err':>8}"
          f" {'det grads':>9}")
    print(f"{'':>17}{'forward ms':^36}| {'forward+backward ms':^35}|")
    for r in rows:
        grad_err = max(v for k, v in r.items() if k.endswith("_rel_err") and
                       not k.startswith("det_"))
        print(f"{r['tokens']:>6} {r['rank']:>4} {r['real_heads']:>5} "
              + " ".join(f"{r[f'{p}_ms']:>8.3f}" for p in PARTS) + " | "
              + " ".join(f"{r[f'{p}_fwd_bwd_ms']:>8.3f}" for p in PARTS)
              + f" | {r['alltoall_bytes'] / 1e6:>7.2f} {r['dispatch_GBps']:>6.1f} "
              f"{r['plain_GBps']:>6.1f} {r['max_abs_diff'] / max(r['max_abs_ref'], 1e-30):>8.1e}"
              f" {'yes' if r['det_y_bitwise'] else 'NO':>5} {grad_err:>8.1e}"
              f" {'bitwise' if det_grads_bitwise(r) else 'NO':>9}")
        if "load_bytes" in r:
            print(f"{'':>12}loading layers {r['load_layers']}: {r['load_bytes'] / 1e9:.3f} GB "
                  f"in {r['load_s']:.2f} s ({r['load_GBps']:.2f} GB/s)")


def checks_pass(rows: list[dict]) -> bool:
    """The gloo tests' bounds, for bf16: outputs within 1e-2 of the largest output,
    gradients within 1e-2 relative; in deterministic mode the outputs and every gradient
    bitwise."""
    for r in rows:
        if r["max_abs_diff"] > 1e-2 * max(r["max_abs_ref"], 1e-6):
            return False
        if any(v > 1e-2 for k, v in r.items() if k.endswith("_rel_err")):
            return False
        if not all(v for k, v in r.items() if k.endswith("_bitwise")):
            return False
    return True


def det_grads_bitwise(row: dict) -> bool:
    return all(v for k, v in row.items() if k.startswith("det_d") and k.endswith("_bitwise"))


def summarize(directory: Path) -> int:
    """The scaling table from the JSON files of several world sizes: the slowest rank's
    times at world W against world 1 at the same tokens per rank."""
    runs = {}
    for file in sorted(directory.glob("parallel_w*.json")):
        data = json.loads(file.read_text())
        runs[data["world"]] = data["rows"]
    if 1 not in runs:
        print(f"{directory}: no world-1 run (parallel_w1.json) to compare with")
        return 2
    print(f"{'W':>3} {'S':>6} {'layer ms':>9} {'vs W=1':>7} {'fwd+bwd ms':>10} {'vs W=1':>7} "
          f"{'(disp+undisp)/layer':>19}")
    for world in sorted(runs):
        for S in sorted({r["tokens"] for r in runs[world]}):
            rows = [r for r in runs[world] if r["tokens"] == S]
            base = [r for r in runs[1] if r["tokens"] == S]
            layer = max(r["layer_ms"] for r in rows)
            fb = max(r["layer_fwd_bwd_ms"] for r in rows)
            comm = max((r["dispatch_ms"] + r["undispatch_ms"]) / r["layer_ms"] for r in rows)
            vs = f"{layer / base[0]['layer_ms']:>7.2f}" if base else f"{'-':>7}"
            vs_fb = f"{fb / base[0]['layer_fwd_bwd_ms']:>7.2f}" if base else f"{'-':>7}"
            print(f"{world:>3} {S:>6} {layer:>9.3f} {vs} {fb:>10.3f} {vs_fb} {comm:>19.1%}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-rank", default="4096,32768",
                        help="comma-separated S: tokens on every rank")
    parser.add_argument("--experts", type=int, default=256, help="experts per head")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--check-tokens", type=int, default=1024,
                        help="tokens a rank of the gradient check (at most S)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None,
                        help="also time load_layers of this checkpoint on every rank")
    parser.add_argument("--out", default=None, help="JSON path (written by rank 0)")
    parser.add_argument("--no-record", action="store_true",
                        help="do not append rows to benchmarks/results.jsonl")
    parser.add_argument("--cpu", action="store_true",
                        help="gloo on CPU processes, float32 (a dry run without GPUs)")
    parser.add_argument("--summarize", default=None, metavar="DIR",
                        help="print the scaling table of DIR/parallel_w*.json and exit")
    args = parser.parse_args()
    if args.summarize:
        return summarize(Path(args.summarize))
    if os.environ.get("MAGI2_DETERMINISTIC"):
        parser.error("unset MAGI2_DETERMINISTIC: it would override the modes this benchmark "
                     "sets itself (default and deterministic)")
    sizes = [int(s) for s in args.tokens_per_rank.split(",")]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # fail before the runs

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    config = MAGI2_PREVIEW.replace(num_experts=args.experts,
                                   top_k=min(MAGI2_PREVIEW.top_k, args.experts))
    if args.cpu:  # the PyTorch path on the CPU; bf16 there would only measure rounding
        config = config.replace(params_dtype=torch.float32)
    # Built once for every S: the full layer is 6 GB at MAGI-2's size.
    full = seeded_layer(config, args.seed, device)
    layer = rank_layer(full, config, HeadPartition(config.num_heads, dist.get_world_size(),
                                                   dist.get_rank()), device)
    rows = []
    for S in sizes:
        row = measure(full, layer, S, args, device)
        if args.checkpoint and S == sizes[0]:
            row |= measure_loading(args.checkpoint, device)
        gathered: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, row)
        rows += gathered
    ok = checks_pass(rows)
    if dist.get_rank() == 0:
        print_tables(rows)
        print("checks against one process: " + ("ok" if ok else "FAILED"))
        env = environment(device)
        if args.out:
            Path(args.out).write_text(json.dumps(
                {"environment": env, "config": json.loads(config.to_json()),
                 "world": dist.get_world_size(), "checks_ok": ok, "rows": rows},
                indent=2) + "\n")
        if not args.no_record and not args.cpu:
            command = (f"torchrun --standalone --nproc-per-node {dist.get_world_size()} "
                       f"benchmarks/bench_parallel.py --tokens-per-rank {args.tokens_per_rank}")
            results = [result_row(f"parallel_{part}{suffix}", f"w{r['world']}_rank{r['rank']}",
                                  r["tokens"], r[f"{part}{suffix}_ms"], env=env,
                                  command=command, real_heads=r["real_heads"],
                                  checks_ok=ok,
                                  **({"alltoall_bytes": r["alltoall_bytes"],
                                      "plain_alltoall_ms": r["plain_alltoall_ms"]}
                                     if part == "dispatch" and not suffix else {}))
                       for r in rows for part in PARTS for suffix in ("", "_fwd_bwd")]
            results += [result_row("parallel_load_layers", f"w{r['world']}_rank{r['rank']}",
                                   0, r["load_s"] * 1e3, env=env, command=command
                                   + f" --checkpoint {args.checkpoint}",
                                   load_bytes=r["load_bytes"], layers=r["load_layers"],
                                   checks_ok=ok)
                        for r in rows if "load_bytes" in r]
            print(f"rows appended to {append_results(results)}")
    # Every rank leaves together: a gloo rank that tore its group down while rank 0 was
    # still writing aborted once at exit ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown. With the group already destroyed behind a
    # barrier, a gloo rank still aborted now and then at exit ("terminate called without
    # an active exception", SIGABRT, under the CPU dry run in the test suite): a C++
    # thread of torch.distributed destroyed while still joinable during finalization.
    # Everything this script writes is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
