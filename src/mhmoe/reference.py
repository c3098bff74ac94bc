"""Pure-PyTorch twins of every op: the portable path and the oracle.

These functions run on any device and in any floating dtype (float64
included). They follow docs/contract.md sections 2 to 4 operation by operation, so the
Triton kernels are checked against them and users without a GPU get the same
numbers. Argument checking lives in the public wrappers (`routing.py`,
`experts.py`); the functions here assume valid input.
"""

from __future__ import annotations

import functools

import torch


def exact_precision(fn):
    """Run `fn` with autocast off: the spec fixes the precision of every step
    (fp32 router logits, fp32 accumulators), and an autocast region around the
    caller must not quietly turn those matmuls into bf16 ones."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: the accumulator type."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


@exact_precision
def route_reference(
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
    """Top-k routing of every (head, token) row.

    logits: [H, S, E] float32 (float64 is kept as float64)
    expert_bias: [H, E] or [H * E], added to the scores for selection only
    returns probs [H, S, K] (logits' float type), indices [H, S, K] int64

    Ties go to the lower expert id (a stable descending sort). A NaN score is
    treated as -inf for selection, so it is picked only when a row has fewer
    than K other experts; the probability gathered for it is NaN, which makes
    that row's normalised probabilities NaN. Other rows are untouched and
    indices always lie in [0, E).
    """
    H, _, E = logits.shape
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    if score_func == "sigmoid":
        scores = torch.sigmoid(logits.detach())
    else:
        scores = torch.softmax(logits, dim=-1)
    # Selection has no gradient: keep it out of the autograd graph, so that
    # nothing of size [H, S, E] is saved for it.
    with torch.no_grad():
        select = scores
        if expert_bias is not None:
            select = scores + expert_bias.to(dtype).reshape(H, 1, E)
        select = torch.where(torch.isnan(select), float("-inf"), select)
        if num_groups > 1:
            select = _limit_to_groups(select, num_groups, topk_groups)
        # contiguous: a view would keep the whole [H, S, E] sort result alive.
        indices = torch.sort(select, dim=-1, descending=True, stable=True) \
            .indices[..., :top_k].contiguous()
    if score_func == "sigmoid":
        probs = _GatheredSigmoid.apply(logits, scores.gather(-1, indices), indices)
    else:
        probs = scores.gather(-1, indices)
    if route_norm:
        # Summed left to right in selection order, as the published code does.
        total = probs[..., 0]
        for k in range(1, top_k):
            total = total + probs[..., k]
        probs = probs / total.clamp_min(norm_eps).unsqueeze(-1)
    probs = probs * route_scale
    return probs, indices


class _GatheredSigmoid(torch.autograd.Function):
    """sigmoid(logits).gather(-1, indices) with a backward that saves only the K
    picked values: d logits = scatter(grad * p * (1 - p)), zero elsewhere.

    The forward values are the gathered full scores, bit for bit; autograd of the
    plain formula would keep the [H, S, E] sigmoid output alive for the backward.
    """

    @staticmethod
    def forward(ctx, logits, picked, indices):
        ctx.save_for_backward(picked, indices)
        ctx.logits_shape = logits.shape
        return picked

    @staticmethod
    def backward(ctx, grad):
        picked, indices = ctx.saved_tensors
        grad_logits = grad.new_zeros(ctx.logits_shape)
        grad_logits.scatter_(-1, indices, grad * picked * (1 - picked))
        return grad_logits, None, None


def _limit_to_groups(select: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Zero the selection scores of experts outside the best `topk_groups` groups."""
    H, S, E = select.shape
    grouped = select.reshape(H, S, num_groups, E // num_groups)
    best = torch.sort(grouped, dim=-1, descending=True, stable=True).values
    group_scores = best[..., 0]
    if grouped.shape[-1] > 1:
        group_scores = group_scores + best[..., 1]
    group_scores = torch.where(torch.isnan(group_scores), float("-inf"), group_scores)
    kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[..., :topk_groups]
    keep = torch.zeros(H, S, num_groups, dtype=torch.bool, device=select.device)
    keep.scatter_(-1, kept, True)
    return torch.where(keep.unsqueeze(-1), grouped, 0.0).reshape(H, S, E)


def sort_routes_reference(
    probs: torch.Tensor, indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR layout of the routes by flat expert id `h * E + e` (docs/contract.md section 3).

    probs, indices: [H, S, K]
    returns gather_ids [H*S*K] int32 (token of each route), sorted_probs
    [H*S*K] float32 (float64 kept), offsets [H*E + 1] int64.

    A stable sort keeps the (h, s, k) order inside one expert, so its routes
    come in ascending token order. The offsets come from a binary search of
    the sorted ids, not a bincount, so nothing is read back to the host.
    """
    H, S, K = indices.shape
    device = indices.device
    heads = torch.arange(H, device=device, dtype=torch.int64).view(H, 1, 1)
    flat = (indices.to(torch.int64) + heads * num_experts).reshape(-1)
    sorted_flat, order = torch.sort(flat, stable=True)
    gather_ids = torch.div(order, K, rounding_mode="floor").remainder_(max(S, 1)).to(torch.int32)
    prob_dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
    sorted_probs = probs.reshape(-1).to(prob_dtype)[order]
    bounds = torch.arange(H * num_experts + 1, device=device, dtype=torch.int64)
    offsets = torch.searchsorted(sorted_flat, bounds)
    return gather_ids, sorted_probs, offsets


def swiglu7_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU clamped at 7: min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1).

    Evaluated in float32 (float64 if either input is float64) whatever the input
    dtype, as the published activation is, and returned in the inputs' (promoted)
    dtype: bf16 arithmetic would round every intermediate (docs/contract.md
    section 4). The expert references call it on fp32 or fp64 accumulators.
    """
    dtype = torch.promote_types(gate.dtype, up.dtype)
    acc = compute_dtype(gate, up)
    g = torch.clamp(gate.to(acc), max=7.0)
    u = torch.clamp(up.to(acc), min=-7.0, max=7.0)
    return (g * torch.sigmoid(1.702 * g) * (u + 1.0)).to(dtype)


@exact_precision
def expert_forward_reference(
    x_heads: torch.Tensor,
    gather_ids: torch.Tensor,
    sorted_probs: torch.Tensor,
    offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """The expert MLPs of every route, weighted and summed per (token, head).

    x_heads: [S, H, D]; gather_ids [R] int; sorted_probs [R]; offsets [H*E + 1]
    w_gate, w_up: [H*E, D, I]; w_down: [H*E, I, D]
    returns [S, H, D] in x_heads' dtype.

    GEMMs run on upcast operands (float32, or float64 if any input is), which
    is what fp32 accumulation of bf16 products computes up to summation order.
    One expert at a time, so this path reads `offsets` on the host once. The
    per-expert adds go in ascending expert order and no (token, head) appears
    twice within one expert, so the sum of the K routes of a (token, head) has
    a fixed order: the result is the same whatever the order of the tokens.
    """
    S, H, D = x_heads.shape
    num_flat = w_gate.shape[0]
    num_experts = num_flat // H if H else 0
    acc = compute_dtype(x_heads, w_gate, sorted_probs)
    out = torch.zeros(S * H, D, dtype=acc, device=x_heads.device)
    if S == 0 or num_flat == 0:
        return out.view(S, H, D).to(x_heads.dtype)
    bounds = offsets.tolist()
    for f in range(num_flat):
        start, end = bounds[f], bounds[f + 1]
        if start == end:
            continue
        head = f // num_experts
        tokens = gather_ids[start:end].to(torch.int64)
        xe = x_heads[tokens, head].to(acc)
        g = xe @ w_gate[f].to(acc)
        u = xe @ w_up[f].to(acc)
        a = swiglu7_reference(g, u).to(w_down.dtype).to(acc)
        o = (a @ w_down[f].to(acc)) * sorted_probs[start:end, None].to(acc)
        out.index_add_(0, tokens * H + head, o)
    return out.view(S, H, D).to(x_heads.dtype)


@exact_precision
def moe_reference_float64(
    x_heads: torch.Tensor,
    probs: torch.Tensor,
    indices: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """The float64 evaluation of docs/contract.md section 4 from routes, for checking a slice.

    x_heads: [S, H, D]; probs, indices: [H, S, K]; weights as in expert_forward.
    returns [S, H, D] float64 on the CPU. No rounding of the activation: this is
    the exact formula the low-precision paths approximate. Only the experts the
    routes use are upcast, so a few tokens can be checked against a 6 GB layer.
    The math runs on the weights' device (float64 GEMMs are exact enough on a GPU too,
    and copying thousands of experts' weights to the CPU one by one took minutes).
    """
    S, H, D = x_heads.shape
    E = w_gate.shape[0] // H
    K = indices.shape[-1]
    device = w_gate.device
    x64 = x_heads.detach().to(device, torch.float64)
    flat = (indices.detach().to(device, torch.int64)
            + torch.arange(H, device=device).view(H, 1, 1) * E).reshape(-1)
    p64 = probs.detach().to(device, torch.float64).reshape(-1)
    out = torch.zeros(S * H, D, dtype=torch.float64, device=device)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    for f, start, count in zip(experts.tolist(), starts.tolist(), counts.tolist(), strict=True):
        routes = order[start:start + count]
        head = f // E
        tokens = torch.div(routes, K, rounding_mode="floor") % S
        xe = x64[tokens, head]
        g = xe @ w_gate[f].detach().to(torch.float64)
        u = xe @ w_up[f].detach().to(torch.float64)
        o = swiglu7_reference(g, u) @ w_down[f].detach().to(torch.float64)
        out.index_add_(0, tokens * H + head, o * p64[routes, None])
    return out.view(S, H, D).cpu()


@exact_precision
def expert_backward_reference(
    grad_y: torch.Tensor,
    x_heads: torch.Tensor,
    gather_ids: torch.Tensor,
    sorted_probs: torch.Tensor,
    offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `expert_forward_reference` by hand, recomputing g, u and a per expert.

    grad_y: [S, H, D] (the gradient of the output)
    returns dx [S, H, D] (x dtype), dprobs [R] (probs dtype), dW_gate, dW_up
    [H*E, D, I], dW_down [H*E, I, D] (weight dtype).

    Nothing of size [routes, I] is kept between forward and backward: the
    activations are recomputed here. The cast of the activation to the weight
    dtype passes gradients straight through; clamp passes them where the input
    lies inside the clamp range (bounds included), as torch.clamp does.
    """
    S, H, D = x_heads.shape
    num_flat = w_gate.shape[0]
    num_experts = num_flat // H if H else 0
    acc = compute_dtype(x_heads, w_gate, sorted_probs, grad_y)
    dx = torch.zeros(S * H, D, dtype=acc, device=x_heads.device)
    dprobs = torch.zeros(sorted_probs.shape, dtype=acc, device=x_heads.device)
    d_gate = torch.zeros(w_gate.shape, dtype=acc, device=x_heads.device)
    d_up = torch.zeros(w_up.shape, dtype=acc, device=x_heads.device)
    d_down = torch.zeros(w_down.shape, dtype=acc, device=x_heads.device)
    bounds = offsets.tolist() if S and num_flat else [0] * (num_flat + 1)
    for f in range(num_flat):
        start, end = bounds[f], bounds[f + 1]
        if start == end:
            continue
        head = f // num_experts
        tokens = gather_ids[start:end].to(torch.int64)
        rows = tokens * H + head
        xe = x_heads[tokens, head].to(acc)
        wg, wu, wd = w_gate[f].to(acc), w_up[f].to(acc), w_down[f].to(acc)
        g, u = xe @ wg, xe @ wu
        a = swiglu7_reference(g, u).to(w_down.dtype).to(acc)
        dy = grad_y[tokens, head].to(acc)
        p = sorted_probs[start:end].to(acc)
        dprobs[start:end] = ((a @ wd) * dy).sum(-1)
        do = dy * p[:, None]
        d_down[f] = a.transpose(0, 1) @ do
        da = do @ wd.transpose(0, 1)
        gc = torch.clamp(g, max=7.0)
        sig = torch.sigmoid(1.702 * gc)
        uc1 = torch.clamp(u, min=-7.0, max=7.0) + 1.0
        dg = da * uc1 * (sig + 1.702 * gc * sig * (1.0 - sig)) * (g <= 7.0)
        du = da * gc * sig * ((u >= -7.0) & (u <= 7.0))
        d_gate[f] = xe.transpose(0, 1) @ dg
        d_up[f] = xe.transpose(0, 1) @ du
        dx.index_add_(0, rows, dg @ wg.transpose(0, 1) + du @ wu.transpose(0, 1))
    return (dx.view(S, H, D).to(x_heads.dtype), dprobs.to(sorted_probs.dtype),
            d_gate.to(w_gate.dtype), d_up.to(w_up.dtype), d_down.to(w_down.dtype))


@exact_precision
def route_probs_backward(
    logits: torch.Tensor,
    indices: torch.Tensor,
    grad_probs: torch.Tensor,
    score_func: str,
    route_norm: bool,
    norm_eps: float,
    route_scale: float,
) -> torch.Tensor:
    """d logits of `route` given d probs, with the selection `indices` fixed.

    logits: [H, S, E]; indices, grad_probs: [H, S, K] -> [H, S, E] (logits' dtype).
    Written out (rather than autograd) so the Triton routing op can register it:
    out_k = s q_k / max(T, eps), T = sum_j q_j, q = the picked scores, gives
    dq_j = s go_j / d - s sum_k(go_k q_k) / d^2 (the second term only where
    T >= eps, as clamp_min passes gradients); sigmoid: dl = dq q (1 - q) at
    the picked experts; softmax: dl = p * (scatter(dq) - sum_k dq_k q_k).
    """
    if score_func == "sigmoid":
        q = torch.sigmoid(logits.gather(-1, indices))
    else:
        full = torch.softmax(logits, dim=-1)
        q = full.gather(-1, indices)
    go = grad_probs.to(q.dtype) * route_scale
    if route_norm:
        total = q[..., 0]
        for k in range(1, q.shape[-1]):
            total = total + q[..., k]
        denom = total.clamp_min(norm_eps)
        shared = (go * q).sum(-1) / denom.square() * (total >= norm_eps)
        gq = go / denom.unsqueeze(-1) - shared.unsqueeze(-1)
    else:
        gq = go
    if score_func == "sigmoid":
        return torch.zeros_like(logits).scatter_(-1, indices, gq * q * (1 - q))
    spread = torch.zeros_like(logits).scatter_(-1, indices, gq)
    return full * (spread - (gq * q).sum(-1, keepdim=True))


# Content keys (deterministic mode's summation order; `kernels/row_keys.py` explains the
# hash). Mixer = (seed, multiplier 1, multiplier 2, shift 1, shift 2, shift 3): seed and
# both multipliers below 2^31, so that a 32-bit value times one stays below 2^63.
ROW_KEY_STEP = 0x9E3779B9
ROW_KEY_MIXERS = ((0, 0x45D9F3B, 0x45D9F3B, 16, 16, 16),
                  (0x5BD1E995, 0x2C1B3C6D, 0x297A2D39, 15, 12, 15))
ROW_KEYS_MAX_COLUMNS = 1 << 20  # c * ROW_KEY_STEP and the row sums stay below 2^63
_MASK32 = 0xFFFFFFFF


def integer_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t's bits as signed integers (a view; last dimension contiguous) and their width:
    elements of 1, 2 or 4 bytes as integers of that width, 8-byte elements as two
    32-bit integers each (the last dimension doubles). The form the content keys read."""
    by_size = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
    size = t.element_size()
    if size not in by_size or t.is_complex():
        raise ValueError(f"row_keys: real elements of 1, 2, 4 or 8 bytes, got {t.dtype}")
    target = by_size[size]
    return (t if t.dtype == target else t.view(target)), 8 * target.itemsize


def check_row_key_inputs(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(S, H) of two [S, H, W] row tensors, or a ValueError saying what is wrong."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[:2] != b.shape[:2]:
        raise ValueError(f"row_keys: a and b must be [S, H, Wa] and [S, H, Wb], got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"row_keys: a on {a.device}, b on {b.device}")
    width = sum(t.shape[2] * max(1, t.element_size() // 4) for t in (a, b))
    if width > ROW_KEYS_MAX_COLUMNS:
        raise ValueError(f"row_keys: at most {ROW_KEYS_MAX_COLUMNS} columns (32-bit words "
                         f"for 8-byte elements) a row, got {width}")
    return a.shape[0], a.shape[1]


def _row_key_mix(z: torch.Tensor, mixer: tuple[int, ...]) -> torch.Tensor:
    seed, mul1, mul2, s1, s2, s3 = mixer
    z = z ^ seed
    z = ((z ^ (z >> s1)) * mul1) & _MASK32
    z = ((z ^ (z >> s2)) * mul2) & _MASK32
    return z ^ (z >> s3)


def row_keys_reference(a: torch.Tensor, b: torch.Tensor, *,
                       chunk_rows: int = 4096) -> torch.Tensor:
    """keys [H, S] int64 of the rows (a[s, h, :], b[s, h, :]), the integers of
    `kernels.row_keys.triton_row_keys` (see there), in int64 arithmetic that never
    overflows. a: [S, H, Wa], b: [S, H, Wb], real elements of 1, 2, 4 or 8 bytes.
    chunk_rows: (token, head) rows hashed at a time (bounds the int64 temporaries)."""
    S, H = check_row_key_inputs(a, b)
    (a, a_bits), (b, b_bits) = integer_view(a.contiguous()), integer_view(b.contiguous())
    rows = torch.cat([a.reshape(S * H, a.shape[2]), b.reshape(S * H, b.shape[2])], dim=1)
    # Built on the device (no host copy), so that a CUDA graph can capture the twin too.
    masks = torch.cat([torch.full((a.shape[2],), (1 << a_bits) - 1, dtype=torch.int64,
                                  device=a.device),
                       torch.full((b.shape[2],), (1 << b_bits) - 1, dtype=torch.int64,
                                  device=a.device)])
    steps = torch.arange(rows.shape[1], dtype=torch.int64, device=a.device) * ROW_KEY_STEP
    keys = torch.empty(S * H, dtype=torch.int64, device=a.device)
    for r0 in range(0, S * H, chunk_rows):
        z = ((rows[r0:r0 + chunk_rows].to(torch.int64) & masks) + steps) & _MASK32
        high = _row_key_mix(z, ROW_KEY_MIXERS[0]).sum(1) & 0x7FFFFFFF
        low = _row_key_mix(z, ROW_KEY_MIXERS[1]).sum(1) & _MASK32
        keys[r0:r0 + chunk_rows] = (high << 32) | low
    return keys.view(S, H).t().contiguous()
