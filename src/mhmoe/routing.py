"""Routing and route layout: `route()`, `route_tokens()` and `sort_routes()`
(docs/contract.md sections 2 and 3).

Routing produces metadata that the expert kernels only consume:

    probs, indices = route(logits, top_k)                     # [H, S, K] each
    routes = route_tokens(x_heads, gate, options)             # the logits too (fused on GPU)
    layout = sort_routes(routes.probs, routes.indices, E)     # a RouteLayout

The layer hands the route kernels' per-block expert counts to the layout, which
then skips its count step (Triton path; the counts stay on the device):

    routes = route_tokens(x_heads, gate, options, block_counts=True)
    layout = sort_routes(routes.probs, routes.indices, E, block_counts=routes.block_counts)

Worked example, H=1, S=3, E=2, K=1, indices [[[1], [0], [1]]]:
    gather_ids   = [1, 0, 2]      token of each route, expert 0's first
    sorted_probs = [p1, p0, p2]
    offsets      = [0, 1, 3]      expert f owns routes offsets[f]:offsets[f+1]

The Triton paths run behind torch.library ops (opaque to torch.compile, with fake
implementations and autograd attached); the routing options cross into them as the
flat scalars of `RouterOptions.op_args()`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .backends import resolve_backend, triton_importable
from .config import RouterOptions
from .reference import (
    exact_precision,
    route_probs_backward,
    route_reference,
    row_keys_reference,
    sort_routes_reference,
)


class Routes(NamedTuple):
    """The routes of every (head, token): what `route` returns.

    probs:   [H, S, K] float32 (float64 for float64 logits), in selection order.
    indices: [H, S, K] int64 in [0, E), descending biased score, ties to the lower id.
    """

    probs: torch.Tensor
    indices: torch.Tensor


class TokenRoutes(NamedTuple):
    """What `route_tokens` returns, whatever it was asked for.

    probs, indices: as `Routes`.
    block_counts:   [H, cdiv(S, T), E] int32, the routes of each expert per block of T
                    tokens of a head (T = `kernels.layout.layout_block_t(K)`), for
                    `sort_routes(..., block_counts=)`; None unless asked for, and on the
                    PyTorch path (where the layout counts itself).
    """

    probs: torch.Tensor
    indices: torch.Tensor
    block_counts: torch.Tensor | None


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
) -> Routes:
    """Pick the top_k experts of every (head, token) and their probabilities.

    logits: [H, S, E] float32 (another float type is upcast to float32;
            float64 stays float64 for gradient checks)
    expert_bias: [H, E] or [H*E] float, or None; shifts selection only
    returns Routes(probs [H, S, K] float32, indices [H, S, K] int64), in
            descending order of the biased score, ties to the lower expert id.
    The other arguments are the fields of `RouterOptions`.

    A NaN logit makes its expert unselectable (its selection score counts as
    -inf); if fewer than K experts of a row are finite, NaN experts fill the
    rest in ascending id and that row's probabilities are NaN. Indices always
    lie in [0, E) and no other row is affected.

    backend: "auto" (the Triton kernel for float32 CUDA logits, PyTorch
    elsewhere), "torch" or "triton". Both give the same indices (ties
    included) and probabilities, and both are differentiable in logits.
    """
    options = RouterOptions(top_k, score_func, route_norm, norm_eps, route_scale, num_groups,
                            topk_groups)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"route: logits must be a [H, S, E] tensor, got shape "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"route: logits must be floating point, got {logits.dtype}")
    H, _, E = logits.shape
    options.check(E, "route")
    _check_bias("route", expert_bias, H, E, logits.device)
    probs, indices, _ = _route_logits(logits, options, expert_bias, backend, block_counts=False)
    return Routes(probs, indices)


def route_tokens(
    x_heads: torch.Tensor,
    gate: torch.Tensor,
    options: RouterOptions,
    expert_bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    fused: bool | None = None,
    block_counts: bool = False,
    deterministic: bool = False,
) -> TokenRoutes:
    """Router logits of every (token, head), then `route` (docs/contract.md section 2,
    steps 1-6).

    x_heads: [S, H, D] float; gate: [H, E, D], the router weight (float32;
    float64 in a float64 layer); logits[h, s, e] = x_heads[s, h] . gate[h, e]
    computed in gate's precision (x upcast), then routed as `route` does.
    options: the routing options (top_k, score function, normalisation, scale, groups).
    expert_bias: [H, E] or [H*E] float, or None; shifts selection only.
    returns TokenRoutes(probs [H, S, K] float32 (float64 for a float64 gate), indices
            [H, S, K] int64, block_counts); differentiable in x_heads and gate through
            probs.

    fused: None (default) computes the logits with the tensor-core kernel of
    `kernels.router_logits.triton_logits_route` (fused with the routing, or followed by
    a route kernel: its config's `split`, the sm_90 default) wherever it applies: the
    triton path (CUDA, or the interpreter with backend="triton"), x_heads bfloat16, gate
    float32, E a power of two in [16, 256], D a multiple of 16; anything else
    takes the unfused path, an fp32 GEMM (cuBLAS on CUDA) then `route`, which
    is also what the fused kernel is checked against. True: the fused kernel or
    a ValueError saying why it cannot run; False: always unfused.

    The fused kernel computes the fp32 logits on tensor cores from an exact
    split of gate into three bf16 parts (products with bf16 x exact, fp32
    accumulation; see `_logits_route_kernel`): the same fp32 dot products as
    the GEMM up to the accumulation order, so indices agree with the unfused
    path except where two selection scores lie within ~1e-6 (relative) of each
    other, and probabilities agree to ~1e-6 relative. It writes the fp32 logits
    [H, S, E] beside probs and indices when the backward needs them (grad mode
    on and x_heads or gate requiring grad; the backward is the unfused path's),
    or when its tile configuration routes them from memory (split, or the fused
    kernel's read-back gather); no host synchronisation either way. One path at
    every S: the same logits for any batch size. Its speed against cuBLAS + route:
    docs/routing.md.

    block_counts: also return the layout's per-block expert counts (see `TokenRoutes`),
    counted by the Triton route kernels as they pick (integer atomic adds:
    deterministic), so that `sort_routes` skips its count step; None on the PyTorch
    path, where the layout counts itself.

    deterministic: the backward's d gate (a sum over tokens) adds each head's tokens in
    the order of their content (`content_keys` of the token's x row and d logits row), so
    that it is bitwise the same under any permutation of the tokens. The forward is the
    same either way (every token is routed on its own).
    """
    if not isinstance(options, RouterOptions):
        raise ValueError(f"route_tokens: options must be a RouterOptions, got "
                         f"{type(options).__name__}")
    if not isinstance(x_heads, torch.Tensor) or x_heads.dim() != 3 or \
            not isinstance(gate, torch.Tensor) or gate.dim() != 3:
        raise ValueError(f"route_tokens: x_heads must be [S, H, D] and gate [H, E, D] tensors, "
                         f"got shapes {tuple(getattr(x_heads, 'shape', ()))} and "
                         f"{tuple(getattr(gate, 'shape', ()))}")
    _, H, D = x_heads.shape
    if gate.shape[0] != H or gate.shape[2] != D:
        raise ValueError(f"route_tokens: gate {tuple(gate.shape)} must be [H={H}, E, D={D}] for "
                         f"x_heads {tuple(x_heads.shape)}")
    if not x_heads.dtype.is_floating_point or not gate.dtype.is_floating_point:
        raise ValueError(f"route_tokens: x_heads and gate must be floating point, got "
                         f"{x_heads.dtype} and {gate.dtype}")
    if gate.device != x_heads.device:
        raise ValueError(f"route_tokens: gate is on {gate.device}, x_heads on {x_heads.device}")
    E = gate.shape[1]
    options.check(E, "route_tokens")
    _check_bias("route_tokens", expert_bias, H, E, x_heads.device)
    if fused not in (None, True, False):
        raise ValueError(f"route_tokens: fused must be None, True or False, got {fused!r}")
    path = resolve_backend(backend, x_heads.device, op="route_tokens")
    if fused is not False:
        reason = _fused_unsupported(path, backend, x_heads, gate)
        if reason is None:
            save_logits = torch.is_grad_enabled() and (x_heads.requires_grad or
                                                       gate.requires_grad)
            probs, indices, _, counts = _logits_route_triton_op(
                x_heads, gate, expert_bias, *options.op_args(), save_logits, block_counts,
                bool(deterministic))
            return TokenRoutes(probs, indices, counts if block_counts else None)
        if fused:
            raise ValueError(f"route_tokens: fused=True, but the fused kernel cannot run here: "
                             f"{reason}")
    logits = RouterLogits.apply(x_heads, gate, bool(deterministic), path == "triton")
    return _route_logits(logits, options, expert_bias, backend, block_counts)


def _route_logits(logits: torch.Tensor, options: RouterOptions,
                  expert_bias: torch.Tensor | None, backend: str,
                  block_counts: bool) -> TokenRoutes:
    """`route` after its checks. block_counts: the layout's block counts (see
    `route_tokens`) where the Triton kernel runs."""
    if _path(backend, logits, "route", "logits") == "triton":
        probs, indices, counts = _route_triton_op(logits, expert_bias, *options.op_args(),
                                                  block_counts)
        return TokenRoutes(probs, indices, counts if block_counts else None)
    probs, indices = route_reference(
        logits, options.top_k, options.score_func, expert_bias, options.route_norm,
        options.norm_eps, options.route_scale, options.num_groups, options.topk_groups)
    return TokenRoutes(probs, indices, None)


def _check_bias(op: str, expert_bias: torch.Tensor | None, H: int, E: int,
                device: torch.device) -> None:
    """The bias check `route` and `route_tokens` share; ValueError naming `op`."""
    if expert_bias is None:
        return
    if expert_bias.numel() != H * E or expert_bias.dim() not in (1, 2) or (
            expert_bias.dim() == 2 and tuple(expert_bias.shape) != (H, E)):
        raise ValueError(f"{op}: expert_bias must have shape [{H}, {E}] or [{H * E}], got "
                         f"{tuple(expert_bias.shape)}")
    if expert_bias.device != device:
        raise ValueError(f"{op}: expert_bias is on {expert_bias.device}, the inputs on "
                         f"{device}")


def _fused_unsupported(path: str, backend: str, x_heads: torch.Tensor,
                       gate: torch.Tensor) -> str | None:
    """Why `route_tokens` cannot take the fused kernel, or None if it can (path: `backend`
    resolved for x's device)."""
    if path != "triton":
        return f"backend {backend!r} takes the PyTorch path on {x_heads.device}"
    from .kernels.router_logits import fused_unsupported

    return fused_unsupported(x_heads, gate)


class RouterLogits(torch.autograd.Function):
    """logits[h, s, e] = x[s, h] . gate[h, e] in the router's dtype (float32).

    Autograd of the plain `bmm(x.float(), gate^T)` would save the float32 copy
    of x (12 KB per token for MAGI-2); this saves x as it is (the expert op
    keeps it anyway) and upcasts again in the backward.
    x_heads: [S, H, D]; gate: [H, E, D] -> logits [H, S, E]
    deterministic: d gate sums the tokens in content order (`route_tokens`).
    triton: the backward may take the tensor-core kernels (the Triton path;
    `router_backward_kernels`).
    """

    @staticmethod
    @exact_precision
    def forward(ctx, x_heads, gate, deterministic=False, triton=False):
        ctx.save_for_backward(x_heads, gate)
        ctx.deterministic = deterministic
        ctx.triton = triton
        return torch.bmm(x_heads.transpose(0, 1).to(gate.dtype), gate.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad):
        x_heads, gate = ctx.saved_tensors
        need_x, need_gate = ctx.needs_input_grad[:2]
        return (*_router_logits_backward(grad, x_heads, gate, need_x, need_gate,
                                         ctx.deterministic, ctx.triton), None, None)


def router_backward_kernels(x_heads, gate, triton: bool) -> bool:
    """Whether the router backward runs on the tensor-core kernels
    (`kernels/router_backward.py`): on the Triton path (CUDA, or the interpreter), with
    bf16 x and an fp32 router, which make the kernels' products exact; else PyTorch's
    fp32 GEMMs."""
    return triton and x_heads.dtype == torch.bfloat16 and gate.dtype == torch.float32


@exact_precision
def _router_logits_backward(grad, x_heads, gate, need_x: bool, need_gate: bool,
                            deterministic: bool, triton: bool):
    """d x_heads [S, H, D] (x's dtype) and d gate [H, E, D] of logits = x . gate^T
    per head, from d logits [H, S, E]; None where not needed. triton: the Triton path
    (`router_backward_kernels`).

    d x is a product per token (its value does not depend on where the token sits).
    d gate sums over tokens; deterministic: in each head's content order."""
    grad = grad.to(gate.dtype)
    grad_x = grad_gate = None
    # Each head's tokens in content order, for a d gate bitwise under permutations.
    order = (torch.argsort(content_keys(x_heads, grad.transpose(0, 1)), dim=1, stable=True)
             if need_gate and deterministic else None)
    if router_backward_kernels(x_heads, gate, triton):
        if need_x:
            grad_x = _router_dx_op(grad, gate, x_heads)
        if need_gate:
            grad_gate = _router_dgate_op(grad, x_heads, order)
        return grad_x, grad_gate
    if need_x:
        grad_x = torch.bmm(grad, gate).transpose(0, 1).to(x_heads.dtype)
    if order is not None:
        # A head at a time: the sorted copies of d logits and x stay one head's size
        # (0.05 GB at S=32,768 for MAGI-2, against 0.6 GB for all heads at once).
        grad_gate = torch.stack([grad[h, order[h]].t() @ x_heads[order[h], h].to(gate.dtype)
                                 for h in range(gate.shape[0])])
    elif need_gate:
        grad_gate = torch.bmm(grad.transpose(1, 2), x_heads.transpose(0, 1).to(gate.dtype))
    return grad_x, grad_gate


def content_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """keys [H, S] int64 of the (token, head) rows (a[s, h, :], b[s, h, :]): the same
    rows give the same key wherever they sit in the batch, and different rows
    different keys but for a hash collision (`kernels/row_keys.py`). Deterministic mode
    sums tokens in the order of these keys.

    a: [S, H, Wa], b: [S, H, Wb] (last dimension contiguous), any float or integer
    elements. The Triton kernel on CUDA where Triton is installed, its PyTorch twin
    `row_keys_reference` elsewhere: the same integers."""
    if a.device.type == "cuda" and triton_importable():
        return _row_keys_triton_op(a, b)
    return row_keys_reference(a, b)


# The router backward's kernels as ops: torch.compile traces the router's backward.
@torch.library.custom_op("mhmoe::router_dx_triton", mutates_args=())
def _router_dx_op(grad: torch.Tensor, gate: torch.Tensor,
                  x_heads: torch.Tensor) -> torch.Tensor:
    from .kernels.router_backward import triton_router_dx

    return triton_router_dx(grad, gate, x_heads)


@_router_dx_op.register_fake
def _router_dx_fake(grad, gate, x_heads):
    return x_heads.new_empty((grad.shape[1], grad.shape[0], gate.shape[2]))


@torch.library.custom_op("mhmoe::router_dgate_triton", mutates_args=())
def _router_dgate_op(grad: torch.Tensor, x_heads: torch.Tensor,
                     order: torch.Tensor | None) -> torch.Tensor:
    from .kernels.router_backward import triton_router_dgate

    return triton_router_dgate(grad, x_heads, order)


@_router_dgate_op.register_fake
def _router_dgate_fake(grad, x_heads, order):
    return grad.new_empty((grad.shape[0], grad.shape[2], x_heads.shape[2]))


# An op, so that torch.compile (which traces the router's backward) sees one opaque node.
@torch.library.custom_op("mhmoe::row_keys_triton", mutates_args=())
def _row_keys_triton_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from .kernels.row_keys import triton_row_keys

    return triton_row_keys(a, b)


@_row_keys_triton_op.register_fake
def _row_keys_triton_fake(a, b):
    return a.new_empty((a.shape[1], a.shape[0]), dtype=torch.int64)


def route_experts(offsets: torch.Tensor, num_routes: int,
                  dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The flat expert of each route of a layout: [num_routes] `dtype`, f repeated
    offsets[f+1] - offsets[f] times (offsets: `RouteLayout.offsets`). No host
    synchronisation (the output size is given)."""
    return torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=offsets.device,
                                                dtype=dtype),
                                   offsets[1:] - offsets[:-1], output_size=num_routes)


def content_route_order(layout: RouteLayout, keys: torch.Tensor) -> torch.Tensor:
    """order [R] int64: the layout's routes with each expert's routes sorted by content
    rather than by token. `gather_ids[order]`, `sorted_probs[order]` (same offsets) is a
    layout of the same routes whose order within an expert does not depend on where
    the tokens sit in the batch, so sums over an expert's routes in that order are
    bitwise independent of the token order.

    keys: [H, S] `content_keys` of the rows the sums read. Within an expert the routes
    go by (key of their token, bits of their probability): routes that tie on both
    carry the same numbers (but for a hash collision), and their order does not matter.
    Torch ops only (three stable sorts of R values), no host synchronisation.
    """
    gather_ids, sorted_probs, offsets = layout
    H = keys.shape[0]
    F = offsets.numel() - 1
    E = F // H if H else 1
    # int32 where it fits: a 32-bit radix sort takes half the passes of a 64-bit one
    flat = route_experts(offsets, gather_ids.numel(),
                         torch.int32 if F < 2**31 else torch.int64)
    route_keys = keys[flat // E, gather_ids.to(torch.int64)]
    bits = sorted_probs.contiguous().view(
        {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            sorted_probs.element_size()])
    order = torch.argsort(bits, stable=True)
    order = order[torch.argsort(route_keys[order], stable=True)]
    return order[torch.argsort(flat[order], stable=True)]


def sort_routes(probs: torch.Tensor, indices: torch.Tensor, num_experts: int, *,
                backend: str = "auto",
                block_counts: torch.Tensor | None = None) -> RouteLayout:
    """Group the routes by flat expert: see `RouteLayout` for the fields.

    probs: [H, S, K] float; indices: [H, S, K] int, each in [0, num_experts)
    backend: "auto" (a Triton counting sort on CUDA, PyTorch's stable sort
    elsewhere), "torch" or "triton"; the layouts are identical. Neither reads
    anything back to the host. sorted_probs is differentiable in probs.

    block_counts: the counts `route_tokens(..., block_counts=True)` returned with
    these very indices (or None): the Triton layout then skips its count step
    (same layout, bitwise). Counts of other indices give a wrong layout, with
    offsets past H*S*K and unwritten slots, which must not reach `expert_forward`
    (the layout itself writes nothing out of bounds); the PyTorch path ignores them.
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
    if block_counts is not None and not isinstance(block_counts, torch.Tensor):
        raise ValueError(f"sort_routes: block_counts must be a tensor or None, got "
                         f"{type(block_counts).__name__}")
    if _path(backend, probs, "sort_routes", "probs") == "triton":
        # positions (the backward's gather) only where a gradient may flow to probs.
        sorted_probs, gather_ids, offsets, _ = _sort_routes_triton_op(
            probs, indices, num_experts, block_counts,
            torch.is_grad_enabled() and probs.requires_grad)
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


# ------------------------------------------------------ the Triton paths as torch.library ops
#
# Opaque nodes with fake (shape-only) implementations for torch.compile, and autograd
# attached to the op. Their schemas take the routing options as the flat scalars of
# `RouterOptions.op_args()`, under the same names, in the same order (top_k .. topk_groups).


class _OpInputs:
    """An op's inputs by argument name. torch.library hands setup_context the op's inputs
    as a tuple in schema order (defaults filled in), and wants from the backward one
    gradient per input: `bind` names the first, `grads` builds the second from the
    gradients there are (None for every other input)."""

    def __init__(self, qualname: str) -> None:
        namespace, name = qualname.split("::")
        schema = getattr(getattr(torch.ops, namespace), name).default._schema
        self.names = tuple(argument.name for argument in schema.arguments)

    def bind(self, inputs: tuple) -> dict[str, object]:
        return dict(zip(self.names, inputs, strict=True))

    def grads(self, **grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        unknown = sorted(set(grads) - set(self.names))
        if unknown:
            raise TypeError(f"gradients for inputs the op does not have: {unknown}")
        return tuple(grads.get(name) for name in self.names)


def _counts_shape(H, S, E, top_k: int, with_counts: bool) -> tuple:
    """Shape of the block counts a routing op returns: [H, NB, E], or [0] without."""
    if not with_counts:
        return (0,)
    from .kernels.layout import layout_block_t

    T = layout_block_t(top_k)
    return (H, (S + T - 1) // T, E)  # cdiv, written out: S may be symbolic in a compile


def _no_counts(indices: torch.Tensor) -> torch.Tensor:
    """The empty [0] int32 tensor an op returns for counts it was not asked for."""
    return indices.new_empty(0, dtype=torch.int32)


@torch.library.custom_op("mhmoe::route_triton", mutates_args=())
def _route_triton_op(logits: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int,
                     score_func: str, route_norm: bool, norm_eps: float, route_scale: float,
                     num_groups: int, topk_groups: int, with_counts: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs, indices, counts): counts [H, NB, E] int32, the layout's block counts
    (`triton_route`'s count_block_t = layout_block_t(top_k)) if with_counts, else an
    empty [0] int32 tensor."""
    from .kernels.layout import layout_block_t
    from .kernels.topk import triton_route

    options = RouterOptions.from_op_args(locals())
    out = triton_route(logits, options, expert_bias,
                       count_block_t=layout_block_t(top_k) if with_counts else None)
    counts = out.block_counts if with_counts else _no_counts(out.indices)
    return out.probs, out.indices, counts


@_route_triton_op.register_fake
def _route_triton_fake(logits, expert_bias, top_k, score_func, route_norm, norm_eps,
                       route_scale, num_groups, topk_groups, with_counts=False):
    H, S, E = logits.shape
    return (logits.new_empty((H, S, top_k), dtype=torch.float32),
            logits.new_empty((H, S, top_k), dtype=torch.int64),
            logits.new_empty(_counts_shape(H, S, E, top_k, with_counts), dtype=torch.int32))


_ROUTE_INPUTS = _OpInputs("mhmoe::route_triton")


def _route_setup_context(ctx, inputs, output):
    args = _ROUTE_INPUTS.bind(inputs)
    ctx.save_for_backward(args["logits"], output[1])
    ctx.options = RouterOptions.from_op_args(args)


def _route_backward(ctx, grad_probs, grad_indices, grad_counts):
    logits, indices = ctx.saved_tensors
    o = ctx.options
    grad_logits = route_probs_backward(logits.float(), indices, grad_probs, o.score_func,
                                       o.route_norm, o.norm_eps, o.route_scale)
    return _ROUTE_INPUTS.grads(logits=grad_logits.to(logits.dtype))


_route_triton_op.register_autograd(_route_backward, setup_context=_route_setup_context)


@torch.library.custom_op("mhmoe::logits_route_triton", mutates_args=())
def _logits_route_triton_op(x_heads: torch.Tensor, gate: torch.Tensor,
                            expert_bias: torch.Tensor | None, top_k: int, score_func: str,
                            route_norm: bool, norm_eps: float, route_scale: float,
                            num_groups: int, topk_groups: int, save_logits: bool,
                            with_counts: bool = False, deterministic: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs, indices, logits, counts): logits [H, S, E] fp32 if save_logits (what
    the backward needs), else an empty [0] tensor; counts as `mhmoe::route_triton`'s.
    deterministic: the backward's, as `route_tokens`'s."""
    from .kernels.layout import layout_block_t
    from .kernels.router_logits import triton_logits_route

    options = RouterOptions.from_op_args(locals())
    out = triton_logits_route(
        x_heads, gate, options, expert_bias, return_logits=save_logits,
        count_block_t=layout_block_t(top_k) if with_counts else None)
    logits = out.logits if save_logits else out.probs.new_empty(0)
    counts = out.block_counts if with_counts else _no_counts(out.indices)
    return out.probs, out.indices, logits, counts


@_logits_route_triton_op.register_fake
def _logits_route_triton_fake(x_heads, gate, expert_bias, top_k, score_func, route_norm,
                              norm_eps, route_scale, num_groups, topk_groups, save_logits,
                              with_counts=False, deterministic=False):
    S, H, _ = x_heads.shape
    E = gate.shape[1]
    return (x_heads.new_empty((H, S, top_k), dtype=torch.float32),
            x_heads.new_empty((H, S, top_k), dtype=torch.int64),
            x_heads.new_empty((H, S, E) if save_logits else (0,), dtype=torch.float32),
            x_heads.new_empty(_counts_shape(H, S, E, top_k, with_counts), dtype=torch.int32))


_LOGITS_ROUTE_INPUTS = _OpInputs("mhmoe::logits_route_triton")


def _logits_route_setup_context(ctx, inputs, output):
    args = _LOGITS_ROUTE_INPUTS.bind(inputs)
    ctx.save_for_backward(args["x_heads"], args["gate"], output[2], output[1])
    ctx.options = RouterOptions.from_op_args(args)
    ctx.saved_logits = args["save_logits"]
    ctx.deterministic = args["deterministic"]


def _logits_route_backward(ctx, grad_probs, grad_indices, grad_logits, grad_counts):
    x_heads, gate, logits, indices = ctx.saved_tensors
    if not ctx.saved_logits:
        raise RuntimeError("mhmoe::logits_route_triton: backward of a call made with "
                           "save_logits=False (route_tokens sets it when a gradient is needed)")
    o = ctx.options
    grad = logits.new_zeros(logits.shape) if grad_probs is None else \
        route_probs_backward(logits, indices, grad_probs, o.score_func, o.route_norm,
                             o.norm_eps, o.route_scale)
    if grad_logits is not None:
        grad = grad + grad_logits
    need_x, need_gate = ctx.needs_input_grad[:2]
    grad_x, grad_gate = _router_logits_backward(grad, x_heads, gate, need_x, need_gate,
                                                ctx.deterministic, True)
    return _LOGITS_ROUTE_INPUTS.grads(x_heads=grad_x, gate=grad_gate)


_logits_route_triton_op.register_autograd(_logits_route_backward,
                                          setup_context=_logits_route_setup_context)


@torch.library.custom_op("mhmoe::sort_routes_triton", mutates_args=())
def _sort_routes_triton_op(
    probs: torch.Tensor, indices: torch.Tensor, num_experts: int,
    block_counts: torch.Tensor | None = None, with_positions: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_probs, gather_ids, offsets, positions): the float output first, as
    torch.library's op checks expect. block_counts: a routing op's counts of these
    indices (at layout_block_t(K)), which replace the layout's count step. positions
    (what the backward of sorted_probs needs) only if with_positions, else an empty
    [0] tensor (nothing written)."""
    from .kernels.layout import triton_sort_routes

    out = triton_sort_routes(probs, indices, num_experts, block_counts=block_counts,
                             return_positions=with_positions)
    positions = out.positions if with_positions else _no_counts(indices)
    return out.sorted_probs, out.gather_ids, out.offsets, positions


@_sort_routes_triton_op.register_fake
def _sort_routes_triton_fake(probs, indices, num_experts, block_counts=None,
                             with_positions=True):
    H, S, K = indices.shape
    R = H * S * K
    return (probs.new_empty(R, dtype=torch.float32), indices.new_empty(R, dtype=torch.int32),
            indices.new_empty(H * num_experts + 1, dtype=torch.int64),
            indices.new_empty(R if with_positions else 0, dtype=torch.int32))


_SORT_ROUTES_INPUTS = _OpInputs("mhmoe::sort_routes_triton")


def _sort_routes_setup_context(ctx, inputs, output):
    args = _SORT_ROUTES_INPUTS.bind(inputs)
    ctx.save_for_backward(output[3])
    ctx.probs_meta = (args["probs"].shape, args["probs"].dtype)
    ctx.with_positions = args["with_positions"]


def _sort_routes_backward(ctx, grad_sorted, grad_gather, grad_offsets, grad_positions):
    (positions,) = ctx.saved_tensors
    shape, dtype = ctx.probs_meta
    if grad_sorted is None:
        return _SORT_ROUTES_INPUTS.grads()
    if not ctx.with_positions:
        raise RuntimeError("mhmoe::sort_routes_triton: backward of a call made without "
                           "positions (sort_routes asks for them when probs needs a gradient)")
    # sorted_probs[positions] == probs.flatten(): the backward is that gather.
    grad_probs = grad_sorted[positions.to(torch.int64)].view(shape).to(dtype)
    return _SORT_ROUTES_INPUTS.grads(probs=grad_probs)


_sort_routes_triton_op.register_autograd(_sort_routes_backward,
                                         setup_context=_sort_routes_setup_context)
