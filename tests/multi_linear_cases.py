"""Shared by the `multi_linear` tests: the op's formula in fp64."""

from __future__ import annotations

import torch


def fp64_formula(x, weights, starts, counts, biases):
    """The op's result in fp64, written independently of `multi_linear_reference` (used by the CPU, CUDA and
    kernel-emulation tests)."""
    blocks = []
    for w, s, c, b in zip(weights, starts, counts, biases, strict=True):
        y = x.double() @ w[s : s + c].double().T
        blocks.append(y if b is None else y + b[s : s + c].double())
    return torch.cat(blocks, dim=1)
