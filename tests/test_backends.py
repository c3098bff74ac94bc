"""Which path an op takes: auto / torch / triton, and the errors for the impossible."""

import pytest

from mhmoe.backends import available_backends, resolve_backend


def test_auto_is_torch_on_the_cpu_and_triton_on_cuda():
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", "cuda") == "triton"  # triton is installed here
    assert resolve_backend("torch", "cuda") == "torch"


def test_triton_on_the_cpu_only_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert available_backends("cpu") == ["torch", "triton"]
    assert resolve_backend("triton", "cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert available_backends("cpu") == ["torch"]
    with pytest.raises(ValueError, match=r"route: backend 'triton' cannot run on cpu"):
        resolve_backend("triton", "cpu", op="route")


def test_unknown_backend():
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("cuda", "cpu")
