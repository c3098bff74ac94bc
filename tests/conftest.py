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
