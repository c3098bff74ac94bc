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
from .fp8 import (
    ACT_BLOCK,
    FP8,
    INFERENCE_ONLY,
    Fp8Weights,
    fp8_expert_reference,
    is_k_major,
    k_major,
)
from .reference import expert_backward_reference, expert_forward_reference, swiglu7_reference
from .routing import RouteLayout, content_keys, content_route_order


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The expert path `backend` takes on `device` (see backends.py)."""
    return _resolve(backend, device, op="expert_forward")


def kernel_shape_problem(device: torch.device, D: int, I: int) -> str | None:
    """Why the fused kernel cannot take these shapes, or None if it can."""
    if D % 16 or I % 16:
        return f"D={D} and I={I} must be multiples of 16 for the fused kernel"
    return None


# fp8 tensor cores (the e4m3 wgmma / mma) first came with Ada (sm_89).
FP8_MIN_CAPABILITY = (8, 9)


def fp8_kernel_problem(device: torch.device, D: int, I: int) -> str | None:
    """Why the fp8 kernel cannot run these shapes on `device`, or None if it can: it
    holds a row's D values in one tile (a power of two), walks I in blocks of
    ACT_BLOCK, and multiplies on fp8 tensor cores (a CUDA device of sm_89 or later)."""
    if D < 16 or D & (D - 1) or I % ACT_BLOCK:
        return (f"D={D} must be a power of two >= 16 and I={I} a multiple of {ACT_BLOCK} for "
                f"the fp8 kernel")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < FP8_MIN_CAPABILITY:
            return (f"the fp8 kernel needs fp8 tensor cores (sm_89 or later); {device} is "
                    f"sm_{capability[0]}{capability[1]}")
    return None


_warned: set[str] = set()


def _warn_once(message: str, stacklevel: int = 3) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)


def _pick_path(backend: str, device: torch.device, D: int, I: int, op: str = "expert_forward",
               problem=kernel_shape_problem) -> str:
    """The path one call takes: resolve_backend, plus the kernel's rule (`problem`, of
    the device and the shapes).

    An explicit "triton" where the kernel cannot run is an error; under "auto" the
    PyTorch path runs instead and says so once in a warning.
    """
    path = _resolve(backend, device, op=op)
    if path != "triton":
        return path
    why = problem(device, D, I)
    if why is None:
        return path
    if backend == "triton":
        raise ValueError(f"{op}: {why}")
    _warn_once(f"{op}: {why}; the PyTorch path runs instead")
    return "torch"


def _check_layout_and_weights(op, x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up,
                              w_down) -> None:
    """The checks `expert_forward` and `expert_forward_fp8` share (shapes, dtypes,
    devices of x, the layout and the weights); `op` names the caller in the errors."""
    if x_heads.dim() != 3:
        raise ValueError(f"{op}: x_heads must be [S, H, D], got {tuple(x_heads.shape)}")
    _, H, D = x_heads.shape
    if w_gate.dim() != 3 or w_up.shape != w_gate.shape:
        raise ValueError(f"{op}: w_gate and w_up must both be [H*E, D, I], got "
                         f"{tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    F, Dw, I = w_gate.shape
    if Dw != D:
        raise ValueError(f"{op}: w_gate is [{F}, {Dw}, {I}] but x_heads has D={D}")
    if H == 0 or F % H:
        raise ValueError(f"{op}: {F} flat experts do not split over H={H} heads")
    if tuple(w_down.shape) != (F, I, D):
        raise ValueError(f"{op}: w_down must be [{F}, {I}, {D}], got {tuple(w_down.shape)}")
    if tuple(offsets.shape) != (F + 1,):
        raise ValueError(f"{op}: offsets must be [{F + 1}], got {tuple(offsets.shape)}")
    if gather_ids.dim() != 1 or sorted_probs.shape != gather_ids.shape:
        raise ValueError(f"{op}: gather_ids and sorted_probs must both be [R], got "
                         f"{tuple(gather_ids.shape)} and {tuple(sorted_probs.shape)}")
    for name, t in (("gather_ids", gather_ids), ("offsets", offsets)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: {name} must be int32 or int64, got {t.dtype}")
    for name, t in (("x_heads", x_heads), ("sorted_probs", sorted_probs), ("w_gate", w_gate),
                    ("w_up", w_up), ("w_down", w_down)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{op}: {name} must be floating point, got {t.dtype}")
    if not (w_gate.dtype == w_up.dtype == w_down.dtype):
        raise ValueError(f"{op}: weight dtypes differ: {w_gate.dtype}, {w_up.dtype}, "
                         f"{w_down.dtype}")
    devices = {t.device for t in (x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up,
                                  w_down)}
    if len(devices) != 1:
        raise ValueError(f"{op}: inputs are on several devices: {sorted(map(str, devices))}")


def check_expert_inputs(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down) -> None:
    """Shape, dtype and device checks of `expert_forward`; reads nothing back from the device.
    Weights of one byte (fp8) are refused: without their scales they are not the weights."""
    _check_layout_and_weights("expert_forward", x_heads, gather_ids, sorted_probs, offsets,
                              w_gate, w_up, w_down)
    if w_gate.dtype.itemsize == 1:
        raise ValueError(f"expert_forward: {w_gate.dtype} weights are quantized (W = W_fp8 * "
                         f"scale): use expert_forward_fp8 with the scales")


def check_fp8_expert_inputs(x_heads, gather_ids, sorted_probs, offsets, w_gate, w_up, w_down,
                            gate_scale, up_scale, down_scale) -> None:
    """The checks of `expert_forward_fp8`: those `expert_forward` shares, then e4m3 weights
    and their fp32 scales ([F, I], [F, I], [F, D]) on the same device; reads nothing back
    from the device."""
    _check_layout_and_weights("expert_forward_fp8", x_heads, gather_ids, sorted_probs, offsets,
                              w_gate, w_up, w_down)
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
    if _pick_path(backend, x_heads.device, *w_gate.shape[1:]) == "triton":
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
    order = None
    if deterministic:
        # The weight gradients sum each expert's routes in layout order; in content order
        # instead, they do not change bitwise when the tokens are permuted. On the Triton
        # path dx's K slots and the per-route dprobs do not depend on the order within an
        # expert (bitwise those of the caller's layout).
        keys = content_keys(x_heads, grad_y)
        order = content_route_order(RouteLayout(gather_ids, sorted_probs, offsets), keys)
        gather_ids, sorted_probs = gather_ids[order], sorted_probs[order]
    if _pick_path(backend, x_heads.device, *w_gate.shape[1:]) == "triton":
        from .kernels.expert_backward import triton_expert_backward

        grads = triton_expert_backward(grad_y, x_heads, gather_ids, sorted_probs, offsets,
                                       w_gate, w_up, w_down, deterministic=deterministic)
    else:
        # The PyTorch backward adds in a fixed order: deterministic by construction.
        grads = expert_backward_reference(grad_y, x_heads, gather_ids, sorted_probs, offsets,
                                          w_gate, w_up, w_down)
    if order is None:
        return grads
    dx, dprobs, d_gate, d_up, d_down = grads
    return dx, torch.empty_like(dprobs).index_copy_(0, order, dprobs), d_gate, d_up, d_down


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
    if _pick_path(backend, x_heads.device, *w_gate.shape[1:], "expert_forward_fp8",
                  fp8_kernel_problem) == "triton":
        from .kernels.expert_forward_fp8 import triton_expert_forward_fp8

        weights = []
        for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
            if not is_k_major(w):
                # A copy of the whole weight, every call (about 1 GB per weight of a MAGI-2
                # layer): the layer's parameters never need it (see MultiHeadMoE).
                _warn_once(f"expert_forward_fp8: {name} is not stored K-major (the layout of "
                           f"fp8.quantize_weights and the layer's parameters); it is copied "
                           f"to it on every call: lay it out once with fp8.k_major")
            weights.append(k_major(w).transpose(1, 2))
        return triton_expert_forward_fp8(
            x_heads, gather_ids, sorted_probs, offsets, *weights, gate_scale.contiguous(),
            up_scale.contiguous(), down_scale.contiguous(), deterministic=deterministic)
    # The float64 twin of the kernel's quantization; it adds in a fixed order
    # (deterministic by construction).
    weights = Fp8Weights(w_gate, w_up, w_down, gate_scale, up_scale, down_scale)
    return fp8_expert_reference(x_heads, gather_ids, sorted_probs, offsets,
                                weights).to(x_heads.dtype)


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
    every (token, head), as every `sort_routes` layout has. The backward too:
    every gradient bitwise reproducible, and the weight gradients (sums over an
    expert's routes) taken in the order of the routes' content
    (`routing.content_route_order`), so that permuting the tokens permutes dx and
    dprobs and leaves the weight gradients bitwise unchanged (but for a 2^-63
    hash collision). The PyTorch path on the CPU follows the same order, but
    its BLAS and elementwise kernels can round a value by its place in a
    tensor, so there it holds only at shapes clear of that.
    backend: "auto" (fused kernel on CUDA, PyTorch elsewhere), "torch" or
    "triton". The fused kernel reads nothing back to the host (CUDA-graph
    capturable); the PyTorch path reads `offsets` on the host once per call.
    D and I must be multiples of 16 for the fused kernel: "triton" raises
    otherwise, "auto" warns once and runs the PyTorch path. One-byte (fp8) weights
    are refused: `expert_forward_fp8` takes them with their scales.
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

    The kernel reads the weights K-major (`fp8.quantize_weights`' layout, which the
    layer's parameters have); weights in another layout are copied to it on every call,
    with a warning the first time (`fp8.k_major` lays them out once).

    backend: "triton": the fused kernel (kernels/expert_forward_fp8.py), x and the
    SwiGLU7 output quantized on the fly with dynamic per-row (per-block) scales, on
    fp8 tensor cores; CUDA, or the interpreter on the CPU. "torch": the kernel's twin
    `fp8.fp8_expert_reference`, the same quantization in float64 math, cast to x's
    dtype: slow, for the CPU and tests. "auto": the kernel on CUDA, the twin elsewhere.
    The kernel needs D a power of two >= 16, I a multiple of `fp8.ACT_BLOCK` and, on
    CUDA, a GPU of sm_89 or later (`fp8_kernel_problem`): "triton" raises otherwise,
    "auto" warns once and runs the twin.
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
