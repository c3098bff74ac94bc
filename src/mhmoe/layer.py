"""`MultiHeadMoE`: the layer as an nn.Module, with the MAGI-2 parameter names."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from .backends import BACKENDS
from .config import BIAS_SOURCES, MultiHeadMoEConfig
from .experts import expert_forward, expert_forward_fp8
from .fp8 import (
    INFERENCE_ONLY,
    SCALE_NAMES,
    empty_k_major,
    is_k_major,
    k_major,
    quantize_into,
    row_chunks,
)
from .parallel import HeadPartition, dispatch, gather_token_counts, undispatch
from .routing import RouteLayout, Routes, TokenRoutes, route_tokens, sort_routes

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


# reset_parameters draws a weight in chunks of whole experts of at most this many
# elements: a MAGI-2 weight (1e9 values) is never held whole in fp32.
INIT_CHUNK_ELEMENTS = 1 << 26


def gaussian_rows(shape: torch.Size, generator: torch.Generator | None,
                  device: torch.device) -> Iterator[tuple[int, int, torch.Tensor]]:
    """fp32 N(0, 1) values of a tensor of `shape`, drawn in order as (begin, end, rows
    [begin, end)) chunks of at most INIT_CHUNK_ELEMENTS elements (a generator, lazily).

    Every chunk but the last holds a multiple of 16 values: the CPU generator, which
    consumes its stream 16 values at a time, then draws the same values as one
    `torch.randn(shape)`. A CUDA generator draws other values than one call would for
    a tensor of more than one chunk (only MAGI-2-sized weights are).
    """
    rows, row = shape[0], math.prod(shape[1:])
    if rows * row <= INIT_CHUNK_ELEMENTS:
        bounds = [(0, rows)]
    else:
        multiple = 16 // math.gcd(row, 16)
        step = max(multiple, INIT_CHUNK_ELEMENTS // row // multiple * multiple)
        bounds = row_chunks(rows, row, step * row)
        if len(bounds) > 1 and (bounds[-1][1] - bounds[-1][0]) * row < 16:
            bounds[-2:] = [(bounds[-2][0], rows)]
    device = generator.device if generator is not None else device
    return ((begin, end, torch.randn((end - begin, *shape[1:]), generator=generator,
                                     dtype=torch.float32, device=device))
            for begin, end in bounds)


def _router_dtype(params_dtype: torch.dtype) -> torch.dtype:
    """The router's dtype for experts of `params_dtype`: float32 (docs/contract.md
    section 2), or float64 for a float64 layer (gradient checks)."""
    return torch.float64 if params_dtype == torch.float64 else torch.float32


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
    """A multi-head mixture-of-experts layer (docs/contract.md section 5).

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

    dtype: the expert weights' dtype (W_gate, W_up, W_down). None takes
    `config.params_dtype`; another dtype overrides it, and `self.config` is then the
    config with that `params_dtype`, so the config always says what the weights are.
    The router (gate and both biases) stays float32 whatever the experts are, as in
    the published module (float64 for a float64 layer, for gradient checks). Casts
    (`.half()`, `.to(torch.float16)`, `.double()`, ...) follow the same rule: they
    change the expert weights and `config.params_dtype`, and leave the router in
    float32. A cast to a one-byte (fp8) dtype, or to one the config refuses, raises
    before anything changes: fp8 weights need scales, which `mhmoe.quantize(layer,
    "fp8")` makes.

    fp8 experts (params_dtype `torch.float8_e4m3fn`, mhmoe.fp8; inference only):
    W_gate, W_up, W_down are e4m3 (stored K-major, as the fp8 kernel reads them),
    with fp32 scales beside them, `W = W_fp8 * scale`:
      W_gate_scale, W_up_scale [local_flat, I], W_down_scale [local_flat, D] float32
    No parameter is trainable, forward refuses to record a graph (an input that
    requires grad under grad mode), and casts leave every dtype as it is (they move
    the layer only). `load_state_dict(..., assign=True)` lays weights of other strides
    out K-major once. `mhmoe.quantize(layer, "fp8")` makes one from a bf16 layer.

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
        dtype: torch.dtype | None = None,
        backend: str = "auto",
        partition: HeadPartition | None = None,
        input_mode: str = "sequence",
        fused_router: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MultiHeadMoEConfig):
            raise TypeError(f"MultiHeadMoE: config must be a MultiHeadMoEConfig, got "
                            f"{type(config).__name__}")
        if dtype is not None:
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise TypeError(f"MultiHeadMoE: dtype must be a floating torch.dtype, got "
                                f"{dtype!r}")
            if dtype != config.params_dtype:
                config = config.replace(params_dtype=dtype)
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
        router_dtype = _router_dtype(dtype)
        self.gate = nn.Parameter(torch.empty(rows, D, dtype=router_dtype, device=device))
        if config.is_fp8:
            self._fp8_experts(rows, D, I, device)
        else:
            self.W_gate = nn.Parameter(torch.empty(rows, D, I, dtype=dtype, device=device))
            self.W_up = nn.Parameter(torch.empty(rows, D, I, dtype=dtype, device=device))
            self.W_down = nn.Parameter(torch.empty(rows, I, D, dtype=dtype, device=device))
        self.router = RouterBiases(rows, device=device, dtype=router_dtype)
        if self.gate.device.type != "meta":
            self.reset_parameters()

    @property
    def local_heads(self) -> int:
        return self.partition.local_heads

    def _fp8_experts(self, rows: int, D: int, I: int, device) -> None:
        """The fp8 expert parameters (docs/fp8.md), none trainable: e4m3 weights stored
        K-major (W_gate and W_up as [rows, I, D] in memory, W_down as [rows, D, I]; the
        parameters are transposed views, as `fp8.quantize_weights` lays them out) and
        their fp32 per-output-channel scales."""
        for name, (k, n) in (("W_gate", (D, I)), ("W_up", (D, I)), ("W_down", (I, D))):
            weight = empty_k_major((rows, k, n), device)
            setattr(self, name, nn.Parameter(weight, requires_grad=False))
            scale = torch.empty(rows, n, dtype=torch.float32, device=device)
            setattr(self, SCALE_NAMES[name], nn.Parameter(scale, requires_grad=False))
        self.gate.requires_grad_(False)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal weights scaled by 1/sqrt(fan_in); padding heads stay zero.

        Drawn a chunk of experts at a time (`gaussian_rows`). fp8 experts draw the same
        values, round them to bf16 and quantize them chunk by chunk on the layer's
        device: an fp8 layer of a seed holds `mhmoe.quantize` of the bf16 layer of that
        seed, and never more than a chunk of it in a wider dtype.
        """
        cfg = self.config
        D, I = cfg.head_dim, cfg.expert_intermediate_size
        real_rows = self.partition.real_heads * cfg.num_experts
        with torch.no_grad():
            for name, fan_in in (("gate", D), ("W_gate", D), ("W_up", D), ("W_down", I)):
                param = getattr(self, name)
                for begin, end, values in gaussian_rows(param.shape, generator, param.device):
                    values[max(0, real_rows - begin):] = 0
                    values.mul_(fan_in ** -0.5)
                    if cfg.is_fp8 and name in SCALE_NAMES:
                        scale = getattr(self, SCALE_NAMES[name])
                        quantize_into(values.to(torch.bfloat16), param[begin:end],
                                      scale[begin:end])
                    else:
                        param[begin:end].copy_(values)
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

    def route_heads(self, x_heads: torch.Tensor) -> Routes:
        """Routing of local heads. x_heads: [S, local_heads, D] -> Routes(probs, indices),
        each [Hl, S, K].

        Logits come from the Triton logits kernel (then routed by the route kernel,
        or in the same kernel, as its config says) where `routing.route_tokens`
        allows it (the triton path with bf16 x; see `fused_router`), else from an
        fp32 GEMM followed by `route`.
        """
        probs, indices, _ = self._route_tokens(x_heads, block_counts=False)
        return Routes(probs, indices)

    def _route_tokens(self, x_heads: torch.Tensor, block_counts: bool) -> TokenRoutes:
        """`routing.route_tokens` on this rank's heads with the layer's router."""
        cfg = self.config
        Hl = self.partition.local_heads
        gate = self.gate.view(Hl, cfg.num_experts, cfg.head_dim)
        return route_tokens(x_heads, gate, cfg.router_options,
                            self.selection_bias().view(Hl, cfg.num_experts),
                            backend=self.backend, fused=self.fused_router,
                            block_counts=block_counts, deterministic=self.deterministic)

    def route_layout(self, x_heads: torch.Tensor) -> RouteLayout:
        """The routes of this rank's heads grouped by expert, as `forward_heads` uses them:
        `route_heads`, then `sort_routes`. On the Triton path the route kernels count
        each expert's routes per block of tokens as they pick, and the layout takes
        those counts instead of running its own count step (the same layout)."""
        routes = self._route_tokens(x_heads, block_counts=True)
        return sort_routes(routes.probs, routes.indices, self.config.num_experts,
                           backend=self.backend, block_counts=routes.block_counts)

    def _check_inference(self, x: torch.Tensor) -> None:
        """fp8 experts have no backward: refuse to record a graph through them."""
        if self.config.is_fp8 and torch.is_grad_enabled() and (
                x.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise RuntimeError(f"MultiHeadMoE: {INFERENCE_ONLY}")

    def forward_heads(self, x_heads: torch.Tensor) -> torch.Tensor:
        """The layer on this rank's heads. x_heads: [S, local_heads, D] -> same."""
        self._check_inference(x_heads)
        layout = self.route_layout(x_heads)
        if self.config.is_fp8:  # the router saw the unquantized x
            return expert_forward_fp8(x_heads, *layout, self.W_gate, self.W_up, self.W_down,
                                      self.W_gate_scale, self.W_up_scale, self.W_down_scale,
                                      deterministic=self.deterministic, backend=self.backend)
        return expert_forward(x_heads, *layout, self.W_gate, self.W_up, self.W_down,
                              deterministic=self.deterministic, backend=self.backend)

    def forward(self, x: torch.Tensor, token_counts: list[int] | None = None) -> torch.Tensor:
        """x: [..., hidden] -> [..., hidden], same dtype.

        Head-parallel (`group` of more than one rank), input_mode "sequence":
        x holds this rank's tokens with all heads; `token_counts` lists every
        rank's token count (it is gathered with one collective if omitted). One
        all-to-all sends each rank its heads of all tokens, one brings them
        back; a module of more than one rank built without a group cannot.
        input_mode "replicated": every rank holds the same tokens and only its
        own heads, x: [..., local_heads * D]; no communication, so no group
        needed, and `token_counts` is refused.
        """
        cfg = self.config
        p = self.partition
        if x.dim() == 0:
            raise ValueError("MultiHeadMoE: input must be [..., features], got a scalar")
        if not x.dtype.is_floating_point:
            raise ValueError(f"MultiHeadMoE: input must be floating point, got {x.dtype}")
        self._check_inference(x)
        lead = x.shape[:-1]
        if self.input_mode == "replicated":
            if token_counts is not None:
                raise ValueError("MultiHeadMoE: token_counts is for input_mode 'sequence' (the "
                                 "ranks' token counts for the all-to-all); replicated input "
                                 "needs none")
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
        if self.group is None:
            raise ValueError(f"MultiHeadMoE: this module holds rank {p.rank} of {p.world_size} "
                             f"(built from a partition, without a process group) and cannot "
                             f"run a sequence-parallel forward; pass group= (or use "
                             f"input_mode='replicated', which needs no communication)")
        if token_counts is None:
            token_counts = gather_token_counts(S, x.device, self.group)
        # Every rank computes all its local heads, padding included (zero weights,
        # zero output, zero gradient), so all ranks take part in the backward
        # all-to-alls whatever requires grad.
        local = dispatch(tokens, p, token_counts, self.group)
        y_local = self.forward_heads(local)
        return undispatch(y_local, p, token_counts, self.group).reshape(*lead, cfg.hidden_size)

    def _apply(self, fn, recurse=True):
        # Every nn.Module cast (.half(), .to(dtype), .double(), .cuda(), ...) reaches the
        # parameters through here. The router keeps `_router_dtype` of what the experts
        # become (what fn makes of an empty tensor like W_gate tells), and the config
        # follows the experts, so that the repr, saved checkpoints and loads stay true.
        if self.config.is_fp8:
            # fp8 experts keep every dtype (e4m3 weights, fp32 scales and router): a cast
            # would no longer be a quantized layer. It moves the layer only; the weights
            # keep their K-major strides (`.to` preserves them).
            def keep_dtype(t):
                moved = fn(torch.empty(0, dtype=t.dtype, device=t.device))
                return t.to(device=moved.device) if moved.dtype != t.dtype else fn(t)

            return super()._apply(keep_dtype, recurse)
        expert = self.W_gate
        after = fn(torch.empty(0, dtype=expert.dtype, device=expert.device))
        if after.dtype != expert.dtype:
            # Refused before anything is cast, so that a refusal leaves the layer whole.
            self._check_cast(after.dtype)
        keep = _router_dtype(after.dtype) if after.is_floating_point() else None
        router = (self.gate, self.router.expert_bias, self.router.expert_bias_ema)
        guarded = {id(t) for param in router for t in (param, param.grad) if t is not None}

        def apply(t):
            if id(t) in guarded and keep is not None:
                moved = fn(torch.empty(0, dtype=t.dtype, device=t.device))
                if moved.dtype != t.dtype:
                    # A cast: the router goes where fn sends it, in its own dtype, and in
                    # one step (through fn it would be rounded to the experts' dtype first).
                    return t.to(device=moved.device, dtype=keep)
            return fn(t)

        super()._apply(apply, recurse)
        if self.W_gate.dtype != self.config.params_dtype:
            self.config = self.config.replace(params_dtype=self.W_gate.dtype)
        return self

    def _check_cast(self, dtype: torch.dtype) -> None:
        """Raise unless the experts can be cast to `dtype`: not a one-byte dtype (fp8
        weights need their scales, which a cast cannot make), and one the config takes."""
        if dtype.itemsize == 1:
            raise ValueError(f"MultiHeadMoE: cannot cast the experts to {dtype}: fp8 weights "
                             f"need per-channel scales; use mhmoe.quantize(layer, 'fp8'), which "
                             f"returns a new fp8 layer (the layer is unchanged)")
        try:
            self.config.replace(params_dtype=dtype)
        except (TypeError, ValueError) as e:
            raise ValueError(f"MultiHeadMoE: cannot cast the experts to {dtype} (the layer is "
                             f"unchanged): {e}") from None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if not self.config.is_fp8:
            return
        # load_state_dict(assign=True) takes the given tensors with their strides; the fp8
        # kernel reads the weights K-major and would copy others on every forward (3 GB a
        # MAGI-2 layer), so they are laid out once here. (Without assign, copy_ keeps the
        # parameters' own K-major strides.)
        for name in SCALE_NAMES:
            param = getattr(self, name)
            if not is_k_major(param):
                setattr(self, name, nn.Parameter(k_major(param.detach()),
                                                 requires_grad=param.requires_grad))

    def extra_repr(self) -> str:
        cfg = self.config
        p = self.partition
        # The dtypes of the parameters themselves, not of the config.
        return (f"hidden={cfg.hidden_size}, heads={cfg.num_heads} (local {p.local_heads} from "
                f"{p.start}), experts={cfg.num_experts}, top_k={cfg.top_k}, "
                f"intermediate={cfg.expert_intermediate_size}, dtype={self.W_gate.dtype}, "
                f"router_dtype={self.gate.dtype}")
