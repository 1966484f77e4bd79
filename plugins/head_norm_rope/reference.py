"""The attention's q/k normalization, its spec: per-head weightless RMS norm in fp32, then rotate-half
RoPE; the RoPE table; the form that writes the k heads and v into the caches. The Triton kernel
(``triton_kernel``) must match it."""

from __future__ import annotations

import torch

from muse_spark.plugins.attention.reference import CacheKV, PagedKV
from muse_spark.plugins.norm import rms_norm


def head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless per-head RMS normalization of q/k, in fp32, back to x's dtype."""
    return rms_norm(x, None, eps, False, x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE. x: [B, S, heads, Dh]; positions: [B, S] int64."""
    dh = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh))
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, S, Dh/2]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1).unsqueeze(2)  # [B, S, 1, Dh]
    sin = torch.cat([freqs.sin(), freqs.sin()], -1).unsqueeze(2)
    xf = x.float()
    x1, x2 = xf[..., : dh // 2], xf[..., dh // 2 :]
    rotated = torch.cat([-x2, x1], -1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rope_table_reference(positions: torch.Tensor, theta: float, dh: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope``'s cos and sin of positions [B, S] (or [N]) → each [B·S, Dh/2] fp32: the spec of the
    RoPE table ``muse_spark::linear_rope_table_triton`` writes."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dh, 2, device=positions.device, dtype=torch.float32) / dh))
    freqs = positions.reshape(-1, 1).to(torch.float32) * inv_freq
    return freqs.cos(), freqs.sin()


def head_norm_rope_reference(x: torch.Tensor, positions: torch.Tensor, eps: float, theta: float,
                             use_rope: bool) -> torch.Tensor:
    """``head_rms_norm``, then ``rope`` at ``positions`` when ``use_rope``: the spec of
    ``muse_spark::head_norm_rope_triton``. x [B, S, heads, Dh], positions [B, S] int64."""
    x = head_rms_norm(x, eps)
    return rope(x, positions, theta) if use_rope else x


def head_norm_rope_cache_reference(x: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, eps: float,
                                   theta: float, use_rope: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   slots: torch.Tensor, scales=None) -> torch.Tensor:
    """``head_norm_rope_reference`` of x [B, S, H + KV, Dh] (q and k heads), its k heads and v [B, S,
    KV, Dh] written into the caches at rows ``slots`` [B], positions ``positions`` [B, S] →
    the normed q [B, S, H, Dh]: the spec of ``muse_spark::head_norm_rope_cache_triton``. ``scales``: an FP8
    cache's (k_scale, v_scale), the writes quantized."""
    n = head_norm_rope_reference(x, positions, eps, theta, use_rope)
    H = x.shape[2] - v.shape[2]
    kind = PagedKV if slots.dim() == 2 else CacheKV  # (block tables into pools of blocks, or slot rows)
    kind(k_cache, v_cache, slots, positions, None, scales)(n[:, :, H:], v)  # the layers' cache write
    return n[:, :, :H].contiguous()
