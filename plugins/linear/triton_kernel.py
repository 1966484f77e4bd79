"""Triton kernel of the skinny linear layer: ``y = x @ Wᵀ`` for few rows (a speculative step).

Spec: ``torch.nn.functional.linear(x, W)`` (bf16/fp16 products, fp32 accumulation, the output
rounded once to x's dtype), and with ``silu_mul`` the DSpark/Muse feed-forward's
``silu(g) * u`` of the two halves ``g = x @ W[:I]ᵀ``, ``u = x @ W[I:]ᵀ``, rounded as the eager
modules round them (g and u to the compute dtype, ``silu`` computed in fp32 and rounded, the
product computed in fp32 and rounded).

Why not cuBLAS: a step multiplies 8 rows (batch 1, γ = 7) by ~17.7 GB of weights, so it is a
stream of the weights. cuBLAS picks tiles of 64–512 weight rows and splits K where that leaves
too few tiles, which costs a second reduction kernel per GEMM (80 per step at batch 1) and
leaves the weight stream below the copy bandwidth (docs/log.md: the GEMM floor). Here
the weight rows are cut into ``BLOCK_N``-row tiles, one program each over the whole of K (no
split, no reduction pass, bits that do not depend on the launch), enough programs to keep
every SM streaming; the rows of x are the MMA's narrow side (``tl.dot(W_tile, x_tileᵀ)``,
padded to 16). ``silu_mul`` computes both halves of a tile of the gate/up projection in one
program and writes only ``silu(g)·u``: the gate/up output never goes to memory.

Measured (H200, docs/log.md, 2026-12-02): faster than cuBLAS for every GEMM of a
batch-1 step (the step's 151 GEMMs 4.51–4.60 ms against 4.64–4.74), slower at 64 rows (hence
``MAX_ROWS``). The default for ≤ ``MAX_ROWS`` rows since 2026-12-03 (batch-1 step 5.95 ms against
6.10 with cuBLAS; the kernel option ``linear="cublas"`` selects cuBLAS): before the head_norm_rope
plugin op, Inductor split the q/k norm + RoPE kernel after the qkv projection into four, which
cost what the GEMMs gained.

Bits: each output element is one fp32 dot over K in a fixed order (BLOCK_K chunks through the
MMA), whatever the batch or the grid, so the eager engine and the compiled packages (which
call the same op) agree bit for bit. Against cuBLAS the sums differ by rounding only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse_spark.plugins.head_norm_rope.triton_kernel import rope_table_rows
from muse_spark.plugins.triton_math import (add_rn, div_rn, e4m3_codes, exp_exact, mul_rn, pdl_enter,
                                            pdl_release, row_scale, to_rne)

# The kernel's range: at most this many rows of x. More rows re-read x once per weight tile and
# each program's share of the weight shrinks: at 64 rows (batch 8) the H200 sweep has the down
# projection at 118.6 µs against cuBLAS's 36.6 (benchmarks/linear.py --batches 1,8).
MAX_ROWS = 16
DEFAULT_CONFIG = dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4)
SHARED_BUDGET = 160 * 1024  # bytes of shared memory the pipeline's stages may take (227 KB per SM)
# The longest row of x the W8A8 row-quantizing kernel loads at once (the draft's fc: 16,384 columns, 64 fp32 values a
# thread at 8 warps); longer rows are read in chunks
ROW_AT_ONCE = 16384


def default_config(M: int, N: int, K: int, silu_mul: bool, budget: int = SHARED_BUDGET, fp8: bool = False,
                   w8a8: bool = False) -> dict:
    """Launch configuration, chosen by benchmarks/linear.py --sweep on the H200 (8 rows, each
    shape's weight streamed from HBM), then timed (``--batches 1,8``): 64-row tiles over 256-column
    chunks, 4 stages (qkv 15.4 µs, o 12.1, lm_head 245.3, against cuBLAS's 16.2 / 13.3 / 255.6);
    with silu·mul (two weight tiles per step) 128-column chunks and 3 stages (59.0 µs against 64.9
    for cuBLAS + silu); a long K (the down projection, the draft's fc) 16-row tiles over 512
    columns, 2 warps (down 31.9 µs against 32.8).
    ``fp8`` (the W8A16 form: an FP8 weight, one byte an element), from ``benchmarks/linear.py --sweep-fp8`` on an
    H100 (8 rows): an output of at most 4,096 columns in 32-row tiles over 256-column chunks, 4 stages (o 11.9 µs
    against 14.7 in the bf16 form's configuration, down 33.7 against 37.0: twice the programs on the SMs); the
    others as bf16 (qkv 15.3 µs, gate_up + silu 46.8; no other candidate was faster).
    ``w8a8`` (the W8A8 form: x's rows as E4M3 codes too, one byte an element), from the same sweep on an H200 (8
    rows): a long K (the down projection, the draft's fc) in 16-row tiles over 1,024-column chunks, 2 warps, 4
    stages, the bf16 form's bytes a stage (down 28.7 µs against 33.2 in W8A16's configuration, the draft's fc 38.3
    against 45.5); the other shapes as W8A16 (the fastest candidates 3–5 % ahead).
    More rows of x take more shared memory per stage: the chunk, then the stages, shrink
    until the stages fit ``budget`` bytes (``SHARED_BUDGET``)."""
    if w8a8 and not silu_mul and K >= 8192:
        cfg = dict(BLOCK_N=16, BLOCK_K=1024, num_warps=2, num_stages=4)
    elif fp8 and not silu_mul and N <= 4096:
        cfg = dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4)
    elif silu_mul:
        cfg = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    elif K >= 8192:
        cfg = dict(BLOCK_N=16, BLOCK_K=512, num_warps=2, num_stages=4)
    else:
        cfg = dict(DEFAULT_CONFIG)
    block_m = max(16, triton.next_power_of_2(M))

    def stage_bytes():
        return ((2 if silu_mul else 1) * cfg["BLOCK_N"] * (1 if fp8 else 2) + block_m * (1 if w8a8 else 2)) * cfg["BLOCK_K"]

    while cfg["num_stages"] * stage_bytes() > budget:
        if cfg["BLOCK_K"] > 128:
            cfg["BLOCK_K"] //= 2
        elif cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        else:
            break
    return cfg


@triton.jit
def _silu_mul(g, u, DTYPE: tl.constexpr):
    """silu(g)·u as the eager modules round it: g, u rounded to DTYPE; silu = g / (1 + exp(-g))
    in fp32, rounded; the product in fp32, rounded."""
    gf = to_rne(g, DTYPE).to(tl.float32)
    uf = to_rne(u, DTYPE).to(tl.float32)
    s = to_rne(div_rn(gf, add_rn(1.0, exp_exact(-gf))), DTYPE).to(tl.float32)
    return to_rne(mul_rn(s, uf), DTYPE)


@triton.jit
def _mma(w, xt, acc, IEEE_DOT: tl.constexpr, FP8_MMA: tl.constexpr = False):
    """acc + w·xt, fp32 accumulation; IEEE_DOT (the CPU interpreter, whose bf16 dot is broken): exact
    fp32 products. FP8_MMA (both operands E4M3: W8A8): Hopper's FP8 MMA keeps its running sum in less than fp32,
    so the sum is carried into the fp32 accumulator after every MMA instruction's 32 columns."""
    if IEEE_DOT:
        acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    elif FP8_MMA:
        acc = tl.dot(w, xt, acc, max_num_imprecise_acc=32)
    else:
        acc = tl.dot(w, xt, acc)
    return acc


@triton.jit
def _dequant(w, sc, SCALED: tl.constexpr, DTYPE: tl.constexpr):
    """SCALED (an FP8 weight tile and its rows' scales [BLOCK_N] fp32): the W8A16 spec's weight,
    ``(w.float() · scale)`` rounded once to the activations' DTYPE (``fp8_linear_reference``); else w."""
    if SCALED:
        w = to_rne(mul_rn(w.to(tl.float32), sc[:, None]), DTYPE)
    return w


@triton.jit
def _stream_tiles(x_ptr, w_ptr, rn, ru, rm, nmask, mmask, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                  TWO: tl.constexpr, IEEE_DOT: tl.constexpr, s_ptr=None, SCALED: tl.constexpr = False,
                  FP8_MMA: tl.constexpr = False):
    """The weight stream: fp32 sums W[rn]·xᵀ over K columns from x_ptr/w_ptr (W's rows ``stride_wn`` apart: the
    whole of K, or one split of it), [BLOCK_N, BLOCK_M]; with TWO also
    W[ru]·xᵀ (the second tile: the up half), else zeros. SCALED: W is FP8 with per-row scales at
    s_ptr, each tile dequantized as it is loaded (``_dequant``): the bf16 stream's sums of the spec's
    weight, bit for bit, from half the bytes. FP8_MMA: x and W both E4M3 codes, multiplied as they are (W8A8;
    the scales are the caller's)."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    sc = 0.0
    sc_u = 0.0
    if SCALED:
        sc = tl.load(s_ptr + rn, mask=nmask, other=0.0)
        if TWO:
            sc_u = tl.load(s_ptr + ru, mask=nmask, other=0.0)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    u_ptrs = w_ptr + ru.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]  # [BLOCK_K, BLOCK_M]: xᵀ
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=mmask[None, :], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
        else:
            kmask = (k0 + rk) < K
            xt = tl.load(x_ptrs, mask=mmask[None, :] & kmask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc = _mma(_dequant(w, sc, SCALED, DT), xt, acc, IEEE_DOT, FP8_MMA)
        if TWO:
            if EVEN_K:
                if EVEN_N:
                    wu = tl.load(u_ptrs)
                else:
                    wu = tl.load(u_ptrs, mask=nmask[:, None], other=0.0)
            else:
                wu = tl.load(u_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc_u = _mma(_dequant(wu, sc_u, SCALED, DT), xt, acc_u, IEEE_DOT, FP8_MMA)
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc, acc_u


@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K], last dim contiguous
    w_ptr,  # [N_w, K] contiguous (N_w = N, or 2·N with SILU_MUL)
    y_ptr,  # [M, N] out
    M, N, K, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, IEEE_DOT: tl.constexpr,
    PDL: tl.constexpr = 0,
    # ROPE_TABLE: one program more than the weight tiles (the last) writes the step's RoPE table of
    # the N_POS positions at pos_ptr into cos_ptr/sin_ptr [N_POS, DH_ROPE/2] fp32 (the qkv projection:
    # the angles' latency-bound chain then runs beside the weight stream, not in every norm kernel)
    pos_ptr=None, cos_ptr=None, sin_ptr=None, N_POS=0, ROPE_TABLE: tl.constexpr = False,
    THETA: tl.constexpr = 0.0, DH_ROPE: tl.constexpr = 2, BLOCK_POS: tl.constexpr = 16,
    # SCALED: w is FP8 (E4M3) with one fp32 scale per weight row at s_ptr [N_w] (W8A16)
    s_ptr=None, SCALED: tl.constexpr = False,
    # W8A8: x holds E4M3 codes with one fp32 scale per row at xs_ptr [M] (``_quantize_rows_kernel``), w E4M3 codes
    # with its rows' scales at s_ptr; FP8 MMA, then each sum times its row's and its column's scale.
    xs_ptr=None, W8A8: tl.constexpr = False,
    # SPLIT_K > 1: K in SPLIT_K equal parts (each a multiple of BLOCK_K), one program each (grid axis 2); each
    # program's fp32 sums, unscaled and unrounded, go to part_ptr [SPLIT_K, M, N] and ``_split_sum_kernel``
    # finishes the product (no SILU_MUL or ROPE_TABLE)
    part_ptr=None, SPLIT_K: tl.constexpr = 1,
):
    pid_n = tl.program_id(0)
    if ROPE_TABLE:
        if pid_n == tl.num_programs(0) - 1:
            rope_table_rows(pos_ptr, cos_ptr, sin_ptr, N_POS, 0, THETA, DH_ROPE, BLOCK_POS, PDL)
            return
    z = pdl_enter(PDL)
    pid_m = tl.program_id(1) + z  # x and y (upstream data) are addressed after the wait
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask = rn < N
    mmask = rm < M
    if SPLIT_K > 1:
        k_part = K // SPLIT_K
        k_lo = tl.program_id(2) * k_part
        acc, acc_u = _stream_tiles(x_ptr + k_lo, w_ptr + k_lo, rn, rn + N, rm, nmask, mmask, k_part, stride_xm, K,
                                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, False, IEEE_DOT, s_ptr, SCALED, W8A8)
        p_ptrs = part_ptr + (tl.program_id(2) * M + rm[None, :]) * N + rn[:, None]  # [BLOCK_N, BLOCK_M]
        pmask = nmask[:, None] & mmask[None, :]
        if PDL == 3:
            pmask = pmask & (pdl_release(acc) == 0)
        tl.store(p_ptrs, acc, mask=pmask)
        return
    acc, acc_u = _stream_tiles(x_ptr, w_ptr, rn, rn + N, rm, nmask, mmask, K, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K,
                               EVEN_N, EVEN_K, SILU_MUL, IEEE_DOT, s_ptr, SCALED, W8A8)  # u: the up half
    if W8A8:
        xs = tl.load(xs_ptr + rm, mask=mmask, other=0.0)
        acc = mul_rn(mul_rn(acc, xs[None, :]), tl.load(s_ptr + rn, mask=nmask, other=0.0)[:, None])
        if SILU_MUL:
            acc_u = mul_rn(mul_rn(acc_u, xs[None, :]), tl.load(s_ptr + rn + N, mask=nmask, other=0.0)[:, None])
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]  # [BLOCK_N, BLOCK_M]: yᵀ
    ymask = nmask[:, None] & mmask[None, :]
    if PDL == 3:  # the weight stream is done: the next kernel may launch while this program finishes
        ymask = ymask & (pdl_release(acc) == 0)  # (ordered through the mask, not the addresses)
    if SILU_MUL:
        out = _silu_mul(acc, acc_u, y_ptr.dtype.element_ty)
    else:
        out = to_rne(acc, y_ptr.dtype.element_ty)
    tl.store(y_ptrs, out, mask=ymask)


@triton.jit
def _split_sum_kernel(part_ptr, y_ptr, xs_ptr, s_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                      W8A8: tl.constexpr = False, PDL: tl.constexpr = 0):
    """The split-K product's last step: y[m, n] = the fp32 sum of the SPLIT_K partial sums part [SPLIT_K, M, N] in
    split order, W8A8: times the row's scale xs[m], then the column's s[n] (as ``_linear_kernel``'s epilogue),
    rounded once to y's dtype. One program per BLOCK columns of a row."""
    m = tl.program_id(1) + pdl_enter(PDL)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    nmask = rn < N
    acc = tl.load(part_ptr + m * N + rn, mask=nmask, other=0.0)
    for k in tl.static_range(1, SPLIT_K):
        acc = add_rn(acc, tl.load(part_ptr + (k * M + m) * N + rn, mask=nmask, other=0.0))
    if W8A8:
        acc = mul_rn(mul_rn(acc, tl.load(xs_ptr + m)), tl.load(s_ptr + rn, mask=nmask, other=0.0))
    tl.store(y_ptr + m * stride_ym + rn, to_rne(acc, y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, in_scale_ptr, BLOCK_K: tl.constexpr,
                          STATIC: tl.constexpr = False, PDL: tl.constexpr = 0, ONE_LOAD: tl.constexpr = False):
    """One row of x [M, K] per program into E4M3 codes q [M, K] and its scale s [M] fp32, as
    ``reference.quantize_rows`` computes them: per token, scale = max(absmax / 448, the smallest normal fp32);
    ``STATIC``, the checkpoint's ``input_scale`` (a float32 scalar at ``in_scale_ptr``, at least the smallest normal
    fp32) for every row, without a pass over the row; codes = x · (1 / scale) clamped to ±448, rounded to nearest
    even. ``PDL`` (``triton_math.pdl_enter``): the GEMM after it launches at once and waits for it in full.
    ``ONE_LOAD`` (BLOCK_K ≥ K): the row is loaded once and kept in registers for its absmax and its codes; else
    it is read in BLOCK_K chunks, twice per token (the kernel sits between its upstream and the GEMM, so its
    latency, a load round trip a chunk, is the step's)."""
    row = tl.program_id(0) + pdl_enter(PDL)
    rk = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row.to(tl.int64) * K
    if ONE_LOAD:
        kmask = rk < K
        v = tl.load(x_row + rk, mask=kmask, other=0.0).to(tl.float32)
        scale = row_scale(v, STATIC, in_scale_ptr)
        tl.store(s_ptr + row, scale)
        tl.store(q_row + rk, e4m3_codes(v, div_rn(1.0, scale)), mask=kmask)
        return
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if not STATIC:
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(x_row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
    scale = row_scale(amax, STATIC, in_scale_ptr)
    tl.store(s_ptr + row, scale)
    inv = div_rn(1.0, scale)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x_row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        tl.store(q_row + k0 + rk, e4m3_codes(v, inv), mask=k0 + rk < K)


def check_input_scale(input_scale: torch.Tensor, op: str = "linear") -> None:
    """A static activation scale (a checkpoint's ``input_scale``) is one float32 value, or a clear error (naming
    ``op``)."""
    if input_scale.numel() != 1 or input_scale.dtype != torch.float32:
        raise ValueError(f"{op}: a static input_scale is one float32 value, got {input_scale.dtype} "
                         f"{list(input_scale.shape)}")


def _quantize_rows(x2: torch.Tensor, wrap, pdl: int = 0, launch_pdl: bool = False,
                   input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] → (E4M3 codes [M, K], fp32 row scales [M]) by ``_quantize_rows_kernel``, one program a row
    (``input_scale``: a static float32 [1] for every row, else per token); under PDL (``pdl``, the GEMM's mode) it
    waits for its upstream, then (where the GEMMs trigger) triggers at once."""
    M, K = x2.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
    xs = torch.empty((M,), dtype=torch.float32, device=x2.device)
    block = triton.next_power_of_2(K)
    one_load = block <= ROW_AT_ONCE
    # (without a static scale its pointer is a dummy, x2, as the GEMM's unused pointers are: never an output)
    wrap(_quantize_rows_kernel)[(M,)](x2, q, xs, K, x2.stride(0), input_scale if input_scale is not None else x2,
                                      BLOCK_K=block if one_load else 1024, STATIC=input_scale is not None,
                                      PDL=1 if pdl == 3 else pdl, ONE_LOAD=one_load,
                                      num_warps=4 if block <= 4096 else 8,
                                      **({"launch_pdl": True} if launch_pdl else {}))
    return q, xs


def launch_linear_rope_table(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, theta: float, dh: int,
                             wrap=lambda f: f, interpret: bool = False, pdl: int = 0,
                             scale: torch.Tensor | None = None, w8a8: bool = False,
                             input_scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``launch_linear(x, w)`` and, from one more program of the same launch, the RoPE table of
    ``positions`` (``head_norm_rope.launch_rope_table``'s (cos, sin), the same bits): → (y, cos, sin).
    For the attention's qkv projection, whose norm + cache kernel then reads the table (the
    default, off with the kernel option ``rope_table`` false; docs/log.md, 2026-12-03). ``scale``, ``w8a8`` and
    ``input_scale``: y is ``launch_linear(x, w, scale=scale, w8a8=w8a8, input_scale=input_scale)``'s."""
    x2 = _rows(x, w)
    M, N = x2.shape[0], w.shape[0]
    pos = positions.reshape(-1)
    if pos.numel() != M or M > MAX_ROWS:
        raise ValueError(f"linear_rope_table: {pos.numel()} positions for {M} rows of x (at most {MAX_ROWS})")
    if pos.stride(0) != 1:
        pos = pos.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    cos = torch.empty((M, dh // 2), dtype=torch.float32, device=x.device)
    sin = torch.empty_like(cos)
    if M > 0:  # (with no weight rows the launch is the table's program alone)
        _launch(x2, w, y, False, wrap, interpret, None, pdl, False, table=(pos, cos, sin, theta, dh),
                scale=None if scale is None else scale.reshape(-1), w8a8=w8a8, input_scale=input_scale)
    return y.reshape(*x.shape[:-1], N), cos, sin


def _rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the kernel's rows [M, K] (last dim contiguous), after checking W is [N, K]."""
    K = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"linear: x {list(x.shape)} and weight {list(w.shape)}: expected weight [N, {K}]")
    x2 = x.reshape(-1, K)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2, w, y, silu_mul: bool, wrap, interpret: bool, config: dict | None, pdl: int, launch_pdl: bool,
            table: tuple | None = None, scale: torch.Tensor | None = None, w8a8: bool = False,
            input_scale: torch.Tensor | None = None, rows: tuple | None = None) -> None:
    """``_linear_kernel`` over rows x2 [M, K] into y [M, N]; ``table`` = (positions, cos, sin, theta,
    dh): one more program writes the RoPE table (``ROPE_TABLE``); ``w8a8`` (with ``scale``): the kernel's ``W8A8``
    form, x2's rows quantized to E4M3 codes by ``_quantize_rows`` first (a launch of its own; per token, or with
    the checkpoint's static ``input_scale``; ``rows``: (codes, scales) that a kernel before it quantized). Every kernel
    argument is passed, the table's as dummies without it (Inductor's mutation analysis fills in no defaults)."""
    row_scales = None
    if w8a8 and rows is not None:
        x2, row_scales = rows[0], rows[1].reshape(-1)
    elif w8a8:
        if scale is None:
            raise ValueError("linear: the W8A8 form needs the FP8 weight's row scales")
        if input_scale is not None:
            check_input_scale(input_scale)
            input_scale = input_scale.reshape(1)
        x2, row_scales = _quantize_rows(x2, wrap, 0 if interpret else int(pdl), launch_pdl, input_scale)
    (M, K), N = x2.shape, y.shape[1]
    cfg = dict(default_config(M, N, K, silu_mul, fp8=scale is not None, w8a8=w8a8), **(config or {}))
    split = int(cfg.get("SPLIT_K", 1))
    if split > 1 and (silu_mul or table is not None or K % (split * cfg["BLOCK_K"])):
        raise ValueError(f"linear: K = {K} splits {split} ways only into multiples of BLOCK_K = {cfg['BLOCK_K']}, "
                         "and not with silu_mul or the RoPE table")
    block_m = max(16, triton.next_power_of_2(M))
    grid = (triton.cdiv(N, cfg["BLOCK_N"]) + (table is not None), triton.cdiv(M, block_m), split)  # (the table last)
    pos, cos, sin, theta, dh = table if table is not None else (x2, x2, x2, 0.0, 2)
    part = torch.empty((split, M, N), dtype=torch.float32, device=x2.device) if split > 1 else None
    kernel_pdl = 0 if interpret else int(pdl)
    wrap(_linear_kernel)[grid](
        x2, w, y, M, N, K, x2.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], EVEN_N=N % cfg["BLOCK_N"] == 0,
        EVEN_K=K % cfg["BLOCK_K"] == 0, SILU_MUL=silu_mul, IEEE_DOT=interpret,
        PDL=kernel_pdl,
        pos_ptr=pos, cos_ptr=cos, sin_ptr=sin, N_POS=M if table is not None else 0, ROPE_TABLE=table is not None,
        THETA=float(theta), DH_ROPE=dh, BLOCK_POS=block_m if table is not None else 16,
        s_ptr=scale if scale is not None else x2, SCALED=scale is not None and not w8a8,
        xs_ptr=row_scales if row_scales is not None else x2, W8A8=w8a8,
        part_ptr=part if part is not None else x2, SPLIT_K=split,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({"launch_pdl": True} if launch_pdl else {}),
    )
    if part is not None:  # the partial sums' total, scaled and rounded
        block = min(1024, triton.next_power_of_2(N))
        wrap(_split_sum_kernel)[(triton.cdiv(N, block), M)](
            part, y, row_scales if row_scales is not None else part, scale if scale is not None else part, M, N,
            y.stride(0), SPLIT_K=split, BLOCK=block, W8A8=w8a8, PDL=1 if kernel_pdl == 3 else kernel_pdl,
            num_warps=4, **({"launch_pdl": True} if launch_pdl else {}))


def fits(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """What the kernel takes: x [..., K] with at most ``MAX_ROWS`` rows, W [N, K] contiguous, both
    bf16 or both fp16; or (``scale``) W FP8 E4M3 with one fp32 scale per row ([N] or [N, 1], contiguous)."""
    return fits_rows(x.numel() // max(x.shape[-1], 1), x.shape[-1], x.dtype, w, scale)


def fits_rows(rows: int, k: int, dtype: torch.dtype, w: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """``fits`` for an x of ``rows`` rows of ``k`` columns in ``dtype``."""
    wdtype = torch.float8_e4m3fn if scale is not None else dtype
    return (dtype in (torch.bfloat16, torch.float16) and w.dtype == wdtype and w.dim() == 2
            and k == w.shape[1] and 0 < rows <= MAX_ROWS and w.is_contiguous()
            and (scale is None or (scale.dtype == torch.float32 and scale.numel() == w.shape[0]
                                   and scale.is_contiguous())))


def launch_linear(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False, wrap=lambda f: f,
                  interpret: bool = False, config: dict | None = None, pdl: int = 0,
                  launch_pdl: bool = False, scale: torch.Tensor | None = None, w8a8: bool = False,
                  input_scale: torch.Tensor | None = None, rows: tuple | None = None) -> torch.Tensor:
    """x [..., K] @ W[N_w, K]ᵀ → [..., N_w] in x's dtype; with ``silu_mul`` (N_w = 2·I) → [..., I]:
    silu(x @ W[:I]ᵀ) · (x @ W[I:]ᵀ). ``wrap`` is ``torch.library.wrap_triton`` inside the op;
    ``config`` overrides the launch configuration (the sweep). ``pdl``: compile the PDL wait in
    (``triton_math.pdl_enter``; the mode); ``launch_pdl``: launch with the PDL attribute (eager
    launches only; docs/pdl.md). ``scale`` (W8A16): W is FP8 E4M3 and ``scale`` [N_w] fp32 its rows'
    scales; the result is, bit for bit, the bf16/fp16 kernel's on ``(W.float() · scale)`` rounded to
    x's dtype (``models.layers.fp8_linear_reference``'s weight). ``w8a8`` (with ``scale``): W8A8 instead, x's rows
    quantized by ``_quantize_rows_kernel`` (a launch of its own; under PDL it waits for its upstream and the GEMM
    after it for it), per token or, with ``input_scale``, with that static float32 scale (saturating at ±448);
    the weight stream has FP8 operands on both sides of the MMA (no conversion of the weight in registers) and both
    scales are applied to each fp32 sum: ``plugins.linear.reference.w8a8_reference``'s product within a rounding of
    the sum's order (``muse_spark::linear_w8a8_triton``, what the models run on FP8 tensor cores). Quantizing inside
    the GEMM's loads was slower, per token (each program finding its rows' scales in a pass over them) and static
    (the conversions in the loop that streams the weights; docs/log.md). ``rows`` (W8A8): x's rows already
    quantized, (E4M3 codes [M, K], fp32 scales [M]), by the kernel that produced them (``gated_residual_add`` with
    ``quantize``): no quantizing launch."""
    x2 = _rows(x, w)
    n_w = w.shape[0]
    if silu_mul and n_w % 2:
        raise ValueError(f"linear: silu_mul needs an even number of weight rows (gate | up), got {n_w}")
    N = n_w // 2 if silu_mul else n_w
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M > 0 and N > 0:
        _launch(x2, w, y, silu_mul, wrap, interpret, config, pdl, launch_pdl,
                scale=None if scale is None else scale.reshape(-1), w8a8=w8a8, input_scale=input_scale, rows=rows)
    return y.reshape(*x.shape[:-1], N)

