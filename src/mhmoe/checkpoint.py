"""Safetensors checkpoints of multi-head MoE layers (SPEC sections 5 and 6).

Layout on disk, the Hugging Face convention MAGI-2 uses:

    ckpt/model.safetensors                       one file, or
    ckpt/model-00001-of-00003.safetensors ...    shards, plus
    ckpt/model.safetensors.index.json            {"metadata": {"total_size": ...},
                                                  "weight_map": {key: shard file name}}

Keys are `[transformer.]block.layers.{L}.mlp.moe_mlp.{name}` with `name` one of
`MOE_PARAM_NAMES`. Every file's safetensors metadata (and the index's metadata)
carries the layer config as JSON under "mhmoe.config".

Reading is lazy: `CheckpointReader.read` reads only the rows asked for, with
positioned reads at the offsets safetensors has validated (not through a memory
map, whose readahead pulls in megabytes of neighbouring rows), so a rank of a
head-parallel group reads its share of the weights (`rows [start*E, start*E +
local_flat)`) and nothing else. Loading checks every
key, shape and dtype (and, optionally, finiteness) before it hands anything back,
then builds the module on the meta device and assigns: a module is never left
half-loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import struct
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from .config import MultiHeadMoEConfig
from .layer import MultiHeadMoE
from .parallel import HeadPartition

MOE_PARAM_NAMES = ("gate", "W_gate", "W_up", "W_down", "router.expert_bias",
                   "router.expert_bias_ema")
PREFIXES = ("", "transformer.")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_METADATA_KEY = "mhmoe.config"
# Set when the saved modules hold one rank's rows only (a pre-sliced checkpoint), so
# that loading it on another rank is an error rather than silently wrong weights.
PARTITION_METADATA_KEY = "mhmoe.partition"

_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_MOE_KEY = re.compile(r"(transformer\.)?block\.layers\.(\d+)\.mlp\.moe_mlp\.(.+)")
_TORCH_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_ST_TO_TORCH = {name: dtype for dtype, name in _TORCH_TO_ST.items()}
# Bytes per write() call: large enough to stream at disk speed, small enough that the
# progress bar moves while a multi-GB tensor is written.
_WRITE_CHUNK = 64 << 20
# The reference reader's limit: a longer header is corrupt, not a real one.
_MAX_HEADER_BYTES = 100_000_000
# Elements checked for finiteness at a time: bounds the temporary bool mask.
_FINITE_CHUNK = 1 << 24


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match what was asked for.

    The message names the file (`path`) and, where one is involved, the tensor `key`.
    """

    def __init__(self, message: str, *, path: str | os.PathLike | None = None,
                 key: str | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.key = key
        self.detail = message
        where = []
        if path is not None:
            where.append(str(path))
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


def moe_key(layer: int, name: str, prefix: str = "") -> str:
    """The checkpoint key of parameter `name` of MoE layer `layer`."""
    if prefix not in PREFIXES:
        raise ValueError(f"moe_key: prefix must be one of {PREFIXES}, got {prefix!r}")
    return f"{prefix}block.layers.{layer}.mlp.moe_mlp.{name}"


def expected_shapes(config: MultiHeadMoEConfig, rows: int | None = None) \
        -> dict[str, tuple[int, ...]]:
    """Shape of every MoE parameter with `rows` flat experts (all `H * E` if None)."""
    rows = config.num_flat_experts if rows is None else rows
    D, I = config.head_dim, config.expert_intermediate_size
    return {"gate": (rows, D), "W_gate": (rows, D, I), "W_up": (rows, D, I),
            "W_down": (rows, I, D), "router.expert_bias": (rows,),
            "router.expert_bias_ema": (rows,)}


def expected_dtypes(config: MultiHeadMoEConfig) -> dict[str, torch.dtype]:
    """The router is fp32 whatever the weights are (SPEC section 5), except in a float64
    layer, whose router `MultiHeadMoE` keeps in float64 too (for gradient checks)."""
    weights = config.params_dtype
    router = torch.float64 if weights == torch.float64 else torch.float32
    return {"gate": router, "W_gate": weights, "W_up": weights, "W_down": weights,
            "router.expert_bias": router, "router.expert_bias_ema": router}


# ----------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------


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
            if tensor.dtype not in _TORCH_TO_ST:
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


def _temp_name(final: Path) -> Path:
    # Same directory as the final name, so os.replace is a rename within one filesystem.
    return final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _write_safetensors(final: Path, entries: list[tuple[str, torch.Tensor]],
                       metadata: dict[str, str], advance: Callable[[int], None]) -> Path:
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
        header[key] = {"dtype": _TORCH_TO_ST[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    temp = _temp_name(final)
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


def _write_json(final: Path, payload: dict) -> None:
    temp = _temp_name(final)
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
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
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

    Crash safety: every file is written under a temporary name in `path`, flushed to
    disk, then renamed into place; the index is written last. Shards are renamed only
    after all are written, and an old index is removed before any old shard is
    overwritten, so an index never names a mix of old and new shards. Checkpoint files
    of the other layout left from an earlier save (`model.safetensors` vs shards and
    index) are deleted once the new checkpoint is complete; until then a reader finds
    both layouts and refuses the directory as ambiguous.

    Returns the files written (shards, then the index).
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError("save_checkpoint writes a directory, but this is a file",
                              path=directory)
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool)
                                        or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes < 1):
        raise ValueError(f"save_checkpoint: max_shard_bytes must be a positive int or None, "
                         f"got {max_shard_bytes!r}")
    if sys.byteorder != "little":
        raise NotImplementedError("save_checkpoint writes host-order bytes; safetensors is "
                                  "little-endian")
    entries, config, partition = _collect(layers, prefix, config, directory)
    directory.mkdir(parents=True, exist_ok=True)

    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if config is not None:
        metadata[CONFIG_METADATA_KEY] = config.to_json()
    if partition is not None:
        metadata[PARTITION_METADATA_KEY] = _partition_to_json(partition)
    shards = _plan_shards(entries, max_shard_bytes)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(len(shards))]
    finals = [directory / name for name in names]
    total = sum(_nbytes(t) for _, t in entries)

    temps: list[Path] = []
    try:
        with _byte_progress(total, progress, f"writing {directory.name or directory}") \
                as advance:
            for final, shard in zip(finals, shards, strict=True):
                temps.append(_write_safetensors(final, shard, metadata, advance))
        index = directory / INDEX_FILE
        if len(shards) > 1:
            index.unlink(missing_ok=True)
        for temp, final in zip(temps, finals, strict=True):
            os.replace(temp, final)
        temps = []
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)
    written = list(finals)
    if len(shards) > 1:
        index_metadata: dict[str, object] = {"total_size": total}
        index_metadata.update({k: v for k, v in metadata.items() if k != "format"})
        weight_map = {key: name for name, shard in zip(names, shards, strict=True)
                      for key, _ in shard}
        _write_json(index, {"metadata": index_metadata, "weight_map": weight_map})
        written.append(index)
    _fsync_dir(directory)

    # The new checkpoint is complete: remove what an earlier save of the other layout
    # (or with another shard count) left, so the directory holds one checkpoint.
    stale = [p for p in directory.iterdir()
             if p not in written and (p.name in (SINGLE_FILE, INDEX_FILE)
                                      or _SHARD_NAME.fullmatch(p.name))]
    # The index first: an index naming deleted shards would be a broken checkpoint.
    for p in sorted(stale, key=lambda p: p.name != INDEX_FILE):
        p.unlink(missing_ok=True)
    if stale:
        _fsync_dir(directory)
    return written


def _partition_to_json(partition: HeadPartition) -> str:
    return json.dumps({"num_heads": partition.num_heads, "world_size": partition.world_size,
                       "rank": partition.rank}, sort_keys=True)


# ----------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------


def _resolve(path: Path) -> Path:
    """The index json or the single safetensors file that `path` designates."""
    if path.is_dir():
        index, single = path / INDEX_FILE, path / SINGLE_FILE
        if index.is_file() and single.is_file():
            raise CheckpointError(f"the directory holds both {SINGLE_FILE} and {INDEX_FILE} "
                                  f"(an interrupted save?); pass one of them explicitly",
                                  path=path)
        if index.is_file():
            return index
        if single.is_file():
            return single
        # Other names of the same convention (e.g. diffusers'), when unambiguous.
        indices = sorted(path.glob("*.safetensors.index.json"))
        files = sorted(path.glob("*.safetensors"))
        if len(indices) == 1:
            return indices[0]
        if not indices and len(files) == 1:
            return files[0]
        found = [p.name for p in indices + files][:10]
        raise CheckpointError(f"no checkpoint found: expected {SINGLE_FILE} or {INDEX_FILE} "
                              f"(found {found})", path=path)
    if not path.exists():
        raise CheckpointError("no such file or directory", path=path)
    return path


class CheckpointReader:
    """An open checkpoint: a .safetensors file, an index .json, or a directory holding
    `model.safetensors` or `model.safetensors.index.json`.

    Nothing is loaded up front: `read` reads only the rows it is asked for. Opening parses
    the headers; a file is validated by safetensors (header, offsets, and that its data
    covers every tensor) when one of its keys is first used, so errors can name the key.

    Rows are read with positioned reads at the offsets safetensors validated, not
    through safetensors' memory map (`get_slice`): a read fault on a mapping pulls in the
    kernel's read-around window on both sides of the rows (measured: about 20 MiB for a
    4 MiB slice with an 8 MiB readahead), so a rank would read much of its neighbours'
    rows from disk; a plain read fetches the rows and readahead past their end only.
    Attributes:
      path        what was opened (the resolved file)
      files       the safetensors files of the checkpoint
      index_path  the index json, or None for a single file
      bytes_read  tensor bytes copied out by `read` so far (rows that exist only)
    Use as a context manager, or call `close`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = _resolve(Path(path))
        self.bytes_read = 0
        self._handles: dict[Path, io.FileIO] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        self._info: dict[str, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        self._metadata_cache: dict[str, str] | None = None
        self._config_cache: tuple[MultiHeadMoEConfig | None] | None = None
        if self.path.name.endswith(".json"):
            self.index_path: Path | None = self.path
            self._weight_map, self._index_metadata = self._read_index(self.path)
            self.files = sorted(set(self._weight_map.values()))
        else:
            self.index_path = None
            self._index_metadata = {}
            _, header = self._read_header(self.path)
            self._weight_map = {key: self.path for key in header if key != "__metadata__"}
            self.files = [self.path]
        self._moe: dict[str, tuple[int, str, str]] = {}
        for key in self._weight_map:
            match = _MOE_KEY.fullmatch(key)
            if match:
                self._moe[key] = (int(match[2]), match[3], match[1] or "")

    @staticmethod
    def _read_index(index: Path) -> tuple[dict[str, Path], dict]:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read the index json: {e}", path=index) from e
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError('the index json must hold "weight_map": {key: file name}',
                                  path=index)
        metadata = data.get("metadata", {})
        if not isinstance(metadata, dict):
            raise CheckpointError('the index json\'s "metadata" must be an object',
                                  path=index)
        files: dict[str, Path] = {}
        for key, name in weight_map.items():
            # Shards live next to the index; refuse names that would leave that directory.
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise CheckpointError(f"the index maps the key to {name!r}, outside the "
                                      f"checkpoint directory", path=index, key=key)
            files[key] = index.parent / name
        return files, metadata

    def _read_header(self, file: Path) -> tuple[int, dict]:
        """(data start, JSON header) of a safetensors file: an 8-byte little-endian header
        length, the header, then the data."""
        if file in self._headers:
            return self._headers[file]
        listed = f" (listed in {self.index_path.name})" if self.index_path else ""
        try:
            with open(file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                if length is None or length > min(size - 8, _MAX_HEADER_BYTES):
                    raise CheckpointError(f"corrupt safetensors header: it claims {length} bytes, "
                                          f"the file has {size}{listed}", path=file)
                header = json.loads(f.read(length))
        except FileNotFoundError as e:
            raise CheckpointError(f"file is missing{listed}", path=file) from e
        except OSError as e:
            raise CheckpointError(f"cannot read the file{listed}: {e}", path=file) from e
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"corrupt safetensors header (not JSON: {e}){listed}",
                                  path=file) from e
        if not isinstance(header, dict):
            raise CheckpointError(f"corrupt safetensors header (not a JSON object){listed}",
                                  path=file)
        self._headers[file] = (8 + length, header)
        return self._headers[file]

    def _open(self, file: Path, key: str | None = None) -> io.FileIO:
        """The open file, validated by safetensors the first time."""
        handle = self._handles.get(file)
        if handle is None:
            listed = f" (listed in {self.index_path.name})" if self.index_path else ""
            try:
                # safetensors checks the header, the offsets and that the data covers every
                # tensor; that is all we use it for here (see the class docstring).
                with safe_open(str(file), framework="pt"):
                    pass
                self._read_header(file)
                handle = open(file, "rb", buffering=0)  # closed by close()
            except FileNotFoundError as e:
                raise CheckpointError(f"file is missing{listed}", path=file, key=key) from e
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"not a readable safetensors file{listed}: {e}"
                                      f"{self._truncation(file)}", path=file, key=key) from e
            except CheckpointError as e:
                raise CheckpointError(e.detail, path=e.path, key=key) from e
            self._handles[file] = handle
        return handle

    def _truncation(self, file: Path) -> str:
        """A hint for a file shorter than its header says, else ''."""
        try:
            data_start, header = self._read_header(file)
            ends = [entry["data_offsets"][1] for key, entry in header.items()
                    if key != "__metadata__"]
            size = file.stat().st_size
        except (CheckpointError, OSError, TypeError, KeyError, IndexError):
            return ""
        expected = data_start + max(ends, default=0)
        if size < expected:
            return f" (truncated: the file has {size} bytes, its header describes {expected})"
        return ""

    def file_keys(self, file: Path) -> list[str]:
        """The keys a file holds (after validating it)."""
        self._open(file)
        return [k for k in self._read_header(file)[1] if k != "__metadata__"]

    def close(self) -> None:
        """Close every file. Tensors returned by `read` own their memory and stay valid."""
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, files={len(self.files)})"

    @property
    def weight_map(self) -> dict[str, Path]:
        """Every key of the checkpoint (MoE or not) -> the file holding it."""
        return dict(self._weight_map)

    def _metadata(self) -> dict[str, str]:
        """Checkpoint-wide metadata: the index's if it has our keys, else the first file's."""
        if self._metadata_cache is None:
            metadata = {k: v for k, v in self._index_metadata.items() if isinstance(v, str)}
            if CONFIG_METADATA_KEY not in metadata and self.files:
                stored = self._read_header(self.files[0])[1].get("__metadata__")
                metadata = dict(stored) if isinstance(stored, dict) else {}
            self._metadata_cache = metadata
        return self._metadata_cache

    @property
    def config(self) -> MultiHeadMoEConfig | None:
        """The config stored in the metadata ("mhmoe.config"), or None if there is none."""
        if self._config_cache is None:
            text = self._metadata().get(CONFIG_METADATA_KEY)
            config = None
            if text is not None:
                try:
                    config = MultiHeadMoEConfig.from_json(text)
                except (ValueError, TypeError) as e:
                    source = self.index_path if CONFIG_METADATA_KEY in self._index_metadata \
                        else self.files[0]
                    raise CheckpointError(f"invalid {CONFIG_METADATA_KEY!r} metadata: {e}",
                                          path=source) from e
            self._config_cache = (config,)
        return self._config_cache[0]

    @property
    def partition(self) -> HeadPartition | None:
        """The head partition of a pre-sliced (one rank's) checkpoint, if recorded."""
        text = self._metadata().get(PARTITION_METADATA_KEY)
        if text is None:
            return None
        try:
            return HeadPartition(**json.loads(text))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"invalid {PARTITION_METADATA_KEY!r} metadata: {e}",
                                  path=self.path) from e

    def moe_layers(self) -> list[int]:
        """Indices of the layers that have any MoE key (with or without the prefix)."""
        return sorted({layer for layer, _, _ in self._moe.values()})

    def layer_keys(self, layer: int) -> dict[str, tuple[str, str]]:
        """The MoE keys of `layer`: {key: (name, prefix)}."""
        return {key: (name, prefix) for key, (lay, name, prefix) in self._moe.items()
                if lay == layer}

    def _key_of(self, layer: int, name: str) -> str:
        present = [moe_key(layer, name, p) for p in PREFIXES
                   if moe_key(layer, name, p) in self._weight_map]
        if not present:
            raise CheckpointError("missing key (looked for it with and without the "
                                  "'transformer.' prefix)", path=self.path,
                                  key=moe_key(layer, name))
        if len(present) > 1:
            raise CheckpointError(f"the key is present both with and without the "
                                  f"'transformer.' prefix: {present}", path=self.path,
                                  key=present[0])
        return present[0]

    def key_info(self, key: str) -> tuple[Path, tuple[int, ...], torch.dtype]:
        """(file, shape, dtype) of any key, from the file's header (no data is read)."""
        if key not in self._info:
            if key not in self._weight_map:
                raise CheckpointError("no such key", path=self.path, key=key)
            file = self._weight_map[key]
            self._open(file, key)
            entry = self._read_header(file)[1].get(key)
            if entry is None:
                raise CheckpointError("the index maps the key to this file, which does not "
                                      "hold it", path=file, key=key)
            st_dtype = entry["dtype"]
            if st_dtype not in _ST_TO_TORCH:
                raise CheckpointError(f"unsupported dtype {st_dtype}", path=file, key=key)
            self._info[key] = (file, tuple(entry["shape"]), _ST_TO_TORCH[st_dtype])
        return self._info[key]

    def tensor_info(self, layer: int, name: str) -> tuple[str, Path, tuple[int, ...],
                                                          torch.dtype]:
        """(key, file, shape, dtype) of parameter `name` of MoE layer `layer`."""
        key = self._key_of(layer, name)
        return (key, *self.key_info(key))

    def read(self, layer: int, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows `[begin, end)` of dim 0 of a parameter (all rows if None): [end - begin, ...].

        Only those rows are read from the file. Rows at or past the tensor's end are
        zeros (the padding heads of SPEC section 6).
        """
        return self.read_key(self._key_of(layer, name), rows)

    def read_key(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """`read` by checkpoint key."""
        file, shape, dtype = self.key_info(key)
        if rows is None:
            begin, end = 0, shape[0] if shape else 1
        else:
            begin, end = rows
            if not shape:
                raise CheckpointError("rows asked of a 0-dim tensor", path=file, key=key)
            if begin < 0 or end < begin:
                raise ValueError(f"CheckpointReader.read: rows must be 0 <= begin <= end, got "
                                 f"{rows}")
        row_shape = shape[1:] if shape else ()
        present = max(0, min(end, shape[0] if shape else 1) - begin)
        tensor = torch.empty((end - begin, *row_shape), dtype=dtype)
        tensor[present:] = 0
        row_bytes = math.prod(row_shape) * tensor.element_size()
        if present:
            data_start, header = self._read_header(file)
            offset = data_start + header[key]["data_offsets"][0] + begin * row_bytes
            self._read_into(file, key, tensor[:present], offset)
        self.bytes_read += present * row_bytes
        return tensor if shape else tensor.reshape(())

    def _read_into(self, file: Path, key: str, out: torch.Tensor, offset: int) -> None:
        if sys.byteorder != "little":
            raise NotImplementedError("CheckpointReader reads safetensors' little-endian bytes "
                                      "as they are; this host is big-endian")
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        handle = self._open(file, key)
        done = 0
        try:
            handle.seek(offset)
            while done < len(view):
                n = handle.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"the file ends before the tensor's data (at byte "
                                          f"{offset + done}); was it truncated while open?",
                                          path=file, key=key)
                done += n
        except OSError as e:
            raise CheckpointError(f"cannot read the tensor: {e}", path=file, key=key) from e


# ----------------------------------------------------------------------------------------
# Loading one layer
# ----------------------------------------------------------------------------------------


def _as_reader(source: str | os.PathLike | CheckpointReader) -> tuple[CheckpointReader, bool]:
    """(reader, whether the caller opened it and must close it)."""
    if isinstance(source, CheckpointReader):
        return source, False
    return CheckpointReader(source), True


def _resolve_config(reader: CheckpointReader, config: MultiHeadMoEConfig | None) \
        -> MultiHeadMoEConfig:
    if config is not None:
        if not isinstance(config, MultiHeadMoEConfig):
            raise TypeError(f"config must be a MultiHeadMoEConfig, got {type(config).__name__}")
        return config
    stored = reader.config
    if stored is None:
        raise CheckpointError(f"the checkpoint has no {CONFIG_METADATA_KEY!r} metadata; pass "
                              f"config=... (e.g. mhmoe.MAGI2_PREVIEW)", path=reader.path)
    return stored


def _check_finite(tensor: torch.Tensor, path: Path, key: str, first_row: int) -> None:
    if not tensor.dtype.is_floating_point or tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    row_size = max(1, math.prod(tensor.shape[1:]))
    bad_total, first_bad = 0, None
    for start in range(0, flat.numel(), _FINITE_CHUNK):
        bad = ~torch.isfinite(flat[start:start + _FINITE_CHUNK])
        count = int(bad.sum())
        if count and first_bad is None:
            first_bad = start + int(bad.nonzero()[0, 0])
        bad_total += count
    if bad_total:
        row = first_row + first_bad // row_size if tensor.dim() else None
        where = f", the first in checkpoint row {row}" if row is not None else ""
        raise CheckpointError(f"{bad_total} non-finite value(s) (NaN or inf){where}; pass "
                              f"verify=False to load them anyway", path=path, key=key)


def load_layer_state(
    path_or_reader: str | os.PathLike | CheckpointReader,
    layer: int,
    config: MultiHeadMoEConfig | None = None,
    partition: HeadPartition | None = None,
    *,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """The six parameters of MoE layer `layer` for one rank, keyed by `MOE_PARAM_NAMES`.

    With `E = num_experts`, `local_flat = partition.local_heads * E` and
    `begin = partition.start * E`, every tensor is rows `[begin, begin + local_flat)` of
    the stored `[H * E, ...]` tensor (SPEC section 6):
      gate [local_flat, D] fp32; W_gate, W_up [local_flat, D, I], W_down [local_flat, I, D]
      in params_dtype; router.expert_bias, router.expert_bias_ema [local_flat] fp32.
    Rows past `H * E` (padding heads) are zeros; a rank with no real heads gets zeros
    without reading anything.

    A stored tensor with exactly `local_flat` rows (when `local_flat != H * E`) is a
    pre-sliced, per-rank checkpoint and is taken as it is; all six must then be
    pre-sliced, and if the file records its partition it must be this one. The shapes
    alone cannot say which rank a pre-sliced file belongs to, so a file without that
    record is trusted to be this rank's. When `local_flat == H * E` (one rank, or one
    head) the tensor is read as the full tensor: the two readings then agree except on
    padding rows, which are zeros either way.

    config: defaults to the checkpoint's "mhmoe.config" metadata.
    partition: defaults to one rank holding every head.
    verify: also reject NaN / inf in what was read.

    Every key, shape and dtype is checked before any data is read, and every check
    passes before anything is returned; failures raise `CheckpointError` naming the
    file and the key.
    """
    reader, owned = _as_reader(path_or_reader)
    try:
        return _load_layer_state(reader, layer, config, partition, verify)
    finally:
        if owned:
            reader.close()


def _load_layer_state(reader: CheckpointReader, layer: int, config: MultiHeadMoEConfig | None,
                      partition: HeadPartition | None, verify: bool) -> dict[str, torch.Tensor]:
    config = _resolve_config(reader, config)
    if partition is None:
        partition = HeadPartition(config.num_heads)
    elif partition.num_heads != config.num_heads:
        raise ValueError(f"load_layer_state: partition is for {partition.num_heads} heads, "
                         f"the config has {config.num_heads}")
    keys = reader.layer_keys(layer)
    if not keys:
        raise CheckpointError(f"layer {layer} is not in the checkpoint (no key "
                              f"{moe_key(layer, '*')!r}); its MoE layers are "
                              f"{reader.moe_layers()}", path=reader.path)
    prefixes = sorted({prefix for _, prefix in keys.values()})
    if len(prefixes) > 1:
        both = sorted(name for name, prefix in keys.values() if prefix == "" and
                      moe_key(layer, name, "transformer.") in keys)
        detail = (f"keys present both ways: {[moe_key(layer, n) for n in both]}" if both
                  else "some keys have it, others not")
        raise CheckpointError(f"layer {layer} mixes keys with and without the "
                              f"'transformer.' prefix ({detail})", path=reader.path,
                              key=moe_key(layer, both[0]) if both else sorted(keys)[0])
    prefix = prefixes[0]
    names = {name for name, _ in keys.values()}
    missing = [moe_key(layer, n, prefix) for n in MOE_PARAM_NAMES if n not in names]
    if missing:
        raise CheckpointError(f"missing key(s) {missing}", path=reader.path, key=missing[0])
    unexpected = sorted(moe_key(layer, n, prefix) for n in names - set(MOE_PARAM_NAMES))
    if unexpected:
        raise CheckpointError(f"unexpected key(s) under this layer's moe_mlp: {unexpected}",
                              path=reader.path, key=unexpected[0])

    E = config.num_experts
    full_rows = config.num_flat_experts
    local_rows = partition.local_heads * E
    shapes, dtypes = expected_shapes(config), expected_dtypes(config)
    infos = {name: reader.tensor_info(layer, name) for name in MOE_PARAM_NAMES}
    pre_sliced = []
    for name, (key, file, shape, dtype) in infos.items():
        if dtype != dtypes[name]:
            raise CheckpointError(f"dtype {dtype}, expected {dtypes[name]}", path=file, key=key)
        tail = shapes[name][1:]
        rows_ok = len(shape) == len(shapes[name]) and shape[0] in (full_rows, local_rows)
        if not rows_ok or tuple(shape[1:]) != tail:
            want = f"{[full_rows, *tail]}"
            if local_rows != full_rows:
                want += f" (or {[local_rows, *tail]} pre-sliced for {partition})"
            raise CheckpointError(f"shape {list(shape)}, expected {want}", path=file, key=key)
        if shape[0] == local_rows != full_rows:
            pre_sliced.append(key)
    if pre_sliced and len(pre_sliced) != len(MOE_PARAM_NAMES):
        raise CheckpointError(f"layer {layer} mixes pre-sliced ({local_rows} rows: "
                              f"{pre_sliced}) and full tensors", path=reader.path,
                              key=pre_sliced[0])
    if pre_sliced:
        recorded = reader.partition
        if recorded is not None and recorded != partition:
            raise CheckpointError(f"this pre-sliced checkpoint holds the rows of {recorded}, "
                                  f"not of {partition}", path=reader.path, key=pre_sliced[0])

    begin, end = partition.rows(E)
    state: dict[str, torch.Tensor] = {}
    for name, (key, _file, shape, dtype) in infos.items():
        if pre_sliced:
            state[name] = reader.read_key(key)
        elif partition.real_heads == 0:
            state[name] = torch.zeros((local_rows, *shape[1:]), dtype=dtype)
        else:
            state[name] = reader.read_key(key, (begin, end))
    if verify:
        for name, (key, file, _, _) in infos.items():
            _check_finite(state[name], file, key, 0 if pre_sliced else begin)
    return state


def load_layer(
    path_or_reader: str | os.PathLike | CheckpointReader,
    layer: int,
    config: MultiHeadMoEConfig | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    partition: HeadPartition | None = None,
    device: torch.device | str = "cpu",
    backend: str = "auto",
    input_mode: str = "sequence",
    verify: bool = True,
) -> MultiHeadMoE:
    """A `MultiHeadMoE` holding this rank's slice of MoE layer `layer`.

    `backend` and `input_mode` are passed to `MultiHeadMoE`.

    The partition is `partition`, else the calling rank's in `group`, else one rank.
    Everything is read and checked first (`load_layer_state`); only then is the module
    built on the meta device and its parameters assigned, so a failure leaves no
    half-loaded module behind.
    """
    reader, owned = _as_reader(path_or_reader)
    try:
        config = _resolve_config(reader, config)
        if partition is None:
            partition = HeadPartition.of_group(config.num_heads, group)
        elif group is not None and partition != HeadPartition.of_group(config.num_heads, group):
            raise ValueError(f"load_layer: partition {partition} does not match the rank of "
                             f"the group")
        state = load_layer_state(reader, layer, config, partition, verify=verify)
    finally:
        if owned:
            reader.close()
    state = {name: tensor.to(device) for name, tensor in state.items()}
    module = MultiHeadMoE(config, group, device="meta", backend=backend, partition=partition,
                          input_mode=input_mode)
    module.load_state_dict(state, strict=True, assign=True)
    # The router biases are frozen parameters; assign must not make them trainable.
    for param in module.router.parameters():
        param.requires_grad_(False)
    return module


def load_layers(
    path_or_reader: str | os.PathLike | CheckpointReader,
    layers: list[int] | None = None,
    config: MultiHeadMoEConfig | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    partition: HeadPartition | None = None,
    device: torch.device | str = "cpu",
    backend: str = "auto",
    input_mode: str = "sequence",
    verify: bool = True,
    progress: bool = False,
) -> tuple[dict[int, MultiHeadMoE], int]:
    """Every MoE layer of a checkpoint (or `layers`) for this rank, and the bytes read.

    Each layer is loaded as `load_layer` does (checked first, then assigned), so a
    rank of a head-parallel group reads only its own rows of each layer.
    returns ({layer index: module}, bytes read from disk by this call)
    """
    reader, owned = _as_reader(path_or_reader)
    try:
        indices = reader.moe_layers() if layers is None else list(layers)
        if not indices:
            raise CheckpointError("no MoE layers found", path=reader.path)
        before = reader.bytes_read
        modules: dict[int, MultiHeadMoE] = {}
        with _layer_progress(len(indices), progress) as advance:
            for index in indices:
                modules[index] = load_layer(reader, index, config, group=group,
                                            partition=partition, device=device, backend=backend,
                                            input_mode=input_mode, verify=verify)
                advance(index, reader.bytes_read - before)
        return modules, reader.bytes_read - before
    finally:
        if owned:
            reader.close()


@contextlib.contextmanager
def _layer_progress(total: int, enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar over layers that shows the bytes read so far."""
    if not enabled:
        yield lambda index, nbytes: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[read]}")) as bar:
        task = bar.add_task("loading MoE layers", total=total, read="")

        def advance(index: int, nbytes: int) -> None:
            bar.update(task, advance=1, description=f"loaded layer {index}",
                       read=f"{nbytes / 1e9:.2f} GB read")

        yield advance


# ----------------------------------------------------------------------------------------
# Inspection
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRow:
    """One MoE tensor of a checkpoint."""

    layer: int
    name: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int
    file: Path


@dataclass
class CheckpointReport:
    """What `inspect_checkpoint` found. `problems` is empty for a sound checkpoint."""

    path: Path
    files: list[Path] = field(default_factory=list)
    config: MultiHeadMoEConfig | None = None
    layers: list[TensorRow] = field(default_factory=list)
    total_bytes: int = 0  # bytes of the MoE tensors listed in `layers`
    other_keys: int = 0  # keys that are not MoE parameters (a full model's checkpoint)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def layer_indices(self) -> list[int]:
        return sorted({row.layer for row in self.layers})

    def format(self) -> str:
        """A plain-text summary: one line per layer, then the problems."""
        lines = [f"{self.path}: {len(self.files)} file(s), {len(self.layer_indices)} MoE "
                 f"layer(s), {self.total_bytes / 1e9:.3f} GB of MoE tensors, "
                 f"{self.other_keys} other key(s)"]
        lines.append(f"config: {self.config.to_json() if self.config else None}")
        for layer in self.layer_indices:
            rows = [r for r in self.layers if r.layer == layer]
            parts = ", ".join(f"{r.name} {list(r.shape)} {str(r.dtype).removeprefix('torch.')}"
                              for r in rows)
            lines.append(f"layer {layer}: {parts}")
        lines += [f"problem: {p}" for p in self.problems] or ["no problems"]
        return "\n".join(lines)


def inspect_checkpoint(path: str | os.PathLike, *, check_finite: bool = False) \
        -> CheckpointReport:
    """Describe a checkpoint and list what is wrong with it, without raising.

    Problems reported: unreadable or missing files, keys the index and its shards
    disagree on, invalid config metadata, missing or unexpected MoE keys, keys present
    with and without the 'transformer.' prefix, a dtype or shape that differs between
    layers or from the config, and (check_finite=True, which reads every MoE tensor)
    NaN / inf values.
    """
    report = CheckpointReport(Path(path))
    try:
        reader = CheckpointReader(path)
    except CheckpointError as e:
        report.problems.append(str(e))
        return report
    with reader:
        report.path = reader.path
        report.files = list(reader.files)
        problems = report.problems
        try:
            report.config = reader.config
        except CheckpointError as e:
            problems.append(str(e))

        weight_map = reader.weight_map
        for file in reader.files:
            try:
                held = set(reader.file_keys(file))
            except CheckpointError as e:
                problems.append(str(e))
                continue
            listed = {k for k, f in weight_map.items() if f == file}
            if listed - held:
                problems.append(f"{file}: keys the index maps here are not in the file: "
                                f"{sorted(listed - held)[:5]}")
            if held - listed:
                problems.append(f"{file}: keys in the file are not in the index: "
                                f"{sorted(held - listed)[:5]}")
        report.other_keys = sum(1 for k in weight_map if k not in reader._moe)

        for layer in reader.moe_layers():
            keys = reader.layer_keys(layer)
            by_name: dict[str, list[str]] = {}
            for key, (name, _) in keys.items():
                by_name.setdefault(name, []).append(key)
            for name, both in by_name.items():
                if len(both) > 1:
                    problems.append(f"{reader.path}: layer {layer}: {name} is present with and "
                                    f"without the 'transformer.' prefix: {sorted(both)}")
            missing = [n for n in MOE_PARAM_NAMES if n not in by_name]
            if missing:
                problems.append(f"{reader.path}: layer {layer}: missing {missing}")
            unexpected = sorted(set(by_name) - set(MOE_PARAM_NAMES))
            if unexpected:
                problems.append(f"{reader.path}: layer {layer}: unexpected {unexpected}")
            for key in sorted(keys, key=lambda k: _name_order(keys[k][0])):
                try:
                    file, shape, dtype = reader.key_info(key)
                except CheckpointError as e:
                    problems.append(str(e))
                    continue
                size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                report.layers.append(TensorRow(layer, keys[key][0], key, shape, dtype, size,
                                               file))
        report.total_bytes = sum(row.bytes for row in report.layers)
        problems += _consistency_problems(report.layers, report.config, reader)
        if check_finite:
            for row in report.layers:
                try:
                    _check_finite_chunked(reader, row)
                except CheckpointError as e:
                    problems.append(str(e))
    return report


def _name_order(name: str) -> tuple[int, str]:
    return (MOE_PARAM_NAMES.index(name) if name in MOE_PARAM_NAMES else len(MOE_PARAM_NAMES),
            name)


def _consistency_problems(rows: list[TensorRow], config: MultiHeadMoEConfig | None,
                          reader: CheckpointReader) -> list[str]:
    """Shapes / dtypes that differ between layers, or from the config."""
    problems = []
    by_name: dict[str, list[TensorRow]] = {}
    for row in rows:
        by_name.setdefault(row.name, []).append(row)
    for name, group in by_name.items():
        kinds: dict[tuple, list[int]] = {}
        for row in group:
            kinds.setdefault((row.shape, row.dtype), []).append(row.layer)
        if len(kinds) > 1:
            # No variant is presumed right (with two layers neither is the majority).
            variants = "; ".join(f"{list(shape)} {dtype} in layers {layers}"
                                 for (shape, dtype), layers in kinds.items())
            problems.append(f"{reader.path}: {name} differs between layers: {variants}")
    if config is not None:
        try:
            recorded = reader.partition
        except CheckpointError as e:
            problems.append(str(e))
            recorded = None
        rows_ok = {config.num_flat_experts}
        if recorded is not None:
            rows_ok.add(recorded.local_heads * config.num_experts)
        shapes, dtypes = expected_shapes(config), expected_dtypes(config)
        for row in rows:
            if row.name not in shapes:
                continue
            want = shapes[row.name]
            if len(row.shape) != len(want) or row.shape[0] not in rows_ok \
                    or row.shape[1:] != want[1:]:
                problems.append(f"{row.file}: {row.key}: shape {list(row.shape)} does not "
                                f"match the config ({list(want)})")
            if row.dtype != dtypes[row.name]:
                problems.append(f"{row.file}: {row.key}: dtype {row.dtype}, the config "
                                f"says {dtypes[row.name]}")
    return problems


def _check_finite_chunked(reader: CheckpointReader, row: TensorRow) -> None:
    """Finiteness of a whole tensor, read a bounded number of rows at a time."""
    if not row.dtype.is_floating_point:
        return
    if not row.shape:
        _check_finite(reader.read_key(row.key), row.file, row.key, 0)
        return
    row_size = max(1, math.prod(row.shape[1:]))
    step = max(1, _FINITE_CHUNK // row_size)
    for begin in range(0, row.shape[0], step):
        end = min(row.shape[0], begin + step)
        _check_finite(reader.read_key(row.key, (begin, end)), row.file, row.key, begin)
