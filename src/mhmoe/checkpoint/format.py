"""The MAGI-2 checkpoint format: file names, the key map, expected shapes and dtypes,
metadata keys and `CheckpointError` (docs/contract.md sections 5 and 6).

Layout on disk, the Hugging Face convention MAGI-2 uses:

    ckpt/model.safetensors                       one file, or
    ckpt/model-00001-of-00003.safetensors ...    shards, plus
    ckpt/model.safetensors.index.json            {"metadata": {"total_size": ...},
                                                  "weight_map": {key: shard file name}}

Keys are `[transformer.]block.layers.{L}.mlp.moe_mlp.{name}` with `name` one of
`MOE_PARAM_NAMES`. Every file's safetensors metadata (and the index's metadata)
carries the layer config as JSON under "mhmoe.config".

fp8 layers (a config with params_dtype float8_e4m3fn, mhmoe.fp8): W_gate, W_up and
W_down are F8_E4M3 tensors in their usual [F, D, I] / [F, I, D] shapes (row-major),
each with its fp32 scale `NAME_scale` beside it (`FP8_SCALE_NAMES`: [F, I], [F, I],
[F, D]), and the metadata names the scheme under "mhmoe.quant" (`fp8.SCHEME`). Rows
of padding heads, which a reader fills in, are zero weights with scale
`fp8.ZERO_SCALE` (what quantizing zeros gives).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..config import MultiHeadMoEConfig
from ..fp8 import SCALE_NAMES

MOE_PARAM_NAMES = ("gate", "W_gate", "W_up", "W_down", "router.expert_bias",
                   "router.expert_bias_ema")
PREFIXES = ("", "transformer.")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_METADATA_KEY = "mhmoe.config"
# The quantization scheme of fp8 expert weights (`fp8.SCHEME`), in fp8 checkpoints only.
QUANT_METADATA_KEY = "mhmoe.quant"
FP8_SCALE_NAMES = tuple(SCALE_NAMES.values())
# Set when the saved modules hold one rank's rows only (a pre-sliced checkpoint), so
# that loading it on another rank is an error rather than silently wrong weights.
PARTITION_METADATA_KEY = "mhmoe.partition"

_MOE_KEY = re.compile(r"(transformer\.)?block\.layers\.(\d+)\.mlp\.moe_mlp\.(.+)")
# safetensors' dtype names of the dtypes this package writes and reads.
TORCH_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
ST_TO_TORCH = {name: dtype for dtype, name in TORCH_TO_ST.items()}


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


def parse_moe_key(key: str) -> tuple[int, str, str] | None:
    """(layer, name, prefix) of a MoE key, or None for any other key."""
    match = _MOE_KEY.fullmatch(key)
    if match is None:
        return None
    return int(match[2]), match[3], match[1] or ""


def param_names(config: MultiHeadMoEConfig | None) -> tuple[str, ...]:
    """The parameter names of a layer of `config`: `MOE_PARAM_NAMES`, and the scales
    (`FP8_SCALE_NAMES`) of an fp8 layer."""
    return MOE_PARAM_NAMES + (FP8_SCALE_NAMES if config is not None and config.is_fp8
                              else ())


def expected_shapes(config: MultiHeadMoEConfig, rows: int | None = None) \
        -> dict[str, tuple[int, ...]]:
    """Shape of every MoE parameter (`param_names`) with `rows` flat experts (all
    `H * E` if None)."""
    rows = config.num_flat_experts if rows is None else rows
    D, I = config.head_dim, config.expert_intermediate_size
    shapes = {"gate": (rows, D), "W_gate": (rows, D, I), "W_up": (rows, D, I),
              "W_down": (rows, I, D), "router.expert_bias": (rows,),
              "router.expert_bias_ema": (rows,)}
    if config.is_fp8:
        shapes.update({"W_gate_scale": (rows, I), "W_up_scale": (rows, I),
                       "W_down_scale": (rows, D)})
    return shapes


def expected_dtypes(config: MultiHeadMoEConfig) -> dict[str, torch.dtype]:
    """The router is fp32 whatever the weights are (docs/contract.md section 5), except
    in a float64 layer, whose router `MultiHeadMoE` keeps in float64 too (for gradient
    checks)."""
    weights = config.params_dtype
    router = torch.float64 if weights == torch.float64 else torch.float32
    dtypes = {"gate": router, "W_gate": weights, "W_up": weights, "W_down": weights,
              "router.expert_bias": router, "router.expert_bias_ema": router}
    if config.is_fp8:
        dtypes.update(dict.fromkeys(FP8_SCALE_NAMES, torch.float32))
    return dtypes
