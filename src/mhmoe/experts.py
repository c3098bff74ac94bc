"""`expert_forward()` and `swiglu7()`: the expert MLPs of every route (docs/contract.md
section 4).

Two paths compute the same function: "torch" (reference.py, any device, any
float dtype) and "triton" (the fused kernels of kernels/expert_forward.py and
kernels/expert_backward.py, CUDA; on the CPU only under TRITON_INTERPRET=1, for
tests). "auto" takes the fused kernels on CUDA and the PyTorch path elsewhere.

`expert_forward_fp8()` is the same for fp8 expert weights (mhmoe.fp8; inference
only): the kernel of kernels/expert_forward_fp8.py, or its float64 twin.

The module reads in order: the checks and the choice of path, the torch.library
ops (forward, backward, fake implementations) with the autograd formula attached
to the forward op, then the public functions.
"""

from __future__ import annotations

import warnings

import torch

from .backends import resolve_backend as _resolve
from .fp8 import ACT_BLOCK, FP8, INFERENCE_ONLY, Fp8Weights, fp8_expert_reference
from .reference import expert_backward_reference, expert_forward_reference, swiglu7_reference


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The expert path `backend` takes on `device` (see backends.py)."""
    return _resolve(backend, device, op="expert_forward")


def kernel_shape_problem(x_heads: torch.Tensor, w_gate: torch.Tensor) -> str | None:
    """Why the fused kernel cannot take these shapes, or None if it can."""
    D, I = w_gate.shape[1], w_gate.shape[2]
    if D % 16 or I % 16:
        return f"D={D} and I={I} must be multiples of 16 for the fused kernel"
    return None


_warned: set[str] = set()


def fp8_kernel_shape_problem(x_heads: torch.Tensor, w_gate: torch.Tensor) -> str | None:
    """Why the fp8 kernel cannot take these shapes, or None if it can: it holds a row's
    D values in one tile (a power of two) and walks I in blocks of ACT_BLOCK."""
    D, I = w_gate.shape[1], w_gate.shape[2]
    if D < 16 or D & (D - 1) or I % ACT_BLOCK:
        return (f"D={D} must be a power of two >= 16 and I={I} a multiple of {ACT_BLOCK} for "
                f"the fp8 kernel")
    return None


def _pick_path(backend: str, x_heads: torch.Tensor, w_gate: torch.Tensor,
               op: str = "expert_forward", shape_problem=kernel_shape_problem) -> str:
    """The path one call takes: resolve_backend, plus the kernel's shape rule.

    An explicit "triton" with shapes the kernel cannot take is an error; under
    "auto" such shapes run the PyTorch path and say so once in a warning.
    """
    path = _resolve(backend, x_heads.device, op=op)
    if path != "triton":
        return path
    problem = shape_problem(x_heads, w_gate)
    if problem is None:
        return path
    if backend == "triton":
        raise ValueError(f"{op}: {problem}")
    if problem not in _warned:
        _warned.add(problem)
        warnings.warn(f"{op}: {problem}; these shapes run the PyTorch path", stacklevel=3)
    return "torch"


def check_expert_inputs(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down) -> None:
    """Shape, dtype and device checks of `expert_forward`; reads nothing back from the device."""
    if x_heads.dim() != 3:
        raise ValueError(f"expert_forward: x_heads must be [S, H, D], got {tuple(x_heads.shape)}")
    _, H, D = x_heads.shape
    if w_gate.dim() != 3 or w_up.shape != w_gate.shape:
        raise ValueError(f"expert_forward: w_gate and w_up must both be [H*E, D, I], got "
                         f"{tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    F, Dw, I = w_gate.shape
    if Dw != D:
        raise ValueError(f"expert_forward: w_gate is [{F}, {Dw}, {I}] but x_heads has D={D}")
    if H == 0 or F % H:
        raise ValueError(f"expert_forward: {F} flat experts do not split over H={H} heads")
    if tuple(w_down.shape) != (F, I, D):
        raise ValueError(f"expert_forward: w_down must be [{F}, {I}, {D}], got "
                         f"{tuple(w_down.shape)}")
    if tuple(offsets.shape) != (F + 1,):
        raise ValueError(f"expert_forward: offsets must be [{F + 1}], got {tuple(offsets.shape)}")
    if gather_ids.dim() != 1 or sorted_probs.shape != gather_ids.shape:
        raise ValueError(f"expert_forward: gather_ids and sorted_probs must both be [R], got "
                         f"{tuple(gather_ids.shape)} and {tuple(sorted_probs.shape)}")
    for name, t in (("gather_ids", gather_ids), ("offsets", offsets)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"expert_forward: {name} must be int32 or int64, got {t.dtype}")
    for name, t in (("x_heads", x_heads), ("sorted_probs", sorted_probs), ("w_gate", w_gate),
                    ("w_up", w_up), ("w_down", w_down)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"expert_forward: {name} must be floating point, got {t.dtype}")
    if not (w_gate.dtype == w_up.dtype == w_down.dtype):
        raise ValueError(f"expert_forward: weight dtypes differ: {w_gate.dtype}, {w_up.dtype}, "
                         f"{w_down.dtype}")
    devices = {t.device for t in (x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up,
                                  w_down)}
    if len(devices) != 1:
        raise ValueError(f"expert_forward: inputs are on several devices: "
                         f"{sorted(map(str, devices))}")


def check_fp8_expert_inputs(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                            gate_scale, up_scale, down_scale) -> None:
    """`check_expert_inputs`, plus: e4m3 weights and their fp32 scales
    ([F, I], [F, I], [F, D]) on the same device; reads nothing back from the device."""
    check_expert_inputs(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down)
    if w_gate.dtype != FP8:
        raise ValueError(f"expert_forward_fp8: the weights must be {FP8}, got {w_gate.dtype}")
    F, D, I = w_gate.shape
    for name, t, shape in (("gate_scale", gate_scale, (F, I)), ("up_scale", up_scale, (F, I)),
                           ("down_scale", down_scale, (F, D))):
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"expert_forward_fp8: {name} must be float32 {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)}")
        if t.device != w_gate.device:
            raise ValueError(f"expert_forward_fp8: {name} is on {t.device}, the weights on "
                             f"{w_gate.device}")


# The ops are registered with torch.library so that torch.compile(fullgraph=True)
# sees one opaque node with a fake (shape-only) implementation, and CUDA graphs
# capture whatever path runs inside. Autograd is attached to the op itself.


@torch.library.custom_op("mhmoe::expert_forward", mutates_args=())
def _expert_forward_op(x_heads: torch.Tensor, gather_ids: torch.Tensor,
                       sorted_probs: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor,
                       w_up: torch.Tensor, w_down: torch.Tensor, deterministic: bool,
                       backend: str) -> torch.Tensor:
    if _pick_path(backend, x_heads, w_gate) == "triton":
        from .kernels.expert_forward import triton_expert_forward

        return triton_expert_forward(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up,
                                     w_down, deterministic=deterministic)
    # The PyTorch path is deterministic by construction.
    return expert_forward_reference(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up,
                                    w_down)


@_expert_forward_op.register_fake
def _expert_forward_fake(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                         deterministic, backend):
    return x_heads.new_empty(x_heads.shape)


@torch.library.custom_op("mhmoe::expert_backward", mutates_args=())
def _expert_backward_op(grad_y: torch.Tensor, x_heads: torch.Tensor, gather_ids: torch.Tensor,
                        sorted_probs: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor,
                        w_up: torch.Tensor, w_down: torch.Tensor, deterministic: bool,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor, torch.Tensor]:
    if _pick_path(backend, x_heads, w_gate) == "triton":
        from .kernels.expert_backward import triton_expert_backward

        return triton_expert_backward(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate,
                                      w_up, w_down, deterministic=deterministic)
    # The PyTorch backward adds in a fixed order: deterministic by construction.
    return expert_backward_reference(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate,
                                     w_up, w_down)


@_expert_backward_op.register_fake
def _expert_backward_fake(grad_y, x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up,
                          w_down, deterministic, backend):
    return (x_heads.new_empty(x_heads.shape), sorted_probs.new_empty(sorted_probs.shape),
            w_gate.new_empty(w_gate.shape), w_up.new_empty(w_up.shape),
            w_down.new_empty(w_down.shape))


def _setup_context(ctx, inputs, output):
    x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down, deterministic, backend = \
        inputs
    # Inputs only: the backward recomputes the [routes, I] activations.
    ctx.save_for_backward(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down)
    ctx.options = (deterministic, backend)


def _backward(ctx, grad_y):
    x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down = ctx.saved_tensors
    dx, dprobs, d_gate, d_up, d_down = _expert_backward_op(
        grad_y.contiguous(), x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
        *ctx.options)
    return dx, None, dprobs, None, d_gate, d_up, d_down, None, None


_expert_forward_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("mhmoe::expert_forward_fp8", mutates_args=())
def _expert_forward_fp8_op(x_heads: torch.Tensor, gather_ids: torch.Tensor,
                           sorted_probs: torch.Tensor, offsets: torch.Tensor,
                           w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                           gate_scale: torch.Tensor, up_scale: torch.Tensor,
                           down_scale: torch.Tensor, deterministic: bool,
                           backend: str) -> torch.Tensor:
    if _pick_path(backend, x_heads, w_gate, "expert_forward_fp8",
                  fp8_kernel_shape_problem) == "triton":
        from .kernels.expert_forward_fp8 import triton_expert_forward_fp8

        # The kernel reads the weights K-major: no copy for the layer's parameters.
        return triton_expert_forward_fp8(
            x_heads, gather_ids, sorted_probs, offsets, w_gate.transpose(1, 2).contiguous(),
            w_up.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous(),
            gate_scale.contiguous(), up_scale.contiguous(), down_scale.contiguous(),
            deterministic=deterministic)
    # The float64 twin, with the multiply the kernel's tile table picks for this shape;
    # it adds in a fixed order (deterministic by construction).
    from .kernels.tuning import fp8_forward_config, interpreting

    config = fp8_forward_config(x_heads.device, gather_ids.numel() / max(1, w_gate.shape[0]),
                                interpreting())
    weights = Fp8Weights(w_gate, w_up, w_down, gate_scale, up_scale, down_scale)
    return fp8_expert_reference(x_heads, gather_ids, sorted_probs, offsets, weights,
                                act_fp8=config.act_fp8).to(x_heads.dtype)


@_expert_forward_fp8_op.register_fake
def _expert_forward_fp8_fake(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                             gate_scale, up_scale, down_scale, deterministic, backend):
    return x_heads.new_empty(x_heads.shape)


def _fp8_setup_context(ctx, inputs, output):
    pass


def _fp8_backward(ctx, grad_y):
    # Reached only through the raw op (expert_forward_fp8 refuses inputs that require
    # grad): fp8 weights have no backward.
    raise RuntimeError(f"mhmoe::expert_forward_fp8: {INFERENCE_ONLY}")


_expert_forward_fp8_op.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)


def swiglu7(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU7 of the gate and up accumulators (any matching shapes, float).

    a = min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)

    Evaluated in float32 whatever the input dtype (float64 stays float64), as the
    published activation is, and returned in the inputs' dtype (docs/contract.md
    section 4).
    """
    if gate.shape != up.shape:
        raise ValueError(f"swiglu7: gate and up shapes differ: {tuple(gate.shape)} vs "
                         f"{tuple(up.shape)}")
    if not (gate.dtype.is_floating_point and up.dtype.is_floating_point):
        raise ValueError(f"swiglu7: gate and up must be floating point, got {gate.dtype} and "
                         f"{up.dtype}")
    return swiglu7_reference(gate, up)


def expert_forward(
    x_heads: torch.Tensor,
    gather_ids: torch.Tensor,
    sorted_probs: torch.Tensor,
    offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    deterministic: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Run every route through its expert and sum the K routes of each (token, head).

    x_heads: [S, H, D]; gather_ids: [R] int32 token of each route;
    sorted_probs: [R] float32; offsets: [H*E + 1] int64 (see `RouteLayout`);
    w_gate, w_up: [H*E, D, I]; w_down: [H*E, I, D]
    returns y_heads [S, H, D] in x_heads' dtype.

    Differentiable in x_heads, sorted_probs and the three weights; the
    backward (fused kernels on the triton path) recomputes the activations
    rather than storing them: autograd keeps only the inputs of this call.

    deterministic: the result is bitwise reproducible and independent of the
    order of the routes within an expert: the K routes of a (token, head) are
    summed in ascending expert order. The PyTorch path always does this; the
    fused kernel's default mode adds with fp32 atomics (last bits may vary).
    Deterministic mode on the fused kernel needs the same number of routes for
    every (token, head), as every `sort_routes` layout has.
    backend: "auto" (fused kernel on CUDA, PyTorch elsewhere), "torch" or
    "triton". The fused kernel reads nothing back to the host (CUDA-graph
    capturable); the PyTorch path reads `offsets` on the host once per call.
    D and I must be multiples of 16 for the fused kernel: "triton" raises
    otherwise, "auto" warns once and runs the PyTorch path.
    """
    resolve_backend(backend, x_heads.device)
    check_expert_inputs(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down)
    return _expert_forward_op(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                              bool(deterministic), backend)


def expert_forward_fp8(
    x_heads: torch.Tensor,
    gather_ids: torch.Tensor,
    sorted_probs: torch.Tensor,
    offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    deterministic: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """`expert_forward` with fp8 expert weights (docs/contract.md section 10, docs/fp8.md).

    x_heads: [S, H, D]; the layout as `expert_forward`'s;
    w_gate, w_up: [H*E, D, I] float8_e4m3fn; w_down: [H*E, I, D] float8_e4m3fn
    (W = W_fp8 * scale); gate_scale, up_scale: [H*E, I] float32; down_scale: [H*E, D]
    float32. Returns y_heads [S, H, D] in x_heads' dtype.

    The weights are read K-major (`fp8.quantize_weights`' layout, which the layer's
    parameters have); weights in another layout are copied to it on every call.

    backend: "triton": the fused kernel (kernels/expert_forward_fp8.py), x and the
    SwiGLU7 output quantized on the fly with dynamic per-row (per-block) scales where
    its tile table runs the fp8 tensor cores; CUDA, or the interpreter on the CPU.
    "torch": the kernel's twin `fp8.fp8_expert_reference`, the same quantization in
    float64 math, cast to x's dtype: slow, for the CPU and tests. "auto": the kernel
    on CUDA, the twin elsewhere. The kernel needs D a power of two >= 16 and I a
    multiple of `fp8.ACT_BLOCK`: "triton" raises otherwise, "auto" warns once and
    runs the twin.
    deterministic: as `expert_forward`'s (the twin always is).

    Inference only: raises if grad mode is on and x_heads or sorted_probs requires
    grad (fp8 weights have no backward).
    """
    _resolve(backend, x_heads.device, op="expert_forward_fp8")
    if torch.is_grad_enabled() and (x_heads.requires_grad or sorted_probs.requires_grad):
        raise RuntimeError(f"expert_forward_fp8: {INFERENCE_ONLY}")
    check_fp8_expert_inputs(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                            gate_scale, up_scale, down_scale)
    return _expert_forward_fp8_op(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up,
                                  w_down, gate_scale, up_scale, down_scale, bool(deterministic),
                                  backend)
