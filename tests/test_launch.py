"""Helpers of the N-process runs (the runs themselves: test_parallel.py, test_cli.py)."""

import pytest

from mhmoe.launch import split_tokens


@pytest.mark.parametrize("total", [0, 1, 7, 96, 1000])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_split_tokens(total, world):
    counts = split_tokens(total, world)
    assert len(counts) == world and sum(counts) == total and min(counts) >= 0
    if world >= 3:
        assert counts[-1] == 0  # a rank with no tokens: the ragged all-to-all edge
    assert counts == sorted(counts, reverse=True)  # uneven on purpose
