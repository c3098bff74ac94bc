"""CheckpointReader: resolving a path, row reads with zero fill, and that a rank's read
touches only its rows (docs/contract.md section 6)."""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import struct
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    CKPT_LAYER,
    ckpt_assert_names,
    ckpt_random_module,
    ckpt_random_state,
    ckpt_tiny_config,
)
from mhmoe import HeadPartition, MultiHeadMoEConfig
from mhmoe.checkpoint import (
    INDEX_FILE,
    MOE_PARAM_NAMES,
    SINGLE_FILE,
    CheckpointError,
    CheckpointReader,
    load_layer_state,
    moe_key,
    save_checkpoint,
)


def test_reader_rows_zero_fill_and_bytes_read(tmp_path, rng):
    cfg = ckpt_tiny_config()
    state = ckpt_random_state(cfg, rng)
    save_checkpoint(tmp_path, {CKPT_LAYER: state}, config=cfg)
    rows = cfg.num_flat_experts  # 16
    row_bytes = cfg.head_dim * cfg.expert_intermediate_size * 4
    with CheckpointReader(tmp_path / SINGLE_FILE) as reader:
        key, file, shape, dtype = reader.tensor_info(CKPT_LAYER, "W_up")
        assert (key, file, shape, dtype) == (moe_key(CKPT_LAYER, "W_up"), tmp_path / SINGLE_FILE,
                                             (rows, cfg.head_dim, cfg.expert_intermediate_size),
                                             torch.float32)
        middle = reader.read(CKPT_LAYER, "W_up", rows=(5, 9))
        assert torch.equal(middle, state["W_up"][5:9]) and reader.bytes_read == 4 * row_bytes
        # rows running past the end: the missing ones are zeros and are not counted
        tail = reader.read(CKPT_LAYER, "W_up", rows=(rows - 2, rows + 3))
        assert tail.shape == (5, cfg.head_dim, cfg.expert_intermediate_size)
        assert torch.equal(tail[:2], state["W_up"][-2:]) and not tail[2:].any()
        assert reader.bytes_read == 6 * row_bytes
        # entirely past the end: all zeros, nothing read
        assert not reader.read(CKPT_LAYER, "W_up", rows=(rows + 4, rows + 6)).any()
        # empty range
        assert reader.read(CKPT_LAYER, "W_up", rows=(3, 3)).shape[0] == 0
        assert reader.bytes_read == 6 * row_bytes
        with pytest.raises(ValueError, match="begin <= end"):
            reader.read(CKPT_LAYER, "W_up", rows=(4, 2))


def test_directory_with_both_layouts_is_ambiguous(tmp_path, rng):
    # what a crash between a layout switch's rename and its clean-up leaves behind
    cfg = ckpt_tiny_config()
    save_checkpoint(tmp_path / "a", {1: ckpt_random_module(cfg, rng)}, max_shard_bytes=4096)
    save_checkpoint(tmp_path / "b", {1: ckpt_random_module(cfg, rng)})
    (tmp_path / "b" / SINGLE_FILE).rename(tmp_path / "a" / SINGLE_FILE)
    with pytest.raises(CheckpointError, match="both") as error:
        load_layer_state(tmp_path / "a", 1)
    ckpt_assert_names(error, tmp_path / "a", None)
    # either one, named explicitly, loads
    load_layer_state(tmp_path / "a" / INDEX_FILE, 1)
    load_layer_state(tmp_path / "a" / SINGLE_FILE, 1)


# ----------------------------------------------------------------------------------------
# A rank's read touches only its rows: measured in the page cache
# ----------------------------------------------------------------------------------------


def _resident(path: Path) -> torch.Tensor:
    """Page-cache residency of every page of `path` (bool [pages]), by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    # ACCESS_COPY (a private mapping) because ctypes can only take the address of a
    # writable buffer; nothing is written, so every page still reflects the page cache.
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        anchor = ctypes.c_char.from_buffer(m)
        try:
            if libc.mincore(ctypes.addressof(anchor), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del anchor  # the mapping cannot close while ctypes holds it
    return torch.frombuffer(bytearray(vec), dtype=torch.uint8) & 1 == 1


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _readahead_bytes(path: Path) -> int | None:
    """The kernel's readahead window for the device backing `path`, if it says."""
    dev = path.stat().st_dev
    try:
        return 1024 * int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}"
                               "/read_ahead_kb").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.skipif(sys.platform != "linux", reason="mincore / posix_fadvise: Linux only")
def test_rank_reads_only_its_pages(tmp_path):
    page = mmap.PAGESIZE
    readahead = _readahead_bytes(tmp_path)
    # A fault or read pulls in up to a readahead window around it, whatever the reader
    # does; pages that close to the rank's rows prove nothing either way.
    margin = max(2 << 20, readahead or 0)
    if margin > 8 << 20:
        pytest.skip(f"readahead of {margin >> 20} MiB is too coarse for a 32 MiB tensor")
    # 64 flat experts of 64 x 2048 fp32: 512 KiB rows, 32 MiB per expert tensor. Rank 3 of
    # 8 owns rows 24..32, 4 MiB in the middle of each tensor, far from both ends.
    cfg = MultiHeadMoEConfig(hidden_size=512, num_heads=8, num_experts=8, top_k=2,
                             expert_intermediate_size=2048, params_dtype=torch.float32)
    rows, (begin, end) = cfg.num_flat_experts, HeadPartition(8, 8, 3).rows(8)
    shapes = {"gate": (rows, 64), "W_gate": (rows, 64, 2048), "W_up": (rows, 64, 2048),
              "W_down": (rows, 2048, 64), "router.expert_bias": (rows,),
              "router.expert_bias_ema": (rows,)}
    # Row r of parameter i holds 1000 i + r: cheap to make, and every row is checkable.
    state = {name: (torch.arange(rows, dtype=torch.float32) + 1000 * i)
             .view(-1, *[1] * (len(shape) - 1)).expand(shape).contiguous()
             for i, (name, shape) in enumerate(shapes.items())}
    save_checkpoint(tmp_path, {CKPT_LAYER: state}, config=cfg)
    file = tmp_path / SINGLE_FILE
    del state
    _evict(file)
    if _resident(file).sum() > 16:
        pytest.skip(f"posix_fadvise(DONTNEED) does not evict {file.parent}'s pages on this "
                    f"filesystem, so page-cache residency cannot be measured here")

    with CheckpointReader(tmp_path) as reader:
        got = load_layer_state(reader, CKPT_LAYER, partition=HeadPartition(8, 8, 3))
        assert reader.bytes_read == (end - begin) * sum(
            math.prod(shape[1:]) * 4 for shape in shapes.values())
    resident = _resident(file)

    # Which pages may be resident: the header's, and each tensor's owned rows +- margin.
    with open(file, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    pages = resident.numel()
    allowed = torch.zeros(pages, dtype=torch.bool)
    owned = torch.zeros(pages, dtype=torch.bool)

    def mark(mask, lo, hi):
        mask[max(0, lo) // page: min(pages, -(-hi // page))] = True

    mark(allowed, 0, data_start + margin)
    for name in MOE_PARAM_NAMES:
        lo, hi = header[moe_key(CKPT_LAYER, name)]["data_offsets"]
        row_bytes = (hi - lo) // rows
        lo, hi = data_start + lo + begin * row_bytes, data_start + lo + end * row_bytes
        mark(allowed, lo - margin, hi + margin)
        mark(owned, lo, hi)
        assert torch.equal(got[name].reshape(end - begin, -1)[:, 0],
                           torch.arange(begin, end, dtype=torch.float32)
                           + 1000 * MOE_PARAM_NAMES.index(name))
    assert (~allowed).sum() * page >= 16 << 20, "the test would check too little"
    stray = resident & ~allowed
    assert not stray.any(), (
        f"{int(stray.sum())} pages outside rank 3's rows (+- {margin >> 20} MiB) are in "
        f"the page cache, the first at byte {int(stray.nonzero()[0, 0]) * page}")
    # and the measurement does see reads: the owned rows are resident
    assert resident[owned].float().mean() > 0.9
