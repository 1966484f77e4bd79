"""The skinny linear layer (plugins/linear, ≤ 16 rows, silu·mul fused) against the correctly
rounded result and the reference."""

from __future__ import annotations

import pytest
import torch

from kernels.kernel_utils import BIG, DEV, HAS_TRITON, INTERPRETED, ON_GPU, compile_for_hopper, needs_kernels, triton


LINEAR_SHAPES = {  # (M rows of x, N outputs, K)
    "step_rows": (8, 96, 256),
    "draft_rows_ragged_n": (7, 80, 192),  # N not a multiple of the tile
    "ragged_k": (5, 64, 200),  # K not a multiple of the chunk
    "one_row": (1, 64, 128),
    "max_rows": (16, 48, 64),
}
if BIG:
    LINEAR_SHAPES.update({"muse_o": (8, 4096, 4096), "muse_down": (8, 4096, 14336), "muse_b2_qkv": (16, 6144, 4096)})


def linear_operands(M, N, K, dtype, exact, seed=0):
    """x [M, K], w [N, K]. ``exact``: small multiples of 2^-2 and 2^-3, whose products and sums are
    exact in fp32 in any order, so every kernel must give the correctly rounded result."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        x = torch.randint(-3, 4, (M, K), generator=g) * 0.25
        w = torch.randint(-2, 3, (N, K), generator=g) * 0.125
    else:
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5
    return x.to(dtype).to(DEV), w.to(dtype).to(DEV)


def exact_linear(x, w, silu_mul):
    """The correctly rounded result: fp32 sums (exact for ``linear_operands(exact=True)``) rounded
    once, then silu·mul in the compute dtype as the modules compute it."""
    from muse_spark.plugins.linear.reference import silu_mul_halves

    y = torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)
    return silu_mul_halves(y) if silu_mul else y


@needs_kernels
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
def test_linear_kernel_gives_the_correctly_rounded_result(tops, shape, dtype, silu_mul):
    M, N, K = LINEAR_SHAPES[shape]
    x, w = linear_operands(M, N, K, dtype, exact=True)
    y = torch.ops.muse_spark.linear_triton(x, w, silu_mul)
    ref = exact_linear(x, w, silu_mul)
    assert y.shape == ref.shape and y.dtype == dtype
    if silu_mul and INTERPRETED:  # numpy's exp against torch's CPU exp: an fp32 ulp may round across
        torch.testing.assert_close(y, ref, rtol=2**-7, atol=0)
    else:  # on the GPU both compute silu with the CUDA math library's expf: the same bits
        assert torch.equal(y, ref)


@needs_kernels
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("shape", ["step_rows", "ragged_k"] + (["muse_down"] if BIG else []))
def test_linear_kernel_random_weights_match_the_reference(tops, shape, silu_mul):
    """Random bf16 operands: the kernel's fp32 sums differ from cuBLAS's (or the CPU's) in order
    only, so the outputs agree to a few bf16 ulps of the output's scale."""
    from muse_spark.plugins.linear.reference import linear_reference

    M, N, K = LINEAR_SHAPES[shape]
    x, w = linear_operands(M, N, K, torch.bfloat16, exact=False, seed=1)
    y = torch.ops.muse_spark.linear_triton(x, w, silu_mul).float()
    ref = linear_reference(x, w, silu_mul).float()
    torch.testing.assert_close(y, ref, rtol=2**-6, atol=2**-7 * ref.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
def test_linear_bits_do_not_depend_on_the_number_of_rows(tops, silu_mul):
    """A row's output is one fixed-order fp32 dot per element, whatever the other rows: a step's
    rows give the same bits in an engine's batch bucket, in the eager engine, or alone."""
    x, w = linear_operands(16, 96, 320, torch.bfloat16, exact=False, seed=2)
    full = torch.ops.muse_spark.linear_triton(x, w, silu_mul)
    for lo, hi in ((0, 1), (3, 11), (7, 16)):
        assert torch.equal(torch.ops.muse_spark.linear_triton(x[lo:hi], w, silu_mul), full[lo:hi])


def fp8_operands(M, N, K, seed=3):
    """x [M, K] bf16, an FP8 weight [N, K] with per-row fp32 scales (random magnitudes per row, as
    ``muse-spark quantize`` writes them from absmax)."""
    from muse_spark.models.layers import FP8, FP8_MAX

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, 1, generator=g))
    scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).float()
    return x.to(DEV), (w / scale).to(FP8).to(DEV), scale.to(DEV)


@needs_kernels
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("shape", ["step_rows", "draft_rows_ragged_n", "ragged_k"] + (["muse_down"] if BIG else []))
def test_the_fp8_weight_kernel_gives_the_bf16_kernels_bits_on_the_dequantized_weight(tops, shape, silu_mul):
    """W8A16 (``linear_fp8_triton``): each FP8 weight tile is dequantized as it streams in (its rows'
    scales, rounded once to bf16, as ``fp8_linear_reference`` rounds the weight), so the output is the
    bf16 kernel's on the dequantized weight: bit for bit in the interpreter; on a GPU within a rounding
    of it (the H100 gave other bits on the down projection's shape: the MMA of a tile converted in
    registers may take K in another order than that of a tile loaded as it is); against the fp32-sum
    reference within the bf16 kernel's own bound. A planted error (the scales of the next row) is caught
    by the same comparison."""
    from muse_spark.plugins.linear.op import fp8_reference

    M, N, K = LINEAR_SHAPES[shape]
    x, w8, scale = fp8_operands(M, 2 * N if silu_mul else N, K)
    got = torch.ops.muse_spark.linear_fp8_triton(x, w8, scale, silu_mul)
    dequant = (w8.float() * scale).to(torch.bfloat16)
    bf16 = torch.ops.muse_spark.linear_triton(x, dequant, silu_mul)
    if ON_GPU:
        torch.testing.assert_close(got.float(), bf16.float(), rtol=2**-7, atol=2**-8 * bf16.float().abs().max().item())
    else:
        assert torch.equal(got, bf16)
    ref = fp8_reference(x, w8, scale, silu_mul).float()
    torch.testing.assert_close(got.float(), ref, rtol=2**-6, atol=2**-7 * ref.abs().max().item())
    planted = torch.ops.muse_spark.linear_fp8_triton(x, w8, scale.roll(1, 0), silu_mul)
    assert not torch.equal(planted, got)
    assert torch.equal(torch.ops.muse_spark.linear_fp8_triton(x, w8, scale.reshape(-1), silu_mul), got)  # [N] too


@needs_kernels
def test_the_models_run_fp8_projections_on_the_kernel(tops):
    """``linear_fp8_triton`` gives the bits of the bf16 kernel on the dequantized weight, and ``models.layers.linear``
    of an ``Fp8Weight`` takes it where the skinny kernel fits on a GPU without FP8 tensor cores (``linear_w8a8_triton``
    with them), the reference beyond its rows; the op refuses a weight or scales it cannot take."""
    from muse_spark.models import layers

    x, w8, scale = fp8_operands(8, 64, 128)
    fw = layers.Fp8Weight(w8, scale, None, torch.bfloat16)
    assert layers._triton_linear_fits(x, fw) == ON_GPU
    want = torch.ops.muse_spark.linear_triton(x, fw.dequantize(torch.bfloat16), False)
    assert torch.equal(torch.ops.muse_spark.linear_fp8_triton(x, w8, scale, False), want) or not ON_GPU
    if ON_GPU and layers.fp8_tensor_cores(x.device):  # (there the models run W8A8: the next test)
        assert torch.equal(layers.linear(x, fw), torch.ops.muse_spark.linear_w8a8_triton(x, w8, scale, False))
    else:
        assert torch.equal(layers.linear(x, fw), want) or not ON_GPU
    assert torch.equal(layers.linear(x, fw), layers.fp8_linear_reference(x, fw)) or ON_GPU
    with pytest.raises(ValueError, match="float8_e4m3fn weight"):
        torch.ops.muse_spark.linear_fp8_triton(x, w8.to(torch.bfloat16), scale, False)
    with pytest.raises(ValueError, match="float32 scales"):
        torch.ops.muse_spark.linear_fp8_triton(x, w8, scale[:-1], False)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("rows", [64, 256] + ([1024] if BIG else []))
def test_many_rows_of_fp8_projections_run_w8a8(tops, rows, silu_mul):
    """Beyond the skinny kernel's rows, ``models.layers.linear`` of an ``Fp8Weight`` runs W8A8 on FP8 hardware
    (``fp8_linear_w8a8``: the rows quantized per token, ``torch._scaled_mm`` with row-wise scales), within one
    bf16 rounding of its spec ``fp8_w8a8_reference`` (two under silu·mul: the H100 gave 1 element of 1.8 M
    1.08 % apart, g or u one rounding off); a planted error (the scale of the channel of the largest output, its
    up-projection's under silu·mul, 5 % off) is
    caught by the same comparison."""
    from muse_spark.models import layers

    N, K = (2 * 1792 if silu_mul else 4096), 4096
    x, w8, scale = fp8_operands(rows, N, K)
    fw = layers.Fp8Weight(w8, scale, None, torch.bfloat16)
    assert not layers._triton_linear_fits(x, fw) and layers._w8a8_fits(x, fw)
    fn = layers.linear_silu_mul if silu_mul else layers.linear
    got = fn(x, fw)
    assert torch.equal(got, layers.fp8_linear_w8a8(x, fw, silu_mul))
    spec = layers.fp8_w8a8_reference(x, fw, silu_mul).float()
    # one bf16 rounding of the product apart; under silu·mul g and u are each one rounding apart, then rounded
    tol = dict(rtol=2**-6 if silu_mul else 2**-7, atol=2**-13 * spec.abs().max().item())
    torch.testing.assert_close(got.float(), spec, **tol)
    bad = layers.Fp8Weight(w8, scale.clone(), None, torch.bfloat16)
    bad.scale[(N // 2 if silu_mul else 0) + int(spec.abs().amax(0).argmax())] *= 1.05  # the largest output's
    with pytest.raises(AssertionError):
        torch.testing.assert_close(fn(x, bad).float(), spec, **tol)


@needs_kernels
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("rows", [1, 8, 16, 64])  # (64: past the ops' rows, what benchmarks/linear.py times at batch 8)
def test_the_skinny_w8a8_kernel_computes_the_w8a8_spec(tops, rows, silu_mul):
    """``launch_linear(w8a8=True)`` (the skinny kernel's W8A8 form for few rows: the rows quantized per token by a
    kernel whose codes and row scales are ``quantize_rows``' bits, per token or with a static scale; FP8
    operands on both sides of the MMA): its product within one bf16 rounding of ``fp8_w8a8_reference`` (two under
    silu·mul: g and u each rounded); a planted error (the largest output's weight scale 5 % off; per-token scales
    where the static one is asked for) is caught by the same comparison. K not a multiple of the chunk."""
    from muse_spark.models import layers
    from muse_spark.plugins.linear import triton_kernel as lk
    from muse_spark.plugins.triton_math import interpreting

    N, K = (2 * 96 if silu_mul else 96), 1100
    x, w8, scale = fp8_operands(rows, N, K)
    x[0, 5] = 0.0
    q = torch.empty((rows, K), dtype=layers.FP8, device=x.device)
    xs = torch.empty((rows,), dtype=torch.float32, device=x.device)
    lk._quantize_rows_kernel[(rows,)](x, q, xs, K, x.stride(0), xs, BLOCK_K=256)
    want_q, want_s = layers.quantize_rows(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(xs, want_s.reshape(-1))
    # a static scale (a checkpoint's input_scale) a third of the largest row's: codes saturate at ±448, as specified
    static = (x.float().abs().amax() / (3 * 448)).reshape(())
    want_q, want_s = layers.quantize_rows(x, static)
    assert (want_q.float().abs() == 448).any()
    lk._quantize_rows_kernel[(rows,)](x, q, xs, K, x.stride(0), static.reshape(1), BLOCK_K=256, STATIC=True)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(xs, want_s.reshape(-1).expand(rows))
    # the launch the op makes: the whole row in one load (K ≤ ROW_AT_ONCE), the same bits per token and static
    for s_in in (None, static.reshape(1)):
        got_q, got_s = lk._quantize_rows(x, lambda f: f, input_scale=s_in)
        want_q, want_s = layers.quantize_rows(x, s_in)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(got_s, want_s.reshape(-1))
    fs = layers.Fp8Weight(w8, scale, static, torch.bfloat16)
    spec_s = layers.fp8_w8a8_reference(x, fs, silu_mul).float()
    got_s = lk.launch_linear(x, w8, silu_mul, interpret=interpreting(), scale=scale, w8a8=True, input_scale=static)
    tol_s = dict(rtol=2**-6 if silu_mul else 2**-7, atol=2**-13 * spec_s.abs().max().item())
    torch.testing.assert_close(got_s.float(), spec_s, **tol_s)
    with pytest.raises(AssertionError):  # (the per-token scales instead of the static one)
        torch.testing.assert_close(
            lk.launch_linear(x, w8, silu_mul, interpret=interpreting(), scale=scale, w8a8=True).float(), spec_s,
            **tol_s)

    fw = layers.Fp8Weight(w8, scale, None, torch.bfloat16)
    spec = layers.fp8_w8a8_reference(x, fw, silu_mul).float()
    got = lk.launch_linear(x, w8, silu_mul, interpret=interpreting(), scale=scale, w8a8=True).float()
    tol = dict(rtol=2**-6 if silu_mul else 2**-7, atol=2**-13 * spec.abs().max().item())
    torch.testing.assert_close(got, spec, **tol)
    bad = scale.clone()
    bad[(N // 2 if silu_mul else 0) + int(spec.abs().amax(0).argmax())] *= 1.05
    with pytest.raises(AssertionError):
        wrong = lk.launch_linear(x, w8, silu_mul, interpret=interpreting(), scale=bad, w8a8=True)
        torch.testing.assert_close(wrong.float(), spec, **tol)


@needs_kernels
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_the_skinny_w8a8_kernel_computes_the_spec_over_a_long_k(static):
    """The W8A8 form's launch for a long K (the down projection's and the draft's fc: 16-row tiles over 1,024-column
    chunks, ``default_config(w8a8=True)``), K not a multiple of the chunk: within one bf16 rounding of
    ``fp8_w8a8_reference``, and a planted wrong weight scale is caught."""
    from muse_spark.models import layers
    from muse_spark.plugins.linear import triton_kernel as lk
    from muse_spark.plugins.triton_math import interpreting

    M, N, K = 8, 48, 8192 + 200
    assert lk.default_config(M, N, K, False, fp8=True, w8a8=True)["BLOCK_K"] == 1024
    x, w8, scale = fp8_operands(M, N, K, seed=5)
    input_scale = (x.float().abs().amax() / (2 * 448)).reshape(()) if static else None
    spec = layers.fp8_w8a8_reference(x, layers.Fp8Weight(w8, scale, input_scale, torch.bfloat16)).float()
    tol = dict(rtol=2**-7, atol=2**-13 * spec.abs().max().item())

    def run(sc):
        return lk.launch_linear(x, w8, interpret=interpreting(), scale=sc, w8a8=True, input_scale=input_scale).float()

    torch.testing.assert_close(run(scale), spec, **tol)
    bad = scale.clone()
    bad[int(spec.abs().amax(0).argmax())] *= 1.05
    with pytest.raises(AssertionError):
        torch.testing.assert_close(run(bad), spec, **tol)


@needs_kernels
def test_the_w8a8_op_is_the_kernels_w8a8_form_and_the_models_take_it_on_fp8_tensor_cores(tops):
    """``muse_spark::linear_w8a8_triton`` gives ``launch_linear(w8a8=True)``'s bits (silu·mul too), refuses what the
    kernel cannot take, and ``models.layers.linear`` of an ``Fp8Weight`` takes it for few rows on a GPU with FP8
    tensor cores, a static activation scale passed on (W8A16 without them)."""
    from muse_spark.models import layers
    from muse_spark.plugins.linear import triton_kernel as lk
    from muse_spark.plugins.triton_math import interpreting

    x, w8, scale = fp8_operands(8, 128, 256)
    for silu_mul in (False, True):
        got = torch.ops.muse_spark.linear_w8a8_triton(x, w8, scale, silu_mul)
        assert torch.equal(got, lk.launch_linear(x, w8, silu_mul, interpret=interpreting(), scale=scale, w8a8=True))
    with pytest.raises(ValueError, match="at most 16 rows"):
        torch.ops.muse_spark.linear_w8a8_triton(torch.cat([x] * 3), w8, scale, False)
    with pytest.raises(ValueError, match="even number of weight rows"):
        torch.ops.muse_spark.linear_w8a8_triton(x, w8[:127], scale[:127], True)
    s = torch.tensor(0.01, device=x.device)
    dynamic = layers.linear(x, layers.Fp8Weight(w8, scale, None, torch.bfloat16))
    static = layers.linear(x, layers.Fp8Weight(w8, scale, s, torch.bfloat16))
    w8a16 = torch.ops.muse_spark.linear_fp8_triton(x, w8, scale, False)
    with pytest.raises(ValueError, match="one float32 value"):
        torch.ops.muse_spark.linear_w8a8_triton(x, w8, scale, False, torch.ones(2, device=x.device))
    # rows quantized before the op (by the residual kernel that produced them): the same bits, no quantizing launch;
    # rows that are not x's shape, or codes without their scales, are refused
    q, qs = layers.quantize_rows(x)
    for silu_mul in (False, True):
        assert torch.equal(torch.ops.muse_spark.linear_w8a8_triton(x, w8, scale, silu_mul, None, q, qs.reshape(-1)),
                           torch.ops.muse_spark.linear_w8a8_triton(x, w8, scale, silu_mul))
    with pytest.raises(ValueError, match="rows must be"):
        torch.ops.muse_spark.linear_w8a8_triton(x, w8, scale, False, None, q[:4], qs[:4].reshape(-1))
    with pytest.raises(ValueError, match="come together"):
        torch.ops.muse_spark.linear_w8a8_triton(x, w8, scale, False, None, q)
    if ON_GPU:
        if layers.fp8_tensor_cores(x.device):
            assert torch.equal(dynamic, torch.ops.muse_spark.linear_w8a8_triton(x, w8, scale, False))
            assert torch.equal(static, torch.ops.muse_spark.linear_w8a8_triton(x, w8, scale, False, s))
            assert not torch.equal(dynamic, w8a16) and not torch.equal(static, dynamic)
        else:
            assert torch.equal(dynamic, w8a16) and torch.equal(static, w8a16)
    else:  # (off CUDA the models run the W8A16 reference)
        assert not layers.fp8_tensor_cores(x.device)
        ref = layers.fp8_linear_reference(x, layers.Fp8Weight(w8, scale, None, torch.bfloat16))
        assert torch.equal(dynamic, ref) and torch.equal(static, ref)


@needs_kernels
def test_linear_op_rejects_bad_inputs(tops):
    x, w = linear_operands(8, 64, 128, torch.bfloat16, exact=True)
    with pytest.raises(ValueError, match="at most 16 rows"):
        torch.ops.muse_spark.linear_triton(torch.cat([x] * 9), w, False)
    with pytest.raises(ValueError, match="contiguous weight"):
        torch.ops.muse_spark.linear_triton(x, w.t().contiguous().t(), False)
    with pytest.raises(ValueError, match="both bf16 or fp16"):
        torch.ops.muse_spark.linear_triton(x, w.half(), False)
    with pytest.raises(ValueError, match="even number of weight rows"):
        torch.ops.muse_spark.linear_triton(x, w[:63], True)


@needs_kernels
def test_models_call_the_linear_kernel_where_it_fits(tops):
    """``models.layers.linear`` takes the Triton kernel for few rows on CUDA (in bf16/fp16; the kernel
    option ``linear``: ``triton``, the default), cuBLAS for more rows or with ``linear="cublas"``,
    ``F.linear`` elsewhere; every path gives the correctly rounded result on exact operands."""
    from muse_spark.models import layers
    from muse_spark.options import KernelOptions, use_options

    assert layers.linear_path("cuda", torch.bfloat16) == "triton"  # the default
    assert layers.linear_path("cpu", torch.bfloat16) == "reference"
    x, w = linear_operands(8, 64, 128, torch.bfloat16, exact=True)
    expect = "triton" if ON_GPU else "reference"
    assert layers.linear_path(x.device, x.dtype) == expect
    assert layers._triton_linear_fits(x, w) == ON_GPU
    assert not layers._triton_linear_fits(torch.cat([x] * 3), w)
    for silu_mul in (False, True):
        fn = layers.linear_silu_mul if silu_mul else layers.linear
        assert torch.equal(fn(x, w), exact_linear(x, w, silu_mul)) or INTERPRETED
    with use_options(KernelOptions(linear="cublas")):
        assert layers.linear_path("cuda", torch.bfloat16) == "cublas"
        assert not layers._triton_linear_fits(x, w)


@needs_kernels
@pytest.mark.parametrize("form", ["bf16", "w8a16", "w8a8"])
@pytest.mark.parametrize("split", [2, 4])
def test_split_k_launches_compute_the_same_product(form, split):
    """A ``SPLIT_K`` launch configuration (K in equal parts, each program's fp32 sums stored, then summed in split
    order, scaled and rounded by ``_split_sum_kernel``): bf16 on exact operands gives the correctly rounded result,
    bit for bit; W8A16 and W8A8 their specs within one bf16 rounding, and a planted wrong weight scale is caught.
    A K that does not split into whole chunks, or silu·mul, is refused with the reason."""
    from muse_spark.models import layers
    from muse_spark.plugins.linear import triton_kernel as lk
    from muse_spark.plugins.triton_math import interpreting

    M, N, K = 7, 80, 1024
    cfg = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=2, SPLIT_K=split)
    if form == "bf16":
        x, w = linear_operands(M, N, K, torch.bfloat16, exact=True, seed=4)
        got = lk.launch_linear(x, w, interpret=interpreting(), config=cfg)
        assert torch.equal(got, exact_linear(x, w, False))
    else:
        x, w8, scale = fp8_operands(M, N, K, seed=6)
        w8a8 = form == "w8a8"
        fw = layers.Fp8Weight(w8, scale, None, torch.bfloat16)
        spec = (layers.fp8_w8a8_reference(x, fw) if w8a8 else layers.fp8_linear_reference(x, fw)).float()
        tol = dict(rtol=2**-7, atol=2**-13 * spec.abs().max().item())

        def run(sc):
            return lk.launch_linear(x, w8, interpret=interpreting(), config=cfg, scale=sc, w8a8=w8a8).float()

        torch.testing.assert_close(run(scale), spec, **tol)
        bad = scale.clone()
        bad[int(spec.abs().amax(0).argmax())] *= 1.05
        with pytest.raises(AssertionError):
            torch.testing.assert_close(run(bad), spec, **tol)
    x, w = linear_operands(M, 2 * N, K + 64, torch.bfloat16, exact=True)
    for silu_mul, k in ((True, K), (False, K + 64)):  # (silu·mul; a K of 1,088 is no whole number of chunks a part)
        with pytest.raises(ValueError, match="splits"):
            lk.launch_linear(x[:, :k].contiguous(), w[:, :k].contiguous(), silu_mul, interpret=interpreting(),
                             config=cfg)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("shape", [(8, 6144, 4096, False), (8, 14336, 4096, True), (8, 4096, 14336, False),
                                   (16, 4096, 4096, False), (16, 14336, 4096, True), (16, 4096, 14336, False),
                                   (64, 6144, 4096, False), (64, 14336, 4096, True), (64, 4096, 14336, False)],
                         ids=str)
@pytest.mark.parametrize("fp8", [False, True, "w8a8"], ids=["bf16", "fp8", "w8a8"])
def test_linear_kernel_compiles_for_hopper(shape, fp8):
    """The linear kernel under its default launch configurations at the production shapes, bf16, W8A16
    (an FP8 weight and its rows' scales) and W8A8 (the rows given as codes with their scales), compiled ahead of
    time for sm_90 without a GPU: it fits an SM's shared memory."""
    from muse_spark.plugins.linear import triton_kernel as lk

    M, N, K, silu_mul = shape
    cfg = lk.default_config(M, N, K, silu_mul, fp8=bool(fp8), w8a8=fp8 == "w8a8")
    names = ["x_ptr", "w_ptr", "y_ptr", "M", "N", "K", "stride_xm", "stride_ym"]
    sig = dict(zip(names, ["*fp8e4nv" if fp8 == "w8a8" else "*bf16", "*fp8e4nv" if fp8 else "*bf16", "*bf16"]
                   + ["i32"] * 5))
    consts = dict(BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                  EVEN_N=N % cfg["BLOCK_N"] == 0, EVEN_K=K % cfg["BLOCK_K"] == 0, SILU_MUL=silu_mul, IEEE_DOT=False)
    if fp8 == "w8a8":  # (launch_linear(w8a8=True)'s: FP8 codes on both sides, the row scales)
        sig.update(s_ptr="*fp32", xs_ptr="*fp32")
        consts["W8A8"] = True
    elif fp8:
        sig["s_ptr"] = "*fp32"
        consts["SCALED"] = True
    k = compile_for_hopper(lk._linear_kernel, sig, consts, cfg["num_warps"], cfg["num_stages"],
                           multiples_of_16=("N", "K", "stride_xm", "stride_ym"))
    assert k.asm["cubin"] and k.metadata.shared <= 227 * 1024


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("w8a8", [False, True], ids=["w8a16", "w8a8"])
def test_split_k_kernels_compile_for_hopper(w8a8):
    """A split-K launch of the down projection's shape (64-row tiles over 512-column chunks, K in 4 parts) and the
    kernel that sums its parts, compiled ahead of time for sm_90 without a GPU."""
    from muse_spark.plugins.linear import triton_kernel as lk

    names = ["x_ptr", "w_ptr", "y_ptr", "M", "N", "K", "stride_xm", "stride_ym"]
    sig = dict(zip(names, ["*fp8e4nv" if w8a8 else "*bf16", "*fp8e4nv", "*bf16"] + ["i32"] * 5))
    sig.update(s_ptr="*fp32", xs_ptr="*fp32", part_ptr="*fp32")
    consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=512, EVEN_N=True, EVEN_K=True, SILU_MUL=False, IEEE_DOT=False,
                  SPLIT_K=4, **({"W8A8": True} if w8a8 else {"SCALED": True}))
    k = compile_for_hopper(lk._linear_kernel, sig, consts, 4, 4, multiples_of_16=("N", "K", "stride_xm", "stride_ym"))
    assert k.asm["cubin"] and k.metadata.shared <= 227 * 1024
    sig = dict(part_ptr="*fp32", y_ptr="*bf16", xs_ptr="*fp32", s_ptr="*fp32", M="i32", N="i32", stride_ym="i32")
    k = compile_for_hopper(lk._split_sum_kernel, sig, dict(SPLIT_K=4, BLOCK=1024, W8A8=w8a8), 4,
                           multiples_of_16=("N", "stride_ym"))
    assert k.asm["cubin"]


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
@pytest.mark.parametrize("block", [(1024, False, 4), (4096, True, 4), (16384, True, 8)],
                         ids=["chunks", "one-load-4096", "one-load-16384"])
def test_the_row_quantizing_kernel_compiles_for_hopper(static, block):
    """The W8A8 form's ``_quantize_rows_kernel`` (bf16 rows to E4M3 codes and fp32 scales, per row or with a static
    scale), compiled ahead of time for sm_90 without a GPU, as ``launch_linear(w8a8=True)`` launches it: a row in
    chunks, or the whole row in one load (the step's 4,096 and 16,384 columns)."""
    from muse_spark.plugins.linear import triton_kernel as lk

    block_k, one_load, warps = block
    sig = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", K="i32", stride_xm="i32", in_scale_ptr="*fp32")
    k = compile_for_hopper(lk._quantize_rows_kernel, sig, dict(BLOCK_K=block_k, STATIC=static, ONE_LOAD=one_load),
                           warps, multiples_of_16=("K", "stride_xm"))
    assert k.asm["cubin"]
