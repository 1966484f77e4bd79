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
``MAX_ROWS``). The default for ≤ ``MAX_ROWS`` rows since the eighth session (batch-1 step 5.95 ms
against 6.10 with cuBLAS; ``MUSE_SPARK_LINEAR=cublas`` selects cuBLAS): before the head_norm_rope
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

from muse_spark.plugins.gated_residual.op import check_gated_residual_inputs
from muse_spark.plugins.gated_residual.triton_kernel import gated_residual_row, launch_gated_residual_add
from muse_spark.plugins.head_norm_rope.triton_kernel import norm_rotate, rope_table_rows
from muse_spark.plugins.triton_math import (add_rn, div_rn, exp_exact, mul_rn, pdl_enter, pdl_enter_after,
                                            pdl_release, prefetch_l2, to_rne)

# The kernel's range: at most this many rows of x. More rows re-read x once per weight tile and
# each program's share of the weight shrinks: at 64 rows (batch 8) the H200 sweep has the down
# projection at 118.6 µs against cuBLAS's 36.6 (benchmarks/linear.py --batches 1,8).
MAX_ROWS = 16
DEFAULT_CONFIG = dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4)
PREFETCH_CHUNKS = tl.constexpr(128)  # one bulk L2 prefetch per thread (4 warps): no thread repeats another's
SHARED_BUDGET = 160 * 1024  # bytes of shared memory the pipeline's stages may take (227 KB per SM)


def default_config(M: int, N: int, K: int, silu_mul: bool, block_n: int | None = None,
                   budget: int = SHARED_BUDGET) -> dict:
    """Launch configuration, chosen by benchmarks/linear.py --sweep on the H200 (8 rows, each
    shape's weight streamed from HBM), then timed (``--batches 1,8``): 64-row tiles over 256-column
    chunks, 4 stages (qkv 15.4 µs, o 12.1, lm_head 245.3, against cuBLAS's 16.2 / 13.3 / 255.6);
    with silu·mul (two weight tiles per step) 128-column chunks and 3 stages (59.0 µs against 64.9
    for cuBLAS + silu); a long K (the down projection, the draft's fc) 16-row tiles over 512
    columns, 2 warps (down 31.9 µs against 32.8).
    More rows of x take more shared memory per stage: the chunk, then the stages, shrink
    until the stages fit ``budget`` bytes (``SHARED_BUDGET``). ``block_n``: the tile's rows, where the
    caller fixes them (the qkv kernel: half a head)."""
    if silu_mul:
        cfg = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    elif K >= 8192:
        cfg = dict(BLOCK_N=16, BLOCK_K=512, num_warps=2, num_stages=4)
    else:
        cfg = dict(DEFAULT_CONFIG)
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    block_m = max(16, triton.next_power_of_2(M))

    def stage_bytes():
        return ((2 if silu_mul else 1) * cfg["BLOCK_N"] + block_m) * cfg["BLOCK_K"] * 2

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
def _mma(w, xt, acc, IEEE_DOT: tl.constexpr):
    """acc + w·xt, fp32 accumulation; IEEE_DOT (the CPU interpreter, whose bf16 dot is broken): exact
    fp32 products."""
    if IEEE_DOT:
        acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, xt, acc)
    return acc


@triton.jit
def _first_tiles(w_ptr, rn, ru, nmask, K, BLOCK_K: tl.constexpr, TWO: tl.constexpr, u_ok=True):
    """The weight tiles of K chunk 0 (W[rn], and W[ru] with TWO where ``u_ok``: the GEMM chain
    decides per phase), loaded ahead (``PRELOAD``)."""
    rk = tl.arange(0, BLOCK_K)
    kmask = nmask[:, None] & (rk < K)[None, :]
    w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :], mask=kmask, other=0.0)
    wu = w
    if TWO:
        wu = tl.load(w_ptr + ru.to(tl.int64)[:, None] * K + rk[None, :], mask=kmask & u_ok, other=0.0)
    return w, wu


@triton.jit
def _stream_tiles(x_ptr, w_ptr, rn, ru, rm, nmask, mmask, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, TWO: tl.constexpr,
                  IEEE_DOT: tl.constexpr, FIRST: tl.constexpr = False, w_first=None, u_first=None):
    """The weight stream: fp32 sums W[rn]·xᵀ over the whole of K, [BLOCK_N, BLOCK_M]; with TWO also
    W[ru]·xᵀ (the second tile: the up half, or a head's second half), else zeros. ``FIRST``: K chunk
    0's weight tiles are ``w_first``/``u_first`` (``_first_tiles``, loaded before the PDL wait),
    the loop starts at chunk 1; the same sums in the same order."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    u_ptrs = w_ptr + ru.to(tl.int64)[:, None] * K + rk[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]  # [BLOCK_K, BLOCK_M]: xᵀ
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = 0
    if FIRST:
        xt = tl.load(x_ptrs, mask=mmask[None, :] & (rk < K)[:, None], other=0.0)
        acc = _mma(w_first, xt, acc, IEEE_DOT)
        if TWO:
            acc_u = _mma(u_first, xt, acc_u, IEEE_DOT)
        w_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
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
        acc = _mma(w, xt, acc, IEEE_DOT)
        if TWO:
            if EVEN_K:
                if EVEN_N:
                    wu = tl.load(u_ptrs)
                else:
                    wu = tl.load(u_ptrs, mask=nmask[:, None], other=0.0)
            else:
                wu = tl.load(u_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc_u = _mma(wu, xt, acc_u, IEEE_DOT)
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
    PDL: tl.constexpr = 0, PREFETCH: tl.constexpr = 0, PRELOAD: tl.constexpr = False,
    # ROPE_TABLE: one program more than the weight tiles (the last) writes the step's RoPE table of
    # the N_POS positions at pos_ptr into cos_ptr/sin_ptr [N_POS, DH_ROPE/2] fp32 (the qkv projection:
    # the angles' latency-bound chain then runs beside the weight stream, not in every norm kernel)
    pos_ptr=None, cos_ptr=None, sin_ptr=None, N_POS=0, ROPE_TABLE: tl.constexpr = False,
    THETA: tl.constexpr = 0.0, DH_ROPE: tl.constexpr = 2, BLOCK_POS: tl.constexpr = 16,
    # RESIDUAL: the layer's gated residual and norms after the projection (plugins/gated_residual's
    # reference, y the branch) in the same launch (``_residual_tail``): stream [M, N] fp32, gate [N]
    # fp32, the norms' weights [N], out: the new stream [M, N] fp32 and its norm [M, N]; sync_ptr: two
    # int32 words, zero before the launch and after it
    stream_ptr=None, gate_ptr=None, nw_ptr=None, bw_ptr=None, new_ptr=None, out_ptr=None, sync_ptr=None,
    RESIDUAL: tl.constexpr = False, EPS: tl.constexpr = 0.0, HAS_WEIGHT: tl.constexpr = False,
    ZERO_CENTERED: tl.constexpr = False, APPLY_NORM: tl.constexpr = False, NORM_BRANCH: tl.constexpr = False,
    HAS_BRANCH_WEIGHT: tl.constexpr = False, BLOCK_D: tl.constexpr = 16,
):
    pid_n = tl.program_id(0)
    if ROPE_TABLE:
        if pid_n == tl.num_programs(0) - 1:
            rope_table_rows(pos_ptr, cos_ptr, sin_ptr, N_POS, 0, THETA, DH_ROPE, BLOCK_POS, PDL)
            return
    w_first = None
    u_first = None
    if PRELOAD:
        # K chunk 0's weight tiles into registers before the wait: with PDL they arrive while the
        # kernel before still runs (the weights are constants), and the wait is ordered after them.
        rn0 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_first, u_first = _first_tiles(w_ptr, rn0, rn0 + N, rn0 < N, K, BLOCK_K, SILU_MUL)
        dep = tl.sum(tl.sum(w_first.to(tl.float32), axis=1), axis=0).to(tl.int32, bitcast=True)
        z = pdl_enter_after(PDL, dep)
    elif PREFETCH > 0:
        # The first PREFETCH bytes of this program's weight rows into L2 before the wait: the weights
        # are constants, so with PDL their stream starts while the kernel before still runs.
        n0 = pid_n * BLOCK_N
        rows_here = tl.minimum(N - n0, BLOCK_N).to(tl.int64)
        nbytes = tl.minimum(rows_here * K * 2, PREFETCH)
        dep = prefetch_l2(w_ptr + n0.to(tl.int64) * K, nbytes, PREFETCH_CHUNKS, PREFETCH // PREFETCH_CHUNKS)
        if SILU_MUL:
            dep += prefetch_l2(w_ptr + (n0 + N).to(tl.int64) * K, nbytes, PREFETCH_CHUNKS, PREFETCH // PREFETCH_CHUNKS)
        z = pdl_enter_after(PDL, dep)
    else:
        z = pdl_enter(PDL)
    pid_m = tl.program_id(1) + z  # x and y (upstream data) are addressed after the wait
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask = rn < N
    mmask = rm < M
    acc, acc_u = _stream_tiles(x_ptr, w_ptr, rn, rn + N, rm, nmask, mmask, K, stride_xm, BLOCK_M, BLOCK_N, BLOCK_K,
                               EVEN_N, EVEN_K, SILU_MUL, IEEE_DOT, PRELOAD, w_first, u_first)  # u: the up half
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]  # [BLOCK_N, BLOCK_M]: yᵀ
    ymask = nmask[:, None] & mmask[None, :]
    if PDL == 3:  # the weight stream is done: the next kernel may launch while this program finishes
        ymask = ymask & (pdl_release(acc) == 0)  # (ordered through the mask, not the addresses)
    if SILU_MUL:
        out = _silu_mul(acc, acc_u, y_ptr.dtype.element_ty)
    else:
        out = to_rne(acc, y_ptr.dtype.element_ty)
    tl.store(y_ptrs, out, mask=ymask)
    if RESIDUAL:
        _residual_tail(sync_ptr + z, M, N, y_ptr, stream_ptr, gate_ptr, nw_ptr, bw_ptr, new_ptr, out_ptr, EPS,
                       HAS_WEIGHT, ZERO_CENTERED, APPLY_NORM, BLOCK_D, NORM_BRANCH, HAS_BRANCH_WEIGHT)


@triton.jit
def _residual_tail(sync_ptr, M, N, y_ptr, stream_ptr, gate_ptr, nw_ptr, bw_ptr, new_ptr, out_ptr,
                   EPS: tl.constexpr, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                   APPLY_NORM: tl.constexpr, BLOCK_D: tl.constexpr, NORM_BRANCH: tl.constexpr,
                   HAS_BRANCH_WEIGHT: tl.constexpr):
    """``RESIDUAL``: after its tile of y, each program counts itself out on sync[0] (bar.sync, then one
    thread's acq_rel increment publishes the CTA's stores at GPU scope). The last M programs to do so
    (tickets n − M … n − 1 of the grid's n ≥ M) wait until all n have (an acquire spin: every
    program's y is then visible), then do one row each: ``gated_residual_row`` over the whole row of
    y, read from L2. None can wait forever: every program not yet counted out is running or can
    start, since the others have exited and at most M spin. The last of the M to leave (sync[1])
    zeroes both words for the next launch, which the kernel boundary orders after."""
    n_prog = tl.num_programs(0)
    tl.debug_barrier()
    ticket = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
    first = n_prog - M
    if ticket >= first:
        done = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        while done < n_prog:
            done = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        gated_residual_row((ticket - first).to(tl.int64), stream_ptr, y_ptr, gate_ptr, nw_ptr, bw_ptr, new_ptr,
                           out_ptr, N, EPS, HAS_WEIGHT, ZERO_CENTERED, APPLY_NORM, BLOCK_D, NORM_BRANCH,
                           HAS_BRANCH_WEIGHT, True)
        tl.debug_barrier()
        left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if left == M - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _qkv_epilogue(acc, acc_u, rm, mmask, head, q_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, S, H, KVH, N_SLOTS, T,
                  skc_n, skc_t, skc_h, svc_n, svc_t, svc_h, EPS: tl.constexpr, THETA: tl.constexpr,
                  ROPE: tl.constexpr, HALF: tl.constexpr):
    """Head ``head`` of the qkv projection for rows ``rm`` (row = b·S + s), its halves ``acc`` and
    ``acc_u`` [HALF, BLOCK_M] (fp32 sums): rounded to the output dtype as the projection's output
    is, then as ``plugins/head_norm_rope`` treats q and k heads (weightless RMS norm, RoPE at the
    row's position) and as the layers' cache write places k and v: a q head into q [B·S, H, Dh],
    a k head into the K cache, a v head (unnormed) into the V cache, at row slots[b], position
    pos[b·S + s]. Rows or positions outside the caches write nothing."""
    DT = q_ptr.dtype.element_ty
    DH: tl.constexpr = 2 * HALF
    d = tl.arange(0, HALF)[:, None]
    y1 = to_rne(acc, DT)
    y2 = to_rne(acc_u, DT)
    b = rm // S
    slot = tl.load(slot_ptr + b, mask=mmask, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + rm, mask=mmask, other=-1).to(tl.int64)
    in_cache = mmask & (slot >= 0) & (slot < N_SLOTS) & (pos >= 0) & (pos < T)  # [BLOCK_M]
    if head >= H + KVH:  # a v head, as projected
        at = vc_ptr + slot[None, :] * svc_n + pos[None, :] * svc_t + (head - H - KVH) * svc_h + d
        tl.store(at, y1, mask=in_cache[None, :])
        tl.store(at + HALF, y2, mask=in_cache[None, :])
    else:
        o1, o2 = norm_rotate(y1.to(tl.float32), y2.to(tl.float32), pos.to(tl.float32)[None, :], 0, EPS, THETA,
                             DH, ROPE, DT)
        if head < H:
            at = q_ptr + (rm.to(tl.int64)[None, :] * H + head) * DH + d
            tl.store(at, o1, mask=mmask[None, :])
            tl.store(at + HALF, o2, mask=mmask[None, :])
        else:
            at = kc_ptr + slot[None, :] * skc_n + pos[None, :] * skc_t + (head - H) * skc_h + d
            tl.store(at, o1, mask=in_cache[None, :])
            tl.store(at + HALF, o2, mask=in_cache[None, :])


@triton.jit
def _linear_qkv_kernel(
    x_ptr, w_ptr, q_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,  # x [M, K]; W [(H + 2·KV)·Dh, K]; q [M, H, Dh]
    M, K, stride_xm, S, H, KVH, N_SLOTS, T, skc_n, skc_t, skc_h, svc_n, svc_t, svc_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE_DOT: tl.constexpr, EPS: tl.constexpr, THETA: tl.constexpr, ROPE: tl.constexpr,
):
    """``_linear_kernel`` for the attention's qkv projection: program pid_n is head pid_n (q heads,
    then k, then v), its two halves of BLOCK_N = Dh/2 weight rows as the two tiles; then
    ``_qkv_epilogue``."""
    head = tl.program_id(0)
    rn = head * (2 * BLOCK_N) + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = rm < M
    acc, acc_u = _stream_tiles(x_ptr, w_ptr, rn, rn + BLOCK_N, rm, rn >= 0, mmask, K, stride_xm, BLOCK_M, BLOCK_N,
                               BLOCK_K, True, EVEN_K, True, IEEE_DOT)
    _qkv_epilogue(acc, acc_u, rm, mmask, head, q_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, S, H, KVH, N_SLOTS, T,
                  skc_n, skc_t, skc_h, svc_n, svc_t, svc_h, EPS, THETA, ROPE, BLOCK_N)


def launch_linear_rope_table(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, theta: float, dh: int,
                             wrap=lambda f: f, interpret: bool = False,
                             pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``launch_linear(x, w)`` and, from one more program of the same launch, the RoPE table of
    ``positions`` (``head_norm_rope.launch_rope_table``'s (cos, sin), the same bits): → (y, cos, sin).
    For the attention's qkv projection, whose norm + cache kernel then reads the table (the
    default, ``MUSE_SPARK_ROPE_TABLE=0`` off; docs/log.md, 2026-12-03)."""
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
        _launch(x2, w, y, False, wrap, interpret, None, pdl, 0, False, False, table=(pos, cos, sin, theta, dh))
    return y.reshape(*x.shape[:-1], N), cos, sin


def _rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the kernel's rows [M, K] (last dim contiguous), after checking W is [N, K]."""
    K = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"linear: x {list(x.shape)} and weight {list(w.shape)}: expected weight [N, {K}]")
    x2 = x.reshape(-1, K)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2, w, y, silu_mul: bool, wrap, interpret: bool, config: dict | None, pdl: int, prefetch: int,
            launch_pdl: bool, preload: bool, table: tuple | None = None, residual: dict | None = None) -> None:
    """``_linear_kernel`` over rows x2 [M, K] into y [M, N]; ``table`` = (positions, cos, sin, theta,
    dh): one more program writes the RoPE table (``ROPE_TABLE``); ``residual``: the ``RESIDUAL``
    tail's arguments (``launch_linear_residual``). Every kernel argument is passed, the table's and
    the tail's as dummies without them (Inductor's mutation analysis fills in no defaults)."""
    (M, K), N = x2.shape, y.shape[1]
    cfg = dict(default_config(M, N, K, silu_mul), **(config or {}))
    block_m = max(16, triton.next_power_of_2(M))
    grid = (triton.cdiv(N, cfg["BLOCK_N"]) + (table is not None), triton.cdiv(M, block_m))  # (the last: the table)
    pos, cos, sin, theta, dh = table if table is not None else (x2, x2, x2, 0.0, 2)
    if residual is None:
        residual = dict(stream_ptr=x2, gate_ptr=x2, nw_ptr=x2, bw_ptr=x2, new_ptr=x2, out_ptr=x2, sync_ptr=x2,
                        RESIDUAL=False, EPS=0.0, HAS_WEIGHT=False, ZERO_CENTERED=False, APPLY_NORM=False,
                        NORM_BRANCH=False, HAS_BRANCH_WEIGHT=False, BLOCK_D=16)
    wrap(_linear_kernel)[grid](
        x2, w, y, M, N, K, x2.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], EVEN_N=N % cfg["BLOCK_N"] == 0,
        EVEN_K=K % cfg["BLOCK_K"] == 0, SILU_MUL=silu_mul, IEEE_DOT=interpret,
        PDL=0 if interpret else int(pdl), PREFETCH=prefetch if pdl and not interpret else 0, PRELOAD=bool(preload),
        pos_ptr=pos, cos_ptr=cos, sin_ptr=sin, N_POS=M if table is not None else 0, ROPE_TABLE=table is not None,
        THETA=float(theta), DH_ROPE=dh, BLOCK_POS=block_m if table is not None else 16, **residual,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({"launch_pdl": True} if launch_pdl else {}),
    )


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """What the kernel takes: x [..., K] with at most ``MAX_ROWS`` rows, W [N, K] contiguous, both
    bf16 or both fp16."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and w.dim() == 2
            and x.shape[-1] == w.shape[1] and 0 < rows <= MAX_ROWS and w.is_contiguous())


def launch_linear(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False, wrap=lambda f: f,
                  interpret: bool = False, config: dict | None = None, pdl: int = 0, prefetch: int = 0,
                  launch_pdl: bool = False, preload: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W[N_w, K]ᵀ → [..., N_w] in x's dtype; with ``silu_mul`` (N_w = 2·I) → [..., I]:
    silu(x @ W[:I]ᵀ) · (x @ W[I:]ᵀ). ``wrap`` is ``torch.library.wrap_triton`` inside the op;
    ``config`` overrides the launch configuration (the sweep). ``pdl``: compile the PDL wait in
    (``triton_math.pdl_enter``), with ``prefetch`` bytes of each program's weight rows prefetched
    into L2 before it (a multiple of 2048); ``launch_pdl``: launch with the PDL attribute (eager
    launches only; scripts/pdl_bench.py, docs/pdl-research.md); ``preload``: the first K chunk's
    weight tiles loaded into registers before the wait (the same bits). The engines use none yet.
    ``out``: a contiguous [M, N] tensor of x's dtype to write instead of a new one (benches)."""
    x2 = _rows(x, w)
    n_w = w.shape[0]
    if silu_mul and n_w % 2:
        raise ValueError(f"linear: silu_mul needs an even number of weight rows (gate | up), got {n_w}")
    N = n_w // 2 if silu_mul else n_w
    M = x2.shape[0]
    if out is not None and (tuple(out.shape) != (M, N) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"linear: out must be a contiguous {x.dtype} [{M}, {N}], got {out.dtype} {list(out.shape)}")
    y = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    if M > 0 and N > 0:
        _launch(x2, w, y, silu_mul, wrap, interpret, config, pdl, prefetch, launch_pdl, preload)
    return y.reshape(*x.shape[:-1], N)


# The ``RESIDUAL`` tail holds a whole row of the stream, the branch, the gate and two norm weights in
# the GEMM's few warps: rows up to this width (the 8B target's 4096).
MAX_RESIDUAL_D = 8192


def residual_fits(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> bool:
    """What ``launch_linear_residual`` takes: ``fits``, a row of at most ``MAX_RESIDUAL_D`` outputs,
    and at least as many weight tiles (programs) as rows of x (the last programs do a row each)."""
    if not fits(x, w):
        return False
    M = x.numel() // x.shape[-1]
    N, K = w.shape
    cfg = dict(default_config(M, N, K, False), **(config or {}))
    return N <= MAX_RESIDUAL_D and triton.cdiv(N, cfg["BLOCK_N"]) >= M


def check_sync(sync: torch.Tensor, device: torch.device) -> None:
    """The ``RESIDUAL`` launch's words: two contiguous int32 on ``device``, or a clear error."""
    if sync.dtype != torch.int32 or sync.numel() != 2 or not sync.is_contiguous() or sync.device != device:
        raise ValueError(f"linear_residual: sync must be 2 contiguous int32 words on {device}, got {sync.dtype} "
                         f"{list(sync.shape)} on {sync.device}")


def launch_linear_residual(x: torch.Tensor, w: torch.Tensor, stream: torch.Tensor, gate: torch.Tensor,
                           norm_weight: torch.Tensor | None, branch_norm_weight: torch.Tensor | None,
                           sync: torch.Tensor, eps: float, zero_centered: bool, apply_norm: bool, norm_branch: bool,
                           wrap=lambda f: f, interpret: bool = False, pdl: int = 0,
                           config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's output projection and the gated residual after it in one launch: ``gated_residual_add(
    stream, x @ Wᵀ, gate, norm_weight, eps, zero_centered, apply_norm, x.dtype, branch_norm_weight,
    norm_branch)`` (plugins/gated_residual/reference.py) → (the new stream [..., N] fp32, its norm
    in x's dtype, or an empty tensor without ``apply_norm``). The projection's programs each write
    their tile of the branch; the last of them do its rows (``_residual_tail``). ``sync``: two int32
    words on x's device, zero; the launch leaves them zero. Under the interpreter, which runs the
    programs one after another (the tail's wait would never end), the same kernels' math as two
    launches: the linear kernel, then the gated residual kernel."""
    x2 = _rows(x, w)
    M, N = x2.shape[0], w.shape[0]
    if tuple(stream.shape) != (*x.shape[:-1], N):
        raise ValueError(f"linear_residual: stream {list(stream.shape)} must be x's rows by the weight's "
                         f"{N} outputs, {[*x.shape[:-1], N]}")
    if not residual_fits(x, w, config):
        raise ValueError(f"linear_residual: x {list(x.shape)} {x.dtype} and weight {list(w.shape)} {w.dtype}: the "
                         f"kernel takes at most {MAX_ROWS} rows, {MAX_RESIDUAL_D} outputs and a weight tile per row")
    check_sync(sync, x.device)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    s2 = stream.reshape(M, N).contiguous()
    check_gated_residual_inputs(s2, y, gate, norm_weight, branch_norm_weight)
    if interpret:
        launch_linear(x2, w, wrap=wrap, interpret=True, config=config, out=y)
        new, out = launch_gated_residual_add(s2, y, gate, norm_weight, eps, zero_centered, apply_norm, x.dtype,
                                             branch_norm_weight, norm_branch, wrap=wrap)
    else:
        new = torch.empty_like(s2)
        out = torch.empty((M, N) if apply_norm else (0,), dtype=x.dtype, device=x.device)
        g = gate.float().contiguous()
        has_bw = norm_branch and branch_norm_weight is not None
        residual = dict(
            stream_ptr=s2, gate_ptr=g, nw_ptr=norm_weight.contiguous() if norm_weight is not None else g,
            bw_ptr=branch_norm_weight.contiguous() if has_bw else g, new_ptr=new, out_ptr=out if apply_norm else new,
            sync_ptr=sync, RESIDUAL=True, EPS=float(eps), HAS_WEIGHT=norm_weight is not None,
            ZERO_CENTERED=bool(zero_centered), APPLY_NORM=bool(apply_norm), NORM_BRANCH=bool(norm_branch),
            HAS_BRANCH_WEIGHT=has_bw, BLOCK_D=triton.next_power_of_2(N))
        _launch(x2, w, y, False, wrap, False, config, pdl, 0, False, False, residual=residual)
    return new.reshape(stream.shape), (out.reshape(stream.shape) if apply_norm else out)


def launch_linear_qkv_cache(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float, theta: float, use_rope: bool,
                            heads: int, wrap=lambda f: f, interpret: bool = False) -> torch.Tensor:
    """The attention's qkv projection with its head norm, RoPE and cache write in the GEMM's
    epilogue: x [B, S, D] @ W[(H + 2·KV)·Dh, D]ᵀ, head by head (one program each, the two halves of
    a head as two weight tiles); q heads normed and rotated → q [B, S, H, Dh]; k heads normed and
    rotated, and v heads, stored into the caches [N, T, KV, Dh] at rows ``slots`` [B], positions
    ``positions`` [B, S]. The spec: ``models.layers.qkv_cache_reference``."""
    B, S, D = x.shape
    kvh, dh = k_cache.shape[2], k_cache.shape[3]
    q = torch.empty((B, S, heads, dh), dtype=x.dtype, device=x.device)
    M = B * S
    if M == 0:
        return q
    x2 = x.reshape(M, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    pos = positions.reshape(M)
    if pos.stride(0) != 1:
        pos = pos.contiguous()
    cfg = default_config(M, w.shape[0] // 2, D, True, block_n=dh // 2)  # two tiles per program, as silu·mul's
    block_m = max(16, triton.next_power_of_2(M))
    wrap(_linear_qkv_kernel)[(heads + 2 * kvh, triton.cdiv(M, block_m))](
        x2, w, q, pos, slots, k_cache, v_cache, M, D, x2.stride(0), S, heads, kvh, k_cache.shape[0],
        k_cache.shape[1], k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2),
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], EVEN_K=D % cfg["BLOCK_K"] == 0, IEEE_DOT=interpret,
        EPS=float(eps), THETA=float(theta), ROPE=bool(use_rope), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return q


@triton.jit
def _prefetch_rows_kernel(w_ptr, sink_ptr, row_bytes, prefix_bytes, ROWS: tl.constexpr):
    """The first ``prefix_bytes`` of each of ``ROWS`` rows of W (``row_bytes`` apart) from row
    pid·ROWS on into L2 (one bulk prefetch a row: fire-and-forget); the zero it returns is stored
    to ``sink_ptr[pid]`` so the prefetches are not dead code."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ptrs = w_ptr.to(tl.pointer_type(tl.int8)) + rows * row_bytes
    z = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                  [ptrs, tl.full([ROWS], 0, tl.int32) + prefix_bytes], dtype=tl.int32,
                                  is_pure=True, pack=1)
    tl.store(sink_ptr + pid, tl.max(z, axis=0))


def launch_prefetch_rows(w: torch.Tensor, nbytes: int, sink: torch.Tensor, rows_per_program: int = 64) -> int:
    """Experiment (scripts/pdl_bench.py ``--side-prefetch-mb``): about ``nbytes`` of the weight W [N, K]
    into L2 as the same leading fraction of every row (each GEMM program's first K chunks, so every
    program of the GEMM after starts from L2), run on a side stream while small kernels leave HBM
    idle. ``sink``: int32, at least N / ``rows_per_program`` elements. → the bytes per row."""
    n, k = w.shape
    if n % rows_per_program or not w.is_contiguous():
        raise ValueError(f"prefetch_rows: W {list(w.shape)} must be contiguous with rows a multiple of "
                         f"{rows_per_program}")
    row_bytes = k * w.element_size()
    prefix = min(row_bytes, max(16, nbytes // n // 16 * 16))
    grid = n // rows_per_program
    if sink.numel() < grid:
        raise ValueError(f"prefetch_rows: sink has {sink.numel()} elements, needs {grid}")
    _prefetch_rows_kernel[(grid,)](w, sink, row_bytes, prefix, ROWS=rows_per_program, num_warps=2)
    return prefix
