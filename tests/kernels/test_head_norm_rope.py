"""The q/k head norm + RoPE kernels (plugins/head_norm_rope) against their references: the plain
kernel, the one that writes the KV caches, and the step's RoPE table."""

from __future__ import annotations

import pytest
import torch

from kernels.kernel_utils import (DEV, HAS_TRITON, INTERPRETED, ON_GPU, cache_write_operands, compile_for_hopper,
                                  needs_kernels)
from tolerances import NORM_TOL


ROPE_SHAPES = {  # (B, S, heads, Dh): q and k of a step side by side, a prefill chunk, one head
    "step": (1, 8, 40, 128),
    "batch": (3, 5, 12, 64),
    "prefill_chunk": (2, 33, 10, 128),
    "one_head": (2, 3, 1, 16),
}


def rope_operands(shape, dtype, strided, seed=0):
    """x [B, S, NH, Dh] on DEV (with ``strided``: the first NH heads of a wider row, as q|k are of a
    qkv projection) and positions [B, S] up to 10^5 (angles far past 2π)."""
    B, S, NH, dh = shape
    g = torch.Generator().manual_seed(seed)
    wide = (3 * torch.randn(B, S, (NH + 3 if strided else NH) * dh, generator=g)).to(dtype).to(DEV)
    x = wide[..., : NH * dh].reshape(B, S, NH, dh)
    positions = torch.randint(0, 100_000, (B, S), generator=g).to(DEV)
    return x, positions


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
@pytest.mark.parametrize("theta", [5e5, 1e4])
def test_head_norm_rope_kernel_matches_reference(tops, shape, dtype, theta):
    """The norm within its rounding (one unit of the dtype's last place where the fp32 value
    straddles a boundary). RoPE of the kernel's own normed values against torch's rope of them:
    the angle position·inv_freq is fp32, whose resolution at positions up to 10^5 is ~0.008 rad,
    so two math libraries (libdevice as Triton links it, torch's CUDA kernels on the H200; numpy
    under the interpreter) may disagree by a few ulps of the angle. The bound is that, plus one
    unit of the dtype at the head's scale. On the H200 a bound of one dtype unit alone failed in
    fp16 at these positions (errors up to 0.012, concentrated in the highest-frequency dims)."""
    from muse_spark.plugins.head_norm_rope.reference import head_norm_rope_reference, head_rms_norm, rope

    x, positions = rope_operands(ROPE_SHAPES[shape], dtype, strided=shape != "one_head", seed=len(shape))
    normed = tops.head_norm_rope(x, positions, 1e-6, theta, False)
    ref_normed = head_rms_norm(x, 1e-6)
    assert normed.shape == x.shape and normed.dtype == dtype and normed.is_contiguous()
    torch.testing.assert_close(normed, ref_normed, **NORM_TOL[dtype])
    assert (normed != ref_normed).float().mean() < 0.02
    out = tops.head_norm_rope(x, positions, 1e-6, theta, True)
    given_normed = rope(normed, positions, theta)
    # 4 ulps of each dim's fp32 angle, times the pair's magnitude |n1| + |n2| (both halves of y see it)
    dh = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh))
    angle = positions.float()[..., None, None] * inv_freq  # [B, S, 1, Dh/2]
    d_angle = 4 * (torch.nextafter(angle, torch.full_like(angle, float("inf"))) - angle)
    nf = normed.float()
    pair = nf[..., : dh // 2].abs() + nf[..., dh // 2 :].abs()
    angle_bound = torch.cat([pair * d_angle] * 2, -1)
    unit = 2 * torch.finfo(dtype).eps * (nf.abs().amax(-1, keepdim=True) + 1e-3)  # a dtype unit at the head's scale
    bound = angle_bound + unit
    err = (out.float() - given_normed.float()).abs()
    differ = (out != given_normed).float().mean().item()
    assert (err <= bound).all(), f"{(err > bound).sum().item()} values off by more than the bound (max {err.max():.4g})"
    assert differ < 0.1, f"{differ:.4f} of the values differ"
    # against the whole reference: the norm's rounding, rotated, on top
    ref = head_norm_rope_reference(x, positions, 1e-6, theta, True)
    assert ((out.float() - ref.float()).abs() <= bound + unit).all()


@needs_kernels
def test_head_norm_rope_rows_are_independent_of_batch_and_grid(tops):
    """A row's bits depend on its own heads and position only: one request alone, or among others,
    or with fewer heads beside it, gives the same bits."""
    x, positions = rope_operands((3, 4, 40, 128), torch.bfloat16, strided=True, seed=3)
    full = tops.head_norm_rope(x, positions, 1e-6, 5e5, True)
    assert torch.equal(tops.head_norm_rope(x[1:2], positions[1:2], 1e-6, 5e5, True), full[1:2])
    assert torch.equal(tops.head_norm_rope(x[:, :, 32:], positions, 1e-6, 5e5, True), full[:, :, 32:])


@needs_kernels
@pytest.mark.parametrize("rope", [True, False])
def test_head_norm_rope_cache_kernel_writes_what_the_layers_wrote(tops, rope):
    """The fused cache write: q is bit for bit the plain kernel's first H heads; the caches hold, at
    rows ``slots`` and ``positions``, the plain kernel's k heads and v exactly, as the layers'
    index_put wrote them, and nothing else changed; the reference op (CPU path) does the same."""
    from muse_spark.plugins.head_norm_rope.reference import head_norm_rope_cache_reference

    x, v, positions, slots, (kc, vc) = cache_write_operands()
    H = x.shape[2] - v.shape[2]
    want_kc, want_vc = kc.clone(), vc.clone()
    normed = tops.head_norm_rope(x, positions, 1e-6, 5e5, rope)
    want_kc[slots[:, None], positions] = normed[:, :, H:]
    want_vc[slots[:, None], positions] = v
    q = torch.ops.muse_spark.head_norm_rope_cache_triton(x, v, positions, 1e-6, 5e5, rope, kc, vc, slots)
    assert q.shape == (*x.shape[:2], H, x.shape[3]) and q.is_contiguous()
    assert torch.equal(q, normed[:, :, :H])
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    # the spec on fresh copies of the same operands (on the CPU): the same writes, its norm and RoPE
    # within the kernel's rounding (test_head_norm_rope_kernel_matches_reference bounds that closely)
    x, v, positions, slots, (rkc, rvc) = (t.cpu() if torch.is_tensor(t) else [c.cpu() for c in t]
                                          for t in cache_write_operands())
    rq = head_norm_rope_cache_reference(x, v, positions, 1e-6, 5e5, rope, rkc, rvc, slots)
    assert torch.equal(rvc, want_vc.cpu())
    torch.testing.assert_close(rq.float(), q.float().cpu(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(rkc.float(), want_kc.float().cpu(), rtol=0.05, atol=0.05)


@needs_kernels
def test_head_norm_rope_cache_kernel_never_writes_outside_the_caches(tops):
    """A row or position outside the caches writes nothing (the index_put it replaces would have
    raised); the other requests' rows are written as usual and q is still computed."""
    x, v, positions, slots, (kc, vc) = cache_write_operands()
    before_k, before_v = kc.clone(), vc.clone()
    bad_pos = positions.clone()
    bad_pos[0, 1] = kc.shape[1]  # one past the window
    bad_slots = slots.clone()
    bad_slots[1] = kc.shape[0]  # one past the last row
    q = torch.ops.muse_spark.head_norm_rope_cache_triton(x, v, bad_pos, 1e-6, 5e5, True, kc, vc, bad_slots)
    changed = (kc != before_k).any(-1).any(-1) | (vc != before_v).any(-1).any(-1)  # [N, T]
    expect = torch.zeros_like(changed)
    for b, slot in enumerate(bad_slots.tolist()):
        for p in bad_pos[b].tolist():
            if slot < kc.shape[0] and p < kc.shape[1]:
                expect[slot, p] = True
    assert expect.sum() == bad_pos.shape[1] - 1  # request 0's other positions; request 1 nothing
    assert torch.equal(changed, expect)
    assert torch.equal(q, tops.head_norm_rope(x, bad_pos, 1e-6, 5e5, True)[:, :, : x.shape[2] - v.shape[2]])


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the op's module imports it)")
def test_head_norm_rope_cache_op_rejects_bad_inputs(tops):
    x, v, positions, slots, (kc, vc) = cache_write_operands()
    op = torch.ops.muse_spark.head_norm_rope_cache_triton
    with pytest.raises(ValueError, match="v must be"):
        op(x, v[:, :2], positions, 1e-6, 5e5, True, kc, vc, slots)
    with pytest.raises(ValueError, match="k_cache must be"):
        op(x, v, positions, 1e-6, 5e5, True, kc.float(), vc, slots)
    with pytest.raises(ValueError, match="v_cache must be"):
        op(x, v, positions, 1e-6, 5e5, True, kc, vc[..., :16], slots)
    with pytest.raises(ValueError, match="slots must be int64"):
        op(x, v, positions, 1e-6, 5e5, True, kc, vc, slots.int())
    with pytest.raises(ValueError, match="positions must be int64"):
        op(x, v, positions[:, :1], 1e-6, 5e5, True, kc, vc, slots)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the op's module imports it)")
def test_head_norm_rope_op_rejects_bad_inputs(tops):
    x, positions = rope_operands((1, 2, 4, 16), torch.bfloat16, strided=False)
    op = torch.ops.muse_spark.head_norm_rope_triton
    with pytest.raises(ValueError, match="bf16 or fp16 with Dh a power of two"):
        op(x.float(), positions, 1e-6, 5e5, True)
    with pytest.raises(ValueError, match="Dh a power of two"):
        op(x[..., :12], positions, 1e-6, 5e5, True)
    with pytest.raises(ValueError, match="positions must be int64"):
        op(x, positions.int(), 1e-6, 5e5, True)
    with pytest.raises(ValueError, match="positions must be int64"):
        op(x, positions[:, :1], 1e-6, 5e5, True)


@needs_kernels
def test_models_call_the_head_norm_rope_kernel_on_cuda(tops, monkeypatch):
    """``models.layers.head_norm_rope`` runs the kernel for bf16/fp16 on CUDA, the reference
    elsewhere (fp32, CPU)."""
    from muse_spark.models import layers

    calls = []
    real = torch.ops.muse_spark.head_norm_rope_triton
    monkeypatch.setattr(layers.torch.ops.muse_spark, "head_norm_rope_triton",
                        lambda *a: calls.append(a[0].device.type) or real(*a), raising=False)
    x, positions = rope_operands((1, 3, 5, 32), torch.bfloat16, strided=True)
    out = layers.head_norm_rope(x, positions, 1e-6, 5e5, True)
    layers.head_norm_rope(x.float(), positions, 1e-6, 5e5, True)
    assert calls == (["cuda"] if ON_GPU else [])  # bf16 on CUDA only
    assert torch.equal(out, tops.head_norm_rope(x, positions, 1e-6, 5e5, True) if ON_GPU
                       else layers.head_norm_rope_reference(x, positions, 1e-6, 5e5, True))


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
def test_head_norm_rope_kernel_compiles_for_hopper_with_the_exact_math():
    """Compiled for sm_90 without a GPU: cos/sin are the CUDA math library's (range reduction in
    software), not the approximate instructions. (The library itself uses FMAs, so the rotation's
    separate roundings are checked by the GPU test's exact match with torch instead.)"""
    from muse_spark.plugins.head_norm_rope import triton_kernel as hk

    names = ["x_ptr", "pos_ptr", "out_ptr", "S", "NH", "sx_b", "sx_s", "sx_h", "sp_b", "sp_s"]
    sig = dict(zip(names, ["*bf16", "*i64", "*bf16"] + ["i32"] * 7))
    k = compile_for_hopper(hk._head_norm_rope_kernel, sig,
                           dict(EPS=1e-6, THETA=5e5, DH=128, BLOCK_H=hk.BLOCK_H, ROPE=True), 4)
    ptx = k.asm["ptx"]
    assert k.asm["cubin"] and "cos.approx" not in ptx and "sin.approx" not in ptx
    # the cache-writing variant: the same math, compiled
    import inspect

    names = [n for n, prm in inspect.signature(hk._head_norm_rope_cache_kernel.fn).parameters.items()
             if "constexpr" not in str(prm.annotation)]
    sig = dict(zip(names, ["*bf16", "*bf16", "*i64", "*i64", "*bf16", "*bf16", "*bf16"] + ["i32"] * 20
                   + ["*fp32", "*fp32", "i32", "*fp32", "*fp32"]))  # (cos_ptr, sin_ptr: the table, read with
    # TABLE; STAB; ks_ptr, vs_ptr: an FP8 cache's scales, read with KV_FP8)
    assert len(sig) == len(names) == 32
    consts = dict(EPS=1e-6, THETA=5e5, DH=128, BLOCK_H=hk.BLOCK_H, ROPE=True, BLOCK_KV=8)
    k = compile_for_hopper(hk._head_norm_rope_cache_kernel, sig, consts, 4)
    assert k.asm["cubin"] and "cos.approx" not in k.asm["ptx"]
    # writing through block tables (paged caches): compiles too
    assert compile_for_hopper(hk._head_norm_rope_cache_kernel, sig, dict(consts, PAGE=16), 4).asm["cubin"]
    # reading the step's table (launch_rope_table) instead: no angle computed, none of the library's
    # trigonometry (its large-argument reduction keeps an array in local memory)
    t = compile_for_hopper(hk._head_norm_rope_cache_kernel, sig, dict(consts, TABLE=True), 4).asm["ptx"]
    assert "ld.local" in k.asm["ptx"] and "ld.local" not in t and len(t.splitlines()) < len(ptx.splitlines()) / 2
    # writing an FP8 cache (KV_FP8: E4M3 caches, the codes by a saturating round-to-nearest conversion), slot rows
    # and block tables
    fp8 = dict(sig, kc_ptr="*fp8e4nv", vc_ptr="*fp8e4nv")
    for extra in ({}, {"PAGE": 16}):
        f = compile_for_hopper(hk._head_norm_rope_cache_kernel, fp8, dict(consts, KV_FP8=True, **extra), 4)
        assert f.asm["cubin"] and "e4m3" in f.asm["ptx"]


@needs_kernels
@pytest.mark.parametrize("rope", [True, False])
def test_the_rope_table_gives_the_norm_kernel_its_own_bits(rope):
    """``launch_rope_table``: the step's RoPE cos/sin computed once (the angles' chain of libdevice
    calls costs 2.7 of the norm kernel's 4.2 µs a layer on the H200, docs/log.md,
    2026-12-03). The norm + cache kernel reading it gives the bits it computes in place: q and the
    caches equal (without RoPE the table is not read)."""
    from muse_spark.plugins.head_norm_rope import triton_kernel as hk

    x, v, positions, slots, (kc, vc) = cache_write_operands()
    kc2, vc2 = kc.clone(), vc.clone()
    table = hk.launch_rope_table(positions, 5e5, x.shape[3])
    assert table[0].shape == (positions.numel(), x.shape[3] // 2) and table[0].dtype == torch.float32
    q = hk.launch_head_norm_rope_cache(x, v, positions, 1e-6, 5e5, rope, kc, vc, slots)
    qt = hk.launch_head_norm_rope_cache(x, v, positions, 1e-6, 5e5, rope, kc2, vc2, slots, table=table)
    assert torch.equal(q, qt) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_the_qkv_projection_writes_the_rope_table_the_norm_kernel_reads(tops, rows):
    """``linear_rope_table_triton`` (the layers' default, the kernel option ``rope_table``): y is
    ``linear_triton``'s bit for bit (the extra program writes only the table); the table is ``launch_rope_table``'s (the same
    angles' code) and close to the torch spec (``rope_table_reference``); the norm + cache op fed
    the table gives its own bits."""
    from muse_spark.plugins.head_norm_rope.reference import rope_table_reference
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_rope_table

    g = torch.Generator().manual_seed(rows)
    dh, K, N = 32, 256, 3 * 64 + 32  # a ragged last weight tile
    x = torch.randn(1, rows, K, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(torch.bfloat16).to(DEV)
    positions = (1000 + torch.arange(rows)).view(1, rows).to(DEV)
    y, cos, sin = torch.ops.muse_spark.linear_rope_table_triton(x, w, positions, 5e5, dh)
    assert torch.equal(y, torch.ops.muse_spark.linear_triton(x, w, False))
    want = launch_rope_table(positions, 5e5, dh)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1]) and cos.shape == (rows, dh // 2)
    spec = rope_table_reference(positions.cpu(), 5e5, dh)
    torch.testing.assert_close(cos.cpu(), spec[0], rtol=0, atol=1e-3)  # angles ~1e3 rad: an fp32 ulp moves them
    torch.testing.assert_close(sin.cpu(), spec[1], rtol=0, atol=1e-3)
    # the norm + cache op reading the table: its own bits
    x4, v, pos, slots, (kc, vc) = cache_write_operands(B=2, S=3)
    table = launch_rope_table(pos, 5e5, x4.shape[3])
    kc2, vc2 = kc.clone(), vc.clone()
    q = torch.ops.muse_spark.head_norm_rope_cache_triton(x4, v, pos, 1e-6, 5e5, True, kc, vc, slots)
    qt = torch.ops.muse_spark.head_norm_rope_cache_triton(x4, v, pos, 1e-6, 5e5, True, kc2, vc2, slots, *table)
    assert torch.equal(q, qt) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@needs_kernels
@pytest.mark.parametrize("w8a8", [False, True], ids=["w8a16", "w8a8"])
def test_an_fp8_qkv_projection_writes_the_rope_table_too(tops, w8a8):
    """``linear_fp8_rope_table_triton`` (an FP8 layer's qkv projection): y is the FP8 projection's own op's bits
    (``linear_fp8_triton``, or ``linear_w8a8_triton`` in the W8A8 form), the table ``launch_rope_table``'s; it
    refuses positions that are not one per row."""
    from muse_spark.models.layers import FP8, FP8_MAX
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_rope_table

    g = torch.Generator().manual_seed(5)
    dh, K, N, rows = 32, 256, 3 * 64 + 32, 8
    x = torch.randn(1, rows, K, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.randn(N, K, generator=g)
    scale = (w.abs().amax(1) / FP8_MAX).float()
    w8, scale = (w / scale[:, None]).to(FP8).to(DEV), scale.to(DEV)
    positions = (1000 + torch.arange(rows)).view(1, rows).to(DEV)
    ops = torch.ops.muse_spark
    y, cos, sin = ops.linear_fp8_rope_table_triton(x, w8, scale, positions, 5e5, dh, w8a8)
    plain = (ops.linear_w8a8_triton if w8a8 else ops.linear_fp8_triton)(x, w8, scale, False)
    assert torch.equal(y, plain) and not torch.equal(y, (ops.linear_fp8_triton if w8a8 else ops.linear_w8a8_triton)(
        x, w8, scale, False))
    want = launch_rope_table(positions, 5e5, dh)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    with pytest.raises(ValueError, match="one per row of x"):
        ops.linear_fp8_rope_table_triton(x, w8, scale, positions[:, :3], 5e5, dh, w8a8)
    static = torch.tensor(0.004, device=DEV)  # (a checkpoint's input_scale: the W8A8 form only)
    if w8a8:
        y_s, cos_s, _ = ops.linear_fp8_rope_table_triton(x, w8, scale, positions, 5e5, dh, True, static)
        assert torch.equal(y_s, ops.linear_w8a8_triton(x, w8, scale, False, static)) and not torch.equal(y_s, y)
        assert torch.equal(cos_s, cos)
    else:
        with pytest.raises(ValueError, match="for the W8A8 form"):
            ops.linear_fp8_rope_table_triton(x, w8, scale, positions, 5e5, dh, False, static)


@needs_kernels
def test_the_rope_table_ops_refuse_what_they_cannot_take(tops):
    x4, v, pos, slots, (kc, vc) = cache_write_operands(B=2, S=3)
    cos, sin = torch.zeros(6, x4.shape[3] // 2, device=DEV), torch.zeros(6, x4.shape[3] // 2, device=DEV)
    op = torch.ops.muse_spark.head_norm_rope_cache_triton
    with pytest.raises(ValueError, match=r"rope_sin must be a contiguous float32 \[6, 16\].*got none"):
        op(x4, v, pos, 1e-6, 5e5, True, kc, vc, slots, cos, None)
    with pytest.raises(ValueError, match=r"rope_cos must be a contiguous float32 \[6, 16\]"):
        op(x4, v, pos, 1e-6, 5e5, True, kc, vc, slots, cos[:5], sin)
    x = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(64, 64, dtype=torch.bfloat16, device=DEV)
    lrt = torch.ops.muse_spark.linear_rope_table_triton
    with pytest.raises(ValueError, match="one per row of x"):
        lrt(x, w, torch.zeros(1, 3, dtype=torch.int64, device=DEV), 5e5, 16)
    with pytest.raises(ValueError, match="head_dim 12 must be a power of two"):
        lrt(x, w, torch.zeros(1, 4, dtype=torch.int64, device=DEV), 5e5, 12)


@needs_kernels
@pytest.mark.parametrize("paged", [False, True], ids=["slot_rows", "block_tables"])
def test_head_norm_rope_cache_kernel_quantizes_into_an_fp8_cache(tops, paged):
    """An FP8 KV cache (E4M3 codes, a float32 scale per KV head): the fused write stores the codes the layers'
    quantized write (``quantize_kv`` of the plain kernel's k heads and of v) stores, bit for bit, and nothing
    else; q is the plain kernel's. Through block tables too."""
    from muse_spark.plugins.attention.reference import CacheKV, PagedKV, quantize_kv

    x, v, positions, slots, (kc, vc) = cache_write_operands()
    KV = v.shape[2]
    H = x.shape[2] - KV
    ks = torch.linspace(0.05, 0.3, KV, device=kc.device)
    vs = torch.linspace(0.4, 0.02, KV, device=kc.device)
    kq, vq = quantize_kv(kc, ks), quantize_kv(vc, vs)
    rows = slots
    if paged:  # the same positions as pools of 8-position blocks (block 0 owned by nobody): slot s's position p
        n = kq.shape[1] // 8  # in block 1 + s·n + p // 8
        kq, vq = (torch.cat([c[:1, :8], c.reshape(-1, 8, *c.shape[2:])]) for c in (kq, vq))
        rows = 1 + slots[:, None] * n + torch.arange(n, device=slots.device)[None, :]
    want_k, want_v = kq.clone(), vq.clone()
    normed = tops.head_norm_rope(x, positions, 1e-6, 5e5, True)
    kind = PagedKV if paged else CacheKV
    kind(want_k, want_v, rows, positions, None, (ks, vs))(normed[:, :, H:], v)
    q = torch.ops.muse_spark.head_norm_rope_cache_triton(x, v, positions, 1e-6, 5e5, True, kq, vq, rows,
                                                         k_scale=ks, v_scale=vs)
    assert torch.equal(q, normed[:, :, :H])
    assert torch.equal(kq.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vq.view(torch.uint8), want_v.view(torch.uint8))
    with pytest.raises(ValueError, match=r"an FP8 cache is written with k_scale float32 \[%d\]" % KV):
        torch.ops.muse_spark.head_norm_rope_cache_triton(x, v, positions, 1e-6, 5e5, True, kq, vq, rows)
    with pytest.raises(ValueError, match="k_cache must be"):  # scales for a cache of the compute dtype
        torch.ops.muse_spark.head_norm_rope_cache_triton(x, v, positions, 1e-6, 5e5, True, kc, vc, slots,
                                                         k_scale=ks, v_scale=vs)
