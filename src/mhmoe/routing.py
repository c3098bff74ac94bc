"""Routing and route layout: `route()` and `sort_routes()` (SPEC sections 2 and 3).

Routing produces metadata that the expert kernels only consume:

    probs, indices = route(logits, top_k)            # [H, S, K] each
    layout = sort_routes(probs, indices, E)          # a RouteLayout

Worked example, H=1, S=3, E=2, K=1, indices [[[1], [0], [1]]]:
    gather_ids   = [1, 0, 2]      token of each route, expert 0's first
    sorted_probs = [p1, p0, p2]
    offsets      = [0, 1, 3]      expert f owns routes offsets[f]:offsets[f+1]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .backends import resolve_backend
from .config import SCORE_FUNCS, check_groups
from .reference import route_probs_backward, route_reference, sort_routes_reference


class RouteLayout(NamedTuple):
    """Routes grouped by flat expert id `f = h * E + e` (CSR).

    gather_ids:   [R] int32, R = H*S*K; token index of each route, ascending
                  flat expert, then ascending token within one expert.
    sorted_probs: [R] float32; the routing probability of each route.
    offsets:      [H*E + 1] int64; expert f owns routes offsets[f]:offsets[f+1].
    """

    gather_ids: torch.Tensor
    sorted_probs: torch.Tensor
    offsets: torch.Tensor


def route(
    logits: torch.Tensor,
    top_k: int,
    score_func: str = "sigmoid",
    expert_bias: torch.Tensor | None = None,
    route_norm: bool = True,
    norm_eps: float = 1e-12,
    route_scale: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the top_k experts of every (head, token) and their probabilities.

    logits: [H, S, E] float32 (another float type is upcast to float32;
            float64 stays float64 for gradient checks)
    expert_bias: [H, E] or [H*E] float, or None; shifts selection only
    returns probs [H, S, K] float32, indices [H, S, K] int64 in descending
            order of the biased score, ties to the lower expert id.

    A NaN logit makes its expert unselectable (its selection score counts as
    -inf); if fewer than K experts of a row are finite, NaN experts fill the
    rest in ascending id and that row's probabilities are NaN. Indices always
    lie in [0, E) and no other row is affected.

    backend: "auto" (the Triton kernel for float32 CUDA logits, PyTorch
    elsewhere), "torch" or "triton". Both give the same indices (ties
    included) and probabilities, and both are differentiable in logits.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"route: logits must be a [H, S, E] tensor, got shape "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"route: logits must be floating point, got {logits.dtype}")
    H, _, E = logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"route: top_k must be an int in [1, E={E}], got {top_k!r}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"route: score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if expert_bias is not None:
        if expert_bias.numel() != H * E or expert_bias.dim() not in (1, 2) or (
                expert_bias.dim() == 2 and tuple(expert_bias.shape) != (H, E)):
            raise ValueError(f"route: expert_bias must have shape [{H}, {E}] or [{H * E}], got "
                             f"{tuple(expert_bias.shape)}")
        if expert_bias.device != logits.device:
            raise ValueError(f"route: expert_bias is on {expert_bias.device}, logits on "
                             f"{logits.device}")
    if not norm_eps > 0:
        raise ValueError(f"route: norm_eps must be > 0, got {norm_eps!r}")
    check_groups(E, num_groups, topk_groups, prefix="route: ")
    if _path(backend, logits, "route", "logits") == "triton":
        return _route_triton_op(logits, top_k, score_func, expert_bias, route_norm,
                                float(norm_eps), float(route_scale), num_groups, topk_groups)
    return route_reference(logits, top_k, score_func, expert_bias, route_norm, norm_eps,
                           route_scale, num_groups, topk_groups)


def sort_routes(probs: torch.Tensor, indices: torch.Tensor, num_experts: int, *,
                backend: str = "auto") -> RouteLayout:
    """Group the routes by flat expert: see `RouteLayout` for the fields.

    probs: [H, S, K] float; indices: [H, S, K] int, each in [0, num_experts)
    backend: "auto" (a Triton counting sort on CUDA, PyTorch's stable sort
    elsewhere), "torch" or "triton"; the layouts are identical. Neither reads
    anything back to the host. sorted_probs is differentiable in probs.
    """
    if indices.dim() != 3 or probs.shape != indices.shape:
        raise ValueError(f"sort_routes: probs and indices must both be [H, S, K], got "
                         f"{tuple(probs.shape)} and {tuple(indices.shape)}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"sort_routes: indices must be integers, got {indices.dtype}")
    if not probs.dtype.is_floating_point:
        raise ValueError(f"sort_routes: probs must be floating point, got {probs.dtype}")
    if probs.device != indices.device:
        raise ValueError(f"sort_routes: probs on {probs.device}, indices on {indices.device}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"sort_routes: num_experts must be a positive int, got {num_experts!r}")
    if indices.device.type == "cpu" and indices.numel() and not torch.compiler.is_compiling():
        # Range check only where it costs no device synchronisation (and not in a
        # compiled graph, where it would be a data-dependent branch).
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"sort_routes: indices must lie in [0, {num_experts}), found "
                             f"values in [{low}, {high}]")
    if _path(backend, probs, "sort_routes", "probs") == "triton":
        sorted_probs, gather_ids, offsets, _ = _sort_routes_triton_op(probs, indices,
                                                                     num_experts)
        return RouteLayout(gather_ids, sorted_probs, offsets)
    return RouteLayout(*sort_routes_reference(probs, indices, num_experts))


def _path(backend: str, values: torch.Tensor, op: str, name: str) -> str:
    """resolve_backend, plus the Triton kernels' dtype rule: float64 `values` stay
    on the PyTorch path under "auto" and are an error under "triton"."""
    path = resolve_backend(backend, values.device, op=op)
    if path == "triton" and values.dtype == torch.float64:
        if backend == "triton":
            raise ValueError(f"{op}: the triton path takes float32 {name}; float64 runs on "
                             f"backend='torch'")
        path = "torch"
    return path


# The Triton paths as torch.library ops: opaque nodes with fake (shape-only)
# implementations for torch.compile, and autograd attached to the op.


@torch.library.custom_op("mhmoe::route_triton", mutates_args=())
def _route_triton_op(logits: torch.Tensor, top_k: int, score_func: str,
                     expert_bias: torch.Tensor | None, route_norm: bool, norm_eps: float,
                     route_scale: float, num_groups: int,
                     topk_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .kernels.routing import triton_route

    return triton_route(logits, top_k, score_func, expert_bias, route_norm, norm_eps,
                        route_scale, num_groups, topk_groups)


@_route_triton_op.register_fake
def _route_triton_fake(logits, top_k, score_func, expert_bias, route_norm, norm_eps,
                       route_scale, num_groups, topk_groups):
    H, S, _ = logits.shape
    return (logits.new_empty((H, S, top_k), dtype=torch.float32),
            logits.new_empty((H, S, top_k), dtype=torch.int64))


def _route_setup_context(ctx, inputs, output):
    logits, _, score_func, _, route_norm, norm_eps, route_scale, _, _ = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.options = (score_func, route_norm, norm_eps, route_scale)


def _route_backward(ctx, grad_probs, grad_indices):
    logits, indices = ctx.saved_tensors
    grad_logits = route_probs_backward(logits.float(), indices, grad_probs, *ctx.options)
    return grad_logits.to(logits.dtype), None, None, None, None, None, None, None, None


_route_triton_op.register_autograd(_route_backward, setup_context=_route_setup_context)


@torch.library.custom_op("mhmoe::sort_routes_triton", mutates_args=())
def _sort_routes_triton_op(
    probs: torch.Tensor, indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_probs, gather_ids, offsets, positions): the float output first, as
    torch.library's op checks expect."""
    from .kernels.routing import triton_sort_routes

    gather_ids, sorted_probs, offsets, positions = triton_sort_routes(
        probs, indices, num_experts, return_positions=True)
    return sorted_probs, gather_ids, offsets, positions


@_sort_routes_triton_op.register_fake
def _sort_routes_triton_fake(probs, indices, num_experts):
    H, S, K = indices.shape
    R = H * S * K
    return (probs.new_empty(R, dtype=torch.float32), indices.new_empty(R, dtype=torch.int32),
            indices.new_empty(H * num_experts + 1, dtype=torch.int64),
            indices.new_empty(R, dtype=torch.int32))


def _sort_routes_setup_context(ctx, inputs, output):
    probs = inputs[0]
    ctx.save_for_backward(output[3])
    ctx.probs_meta = (probs.shape, probs.dtype)


def _sort_routes_backward(ctx, grad_sorted, grad_gather, grad_offsets, grad_positions):
    (positions,) = ctx.saved_tensors
    shape, dtype = ctx.probs_meta
    if grad_sorted is None:
        return None, None, None
    # sorted_probs[positions] == probs.flatten(): the backward is that gather.
    grad_probs = grad_sorted[positions.to(torch.int64)].view(shape).to(dtype)
    return grad_probs, None, None


_sort_routes_triton_op.register_autograd(_sort_routes_backward,
                                         setup_context=_sort_routes_setup_context)
