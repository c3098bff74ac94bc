"""`MultiHeadMoE`: the layer as an nn.Module, with the MAGI-2 parameter names."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from .backends import BACKENDS
from .config import BIAS_SOURCES, MultiHeadMoEConfig
from .experts import expert_forward
from .parallel import HeadPartition, dispatch, gather_token_counts, undispatch
from .routing import RouteLayout, route_tokens, sort_routes

BIAS_SOURCE_ENV = "MAGI2_ROUTER_BIAS_SOURCE"
DETERMINISTIC_ENV = "MAGI2_DETERMINISTIC"
INPUT_MODES = ("sequence", "replicated")


def bias_source_from_env(default: str) -> str:
    """`MAGI2_ROUTER_BIAS_SOURCE` (main|ema) if set, else `default`."""
    value = os.environ.get(BIAS_SOURCE_ENV, "").strip().lower()
    if not value:
        return default
    if value not in BIAS_SOURCES:
        raise ValueError(f"{BIAS_SOURCE_ENV}={value!r}: expected one of {BIAS_SOURCES}")
    return value


def deterministic_from_env(default: bool) -> bool:
    """`MAGI2_DETERMINISTIC` (1/0, true/false) if set, else `default`."""
    value = os.environ.get(DETERMINISTIC_ENV, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{DETERMINISTIC_ENV}={value!r}: expected 1 or 0")


class RouterBiases(nn.Module):
    """The auxiliary-loss-free selection biases; checkpoint keys `router.*`."""

    def __init__(self, rows: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # Parameters (not buffers) to match the published module's named_parameters;
        # never trained: they shift expert selection, which has no gradient.
        self.expert_bias = nn.Parameter(torch.zeros(rows, device=device, dtype=dtype),
                                        requires_grad=False)
        self.expert_bias_ema = nn.Parameter(torch.zeros(rows, device=device, dtype=dtype),
                                            requires_grad=False)


class MultiHeadMoE(nn.Module):
    """A multi-head mixture-of-experts layer (SPEC section 5).

    x: [..., hidden_size] -> y: same shape and dtype.

    With `group` (or an explicit `partition`), this rank holds only the heads of its
    `HeadPartition`
    (padding heads included, zero-initialised): `local_flat = local_heads * E`
    rows of every per-expert tensor.

    Parameters (checkpoint names):
      gate         [local_flat, D] float32 (float64 if params_dtype is float64)
      W_gate, W_up [local_flat, D, I] params_dtype
      W_down       [local_flat, I, D] params_dtype
      router.expert_bias, router.expert_bias_ema [local_flat] float32 (likewise), frozen

    backend: "auto" | "torch" | "triton" for every op; fused_router: `fused` of
    `routing.route_tokens` (None: router logits on tensor cores by the Triton logits
    kernel where it applies, i.e. the triton path with bf16 input; True: required;
    False: never, an fp32 GEMM then `route`).
    """

    def __init__(
        self,
        config: MultiHeadMoEConfig,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
        backend: str = "auto",
        partition: HeadPartition | None = None,
        input_mode: str = "sequence",
        fused_router: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MultiHeadMoEConfig):
            raise TypeError(f"MultiHeadMoE: config must be a MultiHeadMoEConfig, got "
                            f"{type(config).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"MultiHeadMoE: backend must be one of {BACKENDS}, got {backend!r}")
        if input_mode not in INPUT_MODES:
            raise ValueError(f"MultiHeadMoE: input_mode must be one of {INPUT_MODES}, got "
                             f"{input_mode!r}")
        if fused_router not in (None, True, False):
            raise ValueError(f"MultiHeadMoE: fused_router must be None, True or False, got "
                             f"{fused_router!r}")
        self.config = config
        self.group = group
        self.backend = backend
        # route_tokens' `fused`: None = the Triton logits kernel where it applies.
        self.fused_router = fused_router
        self.input_mode = input_mode
        if partition is None:
            partition = HeadPartition.of_group(config.num_heads, group)
        elif group is not None and partition != HeadPartition.of_group(config.num_heads, group):
            raise ValueError(f"MultiHeadMoE: partition {partition} does not match the rank of "
                             f"the group")
        elif partition.num_heads != config.num_heads:
            raise ValueError(f"MultiHeadMoE: partition is for {partition.num_heads} heads, the "
                             f"config has {config.num_heads}")
        # `partition` without `group`: one rank's parameters, e.g. to load or inspect its
        # slice of a checkpoint; such a module cannot run a head-parallel forward.
        self.partition = partition
        rows = self.partition.local_heads * config.num_experts
        D, I = config.head_dim, config.expert_intermediate_size
        dtype = config.params_dtype
        # The router runs in float32 (SPEC section 2); a float64 layer (used for
        # gradient checks) keeps its router in float64 too.
        router_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.gate = nn.Parameter(torch.empty(rows, D, dtype=router_dtype, device=device))
        self.W_gate = nn.Parameter(torch.empty(rows, D, I, dtype=dtype, device=device))
        self.W_up = nn.Parameter(torch.empty(rows, D, I, dtype=dtype, device=device))
        self.W_down = nn.Parameter(torch.empty(rows, I, D, dtype=dtype, device=device))
        self.router = RouterBiases(rows, device=device, dtype=router_dtype)
        if self.gate.device.type != "meta":
            self.reset_parameters()

    @property
    def local_heads(self) -> int:
        return self.partition.local_heads

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal weights scaled by 1/sqrt(fan_in); padding heads stay zero."""
        cfg = self.config
        D, I = cfg.head_dim, cfg.expert_intermediate_size
        real_rows = self.partition.real_heads * cfg.num_experts
        with torch.no_grad():
            for param, fan_in in ((self.gate, D), (self.W_gate, D), (self.W_up, D),
                                  (self.W_down, I)):
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32,
                                     device=generator.device if generator is not None
                                     else param.device)
                values[real_rows:] = 0
                param.copy_(values.mul_(fan_in ** -0.5))
            self.router.expert_bias.zero_()
            self.router.expert_bias_ema.zero_()

    @property
    def bias_source(self) -> str:
        return bias_source_from_env(self.config.bias_source)

    @property
    def deterministic(self) -> bool:
        return deterministic_from_env(self.config.deterministic)

    def selection_bias(self) -> torch.Tensor:
        """The bias that shifts selection: `expert_bias_ema` or `expert_bias`."""
        if self.bias_source == "ema":
            return self.router.expert_bias_ema
        return self.router.expert_bias

    def route_heads(self, x_heads: torch.Tensor, *,
                    block_counts: bool = False) -> tuple[torch.Tensor | None, ...]:
        """Routing of local heads. x_heads: [S, local_heads, D] -> probs, indices [Hl, S, K].

        Logits come from the Triton logits kernel (then routed by the route kernel,
        or in the same kernel, as its config says) where `routing.route_tokens`
        allows it (the triton path with bf16 x; see `fused_router`), else from an
        fp32 GEMM followed by `route`. block_counts: a third value, the layout's
        per-block expert counts for `sort_routes` (None on the PyTorch path).
        """
        cfg = self.config
        Hl = self.partition.local_heads
        gate = self.gate.view(Hl, cfg.num_experts, cfg.head_dim)
        return route_tokens(x_heads, gate, cfg.top_k, cfg.score_func,
                            expert_bias=self.selection_bias().view(Hl, cfg.num_experts),
                            route_norm=cfg.route_norm, norm_eps=cfg.norm_eps,
                            route_scale=cfg.route_scale, num_groups=cfg.num_groups,
                            topk_groups=cfg.topk_groups, backend=self.backend,
                            fused=self.fused_router, block_counts=block_counts)

    def route_layout(self, x_heads: torch.Tensor) -> RouteLayout:
        """The routes of this rank's heads grouped by expert, as `forward_heads` uses them:
        `route_heads`, then `sort_routes`. On the Triton path the route kernels count
        each expert's routes per block of tokens as they pick, and the layout takes
        those counts instead of running its own count step (the same layout)."""
        probs, indices, counts = self.route_heads(x_heads, block_counts=True)
        return sort_routes(probs, indices, self.config.num_experts, backend=self.backend,
                           block_counts=counts)

    def forward_heads(self, x_heads: torch.Tensor) -> torch.Tensor:
        """The layer on this rank's heads. x_heads: [S, local_heads, D] -> same."""
        layout = self.route_layout(x_heads)
        return expert_forward(x_heads, *layout, self.W_gate, self.W_up, self.W_down,
                              deterministic=self.deterministic, backend=self.backend)

    def forward(self, x: torch.Tensor, token_counts: list[int] | None = None) -> torch.Tensor:
        """x: [..., hidden] -> [..., hidden], same dtype.

        Head-parallel (`group` of more than one rank), input_mode "sequence":
        x holds this rank's tokens with all heads; `token_counts` lists every
        rank's token count (it is gathered with one collective if omitted). One
        all-to-all sends each rank its heads of all tokens, one brings them
        back. input_mode "replicated": every rank holds the same tokens and
        only its own heads, x: [..., local_heads * D]; no communication.
        """
        cfg = self.config
        p = self.partition
        if x.dim() == 0:
            raise ValueError("MultiHeadMoE: input must be [..., features], got a scalar")
        if not x.dtype.is_floating_point:
            raise ValueError(f"MultiHeadMoE: input must be floating point, got {x.dtype}")
        if p.world_size > 1 and self.group is None:
            raise ValueError(f"MultiHeadMoE: this module holds rank {p.rank} of {p.world_size} "
                             f"(built from a partition, without a process group) and cannot "
                             f"run forward; pass group=")
        lead = x.shape[:-1]
        if self.input_mode == "replicated":
            width = p.local_heads * cfg.head_dim
            if x.shape[-1] != width:
                raise ValueError(f"MultiHeadMoE: replicated input must be [..., local_heads * D "
                                 f"= {width}] on rank {p.rank}, got {tuple(x.shape)}")
            y = self.forward_heads(x.reshape(-1, p.local_heads, cfg.head_dim))
            return y.reshape(*lead, width)
        if x.shape[-1] != cfg.hidden_size:
            raise ValueError(f"MultiHeadMoE: input must be [..., {cfg.hidden_size}], got "
                             f"{tuple(x.shape)}")
        tokens = x.reshape(-1, cfg.hidden_size)
        S = tokens.shape[0]
        if token_counts is not None:
            token_counts = [int(c) for c in token_counts]
            if len(token_counts) != p.world_size or token_counts[p.rank] != S or \
                    min(token_counts) < 0:
                raise ValueError(f"MultiHeadMoE: token_counts must list the {p.world_size} "
                                 f"ranks' token counts, with {S} for rank {p.rank}; got "
                                 f"{token_counts}")
        if p.world_size == 1:
            y = self.forward_heads(tokens.view(S, cfg.num_heads, cfg.head_dim))
            return y.reshape(*lead, cfg.hidden_size)
        if token_counts is None:
            token_counts = gather_token_counts(S, x.device, self.group)
        # Every rank computes all its local heads, padding included (zero weights,
        # zero output, zero gradient), so all ranks take part in the backward
        # all-to-alls whatever requires grad.
        local = dispatch(tokens, p, token_counts, self.group)
        y_local = self.forward_heads(local)
        return undispatch(y_local, p, token_counts, self.group).reshape(*lead, cfg.hidden_size)

    def extra_repr(self) -> str:
        cfg = self.config
        p = self.partition
        return (f"hidden={cfg.hidden_size}, heads={cfg.num_heads} (local {p.local_heads} from "
                f"{p.start}), experts={cfg.num_experts}, top_k={cfg.top_k}, "
                f"intermediate={cfg.expert_intermediate_size}, dtype={cfg.params_dtype}")
