"""`inspect_checkpoint`: what a checkpoint holds and what is wrong with it, without
raising (`CheckpointReport`, one `TensorRow` per MoE tensor); the consistency checks
between layers and against the config, and the finiteness (and, for the scales of fp8
weights, positivity) checks loading uses too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import MultiHeadMoEConfig
from ..fp8 import FP8, SCALE_NAMES, SCHEME
from .format import (
    FP8_SCALE_NAMES,
    MOE_PARAM_NAMES,
    QUANT_METADATA_KEY,
    CheckpointError,
    expected_dtypes,
    expected_shapes,
    param_names,
    parse_moe_key,
)
from .reader import CheckpointReader

# Elements checked for finiteness at a time: bounds the temporary bool mask.
_FINITE_CHUNK = 1 << 24


def _not_finite(values: torch.Tensor) -> torch.Tensor:
    if values.dtype == FP8:  # no isfinite for e4m3; its only non-finite codes are NaN
        return (values.view(torch.uint8) & 0x7F) == 0x7F
    return ~torch.isfinite(values)


def require_finite(tensor: torch.Tensor, path: Path, key: str, first_row: int) -> None:
    """Raise `CheckpointError` if a floating `tensor` holds NaN or inf; `first_row` is the
    checkpoint row of `tensor[0]`, for the message."""
    _require(tensor, path, key, first_row, _not_finite, "non-finite value(s) (NaN or inf)")


def require_positive(tensor: torch.Tensor, path: Path, key: str, first_row: int) -> None:
    """Raise `CheckpointError` unless every value of `tensor` (a scale) is > 0."""
    _require(tensor, path, key, first_row, lambda v: ~(v > 0),
             "scale(s) that are not > 0 (a scale multiplies its channel's fp8 values)")


def _require(tensor: torch.Tensor, path: Path, key: str, first_row: int, is_bad,
             what: str) -> None:
    if not tensor.dtype.is_floating_point or tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    row_size = max(1, math.prod(tensor.shape[1:]))
    bad_total, first_bad = 0, None
    for start in range(0, flat.numel(), _FINITE_CHUNK):
        bad = is_bad(flat[start:start + _FINITE_CHUNK])
        count = int(bad.sum())
        if count and first_bad is None:
            first_bad = start + int(bad.nonzero()[0, 0])
        bad_total += count
    if bad_total:
        row = first_row + first_bad // row_size if tensor.dim() else None
        where = f", the first in checkpoint row {row}" if row is not None else ""
        raise CheckpointError(f"{bad_total} {what}{where}; pass verify=False to load them "
                              f"anyway", path=path, key=key)


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
    checked_finite: bool = False  # whether every MoE tensor was read and checked for NaN / inf
    scheme: str | None = None  # the fp8 weights' quantization scheme ("mhmoe.quant"), if any

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
        if self.scheme is not None:
            lines.append(f"quantization: {self.scheme}")
        for layer in self.layer_indices:
            rows = [r for r in self.layers if r.layer == layer]
            parts = ", ".join(f"{r.name} {list(r.shape)} {str(r.dtype).removeprefix('torch.')}"
                              for r in rows)
            lines.append(f"layer {layer}: {parts}")
        lines += [f"problem: {p}" for p in self.problems] or ["no problems"]
        if not self.checked_finite:
            lines.append("(values not checked for NaN / inf)")
        return "\n".join(lines)


def inspect_checkpoint(path: str | os.PathLike, *, check_finite: bool = True) \
        -> CheckpointReport:
    """Describe a checkpoint and list what is wrong with it, without raising.

    Problems reported: unreadable or missing files, keys the index and its shards
    disagree on, invalid config metadata, missing or unexpected MoE keys, keys present
    with and without the 'transformer.' prefix, a dtype or shape that differs between
    layers or from the config, and NaN / inf values. The last needs every MoE tensor
    read (a bounded number of rows at a time); check_finite=False skips it, and a
    checkpoint that loading would refuse can then be reported sound.

    fp8 layers (the config's params_dtype, or F8_E4M3 weights or scale keys where
    there is no config): each weight's `NAME_scale` must be there, fp32, of shape
    [rows, output channels] of its weight; the metadata must name this library's
    scheme; with check_finite the scales are also read and must be finite and > 0.
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
        report.scheme = reader.quant_scheme

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
        report.other_keys = sum(1 for k in weight_map if parse_moe_key(k) is None)

        for layer in reader.moe_layers():
            keys = reader.layer_keys(layer)
            by_name: dict[str, list[str]] = {}
            for key, (name, _) in keys.items():
                by_name.setdefault(name, []).append(key)
            for name, both in by_name.items():
                if len(both) > 1:
                    problems.append(f"{reader.path}: layer {layer}: {name} is present with and "
                                    f"without the 'transformer.' prefix: {sorted(both)}")
            fp8 = _layer_is_fp8(reader, layer, by_name, report.config)
            expected = MOE_PARAM_NAMES + FP8_SCALE_NAMES if fp8 else \
                param_names(report.config)
            missing = [n for n in expected if n not in by_name]
            if missing:
                problems.append(f"{reader.path}: layer {layer}: missing {missing}")
            unexpected = sorted(set(by_name) - set(expected))
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
        problems += _scale_problems(report, reader)
        if check_finite:
            report.checked_finite = True
            for row in report.layers:
                try:
                    _check_finite_chunked(reader, row)
                except CheckpointError as e:
                    problems.append(str(e))
    return report


def _layer_is_fp8(reader: CheckpointReader, layer: int, by_name: dict[str, list[str]],
                  config: MultiHeadMoEConfig | None) -> bool:
    """Whether a layer holds fp8 experts: as its config says, else as its keys (a
    scale) or its W_gate's dtype say."""
    if config is not None:
        return config.is_fp8
    if set(by_name) & set(FP8_SCALE_NAMES):
        return True
    try:
        return len(by_name.get("W_gate", [])) == 1 and \
            reader.key_info(by_name["W_gate"][0])[2] == FP8
    except CheckpointError:
        return False  # reported with the tensor's own row


def _scale_problems(report: CheckpointReport, reader: CheckpointReader) -> list[str]:
    """The scheme metadata of fp8 layers, and each scale's shape and dtype against its
    weight's (what the config checks cannot see without a config)."""
    problems = []
    rows = {(row.layer, row.name): row for row in report.layers}
    fp8_layers = sorted({row.layer for row in report.layers
                         if row.name in FP8_SCALE_NAMES or row.dtype == FP8})
    if fp8_layers and report.scheme != SCHEME:
        found = "none" if report.scheme is None else repr(report.scheme)
        problems.append(f"{reader.path}: fp8 layers {fp8_layers} need the "
                        f"{QUANT_METADATA_KEY!r} metadata {SCHEME!r}; it is {found}")
    for layer in fp8_layers:
        for weight, scale in SCALE_NAMES.items():
            w, s = rows.get((layer, weight)), rows.get((layer, scale))
            if w is None or s is None:
                continue  # reported as missing
            if w.dtype != FP8:
                problems.append(f"{w.file}: {w.key}: dtype {w.dtype} beside a scale; fp8 "
                                f"weights are {FP8}")
            want = (w.shape[0], w.shape[2]) if len(w.shape) == 3 else None
            if s.shape != want or s.dtype != torch.float32:
                problems.append(f"{s.file}: {s.key}: {s.dtype} {list(s.shape)}, expected "
                                f"float32 {list(want) if want else '[rows, channels]'} (one "
                                f"scale per output channel of {weight})")
    return problems


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
    """Finiteness of a whole tensor (and positivity of a scale), read a bounded number of
    rows at a time."""
    if not row.dtype.is_floating_point:
        return
    if not row.shape:
        require_finite(reader.read_key(row.key), row.file, row.key, 0)
        return
    row_size = max(1, math.prod(row.shape[1:]))
    step = max(1, _FINITE_CHUNK // row_size)
    for begin in range(0, row.shape[0], step):
        end = min(row.shape[0], begin + step)
        values = reader.read_key(row.key, (begin, end))
        require_finite(values, row.file, row.key, begin)
        if row.name in FP8_SCALE_NAMES:
            require_positive(values, row.file, row.key, begin)
