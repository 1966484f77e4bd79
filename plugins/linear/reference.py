"""The linear layer's spec (``F.linear``, and the gate/up projection's silu·mul), which the skinny
Triton GEMM (``triton_kernel``) must match."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def silu_mul_halves(y: torch.Tensor) -> torch.Tensor:
    """``silu(g) · u`` of the two halves ``[g | u]`` of ``y``'s last dim, in ``y``'s dtype."""
    inter = y.shape[-1] // 2
    return F.silu(y[..., :inter]) * y[..., inter:]


def linear_reference(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """``F.linear(x, w)``; with ``silu_mul``, ``silu(g) · u`` of its halves ``[g | u]``: the spec of
    ``muse_spark::linear_triton``, and what ``linear`` runs off its Triton path."""
    y = F.linear(x, w)
    return silu_mul_halves(y) if silu_mul else y
