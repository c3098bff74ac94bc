"""Loading: strict checks before anything is copied, malformed checkpoints, per-rank
slicing, pre-sliced files, and modules built on the meta device (docs/contract.md
sections 5 and 6).

Malformed checkpoints are built with the reference writer (`safetensors.torch`) or by
editing bytes, so the reader is not only tested against its own writer.
"""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch

import mhmoe.checkpoint.load as load
from conftest import (
    CKPT_LAYER,
    ckpt_assert_names,
    ckpt_random_module,
    ckpt_random_state,
    ckpt_save_both_prefixes,
    ckpt_save_garbage_header,
    ckpt_save_pair,
    ckpt_shard_of,
    ckpt_tiny_config,
    ckpt_twelve_head_config,
)
from mhmoe import HeadPartition, MultiHeadMoE, MultiHeadMoEConfig
from mhmoe.checkpoint import (
    INDEX_FILE,
    MOE_PARAM_NAMES,
    SINGLE_FILE,
    CheckpointError,
    CheckpointReader,
    load_layer,
    load_layer_state,
    load_layers,
    moe_key,
    save_checkpoint,
)


@pytest.mark.parametrize("prefix", ["", "transformer."], ids=["bare", "transformer"])
def test_load_layer_forward_equals_original(tmp_path, rng, prefix):
    cfg = ckpt_tiny_config()
    original = ckpt_random_module(cfg, rng)
    save_checkpoint(tmp_path, {4: original, 5: ckpt_random_module(cfg, rng)}, prefix=prefix)
    loaded = load_layer(tmp_path, 4)
    assert loaded.config == cfg and loaded.partition == original.partition
    for name, param in loaded.named_parameters():
        assert param.device.type == "cpu"
        assert param.requires_grad == (not name.startswith("router.")), name
        assert torch.equal(param, original.state_dict()[name]), name
    x = torch.randn(9, cfg.hidden_size, generator=rng)
    assert torch.equal(loaded(x), original(x))


# ----------------------------------------------------------------------------------------
# Malformed checkpoints
# ----------------------------------------------------------------------------------------


def _layer_keys(prefix: str = "") -> list[str]:
    return [moe_key(CKPT_LAYER, n, prefix) for n in MOE_PARAM_NAMES]


def _case_missing_key(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, lambda s: s.pop("W_up"))
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "W_up")], {}


def _case_unexpected_key(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, lambda s: s.update(W_extra=torch.zeros(3)))
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "W_extra")], {}


def _case_gate_width(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, lambda s: s.update(gate=torch.zeros(16, cfg.head_dim + 1)))
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "gate")], {}


def _case_rows(d, cfg, rng):
    # one flat expert too many
    ckpt_save_pair(d, cfg, rng, lambda s: s.update(W_up=torch.cat([s["W_up"], s["W_up"][:1]])))
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "W_up")], {}


def _case_transposed(d, cfg, rng):
    # W_down stored [rows, D, I] instead of [rows, I, D]
    ckpt_save_pair(d, cfg, rng, lambda s: s.update(W_down=s["W_down"].transpose(1, 2).contiguous()))
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "W_down")], {}


def _case_weight_dtype(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, lambda s: s.update(W_gate=s["W_gate"].half()))
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "W_gate")], {}


def _case_router_dtype(d, cfg, rng):
    # the router must stay fp32 whatever the weights are
    ckpt_save_pair(d, cfg, rng, lambda s: s.update(**{"router.expert_bias":
                                                  s["router.expert_bias"].bfloat16()}))
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "router.expert_bias")], {}


def _case_both_prefixes(d, cfg, rng):
    ckpt_save_both_prefixes(d, cfg, rng)
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "gate")], {}


def _case_truncated(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng)
    file = d / SINGLE_FILE
    os.truncate(file, file.stat().st_size - 100)
    return d, file, _layer_keys(), {}


def _case_truncated_shard(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, max_shard_bytes=4096)
    shard = ckpt_shard_of(d, moe_key(CKPT_LAYER, "W_up"))
    os.truncate(shard, shard.stat().st_size - 1)
    return d, shard, _layer_keys(), {}


def _case_garbage_header(d, cfg, rng):
    ckpt_save_garbage_header(d, cfg, rng)
    return d, d / SINGLE_FILE, None, {}


def _case_header_length(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng)
    with open(d / SINGLE_FILE, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    return d, d / SINGLE_FILE, None, {}


def _case_missing_shard(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, max_shard_bytes=4096)
    shard = ckpt_shard_of(d, moe_key(CKPT_LAYER, "W_down"))
    shard.unlink()
    return d, shard, _layer_keys(), {}


def _case_index_maps_key_to_wrong_shard(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, max_shard_bytes=4096)
    index = json.loads((d / INDEX_FILE).read_text())
    key = moe_key(CKPT_LAYER, "gate")
    other = next(f for f in index["weight_map"].values() if f != index["weight_map"][key])
    index["weight_map"][key] = other
    (d / INDEX_FILE).write_text(json.dumps(index))
    return d, d / other, [key], {}


def _case_garbage_index(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, max_shard_bytes=4096)
    (d / INDEX_FILE).write_text('{"weight_map": ')
    return d, d / INDEX_FILE, None, {}


def _case_nan(d, cfg, rng):
    def poison(state):
        state["W_down"][5, 1, 0] = float("nan")
    ckpt_save_pair(d, cfg, rng, poison)
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "W_down")], {}


def _case_inf(d, cfg, rng):
    def poison(state):
        state["router.expert_bias_ema"][2] = float("-inf")
    ckpt_save_pair(d, cfg, rng, poison)
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "router.expert_bias_ema")], {}


def _case_unknown_layer(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng)
    return d, d / SINGLE_FILE, None, {"layer": CKPT_LAYER + 1, "match": f"layer {CKPT_LAYER + 1} "}


def _case_mixed_pre_sliced(d, cfg, rng):
    # world 2: local_flat = 8 of 16 rows; W_up pre-sliced, the rest full
    ckpt_save_pair(d, cfg, rng, lambda s: s.update(W_up=s["W_up"][:8].clone()))
    return d, d / SINGLE_FILE, [moe_key(CKPT_LAYER, "W_up")], {"partition": HeadPartition(4, 2, 0)}


def _case_no_config(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, config=None)
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
    cfg = ckpt_tiny_config()
    path, file, keys, options = MALFORMED[case](tmp_path / "ckpt", cfg, rng)
    layer = options.get("layer", CKPT_LAYER)
    config = options.get("config", cfg)
    partition = options.get("partition")
    with pytest.raises(CheckpointError, match=options.get("match")) as error:
        load_layer_state(path, layer, config, partition)
    ckpt_assert_names(error, file, keys)

    # load_layer fails the same way, before any module is built.
    built = []

    class Spy(MultiHeadMoE):
        def __init__(self, *args, **kwargs):
            built.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(load, "MultiHeadMoE", Spy)
    with pytest.raises(CheckpointError) as error:
        load_layer(path, layer, config, partition=partition)
    ckpt_assert_names(error, file, keys)
    assert built == []



def test_verify_covers_only_what_was_read(tmp_path, rng):
    cfg = ckpt_twelve_head_config()
    state = ckpt_random_state(cfg, rng)
    state["W_up"][30, 0, 0] = float("nan")  # row 30 = head 10 (E = 3)
    save_checkpoint(tmp_path, {CKPT_LAYER: state}, config=cfg)
    with pytest.raises(CheckpointError, match="row 30") as error:
        load_layer_state(tmp_path, CKPT_LAYER, partition=HeadPartition(12, 2, 1))
    ckpt_assert_names(error, tmp_path / SINGLE_FILE, [moe_key(CKPT_LAYER, "W_up")])
    # rank 0 of 2 (heads 0..5) never reads row 30
    load_layer_state(tmp_path, CKPT_LAYER, partition=HeadPartition(12, 2, 0))
    # verify=False hands the values over as they are
    loaded = load_layer_state(tmp_path, CKPT_LAYER, partition=HeadPartition(12, 2, 1), verify=False)
    assert torch.isnan(loaded["W_up"][30 - 18, 0, 0])


# ----------------------------------------------------------------------------------------
# Per-rank slicing (docs/contract.md section 6)
# ----------------------------------------------------------------------------------------


def expected_rank_rows(full: torch.Tensor, heads: int, E: int, world: int,
                       rank: int) -> torch.Tensor:
    """Written from docs/contract.md section 6 alone: pad heads to a multiple of the world size;
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
    cfg = ckpt_twelve_head_config()
    H, E = cfg.num_heads, cfg.num_experts
    full = ckpt_random_state(cfg, rng)
    save_checkpoint(tmp_path, {CKPT_LAYER: full}, config=cfg, max_shard_bytes=600)
    with CheckpointReader(tmp_path) as reader:
        for rank in range(world):
            partition = HeadPartition(H, world, rank)
            before = reader.bytes_read
            state = load_layer_state(reader, CKPT_LAYER, partition=partition)
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
    full = ckpt_random_state(cfg, rng)
    save_checkpoint(tmp_path, {CKPT_LAYER: full}, config=cfg)
    rank = world - 1
    state = load_layer_state(tmp_path, CKPT_LAYER, partition=HeadPartition(5, world, rank))
    for name in MOE_PARAM_NAMES:
        expected = expected_rank_rows(full[name], 5, 2, world, rank)
        assert torch.equal(state[name], expected), name
        assert not state[name][-2:].any()  # the padding head's two rows


def test_load_layer_per_rank_module(tmp_path, rng):
    cfg = ckpt_twelve_head_config()
    full = ckpt_random_state(cfg, rng)
    save_checkpoint(tmp_path, {CKPT_LAYER: full}, config=cfg)
    partition = HeadPartition(12, 5, 3)  # heads 9, 10, 11
    module = load_layer(tmp_path, CKPT_LAYER, partition=partition)
    assert module.partition == partition
    assert torch.equal(module.W_gate, full["W_gate"][27:36])
    assert not module.router.expert_bias_ema.requires_grad


def test_pre_sliced_checkpoint_is_taken_as_is(tmp_path, rng):
    cfg = ckpt_twelve_head_config()
    world, local_flat = 4, 3 * cfg.num_experts
    # A rank's module saved as it is: its rows only, its partition in the metadata.
    modules = [ckpt_random_module(cfg, rng, HeadPartition(12, world, r)) for r in range(world)]
    for rank, module in enumerate(modules):
        save_checkpoint(tmp_path / f"rank{rank}", {CKPT_LAYER: module})
    for rank, module in enumerate(modules):
        partition = HeadPartition(12, world, rank)
        state = load_layer_state(tmp_path / f"rank{rank}", CKPT_LAYER, partition=partition)
        for name, tensor in module.state_dict().items():
            assert tensor.shape[0] == local_flat
            assert torch.equal(state[name], tensor), (rank, name)
    # Loading rank 1's file on rank 2 would silently give rank 1's weights: refused.
    with pytest.raises(CheckpointError, match="pre-sliced") as error:
        load_layer_state(tmp_path / "rank1", CKPT_LAYER, partition=HeadPartition(12, world, 2))
    ckpt_assert_names(error, tmp_path / "rank1" / SINGLE_FILE, _layer_keys())
    # Without a recorded partition a local_flat-row file is trusted (documented).
    rows = ckpt_random_state(cfg, rng, rows=local_flat)
    save_checkpoint(tmp_path / "bare", {CKPT_LAYER: rows}, config=cfg)
    state = load_layer_state(tmp_path / "bare", CKPT_LAYER, partition=HeadPartition(12, world, 2))
    assert all(torch.equal(state[n], rows[n]) for n in MOE_PARAM_NAMES)
    # A world of 1 expects the full tensors.
    with pytest.raises(CheckpointError, match="shape"):
        load_layer_state(tmp_path / "bare", CKPT_LAYER)


@pytest.mark.parametrize("world", [1, 4, 8])
def test_load_layers_builds_every_layer_of_a_rank(tmp_path, rng, world, capsys):
    cfg = ckpt_twelve_head_config()
    layers = {2: ckpt_random_state(cfg, rng), 3: ckpt_random_state(cfg, rng),
              5: ckpt_random_state(cfg, rng)}
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


def test_layer_index_given_as_text_is_refused_clearly(tmp_path, rng):
    # load_layer(path, "3") used to answer that layer 3 is not in a checkpoint that has it.
    import numpy as np

    ckpt_save_pair(tmp_path, ckpt_tiny_config(), rng)
    for call in (lambda: load_layer(tmp_path, str(CKPT_LAYER)),
                 lambda: load_layer_state(tmp_path, str(CKPT_LAYER)),
                 lambda: load_layers(tmp_path, [str(CKPT_LAYER)])):
        with pytest.raises(TypeError, match="int layer index") as err:
            call()
        assert f"int('{CKPT_LAYER}')" in str(err.value)
        assert "not in the checkpoint" not in str(err.value)
    for bad in (3.0, True):
        with pytest.raises(TypeError, match="int layer index"):
            load_layer(tmp_path, bad)
    # Integer types other than int (a numpy index, say) are fine.
    module = load_layer(tmp_path, np.int64(CKPT_LAYER))
    assert torch.equal(module.gate, load_layer(tmp_path, CKPT_LAYER).gate)


# ---------------------------------------------------------------------------------------
# fp8 checkpoints (docs/fp8.md): F8_E4M3 weights with NAME_scale beside NAME
# ---------------------------------------------------------------------------------------


def _fp8_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_fp8_load_layer_equals_original(tmp_path, rng):
    from mhmoe.fp8 import FP8

    cfg = ckpt_tiny_config().replace(params_dtype=FP8)
    original = ckpt_random_module(cfg, rng)
    save_checkpoint(tmp_path, {4: original}, prefix="transformer.")
    loaded = load_layer(tmp_path, 4, backend="torch")
    assert loaded.config == cfg
    for name, param in loaded.named_parameters():
        assert not param.requires_grad, name
        assert torch.equal(_fp8_bits(param), _fp8_bits(original.state_dict()[name])), name
    for name in ("W_gate", "W_up", "W_down"):  # the K-major layout of the fp8 kernel
        assert getattr(loaded, name).transpose(1, 2).is_contiguous(), name
    x = torch.randn(9, cfg.hidden_size, generator=rng)
    with torch.no_grad():
        assert torch.equal(loaded(x), original(x))
    modules, nbytes = load_layers(tmp_path)
    assert list(modules) == [4] and nbytes > 0


def test_fp8_per_rank_rows_and_padding_scales(tmp_path, rng):
    from mhmoe.fp8 import FP8, ZERO_SCALE

    cfg = ckpt_twelve_head_config().replace(params_dtype=FP8)
    full = ckpt_random_module(cfg, rng).state_dict()
    save_checkpoint(tmp_path, {2: full}, config=cfg)
    E = cfg.num_experts
    for world in (5, 8):  # 12 heads padded to 15 and 16: ranks with padding, and none real
        for rank in range(world):
            p = HeadPartition(12, world, rank)
            state = load_layer_state(tmp_path, 2, partition=p)
            begin, end = p.rows(E)
            real = max(0, min(end, 12 * E) - begin)
            for name, value in state.items():
                assert value.shape[0] == p.local_heads * E, name
                assert torch.equal(_fp8_bits(value[:real]),
                                   _fp8_bits(full[name][begin:begin + real])), name
                pad = value[real:]
                if name.endswith("_scale"):
                    assert (pad == ZERO_SCALE).all(), (name, world, rank)
                else:
                    assert (_fp8_bits(pad) == 0).all(), (name, world, rank)
            module = load_layer(tmp_path, 2, partition=p)
            assert module.partition == p and module.W_down_scale.shape == (p.local_heads * E,
                                                                          cfg.head_dim)


@pytest.mark.parametrize("case", ["missing scale", "mis-shaped scale", "fp16 scale",
                                  "negative scale", "NaN weight", "no scheme", "other scheme"])
def test_fp8_checkpoint_problems_name_the_tensor(tmp_path, rng, case):
    import safetensors.torch

    from mhmoe.checkpoint import QUANT_METADATA_KEY
    from mhmoe.fp8 import FP8

    cfg = ckpt_tiny_config().replace(params_dtype=FP8)
    states = {layer: {n: t.contiguous() for n, t in ckpt_random_module(cfg, rng)
                      .state_dict().items()} for layer in (CKPT_LAYER, CKPT_LAYER + 2)}
    bad = states[CKPT_LAYER]
    key = moe_key(CKPT_LAYER, "W_up_scale")
    if case == "missing scale":
        del bad["W_up_scale"]
    elif case == "mis-shaped scale":
        bad["W_up_scale"] = bad["W_up_scale"][:, :-1].contiguous()
    elif case == "fp16 scale":
        bad["W_up_scale"] = bad["W_up_scale"].half()
    elif case == "negative scale":
        bad["W_up_scale"][1, 2] = -bad["W_up_scale"][1, 2]
    elif case == "NaN weight":
        bad["W_up"].view(torch.uint8).view(-1)[7] = 0x7F  # e4m3's NaN
        key = moe_key(CKPT_LAYER, "W_up")
    save_checkpoint(tmp_path, states, config=cfg)
    if case in ("no scheme", "other scheme"):
        tensors = safetensors.torch.load_file(tmp_path / SINGLE_FILE)
        with safe_open_metadata(tmp_path / SINGLE_FILE) as metadata:
            if case == "no scheme":
                del metadata[QUANT_METADATA_KEY]
            else:
                metadata[QUANT_METADATA_KEY] = "fp8-e4m3fn/weights:per-tensor"
        safetensors.torch.save_file(tensors, tmp_path / SINGLE_FILE, metadata=metadata)
        with pytest.raises(CheckpointError, match=QUANT_METADATA_KEY):
            load_layer(tmp_path, CKPT_LAYER)
        return
    with pytest.raises(CheckpointError) as err:
        load_layer(tmp_path, CKPT_LAYER)
    ckpt_assert_names(err, tmp_path / SINGLE_FILE, [key])
    if case == "negative scale":
        assert "not > 0" in str(err.value)
        load_layer(tmp_path, CKPT_LAYER, verify=False)  # as asked
    load_layer(tmp_path, CKPT_LAYER + 2)  # the sound neighbour loads


class safe_open_metadata:
    """The metadata of a safetensors file as a dict to edit (a context manager)."""

    def __init__(self, file):
        from safetensors import safe_open

        with safe_open(str(file), "pt") as f:
            self.metadata = dict(f.metadata() or {})

    def __enter__(self):
        return self.metadata

    def __exit__(self, *exc):
        return False


def test_fp8_and_bf16_configs_do_not_mix(tmp_path, rng):
    from mhmoe.fp8 import FP8

    cfg = ckpt_tiny_config()
    save_checkpoint(tmp_path / "fp8", {2: ckpt_random_module(cfg.replace(params_dtype=FP8),
                                                             rng)})
    with pytest.raises(CheckpointError, match="scales of an fp8 checkpoint"):
        load_layer(tmp_path / "fp8", 2, cfg)
    save_checkpoint(tmp_path / "bf16", {2: ckpt_random_module(cfg, rng)})
    with pytest.raises(CheckpointError, match="the scales of fp8 weights"):
        load_layer(tmp_path / "bf16", 2, cfg.replace(params_dtype=FP8))
