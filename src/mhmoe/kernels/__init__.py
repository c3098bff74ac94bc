"""Triton kernels of mhmoe (one file per kernel family, plus configs.py)."""
