"""Triton kernel of the attention's per-head q/k normalization and RoPE, in one pass.

Spec: ``muse_spark.plugins.head_norm_rope.reference.head_norm_rope_reference`` (``head_rms_norm`` then ``rope``)::

    n = rms_norm(x, None, eps)                   # fp32 per head, rounded to x's dtype
    inv_freq[i] = 1 / theta ** (2i / Dh)         # fp32, i < Dh/2
    f = position · inv_freq                      # fp32
    y = [n1·cos f − n2·sin f, n2·cos f + n1·sin f]   # rotate-half (NeoX), rounded to x's dtype

for x [B, S, NH, Dh] (q and k of a step side by side: NH = H + KV) and positions [B, S].

Why a kernel: compiled, the two plain functions became four Inductor kernels per layer (a cos/sin
table, q, k fused with the cache write, and one more: 0.20 ms and 128 launches of a batch-1
step on the H200, docs/log.md, 2026-12-03); here q and k of a layer are one launch.

One program per (row b·S + s, block of ``BLOCK_H`` heads): the two halves of each head are
loaded separately, so the rotation needs no shuffle. Rounding, against the reference on CUDA:

* the norm sums x² in another order than torch's reduction (both use the hardware rsqrt), so a
  normed value may land one unit of the dtype's last place away: ``tests/kernels/test_head_norm_rope.py``
  holds the tolerance;
* the rest is the reference's arithmetic step for step: ``inv_freq``, the angle, cos and sin
  come from the CUDA math library (libdevice ``powf``/``cosf``/``sinf``, not the approximate
  instructions, which are far off at large angles), and every product and sum of the rotation
  is rounded on its own (``mul_rn``/``add_rn``, never an FMA). On the H200 the rotated values
  are still not all bit-equal to torch's eager ops given the same normed input (the angles reach
  10^3–10^5 rad, where an fp32 angle resolves only ~0.008 rad, so an ulp of ``inv_freq``, cos or
  sin between libdevice as Triton links it and torch's kernels moves the result): the tests bound
  them by 4 ulps of each dimension's angle times the pair's magnitude, plus one unit of the dtype
  at the head's scale.

The eager engine (bf16/fp16 on CUDA) calls this kernel too, so it and the compiled packages agree
bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse_spark.plugins.triton_math import add_rn, cos_exact, div_rn, mul_rn, pdl_enter, pow_exact, sin_exact, to_rne

BLOCK_H = 16  # heads per program


@triton.jit
def rope_angles(pos, AXIS: tl.constexpr, THETA: tl.constexpr, DH: tl.constexpr):
    """cos and sin of the RoPE angles ``pos · inv_freq`` (fp32; the dims along ``AXIS`` of a 2-D
    block, ``pos`` a scalar or one per position along the other axis): the reference's ``inv_freq``,
    angle, cos and sin step for step (module docstring). A chain of dependent libdevice calls whose
    latency every kernel that rotates pays (docs/log.md, 2026-12-03), hence also
    ``_rope_table_kernel``: the same values once per step."""
    HALF: tl.constexpr = DH // 2
    d = tl.arange(0, HALF)
    expo = div_rn((2 * d).to(tl.float32), tl.full((HALF,), DH, tl.float32))
    inv = tl.expand_dims(div_rn(tl.full((HALF,), 1.0, tl.float32),
                                pow_exact(tl.full((HALF,), THETA, tl.float32), expo)), 1 - AXIS)
    f = mul_rn(inv, tl.zeros_like(inv) + pos)  # the angle, one per (dim, position)
    return cos_exact(f), sin_exact(f)


@triton.jit
def norm_rotate(x1, x2, pos, AXIS: tl.constexpr, EPS: tl.constexpr, THETA: tl.constexpr, DH: tl.constexpr,
                ROPE: tl.constexpr, DTYPE: tl.constexpr, TABLE: tl.constexpr = False, c=0.0, sn=0.0):
    """Heads whose two halves are ``x1``, ``x2`` (fp32, the head's dims along ``AXIS`` of a 2-D
    block): ``head_rms_norm``, rounded to DTYPE as it rounds, then (ROPE) rotated at position
    ``pos`` (fp32, broadcastable to the block: a scalar, or one per head along the other axis) →
    the two halves rounded to DTYPE. The arithmetic of ``head_norm_rope_reference`` step for step
    (module docstring); shared by this module's kernels and the qkv GEMM's epilogue
    (``plugins/linear``). ``TABLE``: the angles' cos and sin are given (``c``, ``sn``, from
    ``_rope_table_kernel``: the same bits), ``pos`` is not read."""
    ms = (tl.sum(x1 * x1, axis=AXIS) + tl.sum(x2 * x2, axis=AXIS)) / DH
    r = tl.expand_dims(tl.rsqrt(ms + EPS), AXIS)
    n1 = to_rne(x1 * r, DTYPE).to(tl.float32)
    n2 = to_rne(x2 * r, DTYPE).to(tl.float32)
    if ROPE:
        if not TABLE:
            c, sn = rope_angles(pos, AXIS, THETA, DH)
        y1 = add_rn(mul_rn(n1, c), mul_rn(-n2, sn))
        y2 = add_rn(mul_rn(n2, c), mul_rn(n1, sn))
    else:
        y1 = n1
        y2 = n2
    return to_rne(y1, DTYPE), to_rne(y2, DTYPE)


@triton.jit
def _norm_rope_heads(x_ptr, pos_ptr, b, s, heads, hm, sx_b, sx_s, sx_h, sp_b, sp_s, EPS: tl.constexpr,
                     THETA: tl.constexpr, DH: tl.constexpr, ROPE: tl.constexpr, DTYPE: tl.constexpr,
                     TABLE: tl.constexpr = False, cos_ptr=None, sin_ptr=None, row=0):
    """The two halves of heads ``heads`` of x[b, s], normed and rotated (``norm_rotate``); with
    ``TABLE`` the angles' cos and sin are row ``row`` of the tables (``_rope_table_kernel``)."""
    HALF: tl.constexpr = DH // 2
    d = tl.arange(0, HALF)
    src = x_ptr + b.to(tl.int64) * sx_b + s.to(tl.int64) * sx_s + heads[:, None].to(tl.int64) * sx_h + d[None, :]
    x1 = tl.load(src, mask=hm, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=hm, other=0.0).to(tl.float32)
    if ROPE and TABLE:
        at = row.to(tl.int64) * HALF + d[None, :]
        return norm_rotate(x1, x2, 0.0, 1, EPS, THETA, DH, ROPE, DTYPE, True, tl.load(cos_ptr + at),
                           tl.load(sin_ptr + at))
    if ROPE:
        pos = tl.load(pos_ptr + b.to(tl.int64) * sp_b + s.to(tl.int64) * sp_s).to(tl.float32)
    else:
        pos = 0.0
    return norm_rotate(x1, x2, pos, 1, EPS, THETA, DH, ROPE, DTYPE)


@triton.jit
def rope_table_rows(pos_ptr, cos_ptr, sin_ptr, N, first, THETA: tl.constexpr, DH: tl.constexpr,
                    BLOCK_R: tl.constexpr, PDL: tl.constexpr = 0):
    """Rows [first, first + BLOCK_R) of the RoPE table: cos and sin [N, Dh/2] fp32 of the angles of
    positions [N] (int64), by ``rope_angles``, so the bits of the rotation that computes them in
    place. (``_rope_table_kernel``, and the qkv GEMM's extra program: ``plugins/linear``.)"""
    HALF: tl.constexpr = DH // 2
    rows = first + tl.arange(0, BLOCK_R) + pdl_enter(PDL)
    rm = rows < N
    pos = tl.load(pos_ptr + rows, mask=rm, other=0).to(tl.float32)[:, None]
    c, sn = rope_angles(pos, 1, THETA, DH)
    at = rows.to(tl.int64)[:, None] * HALF + tl.arange(0, HALF)[None, :]
    tl.store(cos_ptr + at, c, mask=rm[:, None])
    tl.store(sin_ptr + at, sn, mask=rm[:, None])


@triton.jit
def _rope_table_kernel(pos_ptr, cos_ptr, sin_ptr, N, THETA: tl.constexpr, DH: tl.constexpr,
                       BLOCK_R: tl.constexpr, PDL: tl.constexpr = 0):
    """The RoPE table of N positions, BLOCK_R rows a program (``rope_table_rows``)."""
    rope_table_rows(pos_ptr, cos_ptr, sin_ptr, N, tl.program_id(0) * BLOCK_R, THETA, DH, BLOCK_R, PDL)


@triton.jit
def _head_norm_rope_kernel(
    x_ptr,  # [B, S, NH, Dh], last dim contiguous
    pos_ptr,  # [B, S] int64 (unused unless ROPE)
    out_ptr,  # [B, S, NH, Dh] contiguous, x's dtype
    S, NH,
    sx_b, sx_s, sx_h, sp_b, sp_s,
    EPS: tl.constexpr,  # constexpr: Inductor would pass a float argument as fp64 (see attention's SCALE)
    THETA: tl.constexpr,
    DH: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROPE: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    HALF: tl.constexpr = DH // 2
    row = tl.program_id(0) + pdl_enter(PDL)  # every load and store is addressed after the PDL wait
    b = row // S
    s = row % S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = (heads < NH)[:, None]
    y1, y2 = _norm_rope_heads(x_ptr, pos_ptr, b, s, heads, hm, sx_b, sx_s, sx_h, sp_b, sp_s, EPS, THETA, DH, ROPE,
                              out_ptr.dtype.element_ty)
    dst = out_ptr + (row.to(tl.int64) * NH + heads[:, None]) * DH + tl.arange(0, HALF)[None, :]
    tl.store(dst, y1, mask=hm)
    tl.store(dst + HALF, y2, mask=hm)


@triton.jit
def fp8_codes(x, scale, dtype: tl.constexpr):
    """An FP8 KV cache's codes of ``x`` (the compute dtype's values) with ``scale`` (broadcast against x): x / scale
    in fp32 (correctly rounded), saturated to ±448, rounded to nearest even into ``dtype`` (float8e4nv):
    ``plugins.attention.reference.quantize_kv``."""
    y = div_rn(x.to(tl.float32), scale)
    return to_rne(tl.minimum(tl.maximum(y, -448.0), 448.0), dtype)


@triton.jit
def _head_norm_rope_cache_kernel(
    x_ptr,  # [B, S, H + KV, Dh], last dim contiguous: q and k heads
    v_ptr,  # [B, S, KV, Dh], last dim contiguous
    pos_ptr,  # [B, S] int64
    slot_ptr,  # [B] int64
    out_ptr,  # [B, S, H, Dh] contiguous: the normed q
    kc_ptr, vc_ptr,  # caches [N_SLOTS, T, KV, Dh], last dim contiguous
    S, NH, H, KVH, N_SLOTS, T,
    sx_b, sx_s, sx_h, sp_b, sp_s, sv_b, sv_s, sv_h, skc_n, skc_t, skc_h, svc_n, svc_t, svc_h,
    EPS: tl.constexpr, THETA: tl.constexpr, DH: tl.constexpr, BLOCK_H: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_KV: tl.constexpr, PDL: tl.constexpr = 0,
    cos_ptr=None, sin_ptr=None, TABLE: tl.constexpr = False,  # TABLE: the angles' cos/sin [B·S, Dh/2] given
    # PAGE (paged caches): the caches are pools of blocks [N_SLOTS blocks, PAGE, KV, Dh] and slot_ptr the
    # requests' block tables [B, T / PAGE] (row stride STAB): position p goes to offset p % PAGE of block
    # table[b, p // PAGE]
    STAB=0, PAGE: tl.constexpr = 0,
    # KV_FP8: the caches hold an FP8 cache's E4M3 codes, written with the KV heads' scales ks_ptr/vs_ptr
    # (float32 [KV]: ``fp8_codes``)
    ks_ptr=None, vs_ptr=None, KV_FP8: tl.constexpr = False,
):
    """``_head_norm_rope_kernel`` whose heads from H on are keys, stored into the K cache at row
    slots[b], position pos[b, s] instead of the output; the last column of programs copies v's
    heads into the V cache there (``KV_FP8``: both quantized). A row or position outside the caches
    writes nothing."""
    HALF: tl.constexpr = DH // 2
    row = tl.program_id(0) + pdl_enter(PDL)  # every load and store is addressed after the PDL wait
    b = row // S
    s = row % S
    if PAGE > 0:
        cpos = tl.load(pos_ptr + b.to(tl.int64) * sp_b + s.to(tl.int64) * sp_s).to(tl.int64)
        held = (cpos >= 0) & (cpos < T)
        slot = tl.load(slot_ptr + b.to(tl.int64) * STAB + tl.where(held, cpos, 0) // PAGE).to(tl.int64)
        cpos = cpos % PAGE
        in_cache = held & (slot >= 0) & (slot < N_SLOTS)
    else:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        cpos = tl.load(pos_ptr + b.to(tl.int64) * sp_b + s.to(tl.int64) * sp_s).to(tl.int64)
        in_cache = (slot >= 0) & (slot < N_SLOTS) & (cpos >= 0) & (cpos < T)
    if tl.program_id(1) == tl.num_programs(1) - 1:  # the V heads, copied as they are
        kvh = tl.arange(0, BLOCK_KV)
        vm = (kvh < KVH)[:, None] & in_cache
        dd = tl.arange(0, DH)
        val = tl.load(v_ptr + b.to(tl.int64) * sv_b + s.to(tl.int64) * sv_s + kvh[:, None].to(tl.int64) * sv_h
                      + dd[None, :], mask=vm, other=0.0)
        if KV_FP8:
            val = fp8_codes(val, tl.load(vs_ptr + kvh, mask=kvh < KVH, other=1.0)[:, None], vc_ptr.dtype.element_ty)
        tl.store(vc_ptr + slot * svc_n + cpos * svc_t + kvh[:, None].to(tl.int64) * svc_h + dd[None, :], val, mask=vm)
    else:
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = (heads < NH)[:, None]
        y1, y2 = _norm_rope_heads(x_ptr, pos_ptr, b, s, heads, hm, sx_b, sx_s, sx_h, sp_b, sp_s, EPS, THETA, DH,
                                  ROPE, out_ptr.dtype.element_ty, TABLE, cos_ptr, sin_ptr, row)
        d = tl.arange(0, HALF)[None, :]
        qm = hm & (heads < H)[:, None]
        dst = out_ptr + (row.to(tl.int64) * H + heads[:, None]) * DH + d
        tl.store(dst, y1, mask=qm)
        tl.store(dst + HALF, y2, mask=qm)
        km = hm & (heads >= H)[:, None] & in_cache
        kdst = kc_ptr + slot * skc_n + cpos * skc_t + (heads - H)[:, None].to(tl.int64) * skc_h + d
        if KV_FP8:  # (the normed keys, rounded to the compute dtype as the reference's are, then quantized)
            ksc = tl.load(ks_ptr + (heads - H), mask=(heads >= H) & (heads < NH), other=1.0)[:, None]
            y1 = fp8_codes(y1, ksc, kc_ptr.dtype.element_ty)
            y2 = fp8_codes(y2, ksc, kc_ptr.dtype.element_ty)
        tl.store(kdst, y1, mask=km)
        tl.store(kdst + HALF, y2, mask=km)


def fits(x: torch.Tensor) -> bool:
    """What the kernel takes: x [B, S, NH, Dh] in bf16/fp16, Dh a power of two in [2, 512]."""
    return x.dim() == 4 and fits_heads(x.dtype, x.shape[-1])


def fits_heads(dtype: torch.dtype, dh: int) -> bool:
    """``fits`` for heads of ``dtype`` and size ``dh`` (before they exist: the qkv projection that
    writes the RoPE table decides it)."""
    return dtype in (torch.bfloat16, torch.float16) and 2 <= dh <= 512 and dh & (dh - 1) == 0


def launch_head_norm_rope(x: torch.Tensor, positions: torch.Tensor, eps: float, theta: float, use_rope: bool,
                          wrap=lambda f: f, pdl: int = 0, launch_pdl: bool = False) -> torch.Tensor:
    """x [B, S, NH, Dh] (any strides; the last dim is made contiguous if it is not), positions
    [B, S] int64 → [B, S, NH, Dh] contiguous in x's dtype. ``wrap`` is ``torch.library.wrap_triton``
    inside the op; ``pdl``/``launch_pdl``: as ``plugins.linear.triton_kernel.launch_linear``'s."""
    B, S, NH, dh = x.shape
    out = torch.empty((B, S, NH, dh), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_h = min(BLOCK_H, triton.next_power_of_2(NH))
    wrap(_head_norm_rope_kernel)[(B * S, triton.cdiv(NH, block_h))](
        x, positions, out, S, NH, x.stride(0), x.stride(1), x.stride(2), positions.stride(0), positions.stride(1),
        EPS=float(eps), THETA=float(theta), DH=dh, BLOCK_H=block_h, ROPE=bool(use_rope), PDL=int(pdl),
        num_warps=4 if block_h * dh >= 1024 else 1, **({"launch_pdl": True} if launch_pdl else {}),
    )
    return out


def launch_rope_table(positions: torch.Tensor, theta: float, dh: int, wrap=lambda f: f,
                      pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, S] int64 → the RoPE angles' (cos, sin), each [B·S, Dh/2] fp32, computed as the
    norm kernels compute them in place (the same bits): a step's table, for every layer's
    ``launch_head_norm_rope_cache(table=...)``."""
    pos = positions.reshape(-1)
    if pos.stride(0) != 1:
        pos = pos.contiguous()
    n = pos.numel()
    cos = torch.empty((n, dh // 2), dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if n:
        block_r = min(16, triton.next_power_of_2(n))
        wrap(_rope_table_kernel)[(triton.cdiv(n, block_r),)](pos, cos, sin, n, THETA=float(theta), DH=dh,
                                                            BLOCK_R=block_r, PDL=int(pdl), num_warps=4)
    return cos, sin


def launch_head_norm_rope_cache(x: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, eps: float, theta: float,
                                use_rope: bool, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                                wrap=lambda f: f, pdl: int = 0,
                                table: tuple[torch.Tensor, torch.Tensor] | None = None,
                                scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``launch_head_norm_rope`` of x [B, S, H + KV, Dh] (q and k side by side) with the key heads and
    v [B, S, KV, Dh] written into the caches [N, T, KV, Dh] (last dim contiguous) at row
    ``slots[b]``, position ``positions[b, s]`` (as ``k_cache[slots[:, None], positions] = k``) →
    the normed q [B, S, H, Dh] contiguous. One launch: the cache write is the kernel's store. A
    row or position out of the caches' range writes nothing (callers keep them in range; the
    engines check positions against the window before a step). ``pdl``: as
    ``plugins.linear.triton_kernel.launch_linear``'s. ``table``: the step's (cos, sin), as
    ``launch_rope_table(positions)`` writes them, read instead of computing the angles (the same
    bits; the engines by default, from the qkv projection's launch; off with the kernel option
    ``rope_table`` false). ``slots`` [B, n] (paged caches): pools of blocks [blocks, P, KV, Dh] and the
    requests' block tables; position p goes to offset p % P of block slots[b, p // P]. ``scales`` =
    (k_scale, v_scale) float32 [KV]: the caches are an FP8 cache's (float8_e4m3fn), written quantized
    (``plugins.attention.reference.quantize_kv``)."""
    B, S, NH, dh = x.shape
    paged = slots.dim() == 2
    if paged and slots.stride(-1) != 1:
        slots = slots.contiguous()
    KV = v.shape[2]
    H = NH - KV
    out = torch.empty((B, S, H, dh), dtype=x.dtype, device=x.device)
    if B * S == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    block_h = min(BLOCK_H, triton.next_power_of_2(NH))
    wrap(_head_norm_rope_cache_kernel)[(B * S, triton.cdiv(NH, block_h) + 1)](
        x, v, positions, slots, out, k_cache, v_cache, S, NH, H, KV, k_cache.shape[0],
        k_cache.shape[1] * (slots.shape[1] if paged else 1),
        x.stride(0), x.stride(1), x.stride(2), positions.stride(0), positions.stride(1), v.stride(0), v.stride(1),
        v.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), EPS=float(eps), THETA=float(theta), DH=dh, BLOCK_H=block_h, ROPE=bool(use_rope),
        BLOCK_KV=triton.next_power_of_2(KV), PDL=int(pdl), num_warps=4 if block_h * dh >= 1024 else 1,
        # every argument passed (Inductor's mutation analysis fills in no defaults); no table: dummies
        cos_ptr=x if table is None else table[0], sin_ptr=x if table is None else table[1],
        TABLE=table is not None and bool(use_rope), STAB=slots.stride(0) if paged else 0,
        PAGE=k_cache.shape[1] if paged else 0,
        ks_ptr=x if scales is None else scales[0], vs_ptr=x if scales is None else scales[1],
        KV_FP8=scales is not None,
    )
    return out
