"""Reference (spec) of the gated FP32 residual plugin.

The decoder layer's residual update (docs/design.md) is

    branch = post_norm(branch)                     # the branch's own output norm (optional)
    stream = stream + g ⊙ branch.float()          # fp32 [N, D]
    x      = norm(stream.to(compute_dtype))        # the next input norm

where ``g`` is the materialized residual constant (``residual_multiplier *
<layer>.{attn,ffn}_residual_gate``, fp32 [D]). Note the rounding: the norm
reads the stream *rounded to the compute dtype* (vLLM's implementation rounds "to the draft
compute dtype before each trained input norm"), so a fused kernel must round
the same way before it reduces.
"""

from __future__ import annotations

import torch

from muse_spark.plugins.norm import rms_norm


def gated_residual_add_ref(
    stream: torch.Tensor,  # [N, D] fp32
    branch: torch.Tensor,  # [N, D] compute dtype
    gate: torch.Tensor,  # [D] fp32
    norm_weight: torch.Tensor | None,  # [D] or None (norm_affine false)
    eps: float,
    zero_centered: bool,
    apply_norm: bool,
    out_dtype: torch.dtype,
    branch_norm_weight: torch.Tensor | None = None,  # [D] or None (norm_affine false)
    norm_branch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    if norm_branch:  # the layer's post-attention / post-FFN norm, in the branch's dtype
        branch = rms_norm(branch, branch_norm_weight, eps, zero_centered, branch.dtype)
    new_stream = stream + gate.float() * branch.float()
    if not apply_norm:
        return new_stream, new_stream.new_empty((0,), dtype=out_dtype)
    normed = rms_norm(new_stream.to(out_dtype), norm_weight, eps, zero_centered, out_dtype)
    return new_stream, normed
