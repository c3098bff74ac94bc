"""Loading MoE layers: `load_layer_state`, `load_layer`, `load_layers`.

Loading checks every key, shape and dtype (and, optionally, finiteness) before it
hands anything back, then builds the module on the meta device and assigns: a module
is never left half-loaded. A rank of a head-parallel group reads its own rows only.
fp8 layers (format.py) load the same way, their scales sliced as their weights.
"""

from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import MultiHeadMoEConfig
from ..fp8 import FP8, SCHEME, ZERO_SCALE
from ..layer import MultiHeadMoE
from ..parallel import HeadPartition
from .format import (
    CONFIG_METADATA_KEY,
    FP8_SCALE_NAMES,
    QUANT_METADATA_KEY,
    CheckpointError,
    expected_dtypes,
    expected_shapes,
    moe_key,
    param_names,
)
from .inspect import require_finite, require_positive
from .reader import CheckpointReader


def _as_reader(source: str | os.PathLike | CheckpointReader) -> tuple[CheckpointReader, bool]:
    """(reader, whether the caller opened it and must close it)."""
    if isinstance(source, CheckpointReader):
        return source, False
    return CheckpointReader(source), True


def _layer_index(layer: object, what: str = "layer") -> int:
    """`layer` as an int; a str (even "3"), float or bool is refused: a layer index read
    from text must be converted by the caller, not guessed at here."""
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        hint = f" (int({layer!r}) converts it)" if isinstance(layer, str) and \
            layer.strip().isdigit() else ""
        raise TypeError(f"{what} must be an int layer index, got {type(layer).__name__} "
                        f"{layer!r}{hint}")
    return int(layer)


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


def load_layer_state(
    path_or_reader: str | os.PathLike | CheckpointReader,
    layer: int,
    config: MultiHeadMoEConfig | None = None,
    partition: HeadPartition | None = None,
    *,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """The parameters of MoE layer `layer` for one rank, keyed by `param_names(config)`:
    the six of `MOE_PARAM_NAMES`, and for an fp8 config the three scales.

    With `E = num_experts`, `local_flat = partition.local_heads * E` and
    `begin = partition.start * E`, every tensor is rows `[begin, begin + local_flat)` of
    the stored `[H * E, ...]` tensor (docs/contract.md section 6):
      gate [local_flat, D] fp32; W_gate, W_up [local_flat, D, I], W_down [local_flat, I, D]
      in params_dtype; router.expert_bias, router.expert_bias_ema [local_flat] fp32.
    Rows past `H * E` (padding heads) are zeros; a rank with no real heads gets zeros
    without reading anything. fp8: W_gate, W_up, W_down float8_e4m3fn as stored
    (row-major), W_gate_scale, W_up_scale [local_flat, I], W_down_scale [local_flat, D]
    fp32, sliced alike; a padding row's scale is `fp8.ZERO_SCALE` (that of zeros); the
    metadata must name this library's scheme (`fp8.SCHEME`).

    A stored tensor with exactly `local_flat` rows (when `local_flat != H * E`) is a
    pre-sliced, per-rank checkpoint and is taken as it is; all six must then be
    pre-sliced, and if the file records its partition it must be this one. The shapes
    alone cannot say which rank a pre-sliced file belongs to, so a file without that
    record is trusted to be this rank's. When `local_flat == H * E` (one rank, or one
    head) the tensor is read as the full tensor: the two readings then agree except on
    padding rows, which are zeros either way.

    config: defaults to the checkpoint's "mhmoe.config" metadata.
    partition: defaults to one rank holding every head.
    verify: also reject NaN / inf in what was read (and a scale that is not > 0).

    Every key, shape and dtype is checked before any data is read, and every check
    passes before anything is returned; failures raise `CheckpointError` naming the
    file and the key.
    """
    layer = _layer_index(layer)
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
    infos, pre_sliced = checked_layer(reader, layer, config, partition)
    E = config.num_experts
    full_rows = config.num_flat_experts
    local_rows = partition.local_heads * E
    begin, end = partition.rows(E)
    state: dict[str, torch.Tensor] = {}
    for name, (key, _file, shape, dtype) in infos.items():
        if pre_sliced:
            state[name] = reader.read_key(key)
        elif partition.real_heads == 0:
            state[name] = torch.zeros((local_rows, *shape[1:]), dtype=dtype)
        else:
            state[name] = reader.read_key(key, (begin, end))
        if name in FP8_SCALE_NAMES and not pre_sliced:
            # Padding rows: zero weights, with the scale quantizing zeros gives them.
            state[name][max(0, full_rows - begin):] = ZERO_SCALE
    if verify:
        for name, (key, file, _, _) in infos.items():
            first_row = 0 if pre_sliced else begin
            require_finite(state[name], file, key, first_row)
            if name in FP8_SCALE_NAMES:
                require_positive(state[name], file, key, first_row)
    return state


def checked_layer(reader: CheckpointReader, layer: int, config: MultiHeadMoEConfig,
                  partition: HeadPartition) \
        -> tuple[dict[str, tuple[str, Path, tuple[int, ...], torch.dtype]], bool]:
    """The checks of `load_layer_state` that need no data: every key of layer `layer`
    there and no other, one prefix, shapes and dtypes as `config` says (full, or
    pre-sliced for `partition`), an fp8 checkpoint's scheme. Returns
    ({name: (key, file, shape, dtype)} in `param_names(config)` order, whether the
    tensors are pre-sliced)."""
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
    expected = param_names(config)
    missing = [moe_key(layer, n, prefix) for n in expected if n not in names]
    if missing:
        hint = " (the scales of fp8 weights)" if config.is_fp8 and \
            set(missing) & {moe_key(layer, n, prefix) for n in FP8_SCALE_NAMES} else ""
        raise CheckpointError(f"missing key(s) {missing}{hint}", path=reader.path,
                              key=missing[0])
    unexpected = sorted(moe_key(layer, n, prefix) for n in names - set(expected))
    if unexpected:
        hint = " (scales of an fp8 checkpoint, but the config's experts are " \
            f"{config.params_dtype})" if names & set(FP8_SCALE_NAMES) else ""
        raise CheckpointError(f"unexpected key(s) under this layer's moe_mlp: {unexpected}"
                              f"{hint}", path=reader.path, key=unexpected[0])
    if config.is_fp8:
        scheme = reader.quant_scheme
        if scheme != SCHEME:
            found = "none" if scheme is None else repr(scheme)
            raise CheckpointError(f"fp8 weights need the {QUANT_METADATA_KEY!r} metadata "
                                  f"{SCHEME!r} (this library's scaling scheme); the "
                                  f"checkpoint has {found}", path=reader.path)

    E = config.num_experts
    full_rows = config.num_flat_experts
    local_rows = partition.local_heads * E
    shapes, dtypes = expected_shapes(config), expected_dtypes(config)
    infos = {name: reader.tensor_info(layer, name) for name in expected}
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
    if pre_sliced and len(pre_sliced) != len(expected):
        raise CheckpointError(f"layer {layer} mixes pre-sliced ({local_rows} rows: "
                              f"{pre_sliced}) and full tensors", path=reader.path,
                              key=pre_sliced[0])
    if pre_sliced:
        recorded = reader.partition
        if recorded is not None and recorded != partition:
            raise CheckpointError(f"this pre-sliced checkpoint holds the rows of {recorded}, "
                                  f"not of {partition}", path=reader.path, key=pre_sliced[0])
    return infos, bool(pre_sliced)


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
    layer = _layer_index(layer)
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
    for name, tensor in state.items():
        if tensor.dtype == FP8:  # the K-major layout of the fp8 kernel (fp8.quantize_weights)
            state[name] = tensor.transpose(1, 2).contiguous().transpose(1, 2)
    module = MultiHeadMoE(config, group, device="meta", backend=backend, partition=partition,
                          input_mode=input_mode)
    # assign=True keeps each parameter's requires_grad from the module, so the frozen
    # router biases (and every parameter of an fp8 layer) stay frozen.
    module.load_state_dict(state, strict=True, assign=True)
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
        indices = reader.moe_layers() if layers is None else \
            [_layer_index(layer, "every entry of layers") for layer in layers]
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

