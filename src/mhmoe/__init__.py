"""mhmoe: multi-head mixture-of-experts layers (the public surface of SPEC section 8)."""

from .checkpoint import (
    CheckpointError,
    CheckpointReader,
    inspect_checkpoint,
    load_layer,
    load_layers,
    save_checkpoint,
)
from .config import MAGI2_MOE_LAYERS, MAGI2_PREVIEW, MultiHeadMoEConfig
from .experts import expert_forward, swiglu7
from .layer import MultiHeadMoE
from .parallel import HeadPartition
from .routing import RouteLayout, route, sort_routes

__version__ = "0.1.0"

__all__ = [
    "MAGI2_MOE_LAYERS",
    "MAGI2_PREVIEW",
    "CheckpointError",
    "CheckpointReader",
    "HeadPartition",
    "MultiHeadMoE",
    "MultiHeadMoEConfig",
    "RouteLayout",
    "expert_forward",
    "inspect_checkpoint",
    "load_layer",
    "load_layers",
    "route",
    "save_checkpoint",
    "sort_routes",
    "swiglu7",
]
