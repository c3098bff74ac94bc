"""`CheckpointReader`: an open checkpoint, its headers and index, and row reads.

Reading is lazy: `CheckpointReader.read` reads only the rows asked for, with
positioned reads at the offsets safetensors has validated (not through a memory
map, whose readahead pulls in megabytes of neighbouring rows), so a rank of a
head-parallel group reads its share of the weights (`rows [start*E, start*E +
local_flat)`) and nothing else.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import MultiHeadMoEConfig
from ..parallel import HeadPartition
from .format import (
    CONFIG_METADATA_KEY,
    INDEX_FILE,
    PARTITION_METADATA_KEY,
    PREFIXES,
    QUANT_METADATA_KEY,
    SINGLE_FILE,
    ST_TO_TORCH,
    CheckpointError,
    moe_key,
    parse_moe_key,
)

# The reference reader's limit: a longer header is corrupt, not a real one.
_MAX_HEADER_BYTES = 100_000_000


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


def read_index(index: Path) -> tuple[dict[str, Path], dict]:
    """(weight map {key: shard path}, metadata) of an index json; `CheckpointError` if it
    is not one, or names a shard outside its directory."""
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
        raise CheckpointError('the index json\'s "metadata" must be an object', path=index)
    files: dict[str, Path] = {}
    for key, name in weight_map.items():
        # Shards live next to the index; refuse names that would leave that directory.
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"the index maps the key to {name!r}, outside the "
                                  f"checkpoint directory", path=index, key=key)
        files[key] = index.parent / name
    return files, metadata


def read_header(file: Path, listed: str = "") -> tuple[int, dict]:
    """(data start, JSON header) of a safetensors file: an 8-byte little-endian header
    length, the header, then the data. `CheckpointError` if it is not one; `listed` is
    added to its message (the index that lists the file)."""
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
    return 8 + length, header


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
            self._weight_map, self._index_metadata = read_index(self.path)
            self.files = sorted(set(self._weight_map.values()))
        else:
            self.index_path = None
            self._index_metadata = {}
            _, header = self._read_header(self.path)
            self._weight_map = {key: self.path for key in header if key != "__metadata__"}
            self.files = [self.path]
        self._moe: dict[str, tuple[int, str, str]] = {}
        for key in self._weight_map:
            parsed = parse_moe_key(key)
            if parsed is not None:
                self._moe[key] = parsed

    def _read_header(self, file: Path) -> tuple[int, dict]:
        """`read_header` of one of this checkpoint's files, read once."""
        if file not in self._headers:
            listed = f" (listed in {self.index_path.name})" if self.index_path else ""
            self._headers[file] = read_header(file, listed)
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
    def quant_scheme(self) -> str | None:
        """The quantization scheme of fp8 weights ("mhmoe.quant" metadata), or None."""
        return self._metadata().get(QUANT_METADATA_KEY)

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
            if st_dtype not in ST_TO_TORCH:
                raise CheckpointError(f"unsupported dtype {st_dtype}", path=file, key=key)
            self._info[key] = (file, tuple(entry["shape"]), ST_TO_TORCH[st_dtype])
        return self._info[key]

    def tensor_info(self, layer: int, name: str) -> tuple[str, Path, tuple[int, ...],
                                                          torch.dtype]:
        """(key, file, shape, dtype) of parameter `name` of MoE layer `layer`."""
        key = self._key_of(layer, name)
        return (key, *self.key_info(key))

    def read(self, layer: int, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows `[begin, end)` of dim 0 of a parameter (all rows if None): [end - begin, ...].

        Only those rows are read from the file. Rows at or past the tensor's end are
        zeros (the padding heads of docs/contract.md section 6).
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
