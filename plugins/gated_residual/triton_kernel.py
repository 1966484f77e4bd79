"""Triton kernel of the gated FP32 residual add, fused with the RMSNorm after it.

Reference (``reference.py``, the spec)::

    branch     = rms_norm(branch, wb, eps, zc)                     # optional (norm_branch), branch dtype
    new_stream = stream + g ⊙ branch.float()                      # fp32 [N, D]
    normed     = rms_norm(new_stream.to(out_dtype), w, eps, zc)   # out_dtype [N, D]

One program per row: the row is read once, the new fp32 stream written once,
and both norms reduce the row while it is still in registers. In a decoder
layer that is three kernels in one: the branch's post-attention (post-FFN)
norm, the residual add, and the next input norm.

Memory traffic per row: read D·4 (stream) + D·s (branch, s = 2 for bf16)
+ D·4 (gate, L2-resident) + D·s (norm weight, L2-resident) [+ D·s (branch norm
weight, L2-resident)]; write D·4 (new stream) + D·s (normed). The unfused
kernels (branch norm, add, norm) write the normed branch and read it and the new
stream back: two launches and 2·D·s + D·4 bytes saved.

Rounding, against the reference:
* the new stream is bit-identical given the same branch: ``gate·branch`` and
  the add are rounded separately (``mul_rn``/``add_rn``), never contracted
  into an FMA. With ``norm_branch`` the normed branch (rounded to the branch's
  dtype, as the reference rounds it) differs from the reference's by the
  norm's rounding, and the stream follows it;
* the norm reads the stream *rounded to out_dtype*, as the reference does;
* the mean of squares is summed in another order than torch's reduction and
  ``rsqrt`` is the hardware approximation (torch's CUDA ``rsqrt`` is too), so
  ``normed`` differs from the reference by rounding only (tests/tolerances.py
  holds the tolerance table).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse_spark.plugins.gated_residual.op import check_gated_residual_inputs
from muse_spark.plugins.triton_math import add_rn, div_rn, e4m3_codes, mul_rn, pdl_enter, row_scale, to_rne


@triton.jit
def _rms_norm(x, w, D, EPS: tl.constexpr, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """plugins/norm.rms_norm of one fp32 row (zeros past D) with its weight row ``w`` (fp32,
    loaded by the caller) -> fp32, before the cast."""
    ms = tl.sum(x * x, axis=0) / D
    y = x * tl.rsqrt(ms + EPS)
    if HAS_WEIGHT:
        if ZERO_CENTERED:
            y = y * (1.0 + w)
        else:
            y = y * w
    return y


@triton.jit
def gated_residual_row(
    row,  # int64: the row of stream/branch/new/out this program does
    stream_ptr, branch_ptr, gate_ptr, weight_ptr, bweight_ptr, new_ptr, out_ptr, D,
    EPS: tl.constexpr, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr, APPLY_NORM: tl.constexpr,
    BLOCK_D: tl.constexpr, NORM_BRANCH: tl.constexpr, HAS_BRANCH_WEIGHT: tl.constexpr,
    FRESH_BRANCH: tl.constexpr = False, q_ptr=None, qs_ptr=None, in_scale_ptr=None, QUANT: tl.constexpr = 0,
):
    """One row of the reference (module docstring): the kernel below, and the skinny linear kernel's
    ``RESIDUAL`` tail (plugins/linear), whose programs wrote the branch moments before.
    ``FRESH_BRANCH``: the branch is read from L2 (``.cg``), never from a line this SM's L1 kept.
    ``QUANT`` (with ``APPLY_NORM``) 1: the normed row also as a W8A8 product's input, E4M3 codes at q_ptr [N, D] and
    its scale at qs_ptr [N], per token; 2: with the static float32 scale at in_scale_ptr (both
    ``plugins.linear.reference.quantize_rows``' bits of the normed row as stored)."""
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    base = row * D
    # read D*4 + D*s + D*4 B
    s = tl.load(stream_ptr + base + cols, mask=mask, other=0.0)
    if FRESH_BRANCH:
        b = tl.load(branch_ptr + base + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        b = tl.load(branch_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + cols, mask=mask, other=0.0)
    # Every load first: the norms' weights too, so that no memory round trip waits on a reduction
    # (the GEMMs between two calls evict them from L2; issued after each rsqrt, as the compiler
    # placed them when the norm loaded its own weight, they were two more trips to HBM per row).
    if NORM_BRANCH and HAS_BRANCH_WEIGHT:
        wb = tl.load(bweight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        wb = g  # (unused)
    if APPLY_NORM and HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = g  # (unused)
    if NORM_BRANCH:  # the branch's own norm, rounded to the branch's dtype (reference.py)
        b = to_rne(_rms_norm(b, wb, D, EPS, HAS_BRANCH_WEIGHT, ZERO_CENTERED), branch_ptr.dtype.element_ty).to(tl.float32)
    new = add_rn(s, mul_rn(g, b))  # stream + (g * branch): two roundings, as in torch
    tl.store(new_ptr + base + cols, new, mask=mask)  # write D*4 B
    if APPLY_NORM:
        # The norm reads the stream rounded to the compute dtype (reference.py).
        x = to_rne(new, out_ptr.dtype.element_ty).to(tl.float32)
        y = to_rne(_rms_norm(x, w, D, EPS, HAS_WEIGHT, ZERO_CENTERED), out_ptr.dtype.element_ty)
        tl.store(out_ptr + base + cols, y, mask=mask)  # write D*s B
        if QUANT:  # the next GEMM's rows, quantized here: no kernel of their own before it
            yf = y.to(tl.float32)
            scale = row_scale(yf, QUANT == 2, in_scale_ptr)
            tl.store(qs_ptr + row, scale)
            tl.store(q_ptr + base + cols, e4m3_codes(yf, div_rn(1.0, scale)), mask=mask)


@triton.jit
def _gated_residual_norm_kernel(
    stream_ptr,  # [N, D] fp32
    branch_ptr,  # [N, D] compute dtype
    gate_ptr,  # [D] fp32
    weight_ptr,  # [D] norm weight (unused unless HAS_WEIGHT)
    bweight_ptr,  # [D] the branch norm's weight (unused unless NORM_BRANCH and HAS_BRANCH_WEIGHT)
    new_ptr,  # [N, D] fp32 out: the new stream
    out_ptr,  # [N, D] out_dtype out: the normed row (unused unless APPLY_NORM)
    D,
    EPS: tl.constexpr,  # constexpr: Inductor would pass a float argument as fp64 (see attention's SCALE)
    HAS_WEIGHT: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    APPLY_NORM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM_BRANCH: tl.constexpr = False,
    HAS_BRANCH_WEIGHT: tl.constexpr = False,
    PDL: tl.constexpr = 0,
    # QUANT 1 / 2: the normed rows also as E4M3 codes q_ptr [N, D] and fp32 scales qs_ptr [N], per token / with the
    # static scale at in_scale_ptr (``gated_residual_row``)
    q_ptr=None, qs_ptr=None, in_scale_ptr=None, QUANT: tl.constexpr = 0,
):
    row = (tl.program_id(0) + pdl_enter(PDL)).to(tl.int64)  # rows are addressed after the PDL wait
    gated_residual_row(row, stream_ptr, branch_ptr, gate_ptr, weight_ptr, bweight_ptr, new_ptr, out_ptr, D, EPS,
                       HAS_WEIGHT, ZERO_CENTERED, APPLY_NORM, BLOCK_D, NORM_BRANCH, HAS_BRANCH_WEIGHT, False, q_ptr,
                       qs_ptr, in_scale_ptr, QUANT)


def launch_gated_residual_add(
    stream: torch.Tensor,  # [..., D] fp32
    branch: torch.Tensor,  # [..., D] compute dtype
    gate: torch.Tensor,  # [D] fp32
    norm_weight: torch.Tensor | None,  # [D] or None
    eps: float,
    zero_centered: bool,
    apply_norm: bool,
    out_dtype: torch.dtype,
    branch_norm_weight: torch.Tensor | None = None,  # [D] or None
    norm_branch: bool = False,
    wrap=lambda k: k,
    pdl: int = 0,
    launch_pdl: bool = False,
    quantize: bool = False,
    input_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Launch the fused kernel; ``wrap`` is ``torch.library.wrap_triton`` inside the op;
    ``pdl``/``launch_pdl``: as ``plugins.linear.triton_kernel.launch_linear``'s. ``quantize`` (with ``apply_norm``):
    → (new stream, normed, E4M3 codes [N, D], fp32 scales [N]): the normed rows also as a W8A8 product's input,
    per token, or with ``input_scale`` (float32 [1]) for every row (``plugins.linear.reference.quantize_rows``)."""
    check_gated_residual_inputs(stream, branch, gate, norm_weight, branch_norm_weight)
    if quantize and not apply_norm:
        raise ValueError("gated_residual_add: the rows quantized are the normed ones (apply_norm)")
    D = stream.shape[-1]
    s2 = stream.reshape(-1, D).contiguous()
    b2 = branch.reshape(-1, D).contiguous()
    g = gate.float().contiguous()
    N = s2.shape[0]
    new = torch.empty_like(s2)
    out = torch.empty((N, D) if apply_norm else (0,), dtype=out_dtype, device=stream.device)
    q = torch.empty((N, D) if quantize else (0,), dtype=torch.float8_e4m3fn, device=stream.device)
    qs = torch.empty((N if quantize else 0,), dtype=torch.float32, device=stream.device)
    if N > 0:
        block_d = triton.next_power_of_2(D)
        num_warps = min(16, max(1, block_d // 512))
        w = norm_weight.contiguous() if norm_weight is not None else g
        has_bw = norm_branch and branch_norm_weight is not None
        wb = branch_norm_weight.contiguous() if has_bw else g
        wrap(_gated_residual_norm_kernel)[(N,)](
            s2, b2, g, w, wb, new, out if apply_norm else new, D,
            EPS=float(eps), HAS_WEIGHT=norm_weight is not None, ZERO_CENTERED=zero_centered, APPLY_NORM=apply_norm,
            BLOCK_D=block_d, NORM_BRANCH=bool(norm_branch), HAS_BRANCH_WEIGHT=has_bw, PDL=int(pdl), num_warps=num_warps,
            q_ptr=q if quantize else new, qs_ptr=qs if quantize else new,
            in_scale_ptr=input_scale.reshape(1) if input_scale is not None else new,
            QUANT=(2 if input_scale is not None else 1) if quantize else 0,
            **({"launch_pdl": True} if launch_pdl else {}),
        )
    new = new.reshape(stream.shape)
    normed = out.reshape(stream.shape) if apply_norm else out
    return (new, normed, q, qs) if quantize else (new, normed)
