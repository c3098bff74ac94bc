"""Head parallelism over gloo: several CPU processes against one process."""

import json

import pytest
import torch
import torch.multiprocessing as mp

import mhmoe
from dist_worker import run_rank
from mhmoe.parallel import HeadPartition, shard_state_dict

# world size -> per-rank token counts (uneven, with zeros)
CASES = {
    2: [5, 3],
    3: [0, 4, 2],
    4: [3, 0, 0, 6],
    5: [1, 2, 3, 0, 4],
    8: [2, 0, 1, 3, 0, 2, 1, 0],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_head_parallel_matches_one_process(tmp_path, world):
    counts = CASES[world]
    seed = int(torch.randint(0, 2**31 - 1, ()))
    mp.spawn(run_rank, args=(world, str(tmp_path / "init"), counts, seed, str(tmp_path)),
             nprocs=world, join=True)
    for rank in range(world):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        width_error = report.pop("width_error")
        assert "replicated input must be" in width_error, width_error
        real = report.pop("real_heads")
        assert real == HeadPartition(12, world, rank).real_heads
        # every output and gradient, both with counts given and gathered
        expected = {f"{tag}:{what}" for tag in ("counts", "gathered")
                    for what in ("y", "dx", "dgate", "dW_gate", "dW_up", "dW_down")}
        assert expected | {"replicated:y"} == set(report)
        bad = {k: v for k, v in report.items() if not v <= 1e-5}
        assert not bad, (rank, bad)


def test_shard_state_dict_rows():
    # 12 heads x 2 experts on 8 ranks: 2 heads (4 rows) each, ranks 6 and 7 all padding
    state = {"w": torch.arange(24.0).view(24, 1)}
    for rank in range(8):
        part = shard_state_dict(state, HeadPartition(12, 8, rank), 2)["w"].flatten().tolist()
        expected = [float(r) if r < 24 else 0.0 for r in range(rank * 4, rank * 4 + 4)]
        assert part == expected


def test_module_for_one_rank_without_group_cannot_forward():
    cfg = mhmoe.MultiHeadMoEConfig(96, 12, 4, 2, 16, params_dtype=torch.float32)
    layer = mhmoe.MultiHeadMoE(cfg, partition=HeadPartition(12, 4, 1))
    with pytest.raises(ValueError, match="pass group="):
        layer(torch.zeros(2, 96))


def test_token_counts_are_checked():
    cfg = mhmoe.MultiHeadMoEConfig(96, 12, 4, 2, 16, params_dtype=torch.float32)
    layer = mhmoe.MultiHeadMoE(cfg)
    with pytest.raises(ValueError, match="token_counts"):
        layer(torch.zeros(2, 96), token_counts=[3])
    assert layer(torch.zeros(2, 96), token_counts=[2]).shape == (2, 96)


def test_multi_gpu_benchmark_script_dry_run_on_cpu(tmp_path):
    # benchmarks/bench_parallel.py is the multi-GPU (NCCL) benchmark; --cpu runs the same
    # script over gloo, so the script itself is exercised here without GPUs: two world
    # sizes, two token counts a rank, the loading measurement and the scaling table.
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mhmoe.checkpoint import save_checkpoint

    root = Path(__file__).resolve().parents[1]
    script = str(root / "benchmarks" / "bench_parallel.py")
    cfg = mhmoe.MAGI2_PREVIEW.replace(num_experts=2, top_k=2, params_dtype=torch.float32)
    layers = {index: mhmoe.MultiHeadMoE(cfg) for index in (0, 1)}
    save_checkpoint(tmp_path / "ckpt", layers, config=cfg)
    layer_bytes = sum(t.numel() * t.element_size() for t in layers[0].state_dict().values())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for world in (1, 3):
        out = tmp_path / f"parallel_w{world}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(world), script, "--cpu", "--tokens-per-rank", "6,8", "--experts", "2",
             "--runs", "1", "--check-tokens", "4", "--checkpoint", str(tmp_path / "ckpt"),
             "--out", str(out)],
            capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "checks against one process: ok" in proc.stdout, proc.stdout
        data = json.loads(out.read_text())
        assert data["world"] == world and data["checks_ok"]
        rows = data["rows"]
        assert [(r["tokens"], r["rank"]) for r in rows] == \
            [(S, r) for S in (6, 8) for r in range(world)]
        for row in rows:
            part = HeadPartition(12, world, row["rank"])
            assert row["real_heads"] == part.real_heads
            assert row["alltoall_bytes"] == row["tokens"] * part.padded_heads * 256 * 4
            assert row["max_abs_diff"] <= 1e-2 * max(row["max_abs_ref"], 1e-6)
            assert row["det_y_bitwise"] and row["det_dx_bitwise"]
            for part_name in ("dispatch", "experts", "undispatch", "layer"):
                assert row[f"{part_name}_ms"] > 0 and row[f"{part_name}_fwd_bwd_ms"] > 0
            assert all(v <= 1e-5 for k, v in row.items() if k.endswith("_rel_err"))
            assert row["plain_alltoall_ms"] > 0
        # Loading, measured at the first token count: each rank reads its own rows of
        # both layers (of 12 heads x 2 experts), no more.
        for row in rows[:world]:
            part = HeadPartition(12, world, row["rank"])
            assert row["load_layers"] == [0, 1]
            assert row["load_bytes"] == 2 * layer_bytes * part.real_heads // 12
    table = subprocess.run([sys.executable, script, "--summarize", str(tmp_path)],
                           capture_output=True, text=True, timeout=120, env=env)
    assert table.returncode == 0, table.stdout + table.stderr
    assert [line.split()[:2] for line in table.stdout.splitlines()[1:]] == \
        [["1", "6"], ["1", "8"], ["3", "6"], ["3", "8"]]


@pytest.mark.parametrize("world", [3, 8])
def test_ranks_load_only_their_share_of_a_checkpoint(tmp_path, world):
    from dist_worker import load_rank
    from mhmoe.checkpoint import save_checkpoint

    cfg = mhmoe.MultiHeadMoEConfig(96, 12, 4, 2, 16, params_dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    layers = {}
    for index in (2, 3):
        layer = mhmoe.MultiHeadMoE(cfg)
        layer.reset_parameters(generator=gen)
        layers[index] = layer
    save_checkpoint(tmp_path / "ckpt", layers, max_shard_bytes=200_000)
    mp.spawn(load_rank, args=(world, str(tmp_path / "init"), str(tmp_path / "ckpt"),
                              str(tmp_path)), nprocs=world, join=True)
    row_bytes = {name: t[0].numel() * t.element_size()
                 for name, t in layers[2].state_dict().items()}
    for rank in range(world):
        got = torch.load(tmp_path / f"load{rank}.pt")
        part = HeadPartition(12, world, rank)
        assert (got["start"], got["local_heads"]) == (part.start, part.local_heads)
        share = 0
        for index, layer in layers.items():
            expected = shard_state_dict(layer.state_dict(), part, 4)
            for name, tensor in expected.items():
                assert torch.equal(got["state"][f"{index}.{name}"], tensor), (rank, index, name)
                share += part.real_heads * 4 * row_bytes[name]
        assert got["bytes"] == share, (world, rank)  # its own rows of both layers, no more
