"""inspect_checkpoint: the report of a sound checkpoint, and problems listed without
raising (docs/contract.md section 5)."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import (
    CKPT_LAYER,
    ckpt_random_module,
    ckpt_save_both_prefixes,
    ckpt_save_garbage_header,
    ckpt_save_pair,
    ckpt_shard_of,
    ckpt_tiny_config,
)
from mhmoe.checkpoint import (
    INDEX_FILE,
    MOE_PARAM_NAMES,
    SINGLE_FILE,
    inspect_checkpoint,
    moe_key,
    save_checkpoint,
)


def test_inspect_sound_checkpoint(tmp_path, rng):
    cfg = ckpt_tiny_config(torch.bfloat16)
    modules = {2: ckpt_random_module(cfg, rng), 3: ckpt_random_module(cfg, rng)}
    save_checkpoint(tmp_path, modules, max_shard_bytes=8192, prefix="transformer.")
    report = inspect_checkpoint(tmp_path, check_finite=True)
    assert report.problems == [] and report.ok
    assert report.config == cfg
    assert report.path == tmp_path / INDEX_FILE and len(report.files) >= 2
    assert report.layer_indices == [2, 3]
    assert [(r.layer, r.name) for r in report.layers] == \
        [(layer, name) for layer in (2, 3) for name in MOE_PARAM_NAMES]
    for row in report.layers:
        tensor = modules[row.layer].state_dict()[row.name]
        assert row.key == moe_key(row.layer, row.name, "transformer.")
        assert (row.shape, row.dtype) == (tuple(tensor.shape), tensor.dtype)
        assert row.bytes == tensor.numel() * tensor.element_size()
        assert row.file == ckpt_shard_of(tmp_path, row.key)
    assert report.total_bytes == sum(r.bytes for r in report.layers)
    assert "no problems" in report.format()


def _broken_truncated(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng)
    os.truncate(d / SINGLE_FILE, (d / SINGLE_FILE).stat().st_size - 8)
    return [SINGLE_FILE]


def _broken_missing_key(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, lambda s: s.pop("gate"))
    return [f"layer {CKPT_LAYER}", "missing", "gate"]


def _broken_layer_shapes(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, lambda s: s.update(gate=torch.zeros(16, 3)), config=None)
    return ["gate differs between layers", f"in layers [{CKPT_LAYER}]",
            f"in layers [{CKPT_LAYER + 2}]"]


def _broken_config_shapes(d, cfg, rng):
    other = cfg.replace(expert_intermediate_size=8)
    ckpt_save_pair(d, cfg, rng, config=other)
    return ["does not match the config", "W_up"]


def _broken_nan(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, lambda s: s["W_gate"].view(-1)[7].fill_(float("nan")))
    return ["non-finite", moe_key(CKPT_LAYER, "W_gate")]


def _broken_missing_shard(d, cfg, rng):
    ckpt_save_pair(d, cfg, rng, max_shard_bytes=4096)
    shard = ckpt_shard_of(d, moe_key(CKPT_LAYER, "gate"))
    shard.unlink()
    return ["missing", shard.name]


def _broken_both_prefixes(d, cfg, rng):
    ckpt_save_both_prefixes(d, cfg, rng)
    return ["with and without", "gate"]


def _broken_corrupt_header(d, cfg, rng):
    ckpt_save_garbage_header(d, cfg, rng)
    return ["corrupt", SINGLE_FILE]


def _broken_nowhere(d, cfg, rng):
    return ["no such file"]


BROKEN = {
    "truncated file": _broken_truncated,
    "missing key": _broken_missing_key,
    "shapes differ between layers": _broken_layer_shapes,
    "shapes differ from the config": _broken_config_shapes,
    "NaN": _broken_nan,
    "missing shard": _broken_missing_shard,
    "key with and without prefix": _broken_both_prefixes,
    "corrupt header": _broken_corrupt_header,
    "no such path": _broken_nowhere,
}


@pytest.mark.parametrize("case", list(BROKEN), ids=list(BROKEN))
def test_inspect_reports_problems_without_raising(tmp_path, rng, case):
    cfg = ckpt_tiny_config()
    d = tmp_path / "ckpt"
    words = BROKEN[case](d, cfg, rng)
    report = inspect_checkpoint(d, check_finite=True)
    assert report.problems, report.format()
    text = "\n".join(report.problems)
    for word in words:
        assert word in text, text
    assert not report.ok and "problem:" in report.format()
    if case == "NaN":  # the only check that reads the values can be skipped
        skipped = inspect_checkpoint(d, check_finite=False)
        assert skipped.problems == [] and not skipped.checked_finite
        assert "not checked for NaN" in skipped.format()


def test_inspect_checks_finiteness_by_default(tmp_path, rng):
    # A checkpoint holding NaN (or inf), which loading refuses, is not reported sound.
    cfg = ckpt_tiny_config(torch.bfloat16)
    for value in (float("nan"), float("inf")):
        d = tmp_path / str(value)
        ckpt_save_pair(d, cfg, rng, lambda s, v=value: s["W_down"].view(-1)[-1].fill_(v))
        report = inspect_checkpoint(d)
        assert not report.ok, report.format()
        assert "non-finite" in "\n".join(report.problems)
        assert moe_key(CKPT_LAYER, "W_down") in "\n".join(report.problems)
        assert report.checked_finite



# ---------------------------------------------------------------------------------------
# fp8 checkpoints: dtype and scheme shown, the scales checked
# ---------------------------------------------------------------------------------------


def _fp8_states(rng, cfg):
    return {layer: {n: t.contiguous() for n, t in ckpt_random_module(cfg, rng)
                    .state_dict().items()} for layer in (CKPT_LAYER, CKPT_LAYER + 2)}


def test_inspect_sound_fp8_checkpoint(tmp_path, rng):
    from mhmoe.fp8 import FP8, SCHEME

    cfg = ckpt_tiny_config().replace(params_dtype=FP8)
    save_checkpoint(tmp_path, _fp8_states(rng, cfg), config=cfg, max_shard_bytes=4096)
    report = inspect_checkpoint(tmp_path)
    assert report.ok, report.format()
    assert report.scheme == SCHEME and f"quantization: {SCHEME}" in report.format()
    dtypes = {row.name: row.dtype for row in report.layers}
    assert dtypes["W_gate"] == FP8 and dtypes["W_down_scale"] == torch.float32
    assert len(report.layers) == 2 * 9


@pytest.mark.parametrize("case", ["zero scale", "NaN scale", "missing scale",
                                  "mis-shaped scale, no config", "no scheme"])
def test_inspect_reports_fp8_scale_problems(tmp_path, rng, case):
    import safetensors.torch

    from mhmoe.checkpoint import CONFIG_METADATA_KEY, QUANT_METADATA_KEY
    from mhmoe.fp8 import FP8

    cfg = ckpt_tiny_config().replace(params_dtype=FP8)
    states = _fp8_states(rng, cfg)
    bad = states[CKPT_LAYER]
    if case == "zero scale":
        bad["W_gate_scale"][0, 3] = 0
        words = ["W_gate_scale", "not > 0"]
    elif case == "NaN scale":
        bad["W_gate_scale"][0, 3] = float("nan")
        words = ["W_gate_scale", "non-finite"]
    elif case == "missing scale":
        del bad["W_down_scale"]
        words = [f"layer {CKPT_LAYER}: missing ['W_down_scale']"]
    elif case == "mis-shaped scale, no config":
        bad["W_down_scale"] = bad["W_down_scale"][:, :3].contiguous()
        words = ["W_down_scale", "one scale per output channel of W_down"]
    else:
        words = [QUANT_METADATA_KEY, "none"]
    save_checkpoint(tmp_path, states, config=cfg)
    if case in ("mis-shaped scale, no config", "no scheme"):
        file = tmp_path / SINGLE_FILE
        tensors = safetensors.torch.load_file(file)
        dropped = CONFIG_METADATA_KEY if case.endswith("no config") else QUANT_METADATA_KEY
        from safetensors import safe_open

        with safe_open(str(file), "pt") as f:
            metadata = {k: v for k, v in (f.metadata() or {}).items() if k != dropped}
        safetensors.torch.save_file(tensors, file, metadata=metadata)
    report = inspect_checkpoint(tmp_path)
    text = "\n".join(report.problems)
    assert not report.ok
    for word in words:
        assert word in text, text
