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


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations of a W8A8 product in FP8: ``x`` [M, K] → (E4M3 codes [M, K], float32 scales [M, 1]) with
    ``x ≈ codes · scale``. Dynamic (no ``input_scale``): one scale per row (per token), its absmax / 448, so a
    row's codes never depend on the other rows; an all-zero row gets the smallest normal float32 scale. Static:
    the checkpoint's ``input_scale`` for every row (at least that smallest normal), the codes saturated at ±448.
    The codes are ``x · (1 / scale)``: the fp32 reciprocal, then one rounded product a value (what the kernels
    compute: a product, not a division, per element)."""
    from muse_spark.plugins.attention.reference import FP8_MAX

    xf = x.float()
    if input_scale is None:
        # (absmax / 448 rounded once: a tensor divisor, since CUDA divides by a Python scalar as a product with
        # its rounded reciprocal, which is not the quotient the kernels compute)
        amax = xf.abs().amax(-1, keepdim=True)
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    else:
        scale = input_scale.float().reshape(1, 1).clamp_min(torch.finfo(torch.float32).tiny)
        scale = scale.expand(x.shape[0], 1).contiguous()  # (_scaled_mm: [M, 1] dense)
    inv = torch.ones_like(scale) / scale  # (a tensor divisor: the quotient rounded once, as the kernels' div_rn)
    return (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def w8a8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None = None,
                   silu_mul: bool = False) -> torch.Tensor:
    """The W8A8 spec: x's rows quantized as ``quantize_rows`` does, the product of the dequantized codes (exact
    in float32) with the dequantized weight (E4M3 ``w`` [N, K] times its rows' ``scale``) accumulated in float32
    and rounded once to x's dtype; with ``silu_mul``, ``silu(g) · u`` of its halves in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows(x2, input_scale)
    return w8a8_rows_reference(xq, xs, w, scale, x.dtype, silu_mul).reshape(*x.shape[:-1], -1)


def w8a8_rows_reference(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                        silu_mul: bool = False) -> torch.Tensor:
    """``w8a8_reference`` from rows already quantized: E4M3 codes ``xq`` [M, K] and their scales ``xs`` ([M] or
    [M, 1]) → [M, N] (or [M, N/2] with ``silu_mul``) in ``dtype``."""
    y = ((xq.float() * xs.reshape(-1, 1)) @ (w.float() * scale.reshape(-1, 1)).T).to(dtype)
    return silu_mul_halves(y) if silu_mul else y
