"""Running a head-parallel layer on N processes: `mhmoe demo --nproc N`, `torchrun ...
-m mhmoe demo` and the multi-GPU benchmark share this code.

One process per rank: gloo across CPU processes, NCCL across GPUs. Every rank
builds the same seeded full layer, keeps its own heads (`shard_state_dict`),
runs its share of tokens through dispatch -> experts -> undispatch, and checks
its rows against the one-process layer on the same tokens (routing is per
token, so the one-process result for a rank's tokens needs no other rank).

Processes are started by torch's own launcher (`launch_local`, what `torchrun
--standalone` runs); each joins its group with `join_launched_group`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

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


def gather_points(point: ParallelPoint, group=None) -> list[ParallelPoint]:
    """Every rank's `ParallelPoint`, on every rank, in rank order."""
    points: list[ParallelPoint | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(points, point, group=group)
    return [p for p in points if p is not None]


def join_launched_group(device_type: str) -> torch.device:
    """Join the process group of a launcher (torchrun, `launch_local`) from its
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK): NCCL with
    this process on GPU LOCAL_RANK for device_type "cuda", else gloo on the CPU.
    Returns this rank's device. The caller ends with `dist.destroy_process_group()`.
    """
    # torch._dynamo keeps a reference to the default process group if it is first
    # imported after the group exists (torch.library ops import it on their first
    # call), so destroy_process_group cannot free the group: gloo's worker threads
    # then outlive it and release their last work while Python shuts down, which
    # aborts the process ("terminate called without an active exception") now and
    # then. Imported first, it holds no such reference.
    import torch._dynamo

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} needs GPU {local_rank}, this machine has "
                             f"{torch.cuda.device_count()}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # the launcher's user did not choose
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world)
                                  if hasattr(os, "sched_getaffinity") else 1)
        dist.init_process_group("gloo")
    return device


def launch_local(nproc: int, args: Sequence[str], *, cpu_threads: int | None = None) -> int:
    """Run `python -u ARGS` as `nproc` processes of one group on this machine, with
    torch's launcher (`torch.distributed.launcher.api.elastic_launch`), as `torchrun
    --standalone --nproc-per-node NPROC -m ...` does: a c10d rendezvous on a free local
    port, RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set for every
    process, stdout and stderr those of this process, no restarts. When one process
    fails the launcher stops the others.

    cpu_threads: OMP_NUM_THREADS for each process, unless the caller's environment
        sets it.
    Returns the exit status of the run: 0 if every process exited 0, else that of the
    process that failed first (a negative number for a signal).

    A signal to this process stops the processes first (the launcher does that), then:
    SIGINT (Ctrl-C) raises KeyboardInterrupt, as it would without the launcher; SIGTERM,
    SIGHUP or SIGQUIT raises SystemExit(128 + the signal's number), a shell's status of
    a process a signal ended.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0,
                          logs_specs=DefaultLogsSpecs(log_dir=os.devnull))
    saved_env = os.environ.get("OMP_NUM_THREADS")
    if saved_env is None and cpu_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads)  # the processes inherit it
    # The launcher logs every failed process with a traceback of its own; the caller
    # reports the exit status instead.
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic",
                                                  "torch.distributed.launcher")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    handlers = _signal_handlers()
    try:
        elastic_launch(config, sys.executable)("-u", *args)
    except ChildFailedError as failed:
        _, first = failed.get_first_failure()
        return first.exitcode
    except SignalException as e:
        # The launcher turns the signals it handles into this Exception (SIGINT too,
        # which would otherwise be a KeyboardInterrupt), once it has stopped the processes.
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise SystemExit(128 + int(e.sigval)) from None
    finally:
        # The launcher's handlers stay installed after it returns: a later Ctrl-C would
        # raise its exception again, anywhere.
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return 0


def _signal_handlers() -> dict[signal.Signals, object]:
    """The handlers of the signals torch's launcher takes over (in the main thread only:
    TORCHELASTIC_SIGNALS_TO_HANDLE, by default SIGTERM, SIGINT, SIGHUP and SIGQUIT)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    signals = [getattr(signal, name.strip(), None) for name in names.split(",")]
    return {sig: signal.getsignal(sig) for sig in signals
            if isinstance(sig, signal.Signals) and signal.getsignal(sig) is not None}
