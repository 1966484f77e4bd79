"""The Muse Spark RMSNorm, the one formula every norm in the models uses.

``MuseSpark1xRMSNorm``: computed in fp32, ``y = x * rsqrt(mean(x²) + eps)``,
then ``y * (1 + w)`` (zero-centered gamma) or ``y * w``; no weight at all when
the config says ``norm_affine: false``; the result is cast to ``out_dtype``.
"""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    zero_centered: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # x: [..., D] any dtype; weight: [D] or None
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        w = weight.float()
        y = y * (1.0 + w) if zero_centered else y * w
    return y.to(out_dtype)
