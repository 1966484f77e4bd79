"""The gated FP32 residual + RMSNorm kernel (plugins/gated_residual) against its reference."""

from __future__ import annotations

import pytest
import torch

from muse_spark.plugins.gated_residual.reference import gated_residual_add_ref
from muse_spark.plugins.norm import rms_norm

from kernels.kernel_utils import DEV, HAS_TRITON, INTERPRETED, compile_for_hopper, needs_kernels
from tolerances import NORM_TOL


@needs_kernels
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [33, 1000, 4096])
@pytest.mark.parametrize("weight", ["plain", "zero_centered", "none"])
@pytest.mark.parametrize("norm_branch", [False, True], ids=["branch_as_is", "branch_normed"])
def test_gated_residual_norm_matches_reference(tops, out_dtype, D, weight, norm_branch):
    g = torch.Generator().manual_seed(D)
    stream = (4 * torch.randn(2, 7, D, generator=g)).to(DEV)
    branch = (3 * torch.randn(2, 7, D, generator=g)).to(out_dtype).to(DEV)
    gate = (0.5 + torch.rand(D, generator=g)).to(DEV)
    w = None if weight == "none" else (0.1 * torch.randn(D, generator=g)).to(out_dtype).to(DEV)
    wb = None if weight == "none" else (1 + 0.1 * torch.randn(D, generator=g)).to(out_dtype).to(DEV)
    args = (stream, branch, gate, w, 1e-6, weight == "zero_centered", True, out_dtype, wb, norm_branch)
    new, normed = tops.gated_residual_add(*args)
    ref_new, ref_normed = gated_residual_add_ref(*args)
    if norm_branch:
        # The normed branch may differ from the reference's by its rounding (a few units in the
        # last place of the branch dtype where the fp32 norm straddles a rounding boundary); the
        # stream then by gate times that, and nowhere else.
        rb = rms_norm(branch, wb, 1e-6, weight == "zero_centered", out_dtype).float()
        bound = 4 * torch.finfo(out_dtype).eps * (gate * rb.abs()) + 4 * torch.finfo(torch.float32).eps * ref_new.abs()
        assert ((new - ref_new).abs() <= bound).all()
        if out_dtype != torch.float32:  # fp32: the norm's scale may differ in its last bit, so every element
            assert (new != ref_new).float().mean() < 0.05
        # given the reference's normed branch, the kernel's stream is the reference's bit for bit
        again, _ = tops.gated_residual_add(stream, rb.to(out_dtype), *args[2:8])
        assert torch.equal(again, ref_new)
        # the next norm reads the kernel's own stream
        ref_normed = rms_norm(new.to(out_dtype), w, 1e-6, weight == "zero_centered", out_dtype)
    else:
        assert torch.equal(new, ref_new)
    assert normed.dtype == out_dtype and normed.shape == stream.shape
    torch.testing.assert_close(normed, ref_normed, **NORM_TOL[out_dtype])


@needs_kernels
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_the_residual_kernel_quantizes_its_normed_rows_as_the_row_quantizer_does(tops, static):
    """``gated_residual_add_rows_triton``: the new stream and the normed rows are ``gated_residual_add_triton``'s, bit
    for bit, and the E4M3 codes and scales are ``quantize_rows``' of those normed rows (per token, or with a static
    scale under which codes saturate), bit for bit: the W8A8 product that takes them computes what it computed from
    the normed rows. A wrong static scale changes the codes; a static scale of two values is refused."""
    from muse_spark.plugins.linear.reference import quantize_rows

    D = 1000
    g = torch.Generator().manual_seed(11)
    stream = (4 * torch.randn(2, 4, D, generator=g)).to(DEV)
    branch = (3 * torch.randn(2, 4, D, generator=g)).bfloat16().to(DEV)
    gate = (0.5 + torch.rand(D, generator=g)).to(DEV)
    w = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16().to(DEV)
    wb = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16().to(DEV)
    branch[1, 2] = 0.0  # (a row of zeros after its norm: the least scale)
    args = (stream, branch, gate, w, 1e-6, False, torch.bfloat16, wb, True)
    scale = torch.tensor([0.004], device=DEV) if static else None
    new, normed, q, qs = tops.gated_residual_add_rows(*args, scale)
    want_new, want_normed = tops.gated_residual_add(*args[:6], True, *args[6:])
    assert torch.equal(new, want_new) and torch.equal(normed, want_normed)
    want_q, want_s = quantize_rows(normed.reshape(-1, D), scale)
    if static:
        assert (want_q.float().abs() == 448).any()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(qs, want_s.reshape(-1))
    if static:
        _, _, q2, _ = tops.gated_residual_add_rows(*args, scale * 1.5)
        assert not torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    with pytest.raises(ValueError, match="one float32 value"):
        tops.gated_residual_add_rows(*args, torch.ones(2, device=DEV))


@needs_kernels
def test_gated_residual_without_norm_returns_empty(tops):
    stream = torch.randn(3, 64, device=DEV)
    branch = torch.randn(3, 64, device=DEV).bfloat16()
    gate = torch.rand(64, device=DEV)
    new, empty = tops.gated_residual_add(stream, branch, gate, None, 1e-6, False, False, torch.bfloat16)
    assert torch.equal(new, stream + gate * branch.float())
    assert empty.numel() == 0 and empty.dtype == torch.bfloat16


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("norm_branch", [False, True], ids=["one_norm", "branch_norm_too"])
def test_gated_residual_kernel_issues_every_load_before_its_first_reduction(norm_branch):
    """Compiled for sm_90 (the 8B row, 8 warps): every global load, the norms' weights included, comes
    before the first rsqrt, so no trip to memory waits on a reduction (the GEMMs between two calls
    evict the norm weights from L2: each late load was a trip to HBM on the row's critical path)."""
    import re

    from muse_spark.plugins.gated_residual.triton_kernel import _gated_residual_norm_kernel

    sig = {"stream_ptr": "*fp32", "branch_ptr": "*bf16", "gate_ptr": "*fp32", "weight_ptr": "*bf16",
           "bweight_ptr": "*bf16", "new_ptr": "*fp32", "out_ptr": "*bf16", "D": "i32"}
    consts = dict(EPS=1e-6, HAS_WEIGHT=True, ZERO_CENTERED=False, APPLY_NORM=True, BLOCK_D=4096,
                  NORM_BRANCH=norm_branch, HAS_BRANCH_WEIGHT=norm_branch)
    ptx = compile_for_hopper(_gated_residual_norm_kernel, sig, consts, 8, multiples_of_16=("D",)).asm["ptx"]
    lines = ptx.splitlines()
    loads = [i for i, line in enumerate(lines) if re.search(r"\bld\.global", line)]
    rsqrts = [i for i, line in enumerate(lines) if "rsqrt" in line and not line.lstrip().startswith("//")]
    assert len(rsqrts) == (2 if norm_branch else 1)
    # stream, branch, gate, the norm weight(s): 4-byte rows of 4096 in v4 loads of 8 warps
    assert len(loads) == (14 if norm_branch else 12) and max(loads) < min(rsqrts)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("quant", [1, 2], ids=["per-token", "static"])
def test_the_quantizing_residual_kernel_compiles_for_hopper(quant):
    """The residual kernel that also writes its normed rows as E4M3 codes and scales (the 8B row, 8 warps, as
    ``gated_residual_add_rows_triton`` launches it), compiled ahead of time for sm_90 without a GPU: it stores
    FP8 codes."""
    from muse_spark.plugins.gated_residual.triton_kernel import _gated_residual_norm_kernel

    sig = {"stream_ptr": "*fp32", "branch_ptr": "*bf16", "gate_ptr": "*fp32", "weight_ptr": "*bf16",
           "bweight_ptr": "*bf16", "new_ptr": "*fp32", "out_ptr": "*bf16", "D": "i32", "q_ptr": "*fp8e4nv",
           "qs_ptr": "*fp32", "in_scale_ptr": "*fp32"}
    consts = dict(EPS=1e-6, HAS_WEIGHT=True, ZERO_CENTERED=False, APPLY_NORM=True, BLOCK_D=4096, NORM_BRANCH=True,
                  HAS_BRANCH_WEIGHT=True, QUANT=quant)
    ptx = compile_for_hopper(_gated_residual_norm_kernel, sig, consts, 8, multiples_of_16=("D",)).asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
