"""torch.library registration of the skinny linear layer's ops, on its kernel (``triton_kernel``):

* ``muse_spark::linear_triton`` — the skinny linear layer (≤ 16 rows), silu·mul optionally fused,
  which ``models.layers.linear`` calls in bf16/fp16 on CUDA for at most 16 rows (the default; the
  kernel option ``linear="cublas"`` selects ``F.linear``). Its reference is ``reference.linear_reference``;
* ``muse_spark::linear_fp8_triton`` — the same kernel on an FP8 (E4M3) weight with per-row fp32 scales
  (W8A16): each weight tile dequantized as it streams in, the result bit for bit the bf16/fp16
  kernel's on the dequantized weight. Its reference is ``models.layers.fp8_linear_reference``'s math;
* ``muse_spark::linear_w8a8_triton`` — the same kernel in W8A8 form (the models' on FP8 tensor cores): x's
  rows quantized to E4M3 by a small kernel before it (per token, or with a checkpoint's static ``input_scale``),
  FP8 operands on both sides of the MMA, both scales applied to each fp32 sum; its reference is
  ``reference.w8a8_reference``;
* ``muse_spark::linear_rope_table_triton`` — the skinny linear layer plus, from one more program of
  the same launch, the step's RoPE table for ``head_norm_rope_cache_triton`` (the default; off with
  the kernel option ``rope_table`` false); ``muse_spark::linear_fp8_rope_table_triton`` the same on an FP8 weight
  (W8A16, or W8A8 by its ``w8a8`` argument; the models take the table with W8A8 only).

``register_triton`` registers them; only ``plugins.triton_ops`` calls it, so importing this module
never imports Triton.
"""

from __future__ import annotations

import torch

from muse_spark.plugins.head_norm_rope.reference import rope_table_reference
from muse_spark.plugins.linear.reference import linear_reference, w8a8_reference, w8a8_rows_reference


def _check_linear(x: torch.Tensor, w: torch.Tensor) -> None:
    """What the skinny linear kernel takes (``plugins.linear.triton_kernel.fits``), or a clear error."""
    from muse_spark.plugins.linear.triton_kernel import MAX_ROWS, fits

    if not fits(x, w):
        raise ValueError(f"linear: x {list(x.shape)} {x.dtype} and weight {list(w.shape)} {w.dtype}: the kernel takes "
                         f"at most {MAX_ROWS} rows of x [..., K] and a contiguous weight [N, K], both bf16 or fp16")


def _check_linear_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> None:
    from muse_spark.plugins.linear.triton_kernel import MAX_ROWS, fits

    if not fits(x, w, scale):
        raise ValueError(f"linear_fp8: x {list(x.shape)} {x.dtype}, weight {list(w.shape)} {w.dtype} and scale "
                         f"{list(scale.shape)} {scale.dtype}: the kernel takes at most {MAX_ROWS} rows of bf16/fp16 x "
                         f"[..., K], a contiguous float8_e4m3fn weight [N, K] and float32 scales [N] or [N, 1]")


def _check_input_scale(input_scale: torch.Tensor | None, w8a8: bool) -> None:
    """A static activation scale: one float32 value (``triton_kernel.check_input_scale``), for the W8A8 form only."""
    from muse_spark.plugins.linear.triton_kernel import check_input_scale

    if input_scale is None:
        return
    if not w8a8:
        raise ValueError("linear_fp8: a static input_scale is for the W8A8 form (w8a8=True); W8A16 does not "
                         "quantize its activations")
    check_input_scale(input_scale)


def fp8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    """The W8A16 spec: the weight dequantized exactly in fp32, rounded to x's dtype, then ``F.linear``."""
    return linear_reference(x, (w.float() * scale.reshape(-1, 1)).to(x.dtype), silu_mul)


def register_triton(runs_kernels, launch_linear, launch_linear_rope_table) -> None:
    """Registers ``muse_spark::linear_rope_table_triton``, ``linear_fp8_rope_table_triton``, ``linear_triton``,
    ``linear_fp8_triton`` and ``linear_w8a8_triton``: their kernel launches (``plugins.triton_ops``) where
    ``runs_kernels(x)``, else their references."""
    from torch.library import triton_op

    def check_table(x: torch.Tensor, positions: torch.Tensor, head_dim: int) -> None:
        rows = x.numel() // x.shape[-1]
        if positions.dtype != torch.int64 or positions.numel() != rows:
            raise ValueError(f"linear_rope_table: positions must be int64, one per row of x ({rows}), got "
                             f"{positions.dtype} {list(positions.shape)}")
        if head_dim < 2 or head_dim & (head_dim - 1):
            raise ValueError(f"linear_rope_table: head_dim {head_dim} must be a power of two")

    @triton_op("muse_spark::linear_rope_table_triton", mutates_args=())
    def _linear_rope_table_op(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, theta: float,
                              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``linear_triton(x, w)`` (the attention's qkv projection) and the RoPE table of ``positions``
        (one per row of x) from one more program of the same launch → (y, cos, sin), the table [rows,
        head_dim/2] fp32 as the norm kernels compute the angles in place (the same bits), for
        ``head_norm_rope_cache_triton(rope_cos=, rope_sin=)``. Its reference: ``F.linear`` and
        ``plugins.head_norm_rope.reference.rope_table_reference``."""
        _check_linear(x, w)
        check_table(x, positions, head_dim)
        if not runs_kernels(x):
            cos, sin = rope_table_reference(positions, theta, head_dim)
            return linear_reference(x, w), cos, sin
        return launch_linear_rope_table(x, w, positions, theta, head_dim)

    @triton_op("muse_spark::linear_fp8_rope_table_triton", mutates_args=())
    def _linear_fp8_rope_table_op(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, positions: torch.Tensor,
                                  theta: float, head_dim: int, w8a8: bool,
                                  input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
        """``linear_rope_table_triton`` on an FP8 weight with its rows' ``scale``: y is ``linear_fp8_triton``'s
        (W8A16) or, with ``w8a8``, ``linear_w8a8_triton``'s (``input_scale``: static), the table the same bits."""
        _check_linear_fp8(x, w, scale)
        check_table(x, positions, head_dim)
        _check_input_scale(input_scale, w8a8)
        if not runs_kernels(x):
            cos, sin = rope_table_reference(positions, theta, head_dim)
            y = w8a8_reference(x, w, scale, input_scale, False) if w8a8 else fp8_reference(x, w, scale, False)
            return y, cos, sin
        return launch_linear_rope_table(x, w, positions, theta, head_dim, scale=scale, w8a8=w8a8,
                                        input_scale=input_scale)

    def fp8_product(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, silu_mul: bool, reference, launch):
        """An FP8-weight op's body: the checks, then ``launch()`` where the kernels run, else ``reference()``."""
        _check_linear_fp8(x, w, scale)
        if silu_mul and w.shape[0] % 2:
            raise ValueError(f"linear_fp8: silu_mul needs an even number of weight rows (gate | up), got {w.shape[0]}")
        return launch() if runs_kernels(x) else reference()

    @triton_op("muse_spark::linear_fp8_triton", mutates_args=())
    def _linear_fp8_op(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, silu_mul: bool) -> torch.Tensor:
        return fp8_product(x, w, scale, silu_mul, lambda: fp8_reference(x, w, scale, silu_mul),
                           lambda: launch_linear(x, w, silu_mul, scale=scale))

    @triton_op("muse_spark::linear_w8a8_triton", mutates_args=())
    def _linear_w8a8_op(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, silu_mul: bool,
                        input_scale: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                        row_scales: torch.Tensor | None = None) -> torch.Tensor:
        """``rows``/``row_scales``: x's rows already quantized (E4M3 codes [M, K], fp32 scales [M]: what
        ``quantize_rows`` gives for x and ``input_scale``, e.g. from ``gated_residual_add_rows_triton``), so no
        quantizing kernel runs before the GEMM."""
        _check_input_scale(input_scale, True)
        if (rows is None) != (row_scales is None):
            raise ValueError("linear_w8a8: rows and row_scales come together")
        if rows is not None:
            m = x.numel() // x.shape[-1]
            if (rows.dtype != torch.float8_e4m3fn or list(rows.shape) != [m, x.shape[-1]]
                    or row_scales.dtype != torch.float32 or row_scales.numel() != m):
                raise ValueError(f"linear_w8a8: rows must be float8_e4m3fn [{m}, {x.shape[-1]}] with float32 "
                                 f"row_scales [{m}], got {rows.dtype} {list(rows.shape)} and {row_scales.dtype} "
                                 f"{list(row_scales.shape)}")

            def reference():
                y = w8a8_rows_reference(rows, row_scales, w, scale, x.dtype, silu_mul)
                return y.reshape(*x.shape[:-1], -1)
        else:
            def reference():
                return w8a8_reference(x, w, scale, input_scale, silu_mul)
        return fp8_product(x, w, scale, silu_mul, reference,
                           lambda: launch_linear(x, w, silu_mul, scale=scale, w8a8=True, input_scale=input_scale,
                                                 rows=None if rows is None else (rows, row_scales)))

    @triton_op("muse_spark::linear_triton", mutates_args=())
    def _linear_op(x: torch.Tensor, w: torch.Tensor, silu_mul: bool) -> torch.Tensor:
        _check_linear(x, w)
        if silu_mul and w.shape[0] % 2:
            raise ValueError(f"linear: silu_mul needs an even number of weight rows (gate | up), got {w.shape[0]}")
        if not runs_kernels(x):
            return linear_reference(x, w, silu_mul)
        return launch_linear(x, w, silu_mul)
