"""Which implementation an op runs: "torch" (reference.py) or "triton" (kernels/).

"auto" takes the Triton kernels on CUDA tensors and the PyTorch path
elsewhere. "triton" runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1
(the interpreter, for tests); asking for it where it cannot run is an error,
never a silent fallback.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def _probe_triton() -> bool:
    """Triton with the host TensorDescriptor API the kernels use (Triton 3.4 and later)."""
    try:
        import triton  # noqa: F401
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


# Probed once at import: a plain constant is what torch.compile can read cheaply.
TRITON_AVAILABLE = _probe_triton()


def triton_importable() -> bool:
    return TRITON_AVAILABLE


def available_backends(device: torch.device | str) -> list[str]:
    """The paths that can run on `device`, slowest first."""
    device = torch.device(device)
    paths = ["torch"]
    if triton_importable() and (device.type == "cuda" or
                                os.environ.get("TRITON_INTERPRET") == "1"):
        paths.append("triton")
    return paths


def resolve_backend(backend: str, device: torch.device | str, op: str = "mhmoe") -> str:
    """The path `backend` takes on `device`; an error if an explicit path cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    device = torch.device(device)
    if backend == "auto":
        return "triton" if device.type == "cuda" and "triton" in available_backends(device) \
            else "torch"
    if backend not in available_backends(device):
        raise ValueError(f"{op}: backend {backend!r} cannot run on {device} (the triton path "
                         f"needs a CUDA device, or TRITON_INTERPRET=1 on the CPU, and the "
                         f"triton package)")
    return backend
