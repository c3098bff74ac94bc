"""save_checkpoint: files, shards, the index, metadata, crash safety and progress
(docs/contract.md section 5).

Every file written is also read back with the reference reader (`safetensors.torch`).
"""

from __future__ import annotations

import json
import re

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import mhmoe.checkpoint.writer as writer
from conftest import (
    ckpt_random_module,
    ckpt_tiny_config,
)
from mhmoe import MultiHeadMoEConfig
from mhmoe.checkpoint import (
    INDEX_FILE,
    MOE_PARAM_NAMES,
    SINGLE_FILE,
    CheckpointError,
    CheckpointReader,
    load_layer_state,
    moe_key,
    save_checkpoint,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefix", ["", "transformer."], ids=["bare", "transformer"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_round_trip(tmp_path, rng, sharded, prefix, dtype):
    cfg = ckpt_tiny_config(dtype)
    modules = {2: ckpt_random_module(cfg, rng), 7: ckpt_random_module(cfg, rng)}
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


def test_resave_switches_layout_and_removes_stale_files(tmp_path, rng):
    cfg = ckpt_tiny_config()
    first, second, third = (ckpt_random_module(cfg, rng) for _ in range(3))
    save_checkpoint(tmp_path, {1: first}, max_shard_bytes=4096)
    assert (tmp_path / INDEX_FILE).exists()
    save_checkpoint(tmp_path, {1: second}, overwrite=True)  # sharded -> single file
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]
    assert torch.equal(load_layer_state(tmp_path, 1)["W_down"], second.W_down)
    files = save_checkpoint(tmp_path, {1: third}, max_shard_bytes=4096,
                            overwrite=True)  # single -> sharded
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files)
    assert torch.equal(load_layer_state(tmp_path, 1)["W_down"], third.W_down)


def test_failed_save_keeps_previous_checkpoint(tmp_path, rng, monkeypatch):
    cfg = ckpt_tiny_config()
    old = ckpt_random_module(cfg, rng)
    save_checkpoint(tmp_path, {1: old, 2: old}, max_shard_bytes=4096)
    before = sorted(p.name for p in tmp_path.iterdir())
    real_write = writer._write_safetensors
    calls = []

    def crash_in_second_file(final, entries, metadata, advance, stamp):
        calls.append(final)
        if len(calls) < 2:
            return real_write(final, entries, metadata, advance, stamp)

        def advance_then_crash(n):
            raise OSError("disk full (simulated)")
        return real_write(final, entries, metadata, advance_then_crash, stamp)

    monkeypatch.setattr(writer, "_write_safetensors", crash_in_second_file)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, {1: ckpt_random_module(cfg, rng), 2: old}, max_shard_bytes=4096,
                        overwrite=True)
    assert len(calls) == 2
    # nothing was renamed into place, no temporary file is left, the old one loads intact
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    state = load_layer_state(tmp_path, 1)
    for name, tensor in old.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_progress_bar(tmp_path, rng, capsys):
    cfg = ckpt_tiny_config(torch.bfloat16)
    module = ckpt_random_module(cfg, rng)
    files = save_checkpoint(tmp_path, {2: module}, progress=True)
    assert files == [tmp_path / SINGLE_FILE]
    assert torch.equal(load_layer_state(tmp_path, 2)["W_gate"], module.W_gate)


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


def _foreign_checkpoint(directory, rng, sharded):
    """A checkpoint another tool wrote (the reference writer, no mhmoe metadata) plus a
    file that is no checkpoint at all."""
    directory.mkdir()
    tensors = {"transformer.block.layers.0.attn.weight": torch.randn(8, 8, generator=rng)}
    if sharded:
        safetensors.torch.save_file(tensors, directory / "model-00001-of-00002.safetensors")
        safetensors.torch.save_file({"x": torch.ones(3)},
                                    directory / "model-00002-of-00002.safetensors")
        (directory / INDEX_FILE).write_text(json.dumps({
            "metadata": {"total_size": 268},
            "weight_map": {"transformer.block.layers.0.attn.weight":
                           "model-00001-of-00002.safetensors",
                           "x": "model-00002-of-00002.safetensors"}}))
    else:
        safetensors.torch.save_file(tensors, directory / SINGLE_FILE)
    (directory / "README.md").write_text("the model card")
    return {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_save_refuses_a_directory_holding_another_checkpoint(tmp_path, rng, sharded):
    # Data loss: saving into a directory that holds someone else's model deleted its
    # shards and index. Now the save is refused, names the way out, and touches nothing.
    d = tmp_path / "model"
    before = _foreign_checkpoint(d, rng, sharded)
    module = ckpt_random_module(ckpt_tiny_config(), rng)
    for max_shard in (None, 4096):
        with pytest.raises(CheckpointError, match="already holds a checkpoint") as err:
            save_checkpoint(d, {1: module}, max_shard_bytes=max_shard)
        assert "overwrite=True" in str(err.value) and "--overwrite" in str(err.value)
        assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    # Any other safetensors file counts too (not only the names mhmoe writes).
    other = tmp_path / "other"
    other.mkdir()
    safetensors.torch.save_file({"w": torch.ones(2)}, other / "diffusion_pytorch_model.safetensors")
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        save_checkpoint(other, {1: module})
    # A directory with other files only is fine, and they stay.
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "config.json").write_text("{}")
    save_checkpoint(notes, {1: module})
    assert _names(notes) == ["config.json", SINGLE_FILE]


def test_overwrite_never_removes_what_mhmoe_did_not_write(tmp_path, rng):
    cfg = ckpt_tiny_config()
    module = ckpt_random_module(cfg, rng)
    # A foreign sharded checkpoint: overwriting it with mhmoe shards replaces the index
    # and the shards of the same names (asked for), and keeps everything else.
    d = tmp_path / "sharded"
    before = _foreign_checkpoint(d, rng, sharded=True)
    (d / "model-00003-of-00003.safetensors").write_bytes(b"not mhmoe's")
    files = save_checkpoint(d, {1: module}, max_shard_bytes=4096, overwrite=True)
    assert len(files) > 3
    written = {p.name for p in files}
    assert set(_names(d)) == written | set(before) | {"model-00003-of-00003.safetensors"}
    for name, data in before.items():  # the foreign files not replaced are untouched
        if name not in written:
            assert (d / name).read_bytes() == data, name
    state = load_layer_state(d, 1)
    assert torch.equal(state["W_up"], module.W_up)
    # A foreign single file that a sharded save would leave beside its index (or a
    # foreign index beside a single file): refused before anything is written.
    for sharded, max_shard in ((False, 4096), (True, None)):
        d = tmp_path / f"mixed-{sharded}"
        before = _foreign_checkpoint(d, rng, sharded)
        with pytest.raises(CheckpointError, match="not written by mhmoe"):
            save_checkpoint(d, {1: module}, max_shard_bytes=max_shard, overwrite=True)
        assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_overwrite_removes_only_the_shards_its_own_index_lists(tmp_path, rng):
    cfg = ckpt_tiny_config()
    first, second = ckpt_random_module(cfg, rng), ckpt_random_module(cfg, rng)
    old = save_checkpoint(tmp_path, {1: first, 2: first}, max_shard_bytes=4096)
    assert len(old) > 4
    # A look-alike shard that mhmoe's index does not list, and a file of the pattern the
    # index lists but written by someone else (replaced in place after the save).
    (tmp_path / "model-00042-of-00099.safetensors").write_bytes(b"someone else's")
    victim = old[-2]
    safetensors.torch.save_file({"y": torch.zeros(1)}, victim)
    new = save_checkpoint(tmp_path, {1: second}, max_shard_bytes=8192, overwrite=True)
    assert len(new) < len(old)
    expected = {p.name for p in new} | {"model-00042-of-00099.safetensors"}
    if victim.name not in {p.name for p in new}:
        expected.add(victim.name)  # not mhmoe's metadata: kept
    assert set(_names(tmp_path)) == expected
    assert torch.equal(load_layer_state(tmp_path, 1)["gate"], second.gate)
    # Back to one file: the mhmoe shards and index go, the foreign files stay.
    save_checkpoint(tmp_path, {1: first}, overwrite=True)
    assert set(_names(tmp_path)) == {SINGLE_FILE} | (expected - {p.name for p in new})


_KILLED_SAVE = """
import os, sys, time
import torch
import mhmoe.checkpoint.writer as writer
from mhmoe import MultiHeadMoE, MultiHeadMoEConfig
from mhmoe.checkpoint import save_checkpoint

cfg = MultiHeadMoEConfig(hidden_size=32, num_heads=4, num_experts=4, top_k=2,
                         expert_intermediate_size=16, params_dtype=torch.float32)
real = writer._write_safetensors
calls = []

def write_then_hang(final, entries, metadata, advance, stamp):
    calls.append(final)
    if len(calls) == 3:  # two shards written under temporary names, the third started
        def hang(n):
            print("writing", flush=True)
            time.sleep(600)
        return real(final, entries, metadata, hang, stamp)
    return real(final, entries, metadata, advance, stamp)

writer._write_safetensors = write_then_hang
save_checkpoint(sys.argv[1], {2: MultiHeadMoE(cfg), 3: MultiHeadMoE(cfg)}, max_shard_bytes=4096)
"""


_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_next_save_removes_what_a_killed_save_left(tmp_path, rng):
    # kill -9 in the middle of a save leaves the writer's hidden temporaries and its lock
    # file; the next save into the directory removes them, and only them.
    import os
    import signal
    import subprocess
    import sys

    d = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(d)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    left = _names(d)
    temps = [n for n in left if n.endswith(".tmp")]
    assert len(temps) == 3 and all(n.startswith(".") for n in temps), left
    stamp = re.fullmatch(r".*\.(\d+\.[0-9a-f]{8})\.tmp", temps[0])[1]
    assert stamp.startswith(f"{proc.pid}.") and all(stamp in n for n in temps)
    assert [n for n in left if n not in temps] == [f".mhmoe-save.{stamp}.lock"]
    # Files that are not the writer's temporaries of a save that is gone: another tool's
    # temporary, names close to the patterns, and the files of a save in progress in
    # another process (it holds its lock).
    live = f"{os.getpid() + 1}.0123abcd"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK,
                               str(d / f".mhmoe-save.{live}.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        keep = [".model.safetensors.tmp", "model.safetensors.12345.0123abcd.tmp",
                ".model.safetensors.12345.0123abcd.tmp.bak", ".notes.12345.0123abcd.tmp",
                ".model.safetensors.12345.NOTHEXXX.tmp", ".mhmoe-save.12345.lock",
                ".mhmoe-save.12345.0123abcd.lock.bak",
                f".model-00001-of-00002.safetensors.{live}.tmp"]
        for name in keep:
            (d / name).write_bytes(b"keep me")
        files = save_checkpoint(d, {2: ckpt_random_module(ckpt_tiny_config(), rng)})
    finally:
        holder.kill()
        holder.wait()
    assert set(_names(d)) == {p.name for p in files} | set(keep) | {f".mhmoe-save.{live}.lock"}
    assert all((d / name).read_bytes() == b"keep me" for name in keep)


def test_a_killed_save_is_stale_whatever_its_pid(tmp_path, rng):
    # In a container mhmoe may always run with the same PID, so a killed save's files
    # carry the PID of the process saving now (or, on a shared filesystem, a PID that
    # means nothing on this host): the save's lock decides, never the PID.
    import os

    d = tmp_path / "ckpt"
    d.mkdir()
    dead = f"{os.getpid()}.0123abcd"
    stale = [f".model.safetensors.{dead}.tmp", f".mhmoe-save.{dead}.lock",
             f".model-00001-of-00002.safetensors.{dead}.tmp",
             # no lock file at all: a save that is over (or an older writer's temporary)
             f".model.safetensors.index.json.{os.getpid()}.89abcdef.tmp"]
    for name in stale:
        (d / name).write_bytes(b"left by a killed save")
    module = ckpt_random_module(ckpt_tiny_config(), rng)
    # A save in progress in this very process (same PID) holds its lock: its files stay.
    with writer._save_lock(d) as live:
        temp = f".model.safetensors.{live}.tmp"
        (d / temp).write_bytes(b"being written")
        files = save_checkpoint(d, {2: module})
        assert set(_names(d)) == {p.name for p in files} | {temp, f".mhmoe-save.{live}.lock"}
    # That save ended (its lock file with it) without renaming its temporary: now stale.
    assert _names(d) == [temp, SINGLE_FILE]
    save_checkpoint(d, {2: module}, overwrite=True)
    assert _names(d) == [SINGLE_FILE]


def test_progress_description_is_not_markup(tmp_path, rng, monkeypatch):
    # The directory name is shown by rich, which must not read "[...]" in it as markup.
    import io

    import rich
    from rich.console import Console

    module = ckpt_random_module(ckpt_tiny_config(), rng)
    for name in ("ckpt[plot]", "run[red]1"):
        screen = io.StringIO()
        monkeypatch.setattr(rich, "_console", Console(file=screen, force_terminal=True,
                                                      width=120))
        files = save_checkpoint(tmp_path / name, {2: module}, progress=True)
        assert files == [tmp_path / name / SINGLE_FILE]
        assert f"writing {name}" in screen.getvalue()


# ---------------------------------------------------------------------------------------
# fp8 layers (docs/fp8.md), and save_checkpoint_layers
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_fp8_layers_are_saved_as_f8_e4m3_with_their_scales(tmp_path, rng, sharded):
    from mhmoe.checkpoint import FP8_SCALE_NAMES, QUANT_METADATA_KEY
    from mhmoe.fp8 import FP8, SCHEME

    cfg = ckpt_tiny_config().replace(params_dtype=FP8)
    modules = {2: ckpt_random_module(cfg, rng), 4: ckpt_random_module(cfg, rng)}
    files = save_checkpoint(tmp_path, modules, max_shard_bytes=4096 if sharded else None)
    index_metadata = json.loads((tmp_path / INDEX_FILE).read_text())["metadata"] if sharded \
        else None
    if sharded:
        assert index_metadata[QUANT_METADATA_KEY] == SCHEME
    keys = set()
    for file in (f for f in files if f.suffix == ".safetensors"):
        with open(file, "rb") as f:  # the header as written: safetensors' dtype names
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        assert header["__metadata__"][QUANT_METADATA_KEY] == SCHEME
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            name = key.rsplit(".moe_mlp.", 1)[1]
            want = "F8_E4M3" if name in ("W_gate", "W_up", "W_down") else "F32"
            assert entry["dtype"] == want, key
        with safe_open(str(file), "pt") as f:  # the reference reader
            for key in f.keys():
                layer, name = int(key.split(".")[2]), key.rsplit(".moe_mlp.", 1)[1]
                value, want = f.get_tensor(key), modules[layer].state_dict()[name]
                # written contiguous in the checkpoint's own [F, D, I] / [F, I, D] shapes
                assert value.shape == want.shape and value.dtype == want.dtype, key
                if value.dtype == FP8:
                    value, want = value.view(torch.uint8), want.contiguous().view(torch.uint8)
                assert torch.equal(value, want), key
                keys.add(key)
    assert keys == {moe_key(layer, name) for layer in (2, 4)
                    for name in (*MOE_PARAM_NAMES, *FP8_SCALE_NAMES)}


def test_save_checkpoint_layers_makes_and_writes_one_layer_at_a_time(tmp_path, rng):
    from mhmoe.checkpoint import save_checkpoint_layers

    cfg = ckpt_tiny_config()
    made, states = [], {layer: ckpt_random_module(cfg, rng).state_dict() for layer in (2, 3, 6)}

    def make(layer):
        # the files of the layers made before are written (under temporary names)
        assert len([p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]) == len(made)
        made.append(layer)
        return {moe_key(layer, name, "transformer."): t for name, t in states[layer].items()}

    files = save_checkpoint_layers(tmp_path, [3, 2, 6], make, config=cfg)
    assert made == [3, 2, 6]
    assert [p.name for p in files] == [f"model-0000{i}-of-00003.safetensors"
                                       for i in (1, 2, 3)] + [INDEX_FILE]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"][moe_key(2, "gate", "transformer.")] == \
        "model-00002-of-00003.safetensors"
    assert MultiHeadMoEConfig.from_json(index["metadata"]["mhmoe.config"]) == cfg
    for layer in (2, 3, 6):
        state = load_layer_state(tmp_path, layer)
        assert all(torch.equal(state[n], states[layer][n]) for n in MOE_PARAM_NAMES)
    # one layer: one file
    one = tmp_path / "one"
    assert save_checkpoint_layers(one, [2], make=lambda layer: {
        moe_key(layer, n, ""): t for n, t in states[layer].items()}, config=cfg) == \
        [one / SINGLE_FILE]


def test_save_checkpoint_layers_follows_the_writers_rules(tmp_path, rng):
    from mhmoe.checkpoint import save_checkpoint_layers

    cfg = ckpt_tiny_config()
    state = ckpt_random_module(cfg, rng).state_dict()

    def make(layer):
        if layer == 5:
            raise RuntimeError("layer 5 cannot be made")
        return {moe_key(layer, n): t for n, t in state.items()}

    d = tmp_path / "d"
    with pytest.raises(RuntimeError, match="layer 5"):
        save_checkpoint_layers(d, [2, 5], make, config=cfg)
    assert list(d.iterdir()) == []  # nothing half-written is left behind
    save_checkpoint_layers(d, [2, 3], make, config=cfg)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        save_checkpoint_layers(d, [4], make, config=cfg)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    save_checkpoint_layers(d, [4], make, config=cfg, overwrite=True)
    assert sorted(p.name for p in d.iterdir()) == [SINGLE_FILE]  # the old shards removed
    assert CheckpointReader(d).moe_layers() == [4]
