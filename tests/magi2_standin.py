"""A stand-in for the published MAGI-2 MoE module, written from docs/contract.md section 9.

It has the published interface (the class `Magi2MultiHeadMoE`, its config and group
objects, attributes, parameters, `ep_slice` and the loader hook) and a forward in
plain PyTorch that follows sections 2, 4 and 6 step by step, with nothing taken from
mhmoe: the tests of `mhmoe.integrations.magi2` check the accelerated module against
this module's own forward.

Imported by spawned gloo workers too, so it imports neither pytest nor mhmoe.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Magi2MultiHeadMoEConfig:
    """The published config: no bias source, groups or eps (section 9)."""

    hidden_size: int
    num_heads: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    params_dtype: torch.dtype
    score_func: str = "sigmoid"
    route_norm: bool = True
    route_scale: float = 1.0


@dataclass
class Magi2EPGroup:
    """The published expert-parallel group object. `group` None: one rank.
    `replicated_sequence`: every rank holds the same tokens and only its own heads."""

    world_size: int = 1
    rank: int = 0
    group: Any = None
    replicated_sequence: bool = False


# What a module built without `ep_group` gets: the model's default, one rank.
DEFAULT_EP_GROUP = Magi2EPGroup()


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single along dim 0; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.args = (in_splits, out_splits, group)
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, *ctx.args), None, None, None


class Magi2Router(nn.Module):
    """The two selection biases, frozen parameters."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.expert_bias = nn.Parameter(torch.zeros(rows), requires_grad=False)
        self.expert_bias_ema = nn.Parameter(torch.zeros(rows), requires_grad=False)


class Magi2MultiHeadMoE(nn.Module):
    """x: [..., hidden] (replicated mode: [..., local_heads * D]) -> same shape."""

    # a plain set, as published
    _EP_SHARDED_PARAMETER_NAMES: ClassVar[set[str]] = {
        "gate", "W_gate", "W_up", "W_down", "router.expert_bias", "router.expert_bias_ema"}

    def __init__(self, config: Magi2MultiHeadMoEConfig, *, ep_group: Any = None) -> None:
        super().__init__()
        self.config = config
        self.ep_group = ep_group if ep_group is not None else DEFAULT_EP_GROUP
        self.num_heads = config.num_heads
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.d_head = config.hidden_size // config.num_heads
        self.d_expert = config.expert_intermediate_size
        world = self.ep_group.world_size
        self.local_num_heads = math.ceil(self.num_heads / world)
        self.padded_num_heads = self.local_num_heads * world
        self.ep_pad_heads = self.padded_num_heads - self.num_heads
        self.local_head_start = self.ep_group.rank * self.local_num_heads
        self.has_real_moe_heads = self.local_head_start < self.num_heads
        self.local_flatten_num_experts = self.local_num_heads * self.num_experts
        rows, D, I = self.local_flatten_num_experts, self.d_head, self.d_expert
        self.gate = nn.Parameter(torch.zeros(rows, D, dtype=torch.float32))
        self.W_gate = nn.Parameter(torch.zeros(rows, D, I, dtype=config.params_dtype))
        self.W_up = nn.Parameter(torch.zeros(rows, D, I, dtype=config.params_dtype))
        self.W_down = nn.Parameter(torch.zeros(rows, I, D, dtype=config.params_dtype))
        self.router = Magi2Router(rows)
        for name in self._EP_SHARDED_PARAMETER_NAMES:
            self.get_parameter(name).mmap_weight_transform = self.ep_slice

    def ep_slice(self, checkpoint_tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full per-expert tensor (section 6), zero-filled past
        its end; a tensor that already has the local row count is returned as it is."""
        rows = self.local_flatten_num_experts
        if checkpoint_tensor.shape[0] == rows:
            return checkpoint_tensor
        begin = self.local_head_start * self.num_experts
        part = checkpoint_tensor[begin:begin + rows]
        missing = rows - part.shape[0]
        if missing:
            part = torch.cat([part, part.new_zeros(missing, *part.shape[1:])])
        return part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H, Hl, D = self.num_heads, self.local_num_heads, self.d_head
        if self.ep_group.replicated_sequence:
            if x.shape[-1] != Hl * D:
                raise ValueError(f"replicated input must be [..., {Hl * D}], got "
                                 f"{tuple(x.shape)}")
            return self._local_moe(x.reshape(-1, Hl, D)).reshape(x.shape)
        if x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"input must be [..., {self.config.hidden_size}], got "
                             f"{tuple(x.shape)}")
        tokens = x.reshape(-1, H * D)
        S = tokens.shape[0]
        world = self.ep_group.world_size
        if world == 1:
            return self._local_moe(tokens.view(S, H, D)).reshape(x.shape)
        group = self.ep_group.group
        mine = torch.tensor([S], dtype=torch.int64, device=x.device)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        counts = [int(c) for c in gathered]
        heads = tokens.view(S, H, D)
        if self.ep_pad_heads:
            heads = torch.cat([heads, heads.new_zeros(S, self.ep_pad_heads, D)], dim=1)
        # rank j gets heads [j * Hl, (j + 1) * Hl) of every token, tokens in rank order
        send = heads.reshape(S, world, Hl * D).transpose(0, 1).reshape(world * S, Hl * D)
        recv = _AllToAll.apply(send, counts, [S] * world, group)
        y_local = self._local_moe(recv.view(-1, Hl, D)).reshape(-1, Hl * D)
        back = _AllToAll.apply(y_local, [S] * world, counts, group)
        y = back.view(world, S, Hl * D).transpose(0, 1).reshape(S, world * Hl, D)[:, :H]
        return y.reshape(x.shape)

    def _local_moe(self, x_heads: torch.Tensor) -> torch.Tensor:
        """Routing (section 2) and experts (section 4) of this rank's heads.
        x_heads: [S, Hl, D] -> [S, Hl, D], x's dtype."""
        S, Hl, D = x_heads.shape
        E, K = self.num_experts, self.top_k
        cfg = self.config
        xf = x_heads.float()
        logits = torch.einsum("shd,hed->hse", xf, self.gate.float().view(Hl, E, D))
        if cfg.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        elif cfg.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            raise ValueError(f"unknown score_func {cfg.score_func!r}")
        source = os.environ.get("MAGI2_ROUTER_BIAS_SOURCE", "ema").strip().lower() or "ema"
        if source not in ("ema", "main"):
            raise ValueError(f"MAGI2_ROUTER_BIAS_SOURCE={source!r}")
        bias = self.router.expert_bias_ema if source == "ema" else self.router.expert_bias
        with torch.no_grad():
            select = scores + bias.float().view(Hl, 1, E)
            # a sorted top-k, ties to the lower expert id
            indices = torch.sort(select, dim=-1, descending=True, stable=True).indices[..., :K]
        probs = scores.gather(-1, indices)
        if cfg.route_norm:
            total = probs[..., 0]
            for k in range(1, K):  # in selection order
                total = total + probs[..., k]
            probs = probs / total.clamp_min(1e-12).unsqueeze(-1)
        probs = probs * cfg.route_scale
        # [Hl, S, E]: each token's probability for every expert, 0 where not picked
        combine = probs.new_zeros(Hl, S, E).scatter(-1, indices, probs)
        heads = []
        for h in range(Hl):
            y = xf.new_zeros(S, D)
            for e in range(E):
                f = h * E + e
                g = xf[:, h] @ self.W_gate[f].float()
                u = xf[:, h] @ self.W_up[f].float()
                g = torch.clamp(g, max=7.0)
                u = torch.clamp(u, min=-7.0, max=7.0)
                a = (g * torch.sigmoid(1.702 * g) * (u + 1.0)).to(self.W_down.dtype).float()
                y = y + (a @ self.W_down[f].float()) * combine[h, :, e, None]
            heads.append(y)
        return torch.stack(heads, dim=1).to(x_heads.dtype)
