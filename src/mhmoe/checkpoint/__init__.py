"""Safetensors checkpoints of multi-head MoE layers (docs/contract.md sections 5 and 6).

  format.py   file names, the MAGI-2 key map, expected shapes and dtypes, metadata keys,
              `CheckpointError`
  writer.py   `save_checkpoint` (shards, atomic renames, the index last),
              `save_checkpoint_layers` (the same, one layer made and written at a time)
  reader.py   `CheckpointReader` (headers, index, per-rank row reads)
  load.py     `load_layer_state`, `load_layer`, `load_layers` (checked, then assigned)
  inspect.py  `inspect_checkpoint`, `CheckpointReport`, `TensorRow`

This module re-exports the public names of all five.
"""

from .format import (
    CONFIG_METADATA_KEY,
    FP8_SCALE_NAMES,
    INDEX_FILE,
    MOE_PARAM_NAMES,
    PARTITION_METADATA_KEY,
    PREFIXES,
    QUANT_METADATA_KEY,
    SINGLE_FILE,
    CheckpointError,
    expected_dtypes,
    expected_shapes,
    moe_key,
    param_names,
)
from .inspect import CheckpointReport, TensorRow, inspect_checkpoint
from .load import load_layer, load_layer_state, load_layers
from .reader import CheckpointReader
from .writer import save_checkpoint, save_checkpoint_layers

__all__ = [
    "CONFIG_METADATA_KEY",
    "FP8_SCALE_NAMES",
    "INDEX_FILE",
    "MOE_PARAM_NAMES",
    "PARTITION_METADATA_KEY",
    "PREFIXES",
    "QUANT_METADATA_KEY",
    "SINGLE_FILE",
    "CheckpointError",
    "CheckpointReader",
    "CheckpointReport",
    "TensorRow",
    "expected_dtypes",
    "expected_shapes",
    "inspect_checkpoint",
    "load_layer",
    "load_layer_state",
    "load_layers",
    "moe_key",
    "param_names",
    "save_checkpoint",
    "save_checkpoint_layers",
]
