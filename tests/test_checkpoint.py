"""Checkpoints: round trips, strict loading, per-rank slicing (SPEC sections 5 and 6).

Malformed checkpoints are built with the reference writer (`safetensors.torch`) or by
editing bytes, so the reader is not only tested against its own writer.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import re
import struct
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import mhmoe.checkpoint as ckpt
from mhmoe import HeadPartition, MultiHeadMoE, MultiHeadMoEConfig
from mhmoe.checkpoint import (
    INDEX_FILE,
    MOE_PARAM_NAMES,
    SINGLE_FILE,
    CheckpointError,
    CheckpointReader,
    inspect_checkpoint,
    load_layer,
    load_layer_state,
    load_layers,
    moe_key,
    save_checkpoint,
)

LAYER = 3  # the layer the malformed-checkpoint cases load; LAYER + 2 is a sound neighbour


def tiny_config(dtype: torch.dtype = torch.float32) -> MultiHeadMoEConfig:
    return MultiHeadMoEConfig(hidden_size=32, num_heads=4, num_experts=4, top_k=2,
                              expert_intermediate_size=16, params_dtype=dtype)


def twelve_head_config() -> MultiHeadMoEConfig:
    # MAGI-2's head count with tiny experts: D = 2, E = 3, I = 4 (none a power of two).
    return MultiHeadMoEConfig(hidden_size=24, num_heads=12, num_experts=3, top_k=1,
                              expert_intermediate_size=4, params_dtype=torch.float32)


def random_state(cfg: MultiHeadMoEConfig, rng: torch.Generator,
                 rows: int | None = None) -> dict[str, torch.Tensor]:
    """Every parameter random (the biases too, so their values are checked)."""
    rows = cfg.num_flat_experts if rows is None else rows
    D, I = cfg.head_dim, cfg.expert_intermediate_size
    shapes = {"gate": (rows, D), "W_gate": (rows, D, I), "W_up": (rows, D, I),
              "W_down": (rows, I, D), "router.expert_bias": (rows,),
              "router.expert_bias_ema": (rows,)}
    return {name: torch.randn(shape, generator=rng).to(
                cfg.params_dtype if name.startswith("W_") else torch.float32)
            for name, shape in shapes.items()}


def random_module(cfg: MultiHeadMoEConfig, rng: torch.Generator,
                  partition: HeadPartition | None = None) -> MultiHeadMoE:
    module = MultiHeadMoE(cfg, partition=partition)
    module.reset_parameters(generator=rng)
    with torch.no_grad():
        # Non-zero biases: they change the routing, so a lost bias shows in the forward.
        for bias in module.router.parameters():
            bias.copy_(0.1 * torch.randn(bias.shape, generator=rng))
    return module


def assert_names(error: pytest.ExceptionInfo, file: Path, keys: list[str] | None) -> None:
    """The message names the file and (one of) the keys."""
    message = str(error.value)
    assert str(file) in message, message
    if keys:
        assert any(repr(key) in message or key in message for key in keys), message


def shard_of(directory: Path, key: str) -> Path:
    index = json.loads((directory / INDEX_FILE).read_text())
    return directory / index["weight_map"][key]


# ----------------------------------------------------------------------------------------
# Round trips
# ----------------------------------------------------------------------------------------


def test_moe_key():
    assert moe_key(5, "W_up") == "block.layers.5.mlp.moe_mlp.W_up"
    assert moe_key(37, "router.expert_bias_ema", "transformer.") == \
        "transformer.block.layers.37.mlp.moe_mlp.router.expert_bias_ema"
    with pytest.raises(ValueError, match="prefix"):
        moe_key(1, "gate", "model.")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefix", ["", "transformer."], ids=["bare", "transformer"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_round_trip(tmp_path, rng, sharded, prefix, dtype):
    cfg = tiny_config(dtype)
    modules = {2: random_module(cfg, rng), 7: random_module(cfg, rng)}
    layer_bytes = sum(t.numel() * t.element_size() for t in modules[2].state_dict().values())
    max_shard = layer_bytes // 3 if sharded else None  # forces several shards per layer
    files = save_checkpoint(tmp_path, modules, max_shard_bytes=max_shard, prefix=prefix)

    keys = {moe_key(layer, name, prefix) for layer in modules for name in MOE_PARAM_NAMES}
    if sharded:
        *shards, index_path = files
        assert index_path == tmp_path / INDEX_FILE
        assert len(shards) >= 3
        for i, shard in enumerate(shards):
            assert shard.name == f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        index = json.loads(index_path.read_text())
        assert index["metadata"]["total_size"] == 2 * layer_bytes
        assert MultiHeadMoEConfig.from_json(index["metadata"]["mhmoe.config"]) == cfg
        owner = {}
        for shard in shards:
            with safe_open(str(shard), "pt") as f:
                assert f.metadata()["mhmoe.config"] == cfg.to_json()
                held = list(f.keys())
                size = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size()
                           for k in held)
            # a tensor is never split, so only a lone tensor may exceed the limit
            assert size <= max_shard or len(held) == 1
            for key in held:
                assert key not in owner, f"{key} in two shards"
                owner[key] = shard.name
        assert owner == index["weight_map"]
        assert set(owner) == keys
    else:
        assert files == [tmp_path / SINGLE_FILE]
        with safe_open(str(files[0]), "pt") as f:
            assert set(f.keys()) == keys
            assert f.metadata()["mhmoe.config"] == cfg.to_json()
    # no temporary file is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files)

    with CheckpointReader(tmp_path) as reader:
        assert reader.config == cfg
        assert reader.moe_layers() == [2, 7]
        for layer, module in modules.items():
            expected = module.state_dict()
            state = load_layer_state(reader, layer)
            assert list(state) == list(MOE_PARAM_NAMES) == list(expected)
            for name in MOE_PARAM_NAMES:
                assert state[name].dtype == expected[name].dtype
                assert torch.equal(state[name], expected[name]), name
                assert torch.equal(reader.read(layer, name), expected[name]), name
    # The reference reader sees the same tensors.
    for file in files:
        if file.suffix == ".safetensors":
            for key, tensor in safetensors.torch.load_file(file).items():
                match = re.fullmatch(r"(?:transformer\.)?block\.layers\.(\d+)\.mlp\.moe_mlp\.(.+)",
                                     key)
                expected = modules[int(match[1])].state_dict()[match[2]]
                assert torch.equal(tensor, expected), key


@pytest.mark.parametrize("prefix", ["", "transformer."], ids=["bare", "transformer"])
def test_load_layer_forward_equals_original(tmp_path, rng, prefix):
    cfg = tiny_config()
    original = random_module(cfg, rng)
    save_checkpoint(tmp_path, {4: original, 5: random_module(cfg, rng)}, prefix=prefix)
    loaded = load_layer(tmp_path, 4)
    assert loaded.config == cfg and loaded.partition == original.partition
    for name, param in loaded.named_parameters():
        assert param.device.type == "cpu"
        assert param.requires_grad == (not name.startswith("router.")), name
        assert torch.equal(param, original.state_dict()[name]), name
    x = torch.randn(9, cfg.hidden_size, generator=rng)
    assert torch.equal(loaded(x), original(x))


def test_reader_rows_zero_fill_and_bytes_read(tmp_path, rng):
    cfg = tiny_config()
    state = random_state(cfg, rng)
    save_checkpoint(tmp_path, {LAYER: state}, config=cfg)
    rows = cfg.num_flat_experts  # 16
    row_bytes = cfg.head_dim * cfg.expert_intermediate_size * 4
    with CheckpointReader(tmp_path / SINGLE_FILE) as reader:
        key, file, shape, dtype = reader.tensor_info(LAYER, "W_up")
        assert (key, file, shape, dtype) == (moe_key(LAYER, "W_up"), tmp_path / SINGLE_FILE,
                                             (rows, cfg.head_dim, cfg.expert_intermediate_size),
                                             torch.float32)
        middle = reader.read(LAYER, "W_up", rows=(5, 9))
        assert torch.equal(middle, state["W_up"][5:9]) and reader.bytes_read == 4 * row_bytes
        # rows running past the end: the missing ones are zeros and are not counted
        tail = reader.read(LAYER, "W_up", rows=(rows - 2, rows + 3))
        assert tail.shape == (5, cfg.head_dim, cfg.expert_intermediate_size)
        assert torch.equal(tail[:2], state["W_up"][-2:]) and not tail[2:].any()
        assert reader.bytes_read == 6 * row_bytes
        # entirely past the end: all zeros, nothing read
        assert not reader.read(LAYER, "W_up", rows=(rows + 4, rows + 6)).any()
        # empty range
        assert reader.read(LAYER, "W_up", rows=(3, 3)).shape[0] == 0
        assert reader.bytes_read == 6 * row_bytes
        with pytest.raises(ValueError, match="begin <= end"):
            reader.read(LAYER, "W_up", rows=(4, 2))


def test_resave_switches_layout_and_removes_stale_files(tmp_path, rng):
    cfg = tiny_config()
    first, second, third = (random_module(cfg, rng) for _ in range(3))
    save_checkpoint(tmp_path, {1: first}, max_shard_bytes=4096)
    assert (tmp_path / INDEX_FILE).exists()
    save_checkpoint(tmp_path, {1: second})  # sharded -> single file
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]
    assert torch.equal(load_layer_state(tmp_path, 1)["W_down"], second.W_down)
    files = save_checkpoint(tmp_path, {1: third}, max_shard_bytes=4096)  # single -> sharded
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files)
    assert torch.equal(load_layer_state(tmp_path, 1)["W_down"], third.W_down)


def test_directory_with_both_layouts_is_ambiguous(tmp_path, rng):
    # what a crash between a layout switch's rename and its clean-up leaves behind
    cfg = tiny_config()
    save_checkpoint(tmp_path / "a", {1: random_module(cfg, rng)}, max_shard_bytes=4096)
    save_checkpoint(tmp_path / "b", {1: random_module(cfg, rng)})
    (tmp_path / "b" / SINGLE_FILE).rename(tmp_path / "a" / SINGLE_FILE)
    with pytest.raises(CheckpointError, match="both") as error:
        load_layer_state(tmp_path / "a", 1)
    assert_names(error, tmp_path / "a", None)
    # either one, named explicitly, loads
    load_layer_state(tmp_path / "a" / INDEX_FILE, 1)
    load_layer_state(tmp_path / "a" / SINGLE_FILE, 1)


def test_failed_save_keeps_previous_checkpoint(tmp_path, rng, monkeypatch):
    cfg = tiny_config()
    old = random_module(cfg, rng)
    save_checkpoint(tmp_path, {1: old, 2: old}, max_shard_bytes=4096)
    before = sorted(p.name for p in tmp_path.iterdir())
    real_write = ckpt._write_safetensors
    calls = []

    def crash_in_second_file(final, entries, metadata, advance):
        calls.append(final)
        if len(calls) < 2:
            return real_write(final, entries, metadata, advance)

        def advance_then_crash(n):
            raise OSError("disk full (simulated)")
        return real_write(final, entries, metadata, advance_then_crash)

    monkeypatch.setattr(ckpt, "_write_safetensors", crash_in_second_file)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, {1: random_module(cfg, rng), 2: old}, max_shard_bytes=4096)
    assert len(calls) == 2
    # nothing was renamed into place, no temporary file is left, the old one loads intact
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    state = load_layer_state(tmp_path, 1)
    for name, tensor in old.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_progress_bar(tmp_path, rng, capsys):
    cfg = tiny_config(torch.bfloat16)
    module = random_module(cfg, rng)
    files = save_checkpoint(tmp_path, {2: module}, progress=True)
    assert files == [tmp_path / SINGLE_FILE]
    assert torch.equal(load_layer_state(tmp_path, 2)["W_gate"], module.W_gate)


# ----------------------------------------------------------------------------------------
# Malformed checkpoints
# ----------------------------------------------------------------------------------------


def _save_pair(directory: Path, cfg, rng, mutate=None, **kwargs) -> Path:
    """LAYER (optionally mutated) and a sound LAYER + 2."""
    state = random_state(cfg, rng)
    if mutate is not None:
        mutate(state)
    save_checkpoint(directory, {LAYER: state, LAYER + 2: random_state(cfg, rng)},
                    config=kwargs.pop("config", cfg), **kwargs)
    return directory


def _layer_keys(prefix: str = "") -> list[str]:
    return [moe_key(LAYER, n, prefix) for n in MOE_PARAM_NAMES]


def _case_missing_key(d, cfg, rng):
    _save_pair(d, cfg, rng, lambda s: s.pop("W_up"))
    return d, d / SINGLE_FILE, [moe_key(LAYER, "W_up")], {}


def _case_unexpected_key(d, cfg, rng):
    _save_pair(d, cfg, rng, lambda s: s.update(W_extra=torch.zeros(3)))
    return d, d / SINGLE_FILE, [moe_key(LAYER, "W_extra")], {}


def _case_gate_width(d, cfg, rng):
    _save_pair(d, cfg, rng, lambda s: s.update(gate=torch.zeros(16, cfg.head_dim + 1)))
    return d, d / SINGLE_FILE, [moe_key(LAYER, "gate")], {}


def _case_rows(d, cfg, rng):
    # one flat expert too many
    _save_pair(d, cfg, rng, lambda s: s.update(W_up=torch.cat([s["W_up"], s["W_up"][:1]])))
    return d, d / SINGLE_FILE, [moe_key(LAYER, "W_up")], {}


def _case_transposed(d, cfg, rng):
    # W_down stored [rows, D, I] instead of [rows, I, D]
    _save_pair(d, cfg, rng, lambda s: s.update(W_down=s["W_down"].transpose(1, 2).contiguous()))
    return d, d / SINGLE_FILE, [moe_key(LAYER, "W_down")], {}


def _case_weight_dtype(d, cfg, rng):
    _save_pair(d, cfg, rng, lambda s: s.update(W_gate=s["W_gate"].half()))
    return d, d / SINGLE_FILE, [moe_key(LAYER, "W_gate")], {}


def _case_router_dtype(d, cfg, rng):
    # the router must stay fp32 whatever the weights are
    _save_pair(d, cfg, rng, lambda s: s.update(**{"router.expert_bias":
                                                  s["router.expert_bias"].bfloat16()}))
    return d, d / SINGLE_FILE, [moe_key(LAYER, "router.expert_bias")], {}


def _case_both_prefixes(d, cfg, rng):
    d.mkdir()
    tensors = {moe_key(LAYER, n): t for n, t in random_state(cfg, rng).items()}
    tensors[moe_key(LAYER, "gate", "transformer.")] = tensors[moe_key(LAYER, "gate")].clone()
    safetensors.torch.save_file(tensors, d / SINGLE_FILE, metadata={"mhmoe.config":
                                                                    cfg.to_json()})
    return d, d / SINGLE_FILE, [moe_key(LAYER, "gate")], {}


def _case_truncated(d, cfg, rng):
    _save_pair(d, cfg, rng)
    file = d / SINGLE_FILE
    os.truncate(file, file.stat().st_size - 100)
    return d, file, _layer_keys(), {}


def _case_truncated_shard(d, cfg, rng):
    _save_pair(d, cfg, rng, max_shard_bytes=4096)
    shard = shard_of(d, moe_key(LAYER, "W_up"))
    os.truncate(shard, shard.stat().st_size - 1)
    return d, shard, _layer_keys(), {}


def _case_garbage_header(d, cfg, rng):
    _save_pair(d, cfg, rng)
    with open(d / SINGLE_FILE, "r+b") as f:
        f.seek(8)
        f.write(b"#garbage, not json")
    return d, d / SINGLE_FILE, None, {}


def _case_header_length(d, cfg, rng):
    _save_pair(d, cfg, rng)
    with open(d / SINGLE_FILE, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    return d, d / SINGLE_FILE, None, {}


def _case_missing_shard(d, cfg, rng):
    _save_pair(d, cfg, rng, max_shard_bytes=4096)
    shard = shard_of(d, moe_key(LAYER, "W_down"))
    shard.unlink()
    return d, shard, _layer_keys(), {}


def _case_index_maps_key_to_wrong_shard(d, cfg, rng):
    _save_pair(d, cfg, rng, max_shard_bytes=4096)
    index = json.loads((d / INDEX_FILE).read_text())
    key = moe_key(LAYER, "gate")
    other = next(f for f in index["weight_map"].values() if f != index["weight_map"][key])
    index["weight_map"][key] = other
    (d / INDEX_FILE).write_text(json.dumps(index))
    return d, d / other, [key], {}


def _case_garbage_index(d, cfg, rng):
    _save_pair(d, cfg, rng, max_shard_bytes=4096)
    (d / INDEX_FILE).write_text('{"weight_map": ')
    return d, d / INDEX_FILE, None, {}


def _case_nan(d, cfg, rng):
    def poison(state):
        state["W_down"][5, 1, 0] = float("nan")
    _save_pair(d, cfg, rng, poison)
    return d, d / SINGLE_FILE, [moe_key(LAYER, "W_down")], {}


def _case_inf(d, cfg, rng):
    def poison(state):
        state["router.expert_bias_ema"][2] = float("-inf")
    _save_pair(d, cfg, rng, poison)
    return d, d / SINGLE_FILE, [moe_key(LAYER, "router.expert_bias_ema")], {}


def _case_unknown_layer(d, cfg, rng):
    _save_pair(d, cfg, rng)
    return d, d / SINGLE_FILE, None, {"layer": LAYER + 1, "match": f"layer {LAYER + 1} "}


def _case_mixed_pre_sliced(d, cfg, rng):
    # world 2: local_flat = 8 of 16 rows; W_up pre-sliced, the rest full
    _save_pair(d, cfg, rng, lambda s: s.update(W_up=s["W_up"][:8].clone()))
    return d, d / SINGLE_FILE, [moe_key(LAYER, "W_up")], {"partition": HeadPartition(4, 2, 0)}


def _case_no_config(d, cfg, rng):
    _save_pair(d, cfg, rng, config=None)
    return d, d / SINGLE_FILE, None, {"config": None, "match": "config="}


def _case_no_such_path(d, cfg, rng):
    return d / "nowhere", d / "nowhere", None, {}


MALFORMED = {
    "missing key": _case_missing_key,
    "unexpected key": _case_unexpected_key,
    "wrong shape: gate width": _case_gate_width,
    "wrong shape: rows": _case_rows,
    "wrong shape: W_down transposed": _case_transposed,
    "wrong dtype: weights": _case_weight_dtype,
    "wrong dtype: router": _case_router_dtype,
    "key with and without prefix": _case_both_prefixes,
    "truncated file": _case_truncated,
    "truncated shard": _case_truncated_shard,
    "corrupt header: garbage json": _case_garbage_header,
    "corrupt header: length": _case_header_length,
    "missing shard": _case_missing_shard,
    "index maps a key to the wrong shard": _case_index_maps_key_to_wrong_shard,
    "corrupt index json": _case_garbage_index,
    "NaN in a weight": _case_nan,
    "inf in a router bias": _case_inf,
    "unknown layer": _case_unknown_layer,
    "pre-sliced and full tensors mixed": _case_mixed_pre_sliced,
    "no config anywhere": _case_no_config,
    "no such path": _case_no_such_path,
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_checkpoint_is_rejected(tmp_path, rng, monkeypatch, case):
    cfg = tiny_config()
    path, file, keys, options = MALFORMED[case](tmp_path / "ckpt", cfg, rng)
    layer = options.get("layer", LAYER)
    config = options.get("config", cfg)
    partition = options.get("partition")
    with pytest.raises(CheckpointError, match=options.get("match")) as error:
        load_layer_state(path, layer, config, partition)
    assert_names(error, file, keys)

    # load_layer fails the same way, before any module is built.
    built = []

    class Spy(MultiHeadMoE):
        def __init__(self, *args, **kwargs):
            built.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ckpt, "MultiHeadMoE", Spy)
    with pytest.raises(CheckpointError) as error:
        load_layer(path, layer, config, partition=partition)
    assert_names(error, file, keys)
    assert built == []


def test_verify_covers_only_what_was_read(tmp_path, rng):
    cfg = twelve_head_config()
    state = random_state(cfg, rng)
    state["W_up"][30, 0, 0] = float("nan")  # row 30 = head 10 (E = 3)
    save_checkpoint(tmp_path, {LAYER: state}, config=cfg)
    with pytest.raises(CheckpointError, match="row 30") as error:
        load_layer_state(tmp_path, LAYER, partition=HeadPartition(12, 2, 1))
    assert_names(error, tmp_path / SINGLE_FILE, [moe_key(LAYER, "W_up")])
    # rank 0 of 2 (heads 0..5) never reads row 30
    load_layer_state(tmp_path, LAYER, partition=HeadPartition(12, 2, 0))
    # verify=False hands the values over as they are
    loaded = load_layer_state(tmp_path, LAYER, partition=HeadPartition(12, 2, 1), verify=False)
    assert torch.isnan(loaded["W_up"][30 - 18, 0, 0])


# ----------------------------------------------------------------------------------------
# Per-rank slicing (SPEC section 6)
# ----------------------------------------------------------------------------------------


def expected_rank_rows(full: torch.Tensor, heads: int, E: int, world: int,
                       rank: int) -> torch.Tensor:
    """Written from SPEC section 6 alone: pad heads to a multiple of the world size;
    rank r owns `local` heads from r * local; rows past the real ones are zeros."""
    local = math.ceil(heads / world)
    start = rank * local
    out = torch.zeros((local * E, *full.shape[1:]), dtype=full.dtype)
    for row in range(start * E, start * E + local * E):
        if row < heads * E:
            out[row - start * E] = full[row]
    return out


@pytest.mark.parametrize("world", range(1, 9))
def test_rank_slices_match_spec(tmp_path, rng, world):
    cfg = twelve_head_config()
    H, E = cfg.num_heads, cfg.num_experts
    full = random_state(cfg, rng)
    save_checkpoint(tmp_path, {LAYER: full}, config=cfg, max_shard_bytes=600)
    with CheckpointReader(tmp_path) as reader:
        for rank in range(world):
            partition = HeadPartition(H, world, rank)
            before = reader.bytes_read
            state = load_layer_state(reader, LAYER, partition=partition)
            local = math.ceil(H / world)
            start = rank * local
            owned_real = max(0, min(H, start + local) - start) * E  # rows that exist
            share = 0
            for name in MOE_PARAM_NAMES:
                expected = expected_rank_rows(full[name], H, E, world, rank)
                assert state[name].dtype == expected.dtype
                assert torch.equal(state[name], expected), (world, rank, name)
                share += owned_real * full[name][0].numel() * full[name].element_size()
            # a rank reads exactly its own rows, and nothing at all without real heads
            assert reader.bytes_read - before == share, (world, rank)
            if start >= H:  # only padding heads (world 5 rank 4, world 7 rank 6, ...)
                assert not any(t.any() for t in state.values())


@pytest.mark.parametrize("world", [2, 3])
def test_rank_with_some_padding_heads(tmp_path, rng, world):
    # 5 heads: world 2 pads to 6 (rank 1: heads 3, 4 + one padding head); world 3 pads
    # to 6 as well (rank 2: head 4 + one padding head)
    cfg = MultiHeadMoEConfig(hidden_size=10, num_heads=5, num_experts=2, top_k=1,
                             expert_intermediate_size=3, params_dtype=torch.float32)
    full = random_state(cfg, rng)
    save_checkpoint(tmp_path, {LAYER: full}, config=cfg)
    rank = world - 1
    state = load_layer_state(tmp_path, LAYER, partition=HeadPartition(5, world, rank))
    for name in MOE_PARAM_NAMES:
        expected = expected_rank_rows(full[name], 5, 2, world, rank)
        assert torch.equal(state[name], expected), name
        assert not state[name][-2:].any()  # the padding head's two rows


def test_load_layer_per_rank_module(tmp_path, rng):
    cfg = twelve_head_config()
    full = random_state(cfg, rng)
    save_checkpoint(tmp_path, {LAYER: full}, config=cfg)
    partition = HeadPartition(12, 5, 3)  # heads 9, 10, 11
    module = load_layer(tmp_path, LAYER, partition=partition)
    assert module.partition == partition
    assert torch.equal(module.W_gate, full["W_gate"][27:36])
    assert not module.router.expert_bias_ema.requires_grad


def test_pre_sliced_checkpoint_is_taken_as_is(tmp_path, rng):
    cfg = twelve_head_config()
    world, local_flat = 4, 3 * cfg.num_experts
    # A rank's module saved as it is: its rows only, its partition in the metadata.
    modules = [random_module(cfg, rng, HeadPartition(12, world, r)) for r in range(world)]
    for rank, module in enumerate(modules):
        save_checkpoint(tmp_path / f"rank{rank}", {LAYER: module})
    for rank, module in enumerate(modules):
        partition = HeadPartition(12, world, rank)
        state = load_layer_state(tmp_path / f"rank{rank}", LAYER, partition=partition)
        for name, tensor in module.state_dict().items():
            assert tensor.shape[0] == local_flat
            assert torch.equal(state[name], tensor), (rank, name)
    # Loading rank 1's file on rank 2 would silently give rank 1's weights: refused.
    with pytest.raises(CheckpointError, match="pre-sliced") as error:
        load_layer_state(tmp_path / "rank1", LAYER, partition=HeadPartition(12, world, 2))
    assert_names(error, tmp_path / "rank1" / SINGLE_FILE, _layer_keys())
    # Without a recorded partition a local_flat-row file is trusted (documented).
    rows = random_state(cfg, rng, rows=local_flat)
    save_checkpoint(tmp_path / "bare", {LAYER: rows}, config=cfg)
    state = load_layer_state(tmp_path / "bare", LAYER, partition=HeadPartition(12, world, 2))
    assert all(torch.equal(state[n], rows[n]) for n in MOE_PARAM_NAMES)
    # A world of 1 expects the full tensors.
    with pytest.raises(CheckpointError, match="shape"):
        load_layer_state(tmp_path / "bare", LAYER)


# ----------------------------------------------------------------------------------------
# A rank's read touches only its rows: measured in the page cache
# ----------------------------------------------------------------------------------------


def _resident(path: Path) -> torch.Tensor:
    """Page-cache residency of every page of `path` (bool [pages]), by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    # ACCESS_COPY (a private mapping) because ctypes can only take the address of a
    # writable buffer; nothing is written, so every page still reflects the page cache.
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        anchor = ctypes.c_char.from_buffer(m)
        try:
            if libc.mincore(ctypes.addressof(anchor), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del anchor  # the mapping cannot close while ctypes holds it
    return torch.frombuffer(bytearray(vec), dtype=torch.uint8) & 1 == 1


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _readahead_bytes(path: Path) -> int | None:
    """The kernel's readahead window for the device backing `path`, if it says."""
    dev = path.stat().st_dev
    try:
        return 1024 * int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}"
                               "/read_ahead_kb").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.skipif(sys.platform != "linux", reason="mincore / posix_fadvise: Linux only")
def test_rank_reads_only_its_pages(tmp_path):
    page = mmap.PAGESIZE
    readahead = _readahead_bytes(tmp_path)
    # A fault or read pulls in up to a readahead window around it, whatever the reader
    # does; pages that close to the rank's rows prove nothing either way.
    margin = max(2 << 20, readahead or 0)
    if margin > 8 << 20:
        pytest.skip(f"readahead of {margin >> 20} MiB is too coarse for a 32 MiB tensor")
    # 64 flat experts of 64 x 2048 fp32: 512 KiB rows, 32 MiB per expert tensor. Rank 3 of
    # 8 owns rows 24..32, 4 MiB in the middle of each tensor, far from both ends.
    cfg = MultiHeadMoEConfig(hidden_size=512, num_heads=8, num_experts=8, top_k=2,
                             expert_intermediate_size=2048, params_dtype=torch.float32)
    rows, (begin, end) = cfg.num_flat_experts, HeadPartition(8, 8, 3).rows(8)
    shapes = {"gate": (rows, 64), "W_gate": (rows, 64, 2048), "W_up": (rows, 64, 2048),
              "W_down": (rows, 2048, 64), "router.expert_bias": (rows,),
              "router.expert_bias_ema": (rows,)}
    # Row r of parameter i holds 1000 i + r: cheap to make, and every row is checkable.
    state = {name: (torch.arange(rows, dtype=torch.float32) + 1000 * i)
             .view(-1, *[1] * (len(shape) - 1)).expand(shape).contiguous()
             for i, (name, shape) in enumerate(shapes.items())}
    save_checkpoint(tmp_path, {LAYER: state}, config=cfg)
    file = tmp_path / SINGLE_FILE
    del state
    _evict(file)
    if _resident(file).sum() > 16:
        pytest.skip(f"posix_fadvise(DONTNEED) does not evict {file.parent}'s pages on this "
                    f"filesystem, so page-cache residency cannot be measured here")

    with CheckpointReader(tmp_path) as reader:
        got = load_layer_state(reader, LAYER, partition=HeadPartition(8, 8, 3))
        assert reader.bytes_read == (end - begin) * sum(
            math.prod(shape[1:]) * 4 for shape in shapes.values())
    resident = _resident(file)

    # Which pages may be resident: the header's, and each tensor's owned rows +- margin.
    with open(file, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    pages = resident.numel()
    allowed = torch.zeros(pages, dtype=torch.bool)
    owned = torch.zeros(pages, dtype=torch.bool)

    def mark(mask, lo, hi):
        mask[max(0, lo) // page: min(pages, -(-hi // page))] = True

    mark(allowed, 0, data_start + margin)
    for name in MOE_PARAM_NAMES:
        lo, hi = header[moe_key(LAYER, name)]["data_offsets"]
        row_bytes = (hi - lo) // rows
        lo, hi = data_start + lo + begin * row_bytes, data_start + lo + end * row_bytes
        mark(allowed, lo - margin, hi + margin)
        mark(owned, lo, hi)
        assert torch.equal(got[name].reshape(end - begin, -1)[:, 0],
                           torch.arange(begin, end, dtype=torch.float32)
                           + 1000 * MOE_PARAM_NAMES.index(name))
    assert (~allowed).sum() * page >= 16 << 20, "the test would check too little"
    stray = resident & ~allowed
    assert not stray.any(), (
        f"{int(stray.sum())} pages outside rank 3's rows (+- {margin >> 20} MiB) are in "
        f"the page cache, the first at byte {int(stray.nonzero()[0, 0]) * page}")
    # and the measurement does see reads: the owned rows are resident
    assert resident[owned].float().mean() > 0.9


# ----------------------------------------------------------------------------------------
# inspect_checkpoint
# ----------------------------------------------------------------------------------------


def test_inspect_sound_checkpoint(tmp_path, rng):
    cfg = tiny_config(torch.bfloat16)
    modules = {2: random_module(cfg, rng), 3: random_module(cfg, rng)}
    save_checkpoint(tmp_path, modules, max_shard_bytes=8192, prefix="transformer.")
    report = inspect_checkpoint(tmp_path, check_finite=True)
    assert report.problems == [] and report.ok
    assert report.config == cfg
    assert report.path == tmp_path / INDEX_FILE and len(report.files) >= 2
    assert report.layer_indices == [2, 3]
    assert [(r.layer, r.name) for r in report.layers] == \
        [(layer, name) for layer in (2, 3) for name in MOE_PARAM_NAMES]
    for row in report.layers:
        tensor = modules[row.layer].state_dict()[row.name]
        assert row.key == moe_key(row.layer, row.name, "transformer.")
        assert (row.shape, row.dtype) == (tuple(tensor.shape), tensor.dtype)
        assert row.bytes == tensor.numel() * tensor.element_size()
        assert row.file == shard_of(tmp_path, row.key)
    assert report.total_bytes == sum(r.bytes for r in report.layers)
    assert "no problems" in report.format()


def _broken_truncated(d, cfg, rng):
    _save_pair(d, cfg, rng)
    os.truncate(d / SINGLE_FILE, (d / SINGLE_FILE).stat().st_size - 8)
    return [SINGLE_FILE]


def _broken_missing_key(d, cfg, rng):
    _save_pair(d, cfg, rng, lambda s: s.pop("gate"))
    return [f"layer {LAYER}", "missing", "gate"]


def _broken_layer_shapes(d, cfg, rng):
    _save_pair(d, cfg, rng, lambda s: s.update(gate=torch.zeros(16, 3)), config=None)
    return ["gate differs between layers", f"in layers [{LAYER}]", f"in layers [{LAYER + 2}]"]


def _broken_config_shapes(d, cfg, rng):
    other = cfg.replace(expert_intermediate_size=8)
    _save_pair(d, cfg, rng, config=other)
    return ["does not match the config", "W_up"]


def _broken_nan(d, cfg, rng):
    _save_pair(d, cfg, rng, lambda s: s["W_gate"].view(-1)[7].fill_(float("nan")))
    return ["non-finite", moe_key(LAYER, "W_gate")]


def _broken_missing_shard(d, cfg, rng):
    _save_pair(d, cfg, rng, max_shard_bytes=4096)
    shard = shard_of(d, moe_key(LAYER, "gate"))
    shard.unlink()
    return ["missing", shard.name]


def _broken_both_prefixes(d, cfg, rng):
    _case_both_prefixes(d, cfg, rng)
    return ["with and without", "gate"]


def _broken_corrupt_header(d, cfg, rng):
    _case_garbage_header(d, cfg, rng)
    return ["corrupt", SINGLE_FILE]


def _broken_nowhere(d, cfg, rng):
    return ["no such file"]


BROKEN = {
    "truncated file": _broken_truncated,
    "missing key": _broken_missing_key,
    "shapes differ between layers": _broken_layer_shapes,
    "shapes differ from the config": _broken_config_shapes,
    "NaN": _broken_nan,
    "missing shard": _broken_missing_shard,
    "key with and without prefix": _broken_both_prefixes,
    "corrupt header": _broken_corrupt_header,
    "no such path": _broken_nowhere,
}


@pytest.mark.parametrize("case", list(BROKEN), ids=list(BROKEN))
def test_inspect_reports_problems_without_raising(tmp_path, rng, case):
    cfg = tiny_config()
    d = tmp_path / "ckpt"
    words = BROKEN[case](d, cfg, rng)
    report = inspect_checkpoint(d, check_finite=True)
    assert report.problems, report.format()
    text = "\n".join(report.problems)
    for word in words:
        assert word in text, text
    assert not report.ok and "problem:" in report.format()
    if case == "NaN":  # non-finite values are looked for only when asked
        assert inspect_checkpoint(d).problems == []


@pytest.mark.parametrize("world", [1, 4, 8])
def test_load_layers_builds_every_layer_of_a_rank(tmp_path, rng, world, capsys):
    cfg = twelve_head_config()
    layers = {2: random_state(cfg, rng), 3: random_state(cfg, rng), 5: random_state(cfg, rng)}
    save_checkpoint(tmp_path, layers, config=cfg, max_shard_bytes=700, prefix="transformer.")
    for rank in range(world):
        partition = HeadPartition(12, world, rank)
        modules, nbytes = load_layers(tmp_path, partition=partition, progress=True)
        assert sorted(modules) == [2, 3, 5]
        share = 0
        for index, module in modules.items():
            for name, tensor in module.state_dict().items():
                expected = expected_rank_rows(layers[index][name], 12, 3, world, rank)
                assert torch.equal(tensor, expected), (world, rank, index, name)
                real_rows = partition.real_heads * 3
                share += real_rows * tensor[0].numel() * tensor.element_size()
        assert nbytes == share, (world, rank)  # bytes read = this rank's share, nothing more
    assert "loaded layer 5" in capsys.readouterr().out
    modules, _ = load_layers(tmp_path, [3])
    assert list(modules) == [3]
    with pytest.raises(CheckpointError, match=r"block\.layers\.4"):
        load_layers(tmp_path, [2, 4])
