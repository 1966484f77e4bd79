"""Triton kernel of the masked GQA attention over a static KV window (split-KV, "flash decoding").

Spec: ``muse_spark.models.layers.attend`` (fp32 einsums), for q [B, S, H, Dh] and K/V
[B, T, KV, Dh] in bf16/fp16 and a boolean mask [B, S, T]:
``softmax(q·kᵀ/√Dh masked) · v`` per head, K/V entries no query may see never read into the
result (stale garbage, even NaN, cannot leak), zeros for a query that sees no key.

Why not SDPA: a speculative step has few queries (S = γ+1) over a long window. SDPA's kernels
(cuDNN, flash, memory-efficient) give one program per (batch, head, 128 queries), so at batch 1
only 8 KV heads' worth of programs stream the whole window (1.14 ms of the 7.6 ms step on the
H200), and the step had to gather and zero a copy of every request's window first. One layer,
graph-timed on the H200: 10.3 / 31.5 / 101 µs here against 71 / 138 / 379 µs for the SDPA path
at batch 1 / 8 / 32 (docs/log.md). Here:

* the ``rep = H / KV`` query heads of a KV head and the S queries are one block of ``rep·S`` rows
  (the mask depends on the query position only), so each K/V tile is read once per KV head; row
  s·rep + j is query head j of the KV head at position s (rep a constexpr, so a row's position and
  head need no division by the runtime S), and every tensor of addresses is one int32 offset from a
  64-bit base computed once (measured on an H200: 9.4 against 9.8 µs a layer for the plain attention,
  3024 against 3232 sm_90 instructions in the default fused form);
* the window is split into ``SPLIT_T``-key chunks, one program each (``cdiv(T, SPLIT_T)``
  programs per KV head and row block: enough to fill the GPU at batch 1), each keeping an online
  softmax (max, sum, fp32 accumulator); a second kernel merges the splits, one program (one
  warp) per output row, ``MERGE_CHUNK`` splits at a time;
* past one wave of programs (two an SM), one program runs several splits in turn (``SPLITS``,
  chosen by ``splits_per_program``: batch 1–3 one, batch 8 three, batch 32 all nine of a 1152-key
  window). Each split's partials are computed exactly as by a program of its own, so the bits do
  not change; what is shared is the program's fixed chain (the q block's loads, norm and
  rotation, the bounds, the new K/V write). At batch 32 the one-split grid ran 2304 programs in
  about nine waves, 152 µs a layer against a K/V roofline of about 33 (an H200
  profile); with SPLITS = 1 the kernel's PTX is the one it always was (checked with Triton's
  compiler for sm_90: the same instructions, registers renamed);
* a split no row of the block may see is skipped without reading K or V, so the work follows
  the requests' lengths rather than the window's. ``EARLY_KV`` (the default): one mask load per
  split decides that, so each tile's K/V loads wait on nothing else (a visible split's masked
  tail is read and made harmless); without it, each tile's mask decides for that tile;
* with ``slots`` the kernel reads each request's row of the KV cache in place: the step does not
  gather a copy of the window first (at batch 32 that copy alone moved 300 MB per layer);
* with block tables (paged caches: ``slots`` [B, n]) each tile's block ids are loaded one tile
  ahead, so its K/V loads wait on no table load, and the pool is addressed with int32 offsets
  where it has fewer than 2³¹ elements: one layer at batch 1 / 8 / 32 took 1.01 / 1.03 / 1.05× the
  slot caches' time (the fused form 1.09 / 1.05 / 1.06×) against 1.44 / 1.33 / 1.30× with each
  tile's ids loaded before its K/V (H100; docs/performance.md);
* with ``BOUNDS`` (``launch_attention(window=...)``) the mask is ``last`` [B, S] int64: key t is
  visible to query (b, s) iff t ≤ last[b, s] (``plugins.attention.reference.KeyBounds``, the form of every mask
  the models build). No [B, S, T] mask is built or loaded: one layer at batch 1 / 8 / 32 took
  9.0 / 25.2 / 82.0 µs against 10.2 / 31.4 / 100.8 with the dense mask (H200). Its bits differ
  from the dense form's at head_dim 128 (not at the tests' small shapes); each form's bits are
  independent of batch, queries and window.

Numerics: products of the compute dtype with fp32 accumulation (``tl.dot``), scores scaled in
fp32, the probabilities rounded to the compute dtype for the second product (as flash
attention does), the output rounded once. Every multiply-add of the online softmax and of the
merge is written with explicitly rounded products and sums (``triton_math.mul_rn``/``add_rn``),
so its bits do not depend on whether the compiler contracts them into FMAs (Triton's eager
launch does; Inductor turns contraction off for its own kernels under
``emulate_precision_casts``, which the engine builds set, and the packages must give the eager
engine's bits).

Bits: the split size, the tile, the row block and the merge are constants, so an output row's
arithmetic depends on neither the batch, nor the number of queries, nor how many masked keys
follow the last visible one (an empty split or merge chunk changes nothing exactly). The eager engine (window
``kv_len``, unpadded prefill chunks) and the compiled packages (a static window, padded chunks)
therefore agree bit for bit, provided visible keys sit at the same indices: the eager engine
puts the draft's block keys after the whole cache window, as the packages do.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from muse_spark.options import current_options
from muse_spark.plugins.head_norm_rope.triton_kernel import fp8_codes, norm_rotate
from muse_spark.plugins.triton_math import add_rn, mul_rn, pdl_enter, to_rne

BLOCK_T = 64  # keys per tile
BLOCK_M = 32  # rows (query head × query) per program
SPLIT_T = 2 * BLOCK_T  # keys per split
MERGE_CHUNK = 8  # splits the merge loads at once
NEW_ROWS = 16  # new K/V rows per pass of the fused cache write (NORM_QK)
# The launch configuration, from benchmarks/attention.py --sweep on the H200 (one layer,
# graph-timed, batch 1 / 8 / 32): EARLY_KV 11.1 / 36.3 / 118.8 µs against 11.7 / 36.1 / 116.1
# (the same bits); a merge of 8 splits by one warp 11.3 / 31.3 / 97.2 against 16 by four warps.
# Every engine must use one configuration: a row's bits depend on it (EARLY_KV excepted: the
# same arithmetic). ``launch_attention(config=...)`` overrides it for the sweep in
# benchmarks/attention.py, which may also set ``num_stages`` (passed through wrap_triton) and
# ``maxnreg`` (eager launches only; capping the partial kernel's ~227 registers at 96 or 64 was
# slower at every batch on the H200).
# (num_stages: Triton's default unless a sweep sets it. TAB_I32: None, int32 block offsets where the pools fit;
# False, int64 always: the tests' and the benchmark's other form.)
DEFAULT_CONFIG = dict(BLOCK_T=BLOCK_T, BLOCK_M=BLOCK_M, SPLIT_T=SPLIT_T, MERGE_CHUNK=MERGE_CHUNK, num_warps=4,
                      merge_warps=1, EARLY_KV=True, SPLITS=0, TAB_I32=None)
# SPLITS: splits of the window one program of the partial kernel runs in turn; 0 = the kernel options'
# ``attention_splits``, and where that is 0 too, ``splits_per_program``'s choice. Any value gives the
# same bits (each split's partials are computed as by a program of its own).
PROGRAMS_PER_SM = 2  # partial-kernel programs resident on an SM at once (227–253 registers a thread, 4 warps)


def splits_per_program(nsplit, others, sms: int) -> int:
    """How many of its ``nsplit`` splits each program of the partial kernel runs, for a grid of
    ``others`` (row blocks × requests × KV heads) programs per split on ``sms`` SMs: 1 while one
    program per split fits in one wave (batch 1: 72 programs); else the fewest splits a program
    that bring the grid into one wave, as evenly as the splits divide (at 1152 keys, 9 splits:
    batch 4 by 2, 160 programs; batch 8 by 3, 192; batch 16 by 5, 256; batch 32 all 9, 256), so
    a program's fixed chain (the q block's loads, norm and rotation, the bounds) is paid once for
    several splits instead of the grid running in waves. Symbolic sizes (a dynamic export) get 1."""
    if not all(isinstance(x, int) for x in (nsplit, others, sms)) or sms <= 0 or nsplit <= 1:
        return 1
    wave = PROGRAMS_PER_SM * sms
    if nsplit * others <= wave:
        return 1
    groups = max(1, wave // max(others, 1))  # programs per (row block, request, KV head) one wave holds
    each = triton.cdiv(nsplit, min(groups, nsplit))
    return triton.cdiv(nsplit, triton.cdiv(nsplit, each))  # evened out: 9 splits in 2 → 5 + 4, not 8 + 1


@triton.jit
def _tile_update(q, kt, v, vis, m_i, l_i, acc, SCALE: tl.constexpr, BLOCK_M: tl.constexpr, DH: tl.constexpr,
                 IEEE_DOT: tl.constexpr):
    """One tile of the online softmax: scores, masked; the running max, sum and accumulator."""
    if IEEE_DOT:
        sc = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
    else:
        sc = tl.dot(q, kt)
    sc = mul_rn(sc, tl.full(sc.shape, SCALE, tl.float32))
    sc = tl.where(vis, sc, float("-inf"))  # garbage keys (NaN) never pass the mask
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(sc - m_ref[:, None])  # masked: exp(-inf) = 0
    l_i = add_rn(mul_rn(l_i, alpha), tl.sum(p, axis=1))
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = add_rn(mul_rn(acc, tl.broadcast_to(alpha[:, None], (BLOCK_M, DH))), pv)
    return m_new, l_i, acc


@triton.jit
def _norm_rotate_rows(x1, x2, pos, row, ok, cos_ptr, sin_ptr, EPS: tl.constexpr, THETA: tl.constexpr,
                      DH: tl.constexpr, ROPE: tl.constexpr, DTYPE: tl.constexpr, TABLE: tl.constexpr):
    """``norm_rotate`` of heads [rows, Dh/2] (halves ``x1``, ``x2``; rows where ``ok``) at positions
    ``pos`` (fp32 [rows, 1]), or with ``TABLE`` at the angles of rows ``row`` of the step's RoPE
    table [B·S, Dh/2] (``pos`` not read): the same bits."""
    if TABLE:
        HALF: tl.constexpr = DH // 2
        at = row.to(tl.int64)[:, None] * HALF + tl.arange(0, HALF)[None, :]
        c = tl.load(cos_ptr + at, mask=ok[:, None], other=0.0)
        sn = tl.load(sin_ptr + at, mask=ok[:, None], other=0.0)
        return norm_rotate(x1, x2, 0.0, 1, EPS, THETA, DH, ROPE, DTYPE, True, c, sn)
    return norm_rotate(x1, x2, pos, 1, EPS, THETA, DH, ROPE, DTYPE)


@triton.jit
def _store_new_kv(x_ptr, vn_ptr, pos_ptr, kc_ptr, vc_ptr, b, kvh, kv_row, row_ok, lo, hi, S, H,
                  sq_b, sq_s, sq_h, svn_b, svn_s, svn_h, sp_b, sp_s, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                  EPS: tl.constexpr, THETA: tl.constexpr, DH: tl.constexpr, ROPE: tl.constexpr, KB: tl.constexpr,
                  TABLE: tl.constexpr = False, cos_ptr=None, sin_ptr=None, tab_ptr=None, stab=0,
                  PAGE: tl.constexpr = 0, ksc=1.0, vsc=1.0, KV_FP8: tl.constexpr = False,
                  DT: tl.constexpr = tl.bfloat16):
    """The layer's new keys and values of KV head ``kvh`` whose positions fall in [lo, hi) into the
    caches at row ``kv_row``: key head H + kvh of x [B, S, H + KV, Dh] normed and rotated at its
    position (``norm_rotate``, as ``head_norm_rope``'s cache kernel does it), v [B, S, KV, Dh] as
    it is. ``KB`` new rows a pass; a pass with none in range loads nothing but their positions.
    ``TABLE``: the angles' cos and sin are rows b·S + s of the step's RoPE table [B·S, Dh/2].
    ``PAGE`` (paged caches): position p goes to offset p % PAGE of block tab[b, p // PAGE]. ``DT``: the compute
    dtype the normed keys are rounded to; ``KV_FP8``: the caches hold E4M3 codes, the keys and values written
    quantized with the KV head's scales ``ksc``/``vsc`` (``fp8_codes``)."""
    HALF: tl.constexpr = DH // 2
    dh2 = tl.arange(0, HALF)
    dd = tl.arange(0, DH)
    for s0 in range(0, S, KB):
        sr = s0 + tl.arange(0, KB)
        pos = tl.load(pos_ptr + b * sp_b + sr * sp_s, mask=sr < S, other=-1).to(tl.int64)
        w = (sr < S) & (pos >= lo) & (pos < hi) & row_ok
        if tl.max(w.to(tl.int32), axis=0) > 0:
            src = x_ptr + b * sq_b + sr[:, None] * sq_s + (H + kvh) * sq_h + dh2[None, :]
            k1 = tl.load(src, mask=w[:, None], other=0.0).to(tl.float32)
            k2 = tl.load(src + HALF, mask=w[:, None], other=0.0).to(tl.float32)
            y1, y2 = _norm_rotate_rows(k1, k2, pos.to(tl.float32)[:, None], b * S + sr, w, cos_ptr, sin_ptr, EPS,
                                       THETA, DH, ROPE, DT, TABLE)
            if KV_FP8:
                y1 = fp8_codes(y1, ksc, kc_ptr.dtype.element_ty)
                y2 = fp8_codes(y2, ksc, kc_ptr.dtype.element_ty)
            if PAGE > 0:
                blk = tl.load(tab_ptr + b * stab + tl.where(w, pos, 0) // PAGE, mask=w, other=0).to(tl.int64)
                kat = blk[:, None] * sk_b + (pos % PAGE)[:, None] * sk_t
                vat = blk[:, None] * sv_b + (pos % PAGE)[:, None] * sv_t
            else:
                kat = kv_row * sk_b + pos[:, None] * sk_t
                vat = kv_row * sv_b + pos[:, None] * sv_t
            kd = kc_ptr + kat + kvh * sk_h + dh2[None, :]
            tl.store(kd, y1, mask=w[:, None])
            tl.store(kd + HALF, y2, mask=w[:, None])
            val = tl.load(vn_ptr + b * svn_b + sr[:, None] * svn_s + kvh * svn_h + dd[None, :], mask=w[:, None],
                          other=0.0)
            if KV_FP8:
                val = fp8_codes(val, vsc, vc_ptr.dtype.element_ty)
            tl.store(vc_ptr + vat + kvh * sv_h + dd[None, :], val, mask=w[:, None])


@triton.jit
def _tile_blocks(tab_ptr, b, stab, t, tm, PAGE: tl.constexpr, TAB_I32: tl.constexpr):
    """Keys t's blocks tab[b, t // PAGE] (``tm``: the keys whose entries are read; 0 elsewhere), as int64
    or (``TAB_I32``: the pool's elements fit in int32) int32."""
    blk = tl.load(tab_ptr + b * stab + t // PAGE, mask=tm, other=0)
    if TAB_I32:
        blk = blk.to(tl.int32)
    else:
        blk = blk.to(tl.int64)
    return blk


@triton.jit
def _kv_tile(k_base, v_base, t, tm, d, kmask, vmask, blk, sk_b, sk_t, sv_b, sv_t, PAGE: tl.constexpr,
             ksc, vsc, KV_FP8: tl.constexpr, DT: tl.constexpr):
    """Keys t's K tile [DH, BLOCK_T] (transposed) and V tile [BLOCK_T, DH]: rows t of the request's cache
    row, or (``PAGE``, paged caches) through its block table: key t at offset t % PAGE of block
    ``blk`` (``_tile_blocks``). ``KV_FP8``: the caches
    hold E4M3 codes, dequantized here (code · scale in fp32, rounded once to the compute dtype ``DT``:
    ``reference.dequantize_kv``) with the KV head's scales ``ksc``/``vsc``."""
    if PAGE > 0:
        off = t % PAGE
        kt = tl.load(k_base + (blk[None, :] * sk_b + off[None, :] * sk_t + d[:, None]), mask=kmask, other=0.0)
        v = tl.load(v_base + (blk[:, None] * sv_b + off[:, None] * sv_t + d[None, :]), mask=vmask, other=0.0)
    else:
        kt = tl.load(k_base + (t[None, :] * sk_t + d[:, None]), mask=kmask, other=0.0)
        v = tl.load(v_base + (t[:, None] * sv_t + d[None, :]), mask=vmask, other=0.0)
    if KV_FP8:
        kt = to_rne(mul_rn(kt.to(tl.float32), tl.full(kt.shape, 1.0, tl.float32) * ksc), DT)
        v = to_rne(mul_rn(v.to(tl.float32), tl.full(v.shape, 1.0, tl.float32) * vsc), DT)
    return kt, v


@triton.jit
def _split_partial(q, k_base, v_base, mask_ptr, po_ptr, pm_ptr, pl_ptr, b, bk, s, rows, rmask, d, last, row_ok,
                   split, T, M, NSPLIT, sk_t, sv_t, sm_b, sm_s, SCALE: tl.constexpr, DH: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT_T: tl.constexpr, IEEE_DOT: tl.constexpr,
                   HAS_SLOTS: tl.constexpr, EARLY_KV: tl.constexpr, BOUNDS: tl.constexpr, GUARD: tl.constexpr,
                   tab_ptr, stab, sk_b, sv_b, PAGE: tl.constexpr, ksc, vsc, KV_FP8: tl.constexpr, DT: tl.constexpr,
                   TAB_I32: tl.constexpr):
    """One split of the window for the program's row block: its online softmax over the split's
    tiles, and its partials (accumulator, max, sum) stored for the merge. ``GUARD``: the split may
    lie past the last one (a program running several), and then reads and writes nothing.
    Paged caches: a tile's block ids are loaded one tile ahead (the first tile's before the split's
    bounds), so its K/V loads wait on no table load (each tile's own ids before its loads were
    1.3× the slot caches' time on an H100: docs/log.md)."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DH), tl.float32)
    t_begin = split * SPLIT_T
    t_end = tl.minimum(t_begin + SPLIT_T, T)
    if PAGE > 0:
        t = t_begin + tl.arange(0, BLOCK_T)
        blk_next = _tile_blocks(tab_ptr, b, stab, t, t < t_end, PAGE, TAB_I32)
    else:
        blk_next = tl.zeros((BLOCK_T,), tl.int32)  # (not read)
    if GUARD:  # a program's last splits may lie past the window
        t_end = tl.where(split < NSPLIT, t_end, t_begin)
    if BOUNDS:  # key t is visible to row r iff t ≤ last[b, s(r)]: no mask tensor to read
        if not GUARD:  # one split a program: loaded here, as the kernel always did
            last = tl.load(mask_ptr + b * sm_b + s * sm_s, mask=rmask, other=-1)  # [BLOCK_M] int64
        if EARLY_KV:
            t_end = tl.where(t_begin <= tl.max(last, axis=0), t_end, t_begin)  # nobody sees the split: no tile
    elif EARLY_KV:
        # Whether any row of the block sees any key of the split: one mask load for the split, so
        # each tile's K/V loads wait on nothing else (a visible split's masked tail is read, and
        # made harmless below; a split nobody sees is never read).
        ts = t_begin + tl.arange(0, SPLIT_T)
        seen = tl.load(mask_ptr + b * sm_b + s[:, None] * sm_s + ts[None, :],
                       mask=rmask[:, None] & (ts < t_end)[None, :], other=0) != 0
        split_seen = tl.max(tl.max(seen.to(tl.int32), axis=1), axis=0) > 0
        t_end = tl.where(split_seen, t_end, t_begin)  # nobody sees the split: no tile
    if HAS_SLOTS:
        t_end = tl.where(row_ok, t_end, t_begin)
    for t0 in range(t_begin, t_end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < t_end
        if PAGE > 0:
            blk = blk_next
            blk_next = _tile_blocks(tab_ptr, b, stab, t + BLOCK_T, t + BLOCK_T < t_end, PAGE, TAB_I32)
        else:
            blk = blk_next  # (not read)
        if EARLY_KV:
            kt, v = _kv_tile(k_base, v_base, t, tm, d, tm[None, :], tm[:, None], blk, sk_b, sk_t, sv_b,
                             sv_t, PAGE, ksc, vsc, KV_FP8, DT)  # [DH, BLOCK_T], [BLOCK_T, DH]
        if BOUNDS:
            vis = (t[None, :] <= last[:, None]) & rmask[:, None] & tm[None, :]  # [BLOCK_M, BLOCK_T]
        else:
            vis = tl.load(mask_ptr + b * sm_b + s[:, None] * sm_s + t[None, :], mask=rmask[:, None] & tm[None, :],
                          other=0) != 0  # [BLOCK_M, BLOCK_T]
        col_vis = tl.max(vis.to(tl.int32), axis=0) > 0  # [BLOCK_T]: keys some row of the block may see
        if EARLY_KV:
            # Straight-line: a tile nobody sees leaves m, l and acc exactly as they are (its scores
            # are -inf: alpha = 1 and p = 0, or all stay 0), so the bits equal the branch's below.
            # Garbage (even NaN) in unseen keys: its scores are masked, its values zeroed.
            v = tl.where(col_vis[:, None], v, 0.0)
            m_i, l_i, acc = _tile_update(q, kt, v, vis, m_i, l_i, acc, SCALE, BLOCK_M, DH, IEEE_DOT)
        elif tl.max(col_vis.to(tl.int32), axis=0) > 0:  # else: the tile is skipped, K/V never read
            # V issued with K (both wait on the mask only), not after the scores: one memory
            # round trip less in each tile's chain of dependent accesses. [DH, BLOCK_T], [BLOCK_T, DH];
            # unseen rows are 0, not garbage
            kt, v = _kv_tile(k_base, v_base, t, tm, d, (tm & col_vis)[None, :], (tm & col_vis)[:, None], blk,
                             sk_b, sk_t, sv_b, sv_t, PAGE, ksc, vsc, KV_FP8, DT)
            m_i, l_i, acc = _tile_update(q, kt, v, vis, m_i, l_i, acc, SCALE, BLOCK_M, DH, IEEE_DOT)
    base = (bk * NSPLIT + split).to(tl.int64) * M  # this (request, KV head, split)'s first row
    if GUARD:
        rmask = rmask & (split < NSPLIT)
    tl.store(po_ptr + base * DH + (rows[:, None] * DH + d[None, :]), acc, mask=rmask[:, None])
    tl.store(pm_ptr + base + rows, m_i, mask=rmask)
    tl.store(pl_ptr + base + rows, l_i, mask=rmask)


@triton.jit
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr,  # q [B, S, H, Dh]; k, v [N, >= T, KV, Dh]; mask [B, S, T] bool, or
    # with BOUNDS last [B, S] int64 (key t visible to query (b, s) iff t ≤ last[b, s])
    slot_ptr,  # [B] int64: the row of k/v request b reads (when HAS_SLOTS; else row b)
    po_ptr, pm_ptr, pl_ptr,  # partials: acc [B*KV, NSPLIT, M, Dh] fp32, max and sum [B*KV, NSPLIT, M] fp32
    S, T, M, KV, NSPLIT, N_ROWS,  # N_ROWS: k/v's rows (a slot outside [0, N_ROWS) reads nothing)
    sq_b, sq_s, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sm_b, sm_s,
    SCALE: tl.constexpr,  # constexpr: Inductor passes a float argument as fp64, which made the scores fp64
    REP: tl.constexpr, DH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT_T: tl.constexpr,
    IEEE_DOT: tl.constexpr, HAS_SLOTS: tl.constexpr, EARLY_KV: tl.constexpr, PDL: tl.constexpr = 0,
    BOUNDS: tl.constexpr = False,
    # NORM_QK: q_ptr is the layer's raw q and k heads [B, S, H + KV, Dh]: q is normed and rotated here,
    # and the new keys (normed, rotated) and values vn [B, S, KV, Dh] at positions pos [B, S] go into
    # the caches first (``_store_new_kv``; T_CACHE: the caches' length): head_norm_rope's cache kernel
    # folded in, one launch a layer fewer
    vn_ptr=None, pos_ptr=None, svn_b=0, svn_s=0, svn_h=0, sp_b=0, sp_s=0, T_CACHE=0,
    NORM_QK: tl.constexpr = False, EPS: tl.constexpr = 0.0, THETA: tl.constexpr = 0.0, ROPE: tl.constexpr = False,
    KB: tl.constexpr = 16,  # (a literal: Inductor re-emits the kernel source without this module's globals)
    # TABLE (with NORM_QK and ROPE): the angles' cos and sin are rows b·S + s of the step's RoPE
    # table [B·S, Dh/2] fp32 (the qkv GEMM's launch writes it), not computed here: the same bits
    cos_ptr=None, sin_ptr=None, TABLE: tl.constexpr = False,
    # SPLITS: splits a program runs one after the other (a loop; the grid's second dim is
    # cdiv(NSPLIT, SPLITS)). Each split's partials are those of a program of its own, bit for bit:
    # only the q block (and its norm and rotation), the bounds and the new K/V are shared.
    SPLITS: tl.constexpr = 1,
    # PAGE (paged caches): k/v are pools of blocks [blocks, PAGE, KV, Dh] and slot_ptr the requests' block
    # tables [B, n] (row stride STAB): key t of request b is at offset t % PAGE of block table[b, t // PAGE]
    STAB=0, PAGE: tl.constexpr = 0,
    # TAB_I32: the block offsets in int32 (the launcher sets it where the pools' elements fit)
    TAB_I32: tl.constexpr = False,
    # KV_FP8: k/v hold an FP8 cache's E4M3 codes, dequantized as each tile is loaded with the KV head's
    # scales ks_ptr[kvh], vs_ptr[kvh] (float32 [KV]): ``reference.dequantize_kv``
    ks_ptr=None, vs_ptr=None, KV_FP8: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    split0 = tl.program_id(1) * SPLITS
    bk = tl.program_id(2) + pdl_enter(PDL)  # every load and store is addressed after the PDL wait
    b = bk // KV
    kvh = bk % KV
    if PAGE > 0:  # each key's block from the table (``_kv_tile``)
        kv_row = tl.zeros((), tl.int64)
        row_ok = kv_row >= 0
    elif HAS_SLOTS:  # read the cache row in place: no gathered copy of the window
        kv_row = tl.load(slot_ptr + b).to(tl.int64)
        row_ok = (kv_row >= 0) & (kv_row < N_ROWS)  # a slot outside the caches: no key is read, zeros out
        kv_row = tl.where(row_ok, kv_row, 0)
    else:
        kv_row = b.to(tl.int64)
        row_ok = kv_row >= 0  # (not read)
    # row = s·REP + j: query head kvh·REP + j at position s (REP a constexpr: no division by a runtime S)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    s = rows // REP
    head = kvh * REP + rows % REP
    d = tl.arange(0, DH)
    # Scalar base pointers (64-bit, once); every tensor of addresses adds one int32 offset to them
    k_base = k_ptr + kv_row * sk_b + kvh * sk_h
    v_base = v_ptr + kv_row * sv_b + kvh * sv_h
    q_base = q_ptr + b.to(tl.int64) * sq_b
    if KV_FP8:  # the KV head's scales: the new keys and values quantized with them, the tiles dequantized
        ksc = tl.load(ks_ptr + kvh)
        vsc = tl.load(vs_ptr + kvh)
    else:
        ksc = 1.0  # (not read)
        vsc = 1.0
    if NORM_QK:
        HALF: tl.constexpr = DH // 2
        dh2 = tl.arange(0, HALF)
        qsrc = q_base + (s[:, None] * sq_s + head[:, None] * sq_h + dh2[None, :])
        x1 = tl.load(qsrc, mask=rmask[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(qsrc + HALF, mask=rmask[:, None], other=0.0).to(tl.float32)
        if TABLE:
            qpos = 0.0  # (not read)
        else:
            qpos = tl.load(pos_ptr + b * sp_b + s * sp_s, mask=rmask, other=0).to(tl.float32)[:, None]
        y1, y2 = _norm_rotate_rows(x1, x2, qpos, b * S + s, rmask, cos_ptr, sin_ptr, EPS, THETA, DH, ROPE,
                                   q_ptr.dtype.element_ty, TABLE)
        q = tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), (BLOCK_M, DH))  # [y1 | y2]
        # This program's splits' new keys and values into the caches (the last split also takes
        # positions past the window), then a barrier: the tiles below read them back (every row
        # block of a split stores the same values, so none reads another's half-written row).
        lo = split0 * SPLIT_T
        if SPLITS == 1:
            hi = tl.where(split0 == NSPLIT - 1, T_CACHE, lo + SPLIT_T)
        else:
            hi = tl.where(split0 + SPLITS >= NSPLIT, T_CACHE, lo + SPLITS * SPLIT_T)
        _store_new_kv(q_ptr, vn_ptr, pos_ptr, k_ptr, v_ptr, b, kvh, kv_row, row_ok, lo, hi, S, REP * KV, sq_b, sq_s,
                      sq_h, svn_b, svn_s, svn_h, sp_b, sp_s, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, EPS, THETA, DH, ROPE,
                      KB, TABLE, cos_ptr, sin_ptr, slot_ptr, STAB, PAGE, ksc, vsc, KV_FP8, q_ptr.dtype.element_ty)
        tl.debug_barrier()
    else:
        q = tl.load(q_base + (s[:, None] * sq_s + head[:, None] * sq_h + d[None, :]), mask=rmask[:, None], other=0.0)
    last = rows  # with BOUNDS and several splits a program: the bounds, loaded once for all of them
    if BOUNDS and SPLITS > 1:
        last = tl.load(mask_ptr + b * sm_b + s * sm_s, mask=rmask, other=-1)  # [BLOCK_M] int64
    # A loop, not unrolled (unrolled copies spilled registers); one split a program compiles to the
    # kernel as it always was (the same PTX, checked for sm_90)
    for i in range(SPLITS):
        _split_partial(q, k_base, v_base, mask_ptr, po_ptr, pm_ptr, pl_ptr, b, bk, s, rows, rmask, d, last,
                       row_ok, split0 + i, T, M, NSPLIT, sk_t, sv_t, sm_b, sm_s, SCALE, DH, BLOCK_M, BLOCK_T,
                       SPLIT_T, IEEE_DOT, HAS_SLOTS, EARLY_KV, BOUNDS, SPLITS > 1, slot_ptr, STAB, sk_b, sv_b, PAGE,
                       ksc, vsc, KV_FP8, q_ptr.dtype.element_ty, TAB_I32)


@triton.jit
def _combine_kernel(
    po_ptr, pm_ptr, pl_ptr, out_ptr,  # out [B, S, H, Dh] contiguous
    S, M, KV, NSPLIT, H,
    REP: tl.constexpr, DH: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = 0,
):
    # One (row, batch·KV head) per program; the splits CHUNK at a time, merged online. A chunk of
    # empty splits (keys past the last visible one) leaves the running max, and so everything,
    # unchanged exactly (a rescale by exp(0) = 1 and sums of exact zeros).
    row = tl.program_id(0)  # s·REP + j, as the partial kernel orders its rows
    bk = tl.program_id(1) + pdl_enter(PDL)
    b = bk // KV
    kvh = bk % KV
    d = tl.arange(0, DH)
    pb = bk.to(tl.int64) * NSPLIT * M  # this (request, KV head)'s first partial row: int32 offsets from it
    m_run = tl.full((), float("-inf"), tl.float32)
    l_run = tl.zeros((), tl.float32)
    acc = tl.zeros((DH,), tl.float32)
    for c0 in range(0, NSPLIT, CHUNK):
        sp = c0 + tl.arange(0, CHUNK)
        spm = sp < NSPLIT
        at = sp * M + row  # [CHUNK]
        m = tl.load(pm_ptr + pb + at, mask=spm, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_run - m_ref)
        w = tl.exp(m - m_ref)  # 0 for empty splits and padding
        l_run = add_rn(mul_rn(l_run, alpha), tl.sum(mul_rn(w, tl.load(pl_ptr + pb + at, mask=spm, other=0.0)), axis=0))
        po = tl.load(po_ptr + pb * DH + (at[:, None] * DH + d[None, :]), mask=spm[:, None], other=0.0)  # [CHUNK, DH]
        acc = add_rn(mul_rn(acc, tl.broadcast_to(alpha, (DH,))),
                     tl.sum(mul_rn(tl.broadcast_to(w[:, None], (CHUNK, DH)), po), axis=0))
        m_run = m_new
    out = tl.where(l_run > 0.0, acc / tl.where(l_run > 0.0, l_run, 1.0), 0.0)  # no visible key: zeros
    s = row // REP
    head = kvh * REP + row % REP
    tl.store(out_ptr + ((b * S + s) * H + head) * DH + d, out.to(out_ptr.dtype.element_ty))


def program_splits(B: int, M: int, T: int, KV: int, device: torch.device, config: dict | None = None,
                   interpret: bool = False) -> int:
    """The splits of the window a program of the partial kernel runs, as ``launch_attention`` launches
    it for B requests × KV heads × M rows (query heads × queries of a KV head) over T keys: ``config``'s
    SPLITS (over DEFAULT_CONFIG's), else the current kernel options' ``attention_splits``
    (``muse_spark.options``), else ``splits_per_program``
    for this grid on ``device``'s SMs (1 without a GPU, or on the interpreter)."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    if int(cfg["SPLITS"]) < 0:
        raise ValueError(f"attention config: SPLITS {cfg['SPLITS']} must be ≥ 1 (0: the launcher's choice)")
    return int(cfg["SPLITS"]) or current_options().attention_splits or (
        1 if interpret or torch.device(device).type != "cuda" else splits_per_program(
            max(1, triton.cdiv(T, cfg["SPLIT_T"])), triton.cdiv(M, cfg["BLOCK_M"]) * B * KV,
            torch.cuda.get_device_properties(device).multi_processor_count))


def launch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     slots: torch.Tensor | None = None, wrap=lambda f: f, interpret: bool = False,
                     config: dict | None = None, pdl: int = 0, launch_pdl: bool = False,
                     window: int | None = None, new_kv: tuple | None = None,
                     table: tuple | None = None, scales: tuple | None = None) -> torch.Tensor:
    """q [B, S, H, Dh], mask [B, S, T] bool → [B, S, H, Dh] in q's dtype. Or with ``window`` = T, the
    mask in bounds form: ``mask`` is ``last`` [B, S] int64 and key t < T is visible to query (b, s)
    iff t ≤ last[b, s] (``plugins.attention.reference.KeyBounds``; the same bits as its dense mask). k/v: [B, ≥ T, KV, Dh], or
    with ``slots`` ([B] int64) whole caches [N, ≥ T, KV, Dh] of which request b reads row
    ``slots[b]`` in place (a slot outside [0, N) reads nothing: that request's rows are zeros, as
    for a query that sees no key); only the first T positions are read. Or with ``slots`` [B, n] int64
    (paged caches, ``plugins.attention.reference.PagedKV``): k/v pools of blocks [blocks, P, KV, Dh] and the
    requests' block tables, key t of request b at offset t % P of block slots[b, t // P] (T ≤ n·P).
    Any strides (the last dim is made contiguous if it is not). Dh a power of two in [16, 256] and
    KV dividing H (``plugins.attention.reference.triton_attention_fits``). ``wrap`` is
    ``torch.library.wrap_triton`` inside the op; ``config`` overrides ``DEFAULT_CONFIG`` (the
    sweep only: SPLIT_T a multiple of BLOCK_T, powers of two). ``pdl``/``launch_pdl``: as
    ``plugins.linear.triton_kernel.launch_linear``'s.

    ``new_kv`` = (v, positions, eps, theta, use_rope), with ``slots``: q is the layer's raw q and k
    heads [B, S, H + KV, Dh]; the kernel norms and rotates them as ``head_norm_rope`` does and
    writes the keys and v [B, S, KV, Dh] into the caches k/v at rows ``slots`` (or through block
    tables ``slots`` [B, n]), positions ``positions`` [B, S] (a row or position outside the caches
    writes nothing) before it reads them: ``head_norm_rope_cache`` and this attention in one launch of the partial kernel.
    ``table`` (with ``new_kv``): the step's RoPE (cos, sin) [B·S, Dh/2] fp32 of ``positions``
    (``head_norm_rope.launch_rope_table``, or the qkv projection's launch), read instead of
    computing the angles: the same bits.

    ``scales`` = (k_scale, v_scale), float32 [KV] each: k/v are an FP8 cache's float8_e4m3fn codes, each tile
    dequantized as it is loaded (``plugins.attention.reference.dequantize_kv``), and with ``new_kv`` the new keys
    and values written quantized (``quantize_kv``)."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    if cfg["SPLIT_T"] % cfg["BLOCK_T"]:
        raise ValueError(f"attention config: SPLIT_T {cfg['SPLIT_T']} is not a multiple of BLOCK_T {cfg['BLOCK_T']}")
    B, S, H, dh = q.shape
    T, KV = (mask.shape[-1] if window is None else int(window)), k.shape[2]
    paged = slots is not None and slots.dim() == 2
    if paged:
        if T > slots.shape[1] * k.shape[1]:
            raise ValueError(f"attention: a window of {T} keys exceeds the block tables' {slots.shape[1]} blocks of "
                             f"{k.shape[1]}")
        if slots.stride(-1) != 1:
            slots = slots.contiguous()
    if new_kv is not None:
        if slots is None:
            raise ValueError("attention: writing the new K/V (new_kv) needs the caches' rows (slots)")
        H -= KV  # q holds the q heads, then the k heads
        v_new, positions, eps, theta, use_rope = new_kv
        if v_new.stride(-1) != 1:
            v_new = v_new.contiguous()
    fp8 = dict(ks_ptr=scales[0], vs_ptr=scales[1], KV_FP8=True) if scales is not None else \
        dict(ks_ptr=q, vs_ptr=q, KV_FP8=False)
    out = torch.empty((B, S, H, dh), dtype=q.dtype, device=q.device)
    if B == 0 or S == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    M = (H // KV) * S
    launch_opts = {"launch_pdl": True} if launch_pdl else {}
    nsplit = max(1, triton.cdiv(T, cfg["SPLIT_T"]))
    row_blocks = triton.cdiv(M, cfg["BLOCK_M"])
    splits = program_splits(B, M, T, KV, q.device, config, interpret)
    if window is None:
        m8 = mask if mask.stride(-1) == 1 else mask.contiguous()  # bool: Triton loads its bytes as int1
    else:
        m8 = mask  # last [B, S]: any strides
    if new_kv is not None:
        fused = dict(vn_ptr=v_new, pos_ptr=positions, svn_b=v_new.stride(0), svn_s=v_new.stride(1),
                     svn_h=v_new.stride(2), sp_b=positions.stride(0), sp_s=positions.stride(1),
                     T_CACHE=k.shape[1] * (slots.shape[1] if paged else 1),
                     NORM_QK=True, EPS=float(eps), THETA=float(theta), ROPE=bool(use_rope), KB=NEW_ROWS,
                     cos_ptr=q if table is None else table[0], sin_ptr=q if table is None else table[1],
                     TABLE=table is not None and bool(use_rope))
    else:  # every argument passed: Inductor's mutation analysis of a user kernel fills in no defaults
        if table is not None:
            raise ValueError("attention: a RoPE table is read only where the kernel writes the new K/V (new_kv)")
        fused = dict(vn_ptr=q, pos_ptr=m8, svn_b=0, svn_s=0, svn_h=0, sp_b=0, sp_s=0, T_CACHE=0, NORM_QK=False,
                     EPS=0.0, THETA=0.0, ROPE=False, KB=NEW_ROWS, cos_ptr=q, sin_ptr=q, TABLE=False)
    po = torch.empty((B * KV, nsplit, M, dh), dtype=torch.float32, device=q.device)
    pm = torch.empty((B * KV, nsplit, M), dtype=torch.float32, device=q.device)
    pl = torch.empty((B * KV, nsplit, M), dtype=torch.float32, device=q.device)
    wrap(_partial_kernel)[(row_blocks, triton.cdiv(nsplit, splits), B * KV)](
        q, k, v, m8, slots if slots is not None else m8, po, pm, pl, S, T, M, KV, nsplit, k.shape[0],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), m8.stride(0), m8.stride(1),
        SCALE=1.0 / math.sqrt(dh), REP=H // KV, DH=dh, BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"],
        SPLIT_T=cfg["SPLIT_T"], IEEE_DOT=interpret, HAS_SLOTS=slots is not None and not paged,
        EARLY_KV=cfg["EARLY_KV"], PDL=0 if interpret else int(pdl), BOUNDS=window is not None, SPLITS=splits,
        STAB=slots.stride(0) if paged else 0, PAGE=k.shape[1] if paged else 0, num_warps=cfg["num_warps"],
        TAB_I32=paged and max(k.numel(), v.numel()) < 2 ** 31 and cfg["TAB_I32"] is not False,
        **launch_opts,
        **fused,
        **fp8,
        **{opt: cfg[opt] for opt in ("num_stages", "maxnreg") if opt in cfg},  # eager launches only (the sweep)
    )
    wrap(_combine_kernel)[(M, B * KV)](po, pm, pl, out, S, M, KV, nsplit, H, REP=H // KV, DH=dh,
                                       CHUNK=cfg["MERGE_CHUNK"], PDL=0 if interpret else int(pdl),
                                       num_warps=cfg["merge_warps"], **launch_opts)
    return out
