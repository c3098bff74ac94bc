"""Configuration of a multi-head MoE layer and the MAGI-2 Preview preset."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

SCORE_FUNCS = ("sigmoid", "softmax")
BIAS_SOURCES = ("ema", "main")

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class MultiHeadMoEConfig:
    """Shape and routing of one multi-head MoE layer (SPEC sections 1 and 2).

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
        for name in ("hidden_size", "num_heads", "num_experts", "top_k",
                     "expert_intermediate_size", "num_groups", "topk_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MultiHeadMoEConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"MultiHeadMoEConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MultiHeadMoEConfig.top_k ({self.top_k}) must not exceed num_experts "
                f"({self.num_experts})")
        dtype = self.params_dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"MultiHeadMoEConfig.params_dtype must be a floating torch.dtype, got "
                f"{self.params_dtype!r}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f"MultiHeadMoEConfig.score_func must be one of {SCORE_FUNCS}, got "
                f"{self.score_func!r}")
        if not isinstance(self.route_norm, bool):
            raise ValueError(
                f"MultiHeadMoEConfig.route_norm must be a bool, got {self.route_norm!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(
                f"MultiHeadMoEConfig.deterministic must be a bool, got {self.deterministic!r}")
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
        check_groups(self.num_experts, self.num_groups, self.topk_groups,
                     prefix="MultiHeadMoEConfig.")

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

    def expert_weight_bytes(self) -> int:
        """Bytes of W_gate, W_up and W_down of the whole layer."""
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
    carry selection score 0.0 and fill the remaining places (SPEC section 2).
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


# The published MAGI-2 Preview MoE layer (SPEC section 1). route_scale is 4.9:
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
