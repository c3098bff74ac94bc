"""Worker of the multi-process (gloo) tests: one process per rank.

Imported by the spawned processes, so it must not import pytest fixtures.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import mhmoe
from mhmoe.parallel import HeadPartition, shard_state_dict

CONFIG = mhmoe.MultiHeadMoEConfig(hidden_size=96, num_heads=12, num_experts=4, top_k=2,
                                  expert_intermediate_size=16, params_dtype=torch.float32,
                                  route_scale=2.0)


def full_layer(seed: int) -> mhmoe.MultiHeadMoE:
    gen = torch.Generator().manual_seed(seed)
    layer = mhmoe.MultiHeadMoE(CONFIG)
    layer.reset_parameters(generator=gen)
    with torch.no_grad():
        layer.router.expert_bias_ema.copy_(torch.randn(48, generator=gen) * 0.1)
    return layer


def run_rank(rank: int, world: int, init_file: str, counts: list[int], seed: int,
             out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        report = check_rank(rank, world, counts, seed)
        leave_together()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    leave_process()


def leave_together() -> None:
    """A barrier before the group is torn down: a gloo rank that destroyed its group
    while its peer was still finishing aborted the peer under load ("terminate called
    without an active exception", seen in bench_parallel and in this test under
    pytest -n 2)."""
    dist.barrier()


def leave_process() -> None:
    """End a rank that has written its report without the interpreter's teardown: even
    after the barrier, a gloo rank aborted now and then during finalization (SIGABRT,
    "terminate called without an active exception"; the benchmarks/bench_parallel.py dry
    run failed 2 times in 50 that way and 0 in 130 with this exit)."""
    os._exit(0)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def check_rank(rank: int, world: int, counts: list[int], seed: int) -> dict:
    """Sequence-parallel and replicated forward/backward vs the one-process layer."""
    E, D = CONFIG.num_experts, CONFIG.head_dim
    reference = full_layer(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(sum(counts), CONFIG.hidden_size, generator=gen)
    w_all = torch.randn(sum(counts), CONFIG.hidden_size, generator=gen)
    x_ref = x_all.clone().requires_grad_(True)
    y_ref = reference(x_ref)
    (y_ref * w_all).sum().backward()

    part = HeadPartition(CONFIG.num_heads, world, rank)
    begin = sum(counts[:rank])
    mine = slice(begin, begin + counts[rank])
    ref_grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
                 for n, p in reference.named_parameters()}
    ref_grads = shard_state_dict(ref_grads, part, E)
    report = {}
    for passed_counts in (counts, None):
        layer = mhmoe.MultiHeadMoE(CONFIG, group=dist.group.WORLD)
        layer.load_state_dict(shard_state_dict(reference.state_dict(), part, E))
        x = x_all[mine].clone().requires_grad_(True)
        y = layer(x, token_counts=passed_counts)
        (y * w_all[mine]).sum().backward()
        tag = "counts" if passed_counts else "gathered"
        report[f"{tag}:y"] = max_diff(y, y_ref[mine])
        report[f"{tag}:dx"] = max_diff(x.grad, x_ref.grad[mine])
        for name, p in layer.named_parameters():
            if p.requires_grad:
                report[f"{tag}:d{name}"] = max_diff(p.grad, ref_grads[name])

    # Replicated sequence: all tokens on every rank, only this rank's heads.
    layer = mhmoe.MultiHeadMoE(CONFIG, group=dist.group.WORLD, input_mode="replicated")
    layer.load_state_dict(shard_state_dict(reference.state_dict(), part, E))
    heads = torch.zeros(sum(counts), part.padded_heads, D)
    heads[:, :CONFIG.num_heads] = x_all.view(-1, CONFIG.num_heads, D)
    x = heads[:, part.start:part.start + part.local_heads].reshape(sum(counts), -1)
    y = layer(x).view(sum(counts), part.local_heads, D)
    y_ref_heads = torch.zeros(sum(counts), part.padded_heads, D)
    y_ref_heads[:, :CONFIG.num_heads] = y_ref.detach().view(-1, CONFIG.num_heads, D)
    report["replicated:y"] = max_diff(y, y_ref_heads[:, part.start:part.start + part.local_heads])
    report["real_heads"] = part.real_heads
    try:
        layer(torch.zeros(3, CONFIG.hidden_size + 8))
        report["width_error"] = "no error"
    except ValueError as err:
        report["width_error"] = str(err)
    return report


def load_rank(rank: int, world: int, init_file: str, ckpt: str, out_dir: str) -> None:
    """Each rank loads every MoE layer of a checkpoint for its own heads (load_layers with
    the process group), and reports the bytes it read and its tensors."""
    from mhmoe.checkpoint import load_layers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        modules, nbytes = load_layers(ckpt, group=dist.group.WORLD)
        state = {f"{index}.{name}": t for index, m in modules.items()
                 for name, t in m.state_dict().items()}
        partition = modules[min(modules)].partition
        leave_together()
    finally:
        dist.destroy_process_group()
    torch.save({"state": state, "bytes": nbytes, "start": partition.start,
                "local_heads": partition.local_heads},
               os.path.join(out_dir, f"load{rank}.pt"))
    leave_process()
