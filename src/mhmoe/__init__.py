"""mhmoe: multi-head mixture-of-experts layers (the public surface of docs/contract.md
section 8).

The names below are imported on first use (PEP 562), so that `import mhmoe` alone, and
with it `mhmoe --help`, does not load torch and triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "CheckpointError": ".checkpoint",
    "CheckpointReader": ".checkpoint",
    "inspect_checkpoint": ".checkpoint",
    "load_layer": ".checkpoint",
    "load_layers": ".checkpoint",
    "save_checkpoint": ".checkpoint",
    "MAGI2_MOE_LAYERS": ".config",
    "MAGI2_PREVIEW": ".config",
    "MultiHeadMoEConfig": ".config",
    "RouterOptions": ".config",
    "expert_forward": ".experts",
    "expert_forward_fp8": ".experts",
    "swiglu7": ".experts",
    "MultiHeadMoE": ".layer",
    "HeadPartition": ".parallel",
    # the function, not the module: mhmoe.fp8 holds it (a module named quantize would
    # replace it as a package attribute once imported)
    "quantize": ".fp8",
    "RouteLayout": ".routing",
    "route": ".routing",
    "sort_routes": ".routing",
}

__all__ = [
    "MAGI2_MOE_LAYERS",
    "MAGI2_PREVIEW",
    "CheckpointError",
    "CheckpointReader",
    "HeadPartition",
    "MultiHeadMoE",
    "MultiHeadMoEConfig",
    "RouteLayout",
    "RouterOptions",
    "expert_forward",
    "expert_forward_fp8",
    "inspect_checkpoint",
    "load_layer",
    "load_layers",
    "quantize",
    "route",
    "save_checkpoint",
    "sort_routes",
    "swiglu7",
]

if TYPE_CHECKING:
    from .checkpoint import (
        CheckpointError,
        CheckpointReader,
        inspect_checkpoint,
        load_layer,
        load_layers,
        save_checkpoint,
    )
    from .config import MAGI2_MOE_LAYERS, MAGI2_PREVIEW, MultiHeadMoEConfig, RouterOptions
    from .experts import expert_forward, expert_forward_fp8, swiglu7
    from .fp8 import quantize
    from .layer import MultiHeadMoE
    from .parallel import HeadPartition
    from .routing import RouteLayout, route, sort_routes


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mhmoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
