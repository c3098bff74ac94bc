"""The README's Python usage runs as written, and its ops reproduce the layer."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_usage_block_runs_and_matches_the_layer():
    text = README.read_text()
    section = text[text.index("## Python usage"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(block, str(README), "exec"), scope)
    y, y_heads = scope["y"], scope["y_heads"]
    assert y.shape == scope["x"].shape and y.dtype == torch.bfloat16
    # The ops one by one give the module's output exactly.
    assert torch.equal(y_heads.reshape(y.shape), y)
