"""Running a head-parallel layer on N processes: the `mhmoe demo --nproc N` job and
the multi-GPU benchmark share this code.

One process per rank: gloo across CPU processes, NCCL across GPUs. Every rank
builds the same seeded full layer, keeps its own heads (`shard_state_dict`),
runs its share of tokens through dispatch -> experts -> undispatch, and checks
its rows against the one-process layer on the same tokens (routing is per
token, so the one-process result for a rank's tokens needs no other rank).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .config import MultiHeadMoEConfig


@dataclass
class ParallelPoint:
    """One rank's measurements (times are medians over the timed runs, in ms)."""

    rank: int
    world: int
    backend: str
    tokens: int            # this rank's tokens
    total_tokens: int      # all ranks' tokens
    real_heads: int
    dispatch_ms: float
    experts_ms: float
    undispatch_ms: float
    layer_ms: float        # the module forward, end to end
    alltoall_bytes: int    # bytes this rank sends in one dispatch (and one undispatch)
    max_abs_diff: float    # against the one-process layer
    max_abs_ref: float


def split_tokens(total: int, world: int) -> list[int]:
    """Uneven per-rank token counts summing to `total` (rank 0 gets the most, the
    last rank of a world of 3 or more gets none), to exercise ragged all-to-alls."""
    if world == 1:
        return [total]
    weights = list(range(world, 0, -1))
    if world >= 3:
        weights[-1] = 0
    counts = [total * w // sum(weights) for w in weights]
    counts[0] += total - sum(counts)
    return counts


def _sync(device: torch.device, group) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group)


def _median_ms(fn, device, group, runs: int) -> float:
    times = []
    for _ in range(runs):
        _sync(device, group)
        t0 = time.perf_counter()
        fn()
        _sync(device, group)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def measure_rank(config: MultiHeadMoEConfig, total_tokens: int, seed: int, runs: int,
                 device: torch.device, group=None) -> ParallelPoint:
    """Run and time the head-parallel layer on this rank; check it against one process."""
    from .layer import MultiHeadMoE
    from .parallel import HeadPartition, dispatch, shard_state_dict, undispatch

    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    counts = split_tokens(total_tokens, world)
    gen = torch.Generator().manual_seed(seed)
    full = MultiHeadMoE(config, device="cpu")
    full.reset_parameters(generator=gen)
    partition = HeadPartition(config.num_heads, world, rank)
    layer = MultiHeadMoE(config, group=group, device="meta")
    layer.load_state_dict({k: v.to(device) for k, v in
                           shard_state_dict(full.state_dict(), partition,
                                            config.num_experts).items()}, assign=True)
    x_all = torch.randn(total_tokens, config.hidden_size, generator=gen).to(config.params_dtype)
    begin = sum(counts[:rank])
    x = x_all[begin:begin + counts[rank]].to(device)
    with torch.no_grad():
        y = layer(x, token_counts=counts)
        full = full.to(device)
        y_ref = full(x)
        del full
        local = dispatch(x, partition, counts, group)
        y_local = layer.forward_heads(local)
        t_dispatch = _median_ms(lambda: dispatch(x, partition, counts, group), device, group, runs)
        t_experts = _median_ms(lambda: layer.forward_heads(local), device, group, runs)
        t_undispatch = _median_ms(lambda: undispatch(y_local, partition, counts, group), device,
                                  group, runs)
        t_layer = _median_ms(lambda: layer(x, token_counts=counts), device, group, runs)
    diff = (y.float() - y_ref.float()).abs().max().item() if y.numel() else 0.0
    ref = y_ref.float().abs().max().item() if y.numel() else 0.0
    sent = counts[rank] * partition.padded_heads * config.head_dim * x.element_size()
    return ParallelPoint(rank, world, dist.get_backend(group), counts[rank], total_tokens,
                         partition.real_heads, t_dispatch, t_experts, t_undispatch, t_layer,
                         sent, diff, ref)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, config_json: str, total_tokens: int, seed: int,
            runs: int, use_cuda: bool, out_dir: str) -> None:
    # Loopback only: these processes talk to each other on this machine.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if use_cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                            **({"device_id": device} if use_cuda else {}))
    try:
        point = measure_rank(MultiHeadMoEConfig.from_json(config_json), total_tokens, seed, runs,
                             device)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(asdict(point)))


def spawn_parallel(config: MultiHeadMoEConfig, nproc: int, total_tokens: int, *, seed: int = 0,
                   runs: int = 3, use_cuda: bool = False) -> list[ParallelPoint]:
    """Start `nproc` processes (NCCL on GPUs 0..nproc-1, or gloo on the CPU) and
    return every rank's `ParallelPoint`."""
    import torch.multiprocessing as mp

    if use_cuda and torch.cuda.device_count() < nproc:
        raise ValueError(f"--nproc {nproc} needs {nproc} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(nproc, _free_port(), config.to_json(), total_tokens, seed, runs,
                                use_cuda, out_dir), nprocs=nproc, join=True)
        return [ParallelPoint(**json.loads(Path(out_dir, f"rank{r}.json").read_text()))
                for r in range(nproc)]
