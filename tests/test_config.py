"""MultiHeadMoEConfig: validation, the MAGI-2 preset, JSON round trip."""

import dataclasses

import pytest
import torch

import mhmoe
from mhmoe import MAGI2_PREVIEW, MultiHeadMoEConfig


def test_magi2_preset_matches_spec():
    c = MAGI2_PREVIEW
    assert (c.hidden_size, c.num_heads, c.num_experts, c.top_k, c.expert_intermediate_size) == \
        (3072, 12, 256, 6, 1280)
    assert c.head_dim == 256 and c.num_flat_experts == 3072
    assert c.params_dtype == torch.bfloat16 and c.score_func == "sigmoid" and c.route_norm
    assert c.route_scale == 4.9 and c.bias_source == "ema"
    assert c.num_groups == 1 and c.topk_groups == 1 and c.norm_eps == 1e-12
    assert c.expert_flops(1) == 141_557_760  # 141.6 MFLOP per token
    assert c.expert_weight_bytes() == 6_039_797_760  # about 6.04 GB
    assert mhmoe.MAGI2_MOE_LAYERS == tuple(range(2, 38))
    assert MultiHeadMoEConfig.from_name("magi2-preview") is MAGI2_PREVIEW


def test_positional_signature_and_defaults():
    c = MultiHeadMoEConfig(64, 4, 8, 2, 32)
    assert c.params_dtype == torch.bfloat16 and c.route_scale == 1.0 and c.bias_source == "ema"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 3


@pytest.mark.parametrize("field,value", [
    ("hidden_size", 0), ("hidden_size", 65), ("num_heads", -1), ("num_experts", 0),
    ("top_k", 9), ("top_k", 1.5), ("expert_intermediate_size", 0),
    ("params_dtype", torch.int8), ("params_dtype", "bf16"), ("score_func", "relu"),
    ("route_norm", 1), ("route_scale", 0.0), ("route_scale", float("nan")),
    ("bias_source", "mean"), ("num_groups", 3), ("topk_groups", 5), ("norm_eps", -1.0),
    ("deterministic", "yes"),
])
def test_bad_field_is_a_value_error_naming_it(field, value):
    kwargs = dict(hidden_size=64, num_heads=4, num_experts=8, top_k=2, expert_intermediate_size=32,
                  num_groups=4, topk_groups=2)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field if field != "topk_groups" else "topk_groups"):
        MultiHeadMoEConfig(**kwargs)


def test_json_round_trip():
    c = MAGI2_PREVIEW.replace(num_experts=16, params_dtype=torch.float32, num_groups=4,
                              topk_groups=2)
    assert MultiHeadMoEConfig.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="unknown"):
        MultiHeadMoEConfig.from_json('{"hidden_size": 8, "bogus": 1}')


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        MultiHeadMoEConfig.from_name("magi3")
