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

from .config import SCORE_FUNCS, check_groups
from .reference import route_reference, sort_routes_reference


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
    return route_reference(logits, top_k, score_func, expert_bias, route_norm, norm_eps,
                           route_scale, num_groups, topk_groups)


def sort_routes(probs: torch.Tensor, indices: torch.Tensor, num_experts: int) -> RouteLayout:
    """Group the routes by flat expert: see `RouteLayout` for the fields.

    probs: [H, S, K] float; indices: [H, S, K] int, each in [0, num_experts)
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
    return RouteLayout(*sort_routes_reference(probs, indices, num_experts))
