"""Test set-up: Triton kernels run in the interpreter on machines without a GPU.

TRITON_INTERPRET must be set before any module defining a kernel is imported,
so it is set here, at collection time, unless a CUDA device is present.
"""

import os
import random
import zlib

# The interpreter's tl.dot is numpy's matmul, i.e. OpenBLAS's sgemm. Its FMA kernels
# (Haswell, SkylakeX, ...) sum an output's products in an order that depends on the
# matrix's width and on the CPU, so a kernel's logits would change bitwise with its
# tile of experts, which on the GPU (one MMA chain per output) they do not. The SSE
# kernel sums each output's products in order, one rounding each, whatever the shape.
# OpenBLAS reads this when numpy loads it, so it is set before anything imports numpy.
os.environ["OPENBLAS_CORETYPE"] = "Prescott"

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fast_interpreted_xor_sum() -> None:
    """Triton 3.6's interpreter reduces with a combine function it does not know (here
    tl.xor_sum, which tl.flip, tl.sort and tl.bitonic_merge use on integer keys) one
    element at a time in Python: the sorting networks of the router's shortlists took
    seconds a program, most of the CPU suite's routing time. xor is exact, associative
    and commutative, so numpy's reduction gives the same bits in any order."""
    import numpy as np
    from triton.language import standard
    from triton.runtime import interpreter

    slow = interpreter.ReduceOps.apply_impl

    def apply_impl(self, input):
        # Only along one axis counted from 0 (what flip, sort and the kernels ask for):
        # there the stock reduction and numpy's agree in shape too; it shapes a negative
        # axis, and axis=None with keep_dims, its own way.
        if (self.combine_fn == standard._xor_combine and len(input) == 1
                and self.axis is not None and self.axis >= 0):
            data = np.bitwise_xor.reduce(input[0].handle.data, axis=self.axis,
                                         keepdims=self.keep_dims)
            return self.to_tensor(data, input[0].dtype)
        return slow(self, input)

    interpreter.ReduceOps.apply_impl = apply_impl


def _patch_language_once_a_launch() -> None:
    """Triton 3.6's interpreter re-patches triton.language (inspect.getmembers over the
    module, its tensor class and tl.math) on every call of a @triton.jit helper inside a
    kernel (`InterpretedFunction.__call__`), though the launch already patched them and
    the helper's call changes nothing: about 0.4 ms a call, tens of thousands of calls a
    routing test. A helper call whose language modules are already patched (their
    `arange` no longer the builtin) skips it and runs the helper as the stock call does;
    launches (`GridExecutor`) patch and restore as before."""
    import triton.language as tl
    from triton.runtime import interpreter

    stock = interpreter.InterpretedFunction.__call__

    def call(self, *args, **kwargs):
        langs = [v for v in self.fn.__globals__.values() if v is tl or v is tl.core]
        if not langs or any(tl.core.is_builtin(lang.arange) for lang in langs):
            return stock(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.InterpretedFunction.__call__ = call


def _numpy_dtypes_built_once() -> None:
    """The interpreter's `_get_np_dtype` builds its 17-entry dtype table on every call (tens
    of thousands a kernel); the same table, built once, gives the same answers."""
    import triton.language as tl
    from triton.runtime import interpreter

    full = interpreter._get_np_dtype
    table = {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return full(tt_dtype)
        if tt_dtype not in table:
            table[tt_dtype] = full(tt_dtype)
        return table[tt_dtype]

    interpreter._get_np_dtype = get_np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _fast_interpreted_xor_sum()
    _patch_language_once_a_launch()
    _numpy_dtypes_built_once()

# The env overrides of the layer must not leak in from the caller's shell.
os.environ.pop("MAGI2_ROUTER_BIAS_SOURCE", None)
os.environ.pop("MAGI2_DETERMINISTIC", None)


# Fresh random data on every run; MHMOE_TEST_SEED=<n> replays a run (the seed is
# printed in pytest's header).
BASE_SEED = int(os.environ.get("MHMOE_TEST_SEED", random.randrange(2**31)))
os.environ["MHMOE_TEST_SEED"] = str(BASE_SEED)  # xdist workers inherit it


def pytest_report_header(config):
    return f"MHMOE_TEST_SEED={BASE_SEED}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # Also at the end (the header is hidden under -q): what replays a failure.
    terminalreporter.write_line(f"random data of this run: MHMOE_TEST_SEED={BASE_SEED}")


@pytest.fixture
def rng(request) -> torch.Generator:
    """A generator seeded from the run's seed and the test's id (one stream per case)."""
    seed = (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % (2**63)
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------
# Checkpoint builders shared by tests/test_checkpoint_*.py (`from conftest import ...`).
# Their names carry "ckpt" because this file is shared; mhmoe and safetensors are
# imported inside them, so that a broken package fails those tests, not collection.
# ----------------------------------------------------------------------------------------

from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from mhmoe import HeadPartition, MultiHeadMoE, MultiHeadMoEConfig

CKPT_LAYER = 3  # the layer the malformed-checkpoint cases load; +2 is a sound neighbour


def ckpt_tiny_config(dtype: torch.dtype = torch.float32) -> "MultiHeadMoEConfig":
    from mhmoe import MultiHeadMoEConfig

    return MultiHeadMoEConfig(hidden_size=32, num_heads=4, num_experts=4, top_k=2,
                              expert_intermediate_size=16, params_dtype=dtype)


def ckpt_twelve_head_config() -> "MultiHeadMoEConfig":
    from mhmoe import MultiHeadMoEConfig

    # MAGI-2's head count with tiny experts: D = 2, E = 3, I = 4 (none a power of two).
    return MultiHeadMoEConfig(hidden_size=24, num_heads=12, num_experts=3, top_k=1,
                              expert_intermediate_size=4, params_dtype=torch.float32)


def ckpt_random_state(cfg: "MultiHeadMoEConfig", rng: torch.Generator,
                      rows: int | None = None) -> dict[str, torch.Tensor]:
    """Every parameter random (the biases too, so their values are checked)."""
    rows = cfg.num_flat_experts if rows is None else rows
    D, I = cfg.head_dim, cfg.expert_intermediate_size
    shapes = {"gate": (rows, D), "W_gate": (rows, D, I), "W_up": (rows, D, I),
              "W_down": (rows, I, D), "router.expert_bias": (rows,),
              "router.expert_bias_ema": (rows,)}
    return {name: torch.randn(shape, generator=rng).to(
                cfg.params_dtype if name.startswith("W_") else torch.float32)
            for name, shape in shapes.items()}


def ckpt_random_module(cfg: "MultiHeadMoEConfig", rng: torch.Generator,
                       partition: "HeadPartition | None" = None) -> "MultiHeadMoE":
    from mhmoe import MultiHeadMoE

    module = MultiHeadMoE(cfg, partition=partition)
    module.reset_parameters(generator=rng)
    with torch.no_grad():
        # Non-zero biases: they change the routing, so a lost bias shows in the forward.
        for bias in module.router.parameters():
            bias.copy_(0.1 * torch.randn(bias.shape, generator=rng))
    return module


def ckpt_assert_names(error: pytest.ExceptionInfo, file: Path, keys: list[str] | None) -> None:
    """The message names the file and (one of) the keys."""
    message = str(error.value)
    assert str(file) in message, message
    if keys:
        assert any(repr(key) in message or key in message for key in keys), message


def ckpt_shard_of(directory: Path, key: str) -> Path:
    import json

    from mhmoe.checkpoint import INDEX_FILE

    index = json.loads((directory / INDEX_FILE).read_text())
    return directory / index["weight_map"][key]


def ckpt_save_pair(directory: Path, cfg, rng, mutate=None, **kwargs) -> Path:
    """CKPT_LAYER (optionally mutated) and a sound CKPT_LAYER + 2."""
    from mhmoe.checkpoint import save_checkpoint

    state = ckpt_random_state(cfg, rng)
    if mutate is not None:
        mutate(state)
    save_checkpoint(directory, {CKPT_LAYER: state, CKPT_LAYER + 2: ckpt_random_state(cfg, rng)},
                    config=kwargs.pop("config", cfg), **kwargs)
    return directory


def ckpt_save_both_prefixes(d: Path, cfg, rng) -> None:
    """CKPT_LAYER with its gate stored both with and without the 'transformer.' prefix
    (by the reference writer)."""
    import safetensors.torch

    from mhmoe.checkpoint import SINGLE_FILE, moe_key

    d.mkdir()
    tensors = {moe_key(CKPT_LAYER, n): t for n, t in ckpt_random_state(cfg, rng).items()}
    tensors[moe_key(CKPT_LAYER, "gate", "transformer.")] = \
        tensors[moe_key(CKPT_LAYER, "gate")].clone()
    safetensors.torch.save_file(tensors, d / SINGLE_FILE, metadata={"mhmoe.config":
                                                                    cfg.to_json()})


def ckpt_save_garbage_header(d: Path, cfg, rng) -> None:
    """A sound pair whose safetensors header is overwritten by text that is not JSON."""
    from mhmoe.checkpoint import SINGLE_FILE

    ckpt_save_pair(d, cfg, rng)
    with open(d / SINGLE_FILE, "r+b") as f:
        f.seek(8)
        f.write(b"#garbage, not json")
