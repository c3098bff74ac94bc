"""Configuration of a multi-head MoE layer and the MAGI-2 Preview preset."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

SCORE_FUNCS = ("sigmoid", "softmax")
BIAS_SOURCES = ("ema", "main")

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,  # fp8 experts (mhmoe.fp8), inference only
}


@dataclass(frozen=True)
class MultiHeadMoEConfig:
    """Shape and routing of one multi-head MoE layer (docs/contract.md sections 1 and 2).

    `hidden_size` is split into `num_heads` heads of width `head_dim`; every
    head routes each token to `top_k` of its own `num_experts` experts, each a
    gated MLP `head_dim -> expert_intermediate_size -> head_dim`.
    """

    hidden_size: int
    num_heads: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    params_dtype: torch.dtype = torch.bfloat16
    score_func: str = "sigmoid"
    route_norm: bool = True
    route_scale: float = 1.0
    bias_source: str = "ema"
    num_groups: int = 1
    topk_groups: int = 1
    norm_eps: float = 1e-12
    deterministic: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_experts", "expert_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MultiHeadMoEConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"MultiHeadMoEConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})")
        dtype = self.params_dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"MultiHeadMoEConfig.params_dtype must be a floating torch.dtype, got "
                f"{self.params_dtype!r}")
        if dtype.itemsize == 1 and dtype != torch.float8_e4m3fn:
            raise ValueError(f"MultiHeadMoEConfig.params_dtype: the fp8 experts are "
                             f"torch.float8_e4m3fn (docs/fp8.md), got {dtype!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(
                f"MultiHeadMoEConfig.deterministic must be a bool, got {self.deterministic!r}")
        # A layer's scale and floor must also be positive and finite (route() alone
        # takes any number as its scale).
        for name in ("route_scale", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or value == float("inf"):
                raise ValueError(f"MultiHeadMoEConfig.{name} must be a positive finite number, "
                                 f"got {value!r}")
        if self.bias_source not in BIAS_SOURCES:
            raise ValueError(
                f"MultiHeadMoEConfig.bias_source must be one of {BIAS_SOURCES}, got "
                f"{self.bias_source!r}")
        # The routing fields: RouterOptions' own checks, in one place.
        self.router_options.check(self.num_experts, op="MultiHeadMoEConfig")

    @functools.cached_property
    def router_options(self) -> RouterOptions:
        """The routing fields as the one `RouterOptions` the routing functions take."""
        return RouterOptions(self.top_k, self.score_func, self.route_norm, self.norm_eps,
                             self.route_scale, self.num_groups, self.topk_groups)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_flat_experts(self) -> int:
        return self.num_heads * self.num_experts

    def expert_flops(self, tokens: int) -> int:
        """FLOPs of the expert part for `tokens` tokens: 6 * S * H * K * D * I."""
        return 6 * tokens * self.num_heads * self.top_k * self.head_dim * \
            self.expert_intermediate_size

    @property
    def is_fp8(self) -> bool:
        """Whether the experts are fp8 (e4m3 weights with fp32 scales, mhmoe.fp8)."""
        return self.params_dtype == torch.float8_e4m3fn

    def expert_weight_bytes(self) -> int:
        """Bytes of W_gate, W_up and W_down of the whole layer (fp8: without the scales)."""
        itemsize = torch.empty((), dtype=self.params_dtype).element_size()
        return 3 * self.num_flat_experts * self.head_dim * self.expert_intermediate_size * itemsize

    def replace(self, **changes) -> MultiHeadMoEConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["params_dtype"] = str(self.params_dtype).removeprefix("torch.")
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MultiHeadMoEConfig:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError(f"a MultiHeadMoEConfig JSON must be an object, got {text!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown MultiHeadMoEConfig fields {unknown}")
        dtype = fields.get("params_dtype", "bfloat16")
        if dtype not in _DTYPES:
            raise ValueError(
                f"MultiHeadMoEConfig.params_dtype {dtype!r} is not one of {list(_DTYPES)}")
        fields["params_dtype"] = _DTYPES[dtype]
        return cls(**fields)

    @classmethod
    def from_name(cls, name: str) -> MultiHeadMoEConfig:
        key = name.lower().replace("-", "_")
        if key not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[key]


def check_groups(num_experts: int, num_groups: int, topk_groups: int, prefix: str = "") -> None:
    """Raise ValueError unless `num_groups` / `topk_groups` describe a valid grouping.

    Fewer kept experts than top_k is allowed: experts outside the kept groups
    carry selection score 0.0 and fill the remaining places (docs/contract.md section 2).
    """
    if num_groups < 1 or topk_groups < 1:
        raise ValueError(f"{prefix}num_groups and {prefix}topk_groups must be >= 1, got "
                         f"{num_groups} and {topk_groups}")
    if num_experts % num_groups:
        raise ValueError(f"{prefix}num_groups ({num_groups}) must divide num_experts "
                         f"({num_experts})")
    if topk_groups > num_groups:
        raise ValueError(f"{prefix}topk_groups ({topk_groups}) must not exceed num_groups "
                         f"({num_groups})")


@dataclass(frozen=True)
class RouterOptions:
    """How the router picks and weighs experts (docs/contract.md section 2), as one value.

    top_k:        experts picked per (head, token); at most E (`check`).
    score_func:   "sigmoid", or "softmax" over a head's E logits.
    route_norm:   divide the picked probabilities by their sum (at least norm_eps).
    norm_eps:     the floor of that sum, > 0.
    route_scale:  the factor every probability is multiplied by last.
    num_groups, topk_groups: group-limited routing: a head's E experts form num_groups
                  equal groups, of which the best topk_groups are kept (1, 1: off).

    Checked once, when built; `check(num_experts)` adds the rules that need E
    (top_k <= E, groups dividing E). The torch.library ops of `mhmoe.routing` take
    the fields as flat scalars: `op_args()` and `from_op_args()` are the one place
    that turns the object into those scalars and back.
    """

    top_k: int
    score_func: str = "sigmoid"
    route_norm: bool = True
    norm_eps: float = 1e-12
    route_scale: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("top_k", "num_groups", "topk_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RouterOptions.{name} must be a positive int, got {value!r}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"RouterOptions.score_func must be one of {SCORE_FUNCS}, got "
                             f"{self.score_func!r}")
        if not isinstance(self.route_norm, bool):
            raise ValueError(f"RouterOptions.route_norm must be a bool, got {self.route_norm!r}")
        for name in ("norm_eps", "route_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"RouterOptions.{name} must be a number, got {value!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"RouterOptions.norm_eps must be > 0, got {self.norm_eps!r}")
        if self.topk_groups > self.num_groups:
            raise ValueError(f"RouterOptions.topk_groups ({self.topk_groups}) must not exceed "
                             f"num_groups ({self.num_groups})")

    def check(self, num_experts: int, op: str = "RouterOptions") -> None:
        """Raise ValueError (naming `op`) unless these options fit heads of `num_experts`
        experts: top_k <= E, and num_groups dividing E."""
        if self.top_k > num_experts:
            raise ValueError(f"{op}: top_k must be an int in [1, E={num_experts}], got "
                             f"{self.top_k}")
        check_groups(num_experts, self.num_groups, self.topk_groups, prefix=f"{op}: ")

    def op_args(self) -> tuple[int, str, bool, float, float, int, int]:
        """The fields as the routing ops' schemas take them, in field order:
        (top_k, score_func, route_norm, norm_eps, route_scale, num_groups, topk_groups),
        the two scales as Python floats. `RouterOptions(*options.op_args())` equals
        `options` (the ops' bodies rebuild it so)."""
        return (self.top_k, self.score_func, self.route_norm, float(self.norm_eps),
                float(self.route_scale), self.num_groups, self.topk_groups)

    @classmethod
    def from_op_args(cls, args: Mapping[str, object]) -> RouterOptions:
        """The options back from a routing op's inputs by argument name (the fields under
        their own names, as `op_args` lists them; the op's other inputs are ignored)."""
        return cls(**{f.name: args[f.name] for f in dataclasses.fields(cls)})


# The published MAGI-2 Preview MoE layer (docs/contract.md section 1). route_scale is 4.9:
# a plain dataclass default of 1.0 silently changes every output by 4.9x.
MAGI2_PREVIEW = MultiHeadMoEConfig(
    hidden_size=3072,
    num_heads=12,
    num_experts=256,
    top_k=6,
    expert_intermediate_size=1280,
    params_dtype=torch.bfloat16,
    score_func="sigmoid",
    route_norm=True,
    route_scale=4.9,
    bias_source="ema",
)

# The MoE layers of MAGI-2 Preview's 40 transformer layers.
MAGI2_MOE_LAYERS = tuple(range(2, 38))

PRESETS = {"magi2_preview": MAGI2_PREVIEW}
