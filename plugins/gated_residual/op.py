"""torch.library registration of ``muse_spark::gated_residual_add`` and ``muse_spark::gated_residual_add_triton``.

``muse_spark::gated_residual_add`` (registered at import) runs the reference.
``register_triton`` registers ``muse_spark::gated_residual_add_triton``, the same schema on the
Triton kernel (``triton_kernel``); only ``plugins.triton_ops`` calls it, so importing this module
never imports Triton.
"""

from __future__ import annotations

import torch

from muse_spark.plugins.gated_residual.reference import gated_residual_add_ref


def check_gated_residual_inputs(stream: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor,
                                norm_weight: torch.Tensor | None = None,
                                branch_norm_weight: torch.Tensor | None = None) -> None:
    """The schema's shape/dtype contract, shared by the reference op and the kernels."""
    if stream.dtype != torch.float32:
        raise ValueError(f"gated_residual_add: stream must be float32, got {stream.dtype}")
    if stream.shape != branch.shape:
        raise ValueError(
            f"gated_residual_add: branch shape {list(branch.shape)} differs from stream {list(stream.shape)}"
        )
    if gate.shape != stream.shape[-1:]:
        raise ValueError(f"gated_residual_add: expected gate of shape [{stream.shape[-1]}], got {list(gate.shape)}")
    for name, t in (("norm weight", norm_weight), ("branch norm weight", branch_norm_weight)):
        if t is not None and t.shape != stream.shape[-1:]:
            raise ValueError(f"gated_residual_add: expected {name} of shape [{stream.shape[-1]}], got {list(t.shape)}")


@torch.library.custom_op("muse_spark::gated_residual_add", mutates_args=())
def gated_residual_add(
    stream: torch.Tensor,
    branch: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    zero_centered: bool,
    apply_norm: bool,
    out_dtype: torch.dtype,
    branch_norm_weight: torch.Tensor | None = None,
    norm_branch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_gated_residual_inputs(stream, branch, gate, norm_weight, branch_norm_weight)
    return gated_residual_add_ref(stream, branch, gate, norm_weight, eps, zero_centered, apply_norm, out_dtype,
                                  branch_norm_weight, norm_branch)


@gated_residual_add.register_fake
def _(stream, branch, gate, norm_weight, eps, zero_centered, apply_norm, out_dtype, branch_norm_weight=None,
      norm_branch=False):
    normed = stream.new_empty(stream.shape if apply_norm else (0,), dtype=out_dtype)
    return torch.empty_like(stream), normed


def register_triton(runs_kernels, launch) -> None:
    """Registers ``muse_spark::gated_residual_add_triton``: the gated FP32 residual add fused with the
    branch's own output norm before it and the next RMSNorm after it, on the kernel
    (``launch(*args)``, ``plugins.triton_ops``) where ``runs_kernels(stream)``, else the reference."""
    from torch.library import triton_op

    @triton_op("muse_spark::gated_residual_add_triton", mutates_args=())
    def _gated_residual_add_op(
        stream: torch.Tensor,
        branch: torch.Tensor,
        gate: torch.Tensor,
        norm_weight: torch.Tensor | None,
        eps: float,
        zero_centered: bool,
        apply_norm: bool,
        out_dtype: torch.dtype,
        branch_norm_weight: torch.Tensor | None = None,
        norm_branch: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_gated_residual_inputs(stream, branch, gate, norm_weight, branch_norm_weight)
        args = (stream, branch, gate, norm_weight, eps, zero_centered, apply_norm, out_dtype, branch_norm_weight,
                norm_branch)
        if not runs_kernels(stream):
            return gated_residual_add_ref(*args)
        return launch(*args)

    @triton_op("muse_spark::gated_residual_add_rows_triton", mutates_args=())
    def _gated_residual_add_rows_op(
        stream: torch.Tensor,
        branch: torch.Tensor,
        gate: torch.Tensor,
        norm_weight: torch.Tensor | None,
        eps: float,
        zero_centered: bool,
        out_dtype: torch.dtype,
        branch_norm_weight: torch.Tensor | None = None,
        norm_branch: bool = False,
        input_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``gated_residual_add_triton`` with the norm applied, and its normed rows also quantized as a W8A8 product
        quantizes its input (``plugins.linear.reference.quantize_rows``: per token, or with the static float32
        ``input_scale``) → (new stream, normed, E4M3 codes [N, D], fp32 scales [N]) for
        ``linear_w8a8_triton(rows=, row_scales=)``: one kernel instead of the residual's and the quantizer's."""
        from muse_spark.plugins.linear.reference import quantize_rows
        from muse_spark.plugins.linear.triton_kernel import check_input_scale

        check_gated_residual_inputs(stream, branch, gate, norm_weight, branch_norm_weight)
        if input_scale is not None:
            check_input_scale(input_scale, "gated_residual_add_rows")
        args = (stream, branch, gate, norm_weight, eps, zero_centered, True, out_dtype, branch_norm_weight,
                norm_branch)
        if not runs_kernels(stream):
            new, normed = gated_residual_add_ref(*args)
            q, qs = quantize_rows(normed.reshape(-1, normed.shape[-1]), input_scale)
            return new, normed, q, qs.reshape(-1)
        return launch(*args, quantize=True, input_scale=input_scale)
