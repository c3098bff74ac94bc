"""Independent float64 oracles, written from the contract (docs/contract.md) without the
library's code.

They loop over rows and routes one at a time: slow, obvious, and sharing no
code path with `mhmoe` (no CSR, no sort, no batching).
"""

from __future__ import annotations

import math

import torch


def route_row(logits_row, top_k, score_func="sigmoid", bias_row=None, route_norm=True,
              norm_eps=1e-12, route_scale=1.0, num_groups=1, topk_groups=1):
    """One (head, token) row in float64 Python arithmetic -> (probs list, indices list)."""
    values = [float(v) for v in logits_row]
    E = len(values)
    if score_func == "sigmoid":
        scores = [1.0 / (1.0 + math.exp(-v)) for v in values]
    else:
        m = max(values)
        exps = [math.exp(v - m) for v in values]
        total = sum(exps)
        scores = [e / total for e in exps]
    select = [s + (float(bias_row[e]) if bias_row is not None else 0.0)
              for e, s in enumerate(scores)]
    if num_groups > 1:
        size = E // num_groups
        group_scores = []
        for g in range(num_groups):
            best = sorted(select[g * size:(g + 1) * size], reverse=True)
            group_scores.append(sum(best[:2]))
        kept = sorted(range(num_groups), key=lambda g: (-group_scores[g], g))[:topk_groups]
        select = [v if e // size in kept else 0.0 for e, v in enumerate(select)]
    indices = sorted(range(E), key=lambda e: (-select[e], e))[:top_k]
    probs = [scores[e] for e in indices]
    if route_norm:
        total = sum(probs)
        probs = [p / max(total, norm_eps) for p in probs]
    return [p * route_scale for p in probs], indices


def swiglu7_oracle(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    g = g.double().clamp(max=7)
    u = u.double().clamp(-7, 7)
    return g / (1 + torch.exp(-1.702 * g)) * (u + 1)


def expert_mlp(x_vec, wg, wu, wd, act_dtype=None):
    """One route's expert MLP in float64; `act_dtype` rounds the activation like the spec."""
    g = x_vec.double() @ wg.double()
    u = x_vec.double() @ wu.double()
    a = swiglu7_oracle(g, u)
    if act_dtype is not None:
        a = a + (a.to(act_dtype).double() - a).detach()
    return a @ wd.double()


def layer_from_routes(x_heads, probs, indices, w_gate, w_up, w_down, act_dtype=None):
    """y[s, h] = sum_k probs[h, s, k] * MLP_{h*E + indices[h, s, k]}(x[s, h]) in float64.

    x_heads [S, H, D]; probs, indices [H, S, K]; weights [H*E, ...]. Differentiable
    in x, probs and the weights (the activation rounding, if any, passes gradients
    straight through like a cast)."""
    S, H, D = x_heads.shape
    E = w_gate.shape[0] // H
    rows = []
    for s in range(S):
        for h in range(H):
            y = torch.zeros(D, dtype=torch.float64)
            for k in range(indices.shape[2]):
                f = h * E + int(indices[h, s, k])
                o = expert_mlp(x_heads[s, h], w_gate[f], w_up[f], w_down[f], act_dtype)
                y = y + probs[h, s, k].double() * o
            rows.append(y)
    # Built without in-place writes so that autograd can differentiate it.
    return torch.stack(rows).view(S, H, D) if rows else torch.zeros(S, H, D, dtype=torch.float64)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)
