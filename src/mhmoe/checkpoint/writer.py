"""`save_checkpoint`: MoE layers to safetensors files, one or sharded with an index.

Shards are planned greedily in key order; every file is streamed to a temporary name,
fsynced and renamed into place, the index last (see `save_checkpoint` for the order
that keeps a crash from leaving a mixed checkpoint behind).

What a save may remove: the files of an earlier checkpoint that mhmoe wrote (their
metadata carries `WRITER_METADATA_KEY`), and its own temporaries left by a save that
was killed (`_TEMP_NAME`, of a save whose lock, `_save_lock`, nobody holds). Nothing
else: a directory that already holds safetensors files is refused unless
`overwrite=True`.

`save_checkpoint_layers` writes by the same rules, one shard per layer, asking for
each layer's tensors only when it writes them (`mhmoe quantize`: a checkpoint larger
than memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import stat
import struct
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from ..config import MultiHeadMoEConfig
from ..fp8 import SCHEME
from ..layer import MultiHeadMoE
from ..parallel import HeadPartition
from .format import (
    CONFIG_METADATA_KEY,
    INDEX_FILE,
    PARTITION_METADATA_KEY,
    PREFIXES,
    QUANT_METADATA_KEY,
    SINGLE_FILE,
    TORCH_TO_ST,
    CheckpointError,
    moe_key,
)
from .reader import read_header, read_index

_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# The temporary name of every file this writer creates (`_temp_name`): the final name
# and the save's stamp, PID.TAG (the writing process's id, for people, and a random tag
# of the save). A save removes the ones of saves that are gone (killed midway), never a
# file of another name.
_TEMP_NAME = re.compile(r"\.(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|"
                        r"model\.safetensors\.index\.json)\.(\d+\.[0-9a-f]{8})\.tmp")
# The lock file of a save in progress (`_save_lock`), named by the save's stamp.
_LOCK_NAME = re.compile(r"\.mhmoe-save\.(\d+\.[0-9a-f]{8})\.lock")
# Metadata key (in every file and in the index) marking a checkpoint that mhmoe wrote;
# the value is the writer's version. Files of an earlier save are removed only if they
# carry it (or, written before the key existed, mhmoe's config key).
WRITER_METADATA_KEY = "mhmoe.writer"
# Bytes per write() call: large enough to stream at disk speed, small enough that the
# progress bar moves while a multi-GB tensor is written.
_WRITE_CHUNK = 64 << 20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _collect(layers: Mapping[int, MultiHeadMoE | Mapping[str, torch.Tensor]], prefix: str,
             config: MultiHeadMoEConfig | None, path: Path) \
        -> tuple[list[tuple[str, torch.Tensor]], MultiHeadMoEConfig | None,
                 HeadPartition | None]:
    """Flatten `layers` into (key, tensor) pairs, layers ascending; resolve the config."""
    if prefix not in PREFIXES:
        raise ValueError(f"save_checkpoint: prefix must be one of {PREFIXES}, got {prefix!r}")
    if not isinstance(layers, Mapping) or not layers:
        raise CheckpointError("save_checkpoint needs a non-empty mapping {layer index: "
                              "MultiHeadMoE or {name: tensor}}", path=path)
    entries: list[tuple[str, torch.Tensor]] = []
    module_configs: dict[int, MultiHeadMoEConfig] = {}
    partitions: set[HeadPartition] = set()
    for layer in sorted(layers):
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise CheckpointError(f"layer indices must be non-negative ints, got {layer!r}",
                                  path=path)
        source = layers[layer]
        if isinstance(source, MultiHeadMoE):
            tensors = source.state_dict()
            module_configs[layer] = source.config
            partitions.add(source.partition)
        elif isinstance(source, Mapping):
            tensors = source
        else:
            raise CheckpointError(f"layer {layer}: expected a MultiHeadMoE or a mapping of "
                                  f"tensors, got {type(source).__name__}", path=path)
        for name, tensor in tensors.items():
            if not isinstance(name, str) or not name:
                raise CheckpointError(f"layer {layer}: parameter names must be non-empty "
                                      f"strings, got {name!r}", path=path)
            key = moe_key(layer, name, prefix)
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"expected a tensor, got {type(tensor).__name__}",
                                      path=path, key=key)
            if tensor.dtype not in TORCH_TO_ST:
                raise CheckpointError(f"dtype {tensor.dtype} cannot be stored in safetensors "
                                      f"by this writer", path=path, key=key)
            if tensor.device.type == "meta":
                raise CheckpointError("tensor is on the meta device (it has no data)",
                                      path=path, key=key)
            entries.append((key, tensor.detach()))

    for layer, module_config in module_configs.items():
        if config is None:
            config = module_config
        elif module_config != config:
            differ = [f.name for f in dataclasses.fields(config)
                      if getattr(config, f.name) != getattr(module_config, f.name)]
            raise CheckpointError(f"layer {layer}'s module config differs from the checkpoint "
                                  f"config in {differ}; one file holds one config", path=path)
    partition = None
    if len(partitions) > 1:
        raise CheckpointError(f"the modules belong to different head partitions "
                              f"{sorted(partitions, key=repr)}; save one rank per checkpoint",
                              path=path)
    if partitions:
        (partition,) = partitions
        if partition.world_size == 1:
            partition = None  # full tensors: nothing to record
    return entries, config, partition


def _plan_shards(entries: list[tuple[str, torch.Tensor]], max_shard_bytes: int | None) \
        -> list[list[tuple[str, torch.Tensor]]]:
    """Greedy, in key order: a shard closes when the next tensor would overflow it. A
    tensor larger than `max_shard_bytes` gets a shard of its own (never split)."""
    if max_shard_bytes is None:
        return [entries]
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for key, tensor in entries:
        n = _nbytes(tensor)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, tensor))
        size += n
    return shards


def _temp_name(final: Path, stamp: str) -> Path:
    # Same directory as the final name, so os.replace is a rename within one filesystem.
    # The pattern is `_TEMP_NAME`: the next save recognises what a killed one left.
    return final.with_name(f".{final.name}.{stamp}.tmp")


def _lock_path(directory: Path, stamp: str) -> Path:
    return directory / f".mhmoe-save.{stamp}.lock"


def _still_names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    open_st = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (open_st.st_dev, open_st.st_ino)


@contextlib.contextmanager
def _save_lock(directory: Path) -> Iterator[str]:
    """Hold the lock of one save into `directory` (an exclusive `flock` on a lock file
    there); yields the save's stamp, which its temporaries' names carry (`_temp_name`).

    Held from before the first temporary is created until after the last is renamed
    into place or removed, so a temporary is stale exactly when the lock of its stamp
    can be taken or its lock file is gone: the kernel releases the lock of a process
    that dies however it dies, whatever its PID (a container's mhmoe may always run as
    the same PID), and on a shared filesystem with working locks (NFS) a save of another
    host holds its lock too, where its PID would mean nothing here.
    """
    while True:
        stamp = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
        path = _lock_path(directory, stamp)
        # Read-write: NFS implements flock's LOCK_EX by a write lock.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        # Another save's clean-up may have taken the lock between the open and the flock
        # and removed the file as stale; then start again under another stamp.
        if _still_names(path, fd):
            break
        os.close(fd)
    try:
        yield stamp
    finally:
        path.unlink(missing_ok=True)  # while still locked: see _remove_stale_temporaries
        os.close(fd)


def _remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove this writer's temporaries (`_TEMP_NAME`) of saves that are gone, and their
    lock files: what a save killed midway (kill -9, power loss) left. A save is gone
    when its lock file (`_LOCK_NAME`) is absent or its lock can be taken; the temporaries
    of a save whose lock is held are kept, as is every file of another name."""
    saves: dict[str, list[Path]] = {}
    for p in directory.iterdir():
        match = _TEMP_NAME.fullmatch(p.name) or _LOCK_NAME.fullmatch(p.name)
        if match:
            saves.setdefault(match[match.lastindex], []).append(p)
    removed = []
    for stamp, files in sorted(saves.items()):
        lock = _lock_path(directory, stamp)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = None  # the save is over; what it left is stale
        except OSError:
            continue  # a lock we cannot take (another user's, a link): leave its files
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # held: a save in progress
                if not stat.S_ISREG(os.fstat(fd).st_mode) or not _still_names(lock, fd):
                    continue  # not a lock file of ours, or its save just ended
            temps = [p for p in files if p != lock]
            for p in [*temps, lock] if fd is not None else temps:
                if p.is_file() and not p.is_symlink():
                    p.unlink(missing_ok=True)
                    removed.append(p)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _safetensors_metadata(file: Path) -> dict | None:
    """The `__metadata__` of a safetensors file's header, or None if it is not one."""
    try:
        _, header = read_header(file)
    except CheckpointError:
        return None
    metadata = header.get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def _written_by_mhmoe(metadata: object) -> bool:
    return isinstance(metadata, dict) and (WRITER_METADATA_KEY in metadata
                                           or CONFIG_METADATA_KEY in metadata)


def _checkpoint_files(directory: Path) -> list[Path]:
    """The files that make `directory` hold a checkpoint: safetensors files and indices."""
    return sorted(p for p in directory.iterdir()
                  if p.name.endswith((".safetensors", ".safetensors.index.json"))
                  and not p.name.startswith("."))


def _mhmoe_files(directory: Path) -> set[Path]:
    """The checkpoint files of `directory` that an earlier mhmoe save wrote: its index
    and the shards that index lists, or its single file; each shard and the single file
    must carry mhmoe's metadata too."""
    ours: set[Path] = set()
    index = directory / INDEX_FILE
    try:
        weight_map, index_metadata = read_index(index) if index.is_file() else ({}, None)
    except CheckpointError:
        weight_map, index_metadata = {}, None
    if _written_by_mhmoe(index_metadata):
        ours.add(index)
        for shard in set(weight_map.values()):
            # Only plain names of this writer's pattern: an index cannot point a removal
            # outside the directory or at another file.
            if shard.parent == directory and _SHARD_NAME.fullmatch(shard.name) \
                    and shard.is_file() and _written_by_mhmoe(_safetensors_metadata(shard)):
                ours.add(shard)
    single = directory / SINGLE_FILE
    if single.is_file() and _written_by_mhmoe(_safetensors_metadata(single)):
        ours.add(single)
    return ours


def _write_safetensors(final: Path, entries: list[tuple[str, torch.Tensor]],
                       metadata: dict[str, str], advance: Callable[[int], None],
                       stamp: str) -> Path:
    """Write `entries` as a safetensors file under a temporary name next to `final`;
    returns that name (the caller renames it into place once every file is written).

    Streamed tensor by tensor, so neither the file nor a serialized copy of it is ever
    held in memory, and the progress bar can follow the bytes.
    """
    # Tensors ordered by element size, largest first (stable), as the reference writer
    # does: every data offset is then a multiple of its tensor's element size.
    ordered = sorted(entries, key=lambda kv: -kv[1].element_size())
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key, tensor in ordered:
        n = _nbytes(tensor)
        header[key] = {"dtype": TORCH_TO_ST[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    temp = _temp_name(final, stamp)
    try:
        with open(temp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for _, tensor in ordered:
                # Bytes in host order; safetensors is little-endian (checked by the caller).
                data = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                for start in range(0, len(data), _WRITE_CHUNK):
                    chunk = data[start:start + _WRITE_CHUNK]
                    f.write(memoryview(chunk))
                    advance(len(chunk))
            f.flush()
            # Data on disk before the rename publishes it: otherwise a power loss could
            # leave an empty or partial file under the final name.
            os.fsync(f.fileno())
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


def _write_json(final: Path, payload: dict, stamp: str) -> None:
    temp = _temp_name(final, stamp)
    try:
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    """Make the renames durable. Not every platform can open a directory; skip there."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _byte_progress(total: int, enabled: bool, description: str) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    # markup=False: the description holds a directory name, which rich would otherwise
    # read as markup ("[...]" vanishes, "[/...]" raises).
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.update(task, advance=n)


def save_checkpoint(
    path: str | os.PathLike,
    layers: Mapping[int, MultiHeadMoE | Mapping[str, torch.Tensor]],
    *,
    config: MultiHeadMoEConfig | None = None,
    max_shard_bytes: int | None = None,
    prefix: str = "",
    progress: bool = False,
    overwrite: bool = False,
) -> list[Path]:
    """Write MoE layers to the checkpoint directory `path` (created if needed).

    layers: {layer index: MultiHeadMoE, or {name: tensor}}. A module contributes its
        state_dict (the names of `MOE_PARAM_NAMES`); a mapping is written as given, under
        `moe_key(layer, name, prefix)`, without checks (loading checks).
    config: stored as "mhmoe.config" metadata; defaults to the modules' config (which
        must then be one config for all of them).
    max_shard_bytes: if the tensors' bytes exceed it, write shards
        `model-0000i-of-0000N.safetensors` of at most that many tensor bytes each (a
        larger tensor gets a shard of its own) and `model.safetensors.index.json`;
        otherwise, or if None, one `model.safetensors`.
    prefix: "" or "transformer.".
    progress: show a rich progress bar of the bytes written.
    overwrite: replace the checkpoint `path` already holds. Without it, a directory
        holding any `*.safetensors` file or `*.safetensors.index.json` is refused
        (`CheckpointError`), and nothing is written or removed.

    What a save removes (with overwrite=True): once the new checkpoint is complete,
    the files of the earlier one that mhmoe wrote and the new one does not reuse (the
    shards its index lists, or its `model.safetensors`; each must carry mhmoe's
    metadata). Files mhmoe did not write are never removed; only a file at a name the
    new checkpoint uses is replaced. A save that would leave a `model.safetensors` or
    `model.safetensors.index.json` of another writer beside the new checkpoint of the
    other layout is refused before anything is written (a reader could not tell the
    two apart). Every save also removes the temporaries of an earlier save into `path`
    that was killed midway (this writer's `.NAME.PID.TAG.tmp` files, and the
    `.mhmoe-save.PID.TAG.lock` file, of a save whose lock nobody holds).

    Crash safety: every file is written under a temporary name in `path`, flushed to
    disk, then renamed into place; the index is written last. Shards are renamed only
    after all are written, and an old index is removed before any old shard is
    overwritten, so an index never names a mix of old and new shards. Until the stale
    files of the other layout are removed, a reader finds both layouts and refuses the
    directory as ambiguous.

    Returns the files written (shards, then the index).
    """
    directory = Path(path)
    _check_target(directory)
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool)
                                        or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes < 1):
        raise ValueError(f"save_checkpoint: max_shard_bytes must be a positive int or None, "
                         f"got {max_shard_bytes!r}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"save_checkpoint: overwrite must be a bool, got {overwrite!r}")
    entries, config, partition = _collect(layers, prefix, config, directory)
    shards = _plan_shards(entries, max_shard_bytes)
    names = _file_names(len(shards))
    finals = [directory / name for name in names]
    ours = _prepare_directory(directory, names, overwrite)
    metadata = _metadata(config, partition)
    total = sum(_nbytes(t) for _, t in entries)

    with _save_lock(directory) as stamp:
        temps: list[Path] = []
        try:
            with _byte_progress(total, progress, f"writing {directory.name or directory}") \
                    as advance:
                for final, shard in zip(finals, shards, strict=True):
                    temps.append(_write_safetensors(final, shard, metadata, advance, stamp))
            _publish(directory, temps, finals)
            temps = []
        finally:
            for temp in temps:
                temp.unlink(missing_ok=True)
        weight_map = {key: name for name, shard in zip(names, shards, strict=True)
                      for key, _ in shard}
        return _finish(directory, finals, weight_map, metadata, total, ours, stamp)


def _check_target(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise CheckpointError("save_checkpoint writes a directory, but this is a file",
                              path=directory)
    if sys.byteorder != "little":
        raise NotImplementedError("save_checkpoint writes host-order bytes; safetensors is "
                                  "little-endian")


def _file_names(count: int) -> list[str]:
    """The names of a checkpoint of `count` safetensors files."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _metadata(config: MultiHeadMoEConfig | None, partition: HeadPartition | None) \
        -> dict[str, str]:
    """The metadata of every file (and, but "format", of the index)."""
    from .. import __version__

    metadata = {"format": "pt",  # transformers refuses safetensors files without it
                WRITER_METADATA_KEY: __version__}
    if config is not None:
        metadata[CONFIG_METADATA_KEY] = config.to_json()
        if config.is_fp8:
            metadata[QUANT_METADATA_KEY] = SCHEME
    if partition is not None:
        metadata[PARTITION_METADATA_KEY] = _partition_to_json(partition)
    return metadata


def _prepare_directory(directory: Path, names: list[str], overwrite: bool) -> set[Path]:
    """Refuse a target the save must not write into (see `save_checkpoint`'s overwrite),
    remove the temporaries of killed saves, create the directory. Returns the files of
    the earlier mhmoe checkpoint there (removed once the new one is complete)."""
    index = directory / INDEX_FILE
    ours: set[Path] = set()
    if directory.is_dir():
        existing = _checkpoint_files(directory)
        if existing and not overwrite:
            shown = ", ".join(p.name for p in existing[:5]) + \
                (f" and {len(existing) - 5} more" if len(existing) > 5 else "")
            raise CheckpointError(f"the directory already holds a checkpoint ({shown}); pass "
                                  f"overwrite=True (--overwrite of mhmoe make-checkpoint and "
                                  f"mhmoe quantize) to replace it, or choose another "
                                  f"directory", path=directory)
        ours = _mhmoe_files(directory)
        new_names = set(names) | ({INDEX_FILE} if len(names) > 1 else set())
        foreign_entry = [p for p in (directory / SINGLE_FILE, index)
                         if p.is_file() and p not in ours and p.name not in new_names]
        if foreign_entry:
            raise CheckpointError(f"{foreign_entry[0].name} was not written by mhmoe and the "
                                  f"new checkpoint would not replace it; a reader could not "
                                  f"tell the two checkpoints apart. Remove it yourself, or "
                                  f"choose another directory", path=directory)
        _remove_stale_temporaries(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return ours


def _publish(directory: Path, temps: list[Path], finals: list[Path]) -> None:
    """Rename the written temporaries into place (all files written first)."""
    if len(finals) > 1:
        # Before any shard is replaced: an index naming a mix of old and new shards
        # would read as a sound checkpoint. The new index takes its place (one of
        # another writer is only removed here with overwrite=True, as replaced).
        (directory / INDEX_FILE).unlink(missing_ok=True)
    for temp, final in zip(temps, finals, strict=True):
        os.replace(temp, final)


def _finish(directory: Path, finals: list[Path], weight_map: dict[str, str],
            metadata: dict[str, str], total: int, ours: set[Path], stamp: str) -> list[Path]:
    """After `_publish`: the index (last), then the earlier checkpoint's stale files."""
    index = directory / INDEX_FILE
    written = list(finals)
    if len(finals) > 1:
        index_metadata: dict[str, object] = {"total_size": total}
        index_metadata.update({k: v for k, v in metadata.items() if k != "format"})
        _write_json(index, {"metadata": index_metadata, "weight_map": weight_map}, stamp)
        written.append(index)
    _fsync_dir(directory)

    # The new checkpoint is complete: remove the files of the earlier one that mhmoe
    # wrote and the new one did not replace (the other layout, or another shard count).
    stale = ours - set(written)
    # The index first: an index naming deleted shards would be a broken checkpoint.
    for p in sorted(stale, key=lambda p: (p.name != INDEX_FILE, p.name)):
        p.unlink(missing_ok=True)
    if stale:
        _fsync_dir(directory)
    return written


def save_checkpoint_layers(
    path: str | os.PathLike,
    layers: Sequence[int],
    make: Callable[[int], Mapping[str, torch.Tensor]],
    *,
    config: MultiHeadMoEConfig,
    partition: HeadPartition | None = None,
    progress: bool = False,
    overwrite: bool = False,
) -> list[Path]:
    """`save_checkpoint` for checkpoints larger than memory: one file per layer, each
    layer's tensors asked for (`make(layer)` -> {checkpoint key: tensor}) only when its
    file is written and let go after it.

    One layer gives `model.safetensors`, more give `model-0000i-of-0000N.safetensors`
    (layer i of `layers`, in that order) and the index. The metadata as
    `save_checkpoint`'s (`config`, and `partition` for one rank's rows); the same rules
    for the directory, `overwrite`, crash safety and what is removed. `make`'s tensors
    are written as they are, contiguous, without checks (loading checks).
    progress: a rich bar over the layers.
    Returns the files written (shards, then the index).
    """
    directory = Path(path)
    _check_target(directory)
    if not isinstance(overwrite, bool):
        raise TypeError(f"save_checkpoint_layers: overwrite must be a bool, got {overwrite!r}")
    layers = list(layers)
    if not layers:
        raise CheckpointError("save_checkpoint_layers needs at least one layer", path=directory)
    names = _file_names(len(layers))
    finals = [directory / name for name in names]
    ours = _prepare_directory(directory, names, overwrite)
    metadata = _metadata(config, partition)
    weight_map: dict[str, str] = {}
    total = 0
    with _save_lock(directory) as stamp:
        temps: list[Path] = []
        try:
            with _layer_bar(len(layers), progress) as advance:
                for final, layer in zip(finals, layers, strict=True):
                    advance(f"layer {layer}", 0)
                    entries = []
                    for key, tensor in make(layer).items():
                        if tensor.dtype not in TORCH_TO_ST:
                            raise CheckpointError(f"dtype {tensor.dtype} cannot be stored in "
                                                  f"safetensors by this writer", path=directory,
                                                  key=key)
                        entries.append((key, tensor.detach()))
                        weight_map[key] = final.name
                    temps.append(_write_safetensors(final, entries, metadata, lambda n: None,
                                                stamp))
                    total += sum(_nbytes(t) for _, t in entries)
                    del entries  # before the next layer is made
                    advance(f"wrote layer {layer} ({total / 1e9:.2f} GB so far)", 1)
            _publish(directory, temps, finals)
            temps = []
        finally:
            for temp in temps:
                temp.unlink(missing_ok=True)
        return _finish(directory, finals, weight_map, metadata, total, ours, stamp)


@contextlib.contextmanager
def _layer_bar(total: int, enabled: bool) -> Iterator[Callable[[str, int], None]]:
    if not enabled:
        yield lambda description, n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # markup=False: the description is plain text (see _byte_progress).
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("layers", total=total)
        yield lambda description, n: bar.update(task, advance=n, description=description)


def _partition_to_json(partition: HeadPartition) -> str:
    return json.dumps({"num_heads": partition.num_heads, "world_size": partition.world_size,
                       "rank": partition.rank}, sort_keys=True)

