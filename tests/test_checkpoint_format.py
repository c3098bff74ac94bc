"""The checkpoint format: the MAGI-2 key map (docs/contract.md section 5)."""

from __future__ import annotations

import pytest

from mhmoe.checkpoint import MOE_PARAM_NAMES, PREFIXES, moe_key
from mhmoe.checkpoint.format import parse_moe_key


def test_moe_key():
    assert moe_key(5, "W_up") == "block.layers.5.mlp.moe_mlp.W_up"
    assert moe_key(37, "router.expert_bias_ema", "transformer.") == \
        "transformer.block.layers.37.mlp.moe_mlp.router.expert_bias_ema"
    with pytest.raises(ValueError, match="prefix"):
        moe_key(1, "gate", "model.")


@pytest.mark.parametrize("prefix", PREFIXES, ids=["bare", "transformer"])
def test_parse_moe_key_inverts_moe_key(prefix):
    for layer in (0, 5, 37):
        for name in MOE_PARAM_NAMES:
            assert parse_moe_key(moe_key(layer, name, prefix)) == (layer, name, prefix)
    # Not MoE parameters: another module of the block, another prefix, no layer number.
    for key in ("block.layers.5.attn.qkv.weight", "model.block.layers.5.mlp.moe_mlp.gate",
                "block.layers.x.mlp.moe_mlp.gate", "block.layers.5.mlp.moe_mlp."):
        assert parse_moe_key(key) is None, key

