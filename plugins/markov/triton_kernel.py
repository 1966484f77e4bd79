"""Triton kernel of the fused DSpark Markov loop (vanilla head, greedy and sampled).

Reference (``reference.py``, the spec), for k = 0 … γ−1 with ``prev = anchor``::

    z_k  = sanitize(U_k + W2 @ W1[prev])           # NaN→−inf; +inf rows; all −inf rows
    x_k  = argmax(z_k)                   T == 0
         = argmax(z_k·(1/T) + Gumbel)    T > 0     # keyed (seed, p+k+1, SALT_DRAFT)
    q_k  = softmax(z_k·(1/T))  (one-hot when T == 0)
    prev = x_k + d2t[x_k]

Design. A step is a GEMV over W2 ([Vd, r] bf16: 16 MB at Vd = 32768,
r = 256), which one SM cannot stream fast enough, then a row-wide argmax and
softmax. So the draft vocabulary is split into NS slices of BLOCK_V columns
(128 slices at Vd = 32768), one program per slice and block of BLOCK_B
requests, all resident at once (one launch, ``GRID_SYNC``) or one launch per
step. The loop is latency-bound at small batch, so each step keeps its chain of
dependent memory accesses short:

* before ``prev`` is known a program already loads U_k and draws its noise;
* the step's result travels as ONE 64-bit word per (request, step, slice):
  ``[call parity : 1][class+1 : 2][order-preserving key : 32][511 − column : 9][target id : 20]``
  so that the maximum word (parity bit cleared) is the winner of the sanitized
  argmax with torch's tie-break (highest class, highest key, lowest index) and
  carries ``prev = x + d2t[x]`` itself. Readers poll the NS words of step k−1
  until all carry this call's parity: the poll is both the barrier and the
  data (no fence, no atomic). ``POLL_MAX`` (default): each poll is one
  max-reduction over the words with the ones of another parity mapped to a
  sentinel, which is both the "all written?" test and the winner;
* the words live in a workspace ``[counter, epoch, error flag, 0, words…]``:
  the call's parity is 1 − (epoch mod 2), every call writes every word of its
  shape, and the final grid barrier flips the parity for the next call. So a
  workspace kept by the caller for one shape (an engine's batch bucket) is never
  zeroed again: no memset per call. A zeroed workspace (epoch 0: parity 1, and a
  zero word has parity 0) serves any one call. The barrier: ``COUNT_BARRIER``
  (default) — the counter is never reset, the epoch is counter / programs, and
  the waiters poll the counter itself, so the last program to arrive does no
  extra atomics before the others go on; otherwise sense-reversing — the last
  program to arrive resets the counter and advances the epoch the others wait on;
* at batch 1 the program's W2 slice (BLOCK_V·r·2 B = 128 KB) is read once for
  all γ steps (``RESIDENT``): with ``MMA`` (default) into shared memory, and
  each step's GEMV is one tensor-core product W2_slice @ [e … e] (the W1 row
  broadcast to 16 columns); without, into registers as bf16 pairs (int32) and
  the GEMV runs on the CUDA cores.

Barriers: a CTA barrier (``tl.debug_barrier``) stands before and inside the poll, after its
final reduction, and after the word is published. Without them, on the H200 with Triton 3.6
(Vd = 4096, r = 64, batches 8–16, every launch configuration), programs spun to the poll limit
on step words that were all written, even with one launch per step: the poll's reductions and
the step's other reductions race on their shared-memory scratch. The kernel tests' polling and
kept-workspace cases (tests/kernels/test_markov.py) are the check.

Off the critical path each program writes its softmax partials (max, sum of
exp over the finite class, count of +inf) and stashes exp(z/T − max) in the
probs buffer; after one grid barrier (or the kernel boundary), the final phase
merges the partials per (request, step), writes ids (target vocabulary) and
rescales the stash into probabilities.

Memory traffic per step: W2 Vd·r·2 B (16 MB; from L2 after the first step, or
once per call when RESIDENT), U_k B·Vd·4 B, W1 B·r·2 B, words B·NS·8 B polled;
stash B·Vd·4 B written. Final phase: B·γ·Vd·4 B read, B·γ·Vd·4 B written.

Exactness: the Gumbel noise is the reference's murmur3 chain in uint32
(wrapping) and ``-log(-log(u))`` with libdevice's ``logf`` (bit-identical to
torch's CUDA log, tested); 1/T is an IEEE division; ``z·(1/T) + g`` is
rounded twice, never fused. Only the GEMV's summation order differs from
torch's, so tokens match unless two candidates tie within that rounding.
Sanitization is a per-element class (2: +inf, 1: finite, 0: −inf or NaN): the
row's highest class decides which elements compete (their sanitized key is
z·(1/T) + g, or g where the sanitized value is 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse_spark.plugins.keyed_random import GOLDEN, MASK32, SALT_DRAFT
from muse_spark.plugins.triton_math import add_rn, exp_exact, log_exact, mul_rn

SALT_KEY = (SALT_DRAFT * GOLDEN) & MASK32  # the first key word, as keyed_random.key_hash
TID_BITS = tl.constexpr(20)  # target ids < 2^20
TID_MASK = tl.constexpr((1 << 20) - 1)
SLOT_BITS = tl.constexpr(9)  # columns of a slice and slices of a row < 2^9
MAX_SLOT = tl.constexpr(511)  # a word's slot field holds 511 - column (in a slice) or 511 - slice
CLEAR_SLOT = tl.constexpr(~(511 << 20))
WORD_MASK = tl.constexpr((1 << 63) - 1)  # a word without its parity bit
CTL_WORDS = 4  # the workspace's control words before the step words: counter, epoch, error flag, (unused)
CTL = tl.constexpr(CTL_WORDS)
MAX_TARGET_VOCAB = 2**20
SPIN_LIMIT = 1 << 24  # polls before giving up (a bug must fail, not hang the GPU); ``spin_limit`` overrides


# ----------------------------------------------------------------------------- keyed noise
@triton.jit
def _fmix32(h):
    # murmur3 finalizer on uint32 (products wrap mod 2^32, shifts are logical)
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return h


@triton.jit
def _key_hash(seed, pos, SALT: tl.constexpr):
    """keyed_random.key_hash: seed, pos int64 [BLOCK_B] -> uint32 [BLOCK_B]."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = _fmix32(lo ^ SALT)
    h = _fmix32(h ^ hi)
    return _fmix32(h ^ (pos & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _uniform(h):
    """keyed_random.uniform_from_hash of a mixed uint32 hash: its top 23 bits, centred, in (0, 1)."""
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _gumbel(key, cols):
    """keyed_random.keyed_gumbel: key uint32 [BB], cols int32 [BV] -> fp32 [BB, BV]."""
    h = _fmix32(key[:, None] ^ (cols.to(tl.uint32) * 0x9E3779B9)[None, :])
    return -log_exact(-log_exact(_uniform(h)))


@triton.jit
def _keyed_gumbel_kernel(seed_ptr, pos_ptr, out_ptr, n, SALT: tl.constexpr, BLOCK: tl.constexpr):
    # A test hook: the kernel's noise, to compare bit for bit with keyed_gumbel.
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + row + tl.arange(0, 1))
    pos = tl.load(pos_ptr + row + tl.arange(0, 1))
    g = _gumbel(_key_hash(seed, pos, SALT), cols)
    tl.store(out_ptr + row * n + cols[None, :], g, mask=(cols < n)[None, :])


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _ordered(x):
    """fp32 -> int64 holding a uint32 whose unsigned order is x's order (no NaN)."""
    b = x.to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) != 0, b ^ 0xFFFFFFFF, b | 0x80000000).to(tl.int64)


@triton.jit
def _poll_words(ptrs, msk, parity):
    """One poll of a block of step words -> per row, the winning word (parity bit cleared), or
    ``WORD_MASK`` where a word does not carry this call's ``parity`` yet. WORD_MASK is never a word:
    its key field would be all ones, the order key of a NaN, and keys are never NaN."""
    w = tl.load(ptrs, mask=msk, other=0, volatile=True)  # volatile: from L2, never a stale L1 line
    t = w ^ (parity << 63)  # this call's words: sign bit clear, the rest the word; others: negative
    return tl.max(tl.where(msk, tl.where(t < 0, WORD_MASK, t), 0), axis=1)


@triton.jit
def _wait_for_words(word_ptr, rows, rmask, k, GAMMA, NS, flag_ptr, parity, NS_P2: tl.constexpr,
                    SPIN: tl.constexpr, POLL_MAX: tl.constexpr):
    """Poll the NS words of step k until all carry this call's ``parity`` -> the winning word per
    row (parity bit cleared). A poll that gives up (after SPIN polls) raises the error flag to 1.
    ``POLL_MAX``: each poll is one max-reduction that yields the winner too (``_poll_words``);
    else a count of missing words per poll, then the max."""
    sl = tl.arange(0, NS_P2)
    msk = rmask[:, None] & (sl < NS)[None, :]
    ptrs = word_ptr + (rows[:, None] * GAMMA + k) * NS + sl[None, :]
    # CTA barriers around the poll (see the module docstring, "Barriers"): without them, on the
    # H200 (Triton 3.6) the poll's reductions read each other's shared-memory scratch and a
    # program spun on words that were all written (2026-12-02).
    tl.debug_barrier()
    if POLL_MAX:
        w = _poll_words(ptrs, msk, parity)
        missing = tl.max(w, axis=0) == WORD_MASK
        spins = 0
        while missing & (spins < SPIN):
            tl.debug_barrier()  # every thread has read ``missing`` before the scratch is reused
            w = _poll_words(ptrs, msk, parity)
            missing = tl.max(w, axis=0) == WORD_MASK
            spins += 1
        tl.store(flag_ptr, 1, mask=missing)
    else:
        w = tl.load(ptrs, mask=msk, other=0, volatile=True)
        missing = tl.sum(tl.sum((msk & (((w >> 63) & 1) != parity)).to(tl.int32), axis=1), axis=0)
        spins = 0
        while (missing > 0) & (spins < SPIN):
            tl.debug_barrier()  # every thread has read ``missing`` before the scratch is reused
            w = tl.load(ptrs, mask=msk, other=0, volatile=True)
            missing = tl.sum(tl.sum((msk & (((w >> 63) & 1) != parity)).to(tl.int32), axis=1), axis=0)
            spins += 1
        tl.store(flag_ptr, 1, mask=missing > 0)
        w = tl.max(tl.where(msk, w & WORD_MASK, 0), axis=1)
    tl.debug_barrier()
    return w


@triton.jit
def _count_barrier(ctl_ptr, n_prog, SPIN: tl.constexpr):
    """``COUNT_BARRIER``: the counter (ctl[0]) only grows, by ``n_prog`` per call, so the call's
    target is the next multiple of ``n_prog`` above a program's own arrival. bar.sync, then one
    thread's release increment publishes the CTA's stores at GPU scope; the acquire spin on the
    counter makes every other CTA's visible."""
    tl.debug_barrier()
    arrived = tl.atomic_add(ctl_ptr, 1, sem="release", scope="gpu")
    target = (arrived // n_prog + 1) * n_prog
    cnt = tl.atomic_add(ctl_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (cnt < target) & (spins < SPIN):
        cnt = tl.atomic_add(ctl_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    tl.store(ctl_ptr + 2, 2, mask=cnt < target)  # gave up: the error flag
    tl.debug_barrier()


@triton.jit
def _grid_barrier(ctl_ptr, n_prog, epoch, SPIN: tl.constexpr):
    """Sense-reversing: the last of ``n_prog`` programs to arrive resets the counter (ctl[0]) and
    advances the epoch (ctl[1]) that the others wait on, which also flips the next call's parity.
    All programs are resident (checked by the launcher). bar.sync, then one thread's acq_rel
    increment publishes the CTA's stores at GPU scope and, for the last, acquires everyone's; the
    others' acquire spin on the epoch makes every CTA's stores visible to them."""
    tl.debug_barrier()
    arrived = tl.atomic_add(ctl_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == n_prog - 1
    if last:
        tl.atomic_xchg(ctl_ptr, 0, sem="relaxed", scope="gpu")  # ordered before the next call by the kernel boundary
        tl.atomic_add(ctl_ptr + 1, 1, sem="release", scope="gpu")
    else:
        now = tl.atomic_add(ctl_ptr + 1, 0, sem="acquire", scope="gpu")
        spins = 0
        while (now == epoch) & (spins < SPIN):
            now = tl.atomic_add(ctl_ptr + 1, 0, sem="acquire", scope="gpu")
            spins += 1
        tl.store(ctl_ptr + 2, 2, mask=now == epoch)  # gave up: the error flag
    tl.debug_barrier()


@triton.jit
def _bias(w1_ptr, w2_ptr, prev, rmask, cols, cmask, RANK, RANK_W, w_res, RANK_P2: tl.constexpr,
          BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, RESIDENT: tl.constexpr,
          IEEE_DOT: tl.constexpr, MMA: tl.constexpr):
    """W2[cols] @ W1[prev] -> [BLOCK_B, BLOCK_V] fp32.

    Reads BLOCK_V*r*2 B of W2 (none if RESIDENT) and BLOCK_B*r*2 B of W1."""
    acc = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
    if RESIDENT and MMA:
        # batch 1, W2 slice held as bf16 [BLOCK_V, r]: z^T = W2 @ [e e … e] on the tensor cores (the
        # W1 row broadcast to the MMA's 16 columns; every column is the same sum, so their max is it).
        rr = tl.arange(0, RANK_P2)
        e = tl.load(w1_ptr + prev[:, None] * RANK_W + rr[None, :], mask=rmask[:, None] & (rr < RANK)[None, :],
                    other=0.0)  # [1, r]
        eb = tl.broadcast_to(tl.trans(e), (RANK_P2, 16))
        if IEEE_DOT:
            zt = tl.dot(w_res.to(tl.float32), eb.to(tl.float32), input_precision="ieee")
        else:
            zt = tl.dot(w_res, eb)  # [BLOCK_V, 16] fp32; bf16 products are exact in fp32
        acc += tl.max(zt, axis=1)[None, :]
    elif RESIDENT:
        # batch 1, W2 slice held as bf16 pairs in int32 [BLOCK_V, r/2]; the W1 row likewise [1, r/2].
        # (Columns on dim 0 and a reduction over dim 1 keep the result spread over the threads.)
        jj = tl.arange(0, RANK_P2 // 2)
        e = tl.load(w1_ptr + prev[:, None] * RANK_W + jj[None, :], mask=rmask[:, None] & (jj < RANK_W)[None, :],
                    other=0)  # [1, r/2]
        e_lo = (e << 16).to(tl.float32, bitcast=True)
        e_hi = (e & -65536).to(tl.float32, bitcast=True)
        # Unpack W2 inside the step: ``zero`` (prev < 2^32) is unknown to the compiler, which
        # would otherwise hoist both unpacked fp32 copies out of the loop (2x the registers).
        w = w_res + (prev >> 32).to(tl.int32)[:, None]
        w_lo = (w << 16).to(tl.float32, bitcast=True)
        w_hi = (w & -65536).to(tl.float32, bitcast=True)
        acc += tl.sum(e_lo * w_lo + e_hi * w_hi, axis=1)[None, :]  # [BLOCK_V, r/2] -> [1, BLOCK_V]
    elif BLOCK_B == 1:
        # one request: a GEMV on the CUDA cores; the unrolled loop issues all W2 loads at once
        for r0 in tl.static_range(0, RANK_P2, BLOCK_R):
            rk = r0 + tl.arange(0, BLOCK_R)
            rkm = rk < RANK
            w = tl.load(w2_ptr + cols[:, None] * RANK_W + rk[None, :], mask=cmask[:, None] & rkm[None, :], other=0.0)
            e = tl.load(w1_ptr + prev[:, None] * RANK_W + rk[None, :], mask=rmask[:, None] & rkm[None, :], other=0.0)
            acc += tl.sum(e.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]  # [BV, BLOCK_R] -> [1, BV]
    else:
        # a block of requests: tensor cores, [BLOCK_B, BLOCK_R] @ [BLOCK_R, BLOCK_V], software-pipelined
        for r0 in range(0, RANK_P2, BLOCK_R):
            rk = r0 + tl.arange(0, BLOCK_R)
            rkm = rk < RANK
            w = tl.load(w2_ptr + cols[None, :] * RANK_W + rk[:, None], mask=rkm[:, None] & cmask[None, :], other=0.0)
            e = tl.load(w1_ptr + prev[:, None] * RANK_W + rk[None, :], mask=rmask[:, None] & rkm[None, :], other=0.0)
            if IEEE_DOT:  # fp32 weights (and the CPU interpreter, whose bf16 dot is broken)
                acc = tl.dot(e.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(e, w, acc)  # bf16 products are exact in fp32; fp32 accumulation
    return acc


# ----------------------------------------------------------------------------- kernel
# Sizes that only index the partials are not specialized (on == 1 or % 16), so
# one compiled kernel serves every batch size and step of a configuration.
@triton.jit(do_not_specialize=["B", "GAMMA", "NS", "k_begin", "k_end"])
def _markov_kernel(
    u_ptr,  # [B, gamma, Vd] fp32 base logits (last dim contiguous)
    anchor_ptr,  # [B] int64 target ids
    w1_ptr,  # [V, r] contiguous, row stride RANK_W elements (bf16, or int32 pairs when RESIDENT)
    w2_ptr,  # [Vd, r] contiguous, likewise
    d2t_ptr,  # [Vd] int64
    seed_ptr, pos_ptr,  # [B] int64
    temp_ptr,  # [B] fp32 temperature, 0 = greedy
    ids_ptr,  # [B, gamma] int64 out
    probs_ptr,  # [B, gamma, Vd] fp32 out (holds the stash until the final phase)
    ws_ptr,  # int64 workspace [counter, epoch, error flag, 0, B*gamma*NS words] (module docstring)
    pf_ptr,  # [2, B, gamma, NS] fp32: softmax max, sum
    pi_ptr,  # [2, B, gamma, NS] int32: count of +inf, local draft id of the winner
    B, Vd, GAMMA, RANK, NS, k_begin, k_end, stride_ub, stride_uk, RANK_W,
    RANK_P2: tl.constexpr, NS_P2: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    FINAL_ROWS: tl.constexpr, SALT: tl.constexpr, HAS_MARKOV: tl.constexpr, RESIDENT: tl.constexpr,
    GRID_SYNC: tl.constexpr, FINAL: tl.constexpr, IEEE_DOT: tl.constexpr, SPIN: tl.constexpr,
    COUNT_BARRIER: tl.constexpr = False, POLL_MAX: tl.constexpr = False, MMA: tl.constexpr = False,
    CHECK_READS: tl.constexpr = False,
):
    pid_v = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    lcol = tl.arange(0, BLOCK_V)
    cols = pid_v * BLOCK_V + lcol
    cmask = cols < Vd
    m2 = rmask[:, None] & cmask[None, :]
    temp = tl.load(temp_ptr + rows, mask=rmask, other=0.0)
    greedy = (temp == 0.0)[:, None]
    # 1/T exactly as the reference: where(T > 0, 1 / T.clamp_min(1e-30), 1), IEEE division
    inv_t = tl.where(temp > 0.0, tl.div_rn(tl.full(temp.shape, 1.0, tl.float32), tl.maximum(temp, 1e-30)), 1.0)
    inv_t = inv_t[:, None]
    seed = tl.load(seed_ptr + rows, mask=rmask, other=0)
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0)
    plane = B * GAMMA * NS
    word_ptr = ws_ptr + CTL
    flag_ptr = ws_ptr + 2
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    if COUNT_BARRIER:  # the counter is a multiple of n_prog between calls
        epoch = tl.load(ws_ptr, volatile=True) // n_prog
    else:  # read by every program before the final barrier advances it
        epoch = tl.load(ws_ptr + 1, volatile=True)
    parity = 1 - (epoch & 1)
    z_base = probs_ptr + (rows[:, None] * GAMMA) * Vd + cols[None, :]
    slot = ((lcol ^ MAX_SLOT).to(tl.int64) << TID_BITS)[None, :]  # 511 - column, for the tie-break
    w_res = tl.zeros((1, 1), dtype=tl.int32)
    if RESIDENT and MMA:  # the W2 slice, read once for all steps: [BLOCK_V, r] bf16
        rr = tl.arange(0, RANK_P2)
        w_res = tl.load(w2_ptr + cols[:, None] * RANK_W + rr[None, :], mask=cmask[:, None] & (rr < RANK)[None, :],
                        other=0.0)
    elif RESIDENT:  # the W2 slice, read once for all steps: [BLOCK_V, r/2] int32 (bf16 pairs)
        jj = tl.arange(0, RANK_P2 // 2)
        w_res = tl.load(w2_ptr + cols[:, None] * RANK_W + jj[None, :], mask=cmask[:, None] & (jj < RANK_W)[None, :],
                        other=0)

    for k in range(k_begin, k_end):
        # ---- independent of prev: U_k (read B*BLOCK_V*4 B), the noise, d2t of the slice
        z = tl.load(u_ptr + rows[:, None] * stride_ub + k * stride_uk + cols[None, :], mask=m2, other=0.0)
        g = _gumbel(_key_hash(seed, pos + k + 1, SALT), cols)
        tgt = (cols + tl.load(d2t_ptr + cols, mask=cmask, other=0))[None, :]  # target ids of the slice
        # ---- prev: the anchor, or the winner of step k-1 (polled from the words)
        if k == 0:
            prev = tl.load(anchor_ptr + rows, mask=rmask, other=0)
        else:
            prev = _wait_for_words(word_ptr, rows, rmask, k - 1, GAMMA, NS, flag_ptr, parity, NS_P2,
                                   SPIN, POLL_MAX) & TID_MASK
            if pid_v == 0:
                tl.store(ids_ptr + rows * GAMMA + (k - 1), prev, mask=rmask)
        # ---- z = U_k + W2 @ W1[prev]
        if HAS_MARKOV:
            z = z + _bias(w1_ptr, w2_ptr, prev, rmask, cols, cmask, RANK, RANK_W, w_res, RANK_P2, BLOCK_B, BLOCK_V,
                          BLOCK_R, RESIDENT, IEEE_DOT, MMA)
        # ---- sanitize: class 2 = +inf, 1 = finite, 0 = -inf/NaN, -1 = padding
        z = tl.where(z != z, float("-inf"), z)
        cls = tl.where(z == float("inf"), 2, tl.where(z == float("-inf"), 0, 1))
        cls = tl.where(m2, cls, -1)
        # ---- the sampling key of each element; sanitized values of classes 2 and 0 are 0
        scaled = mul_rn(z, inv_t)
        key = tl.where(cls == 1, tl.where(greedy, z, add_rn(scaled, g)), tl.where(greedy, 0.0, g))
        word = ((cls + 1).to(tl.int64) << 61) | (_ordered(key) << 29) | slot | tgt
        word = tl.max(tl.where(cls >= 0, word, 0), axis=1)  # the slice's winner
        x_loc = pid_v * BLOCK_V + (((word >> TID_BITS) & MAX_SLOT).to(tl.int32) ^ MAX_SLOT)
        word = (word & CLEAR_SLOT) | ((pid_v ^ MAX_SLOT).to(tl.int64) << TID_BITS)
        off = (rows * GAMMA + k) * NS + pid_v
        tl.store(word_ptr + off, word | (parity << 63), mask=rmask)  # publish: the next step can start
        tl.debug_barrier()  # the winner's reductions are done before the softmax's reuse their scratch
        # ---- softmax partials over the finite class, and the stash exp(z/T - max)
        sm = tl.where(cls == 1, scaled, float("-inf"))
        m_loc = tl.max(sm, axis=1)
        n_inf = tl.sum((cls == 2).to(tl.int32), axis=1)
        ex = tl.where(cls == 1, exp_exact(sm - m_loc[:, None]), 0.0)
        tl.store(pf_ptr + off, m_loc, mask=rmask)
        tl.store(pf_ptr + plane + off, tl.sum(ex, axis=1), mask=rmask)
        tl.store(pi_ptr + off, n_inf, mask=rmask)
        tl.store(pi_ptr + plane + off, x_loc, mask=rmask)
        tl.store(z_base + k * Vd, tl.where(cls == 2, float("inf"), ex), mask=m2)  # write B*BLOCK_V*4 B

    if FINAL:
        if GRID_SYNC:
            if COUNT_BARRIER:
                _count_barrier(ws_ptr, n_prog, SPIN)
            else:
                _grid_barrier(ws_ptr, n_prog, epoch, SPIN)
        elif (pid_v == 0) & (tl.program_id(1) == 0):
            # One launch per step: the step launches all read this epoch; the next call's see the next.
            if COUNT_BARRIER:
                tl.atomic_add(ws_ptr, n_prog, sem="relaxed", scope="gpu")
            else:
                tl.atomic_add(ws_ptr + 1, 1, sem="relaxed", scope="gpu")
        # ---- per (request, step): merge the slices, write the id, rescale the stash.
        # FINAL_ROWS (request, step) pairs at a time; read/write B*gamma*BLOCK_V*4 B.
        sl = tl.arange(0, NS_P2)
        for start in range(0, BLOCK_B * GAMMA, FINAL_ROWS):
            pair = start + tl.arange(0, FINAL_ROWS)
            row = tl.program_id(1) * BLOCK_B + pair // GAMMA
            kk = pair % GAMMA
            pm = (pair < BLOCK_B * GAMMA) & (row < B)
            msk = pm[:, None] & (sl < NS)[None, :]
            off = ((row * GAMMA + kk) * NS)[:, None] + sl[None, :]
            raw = tl.load(word_ptr + off, mask=msk, other=0, cache_modifier=".cg")
            words = raw & WORD_MASK
            xs = tl.load(pi_ptr + plane + off, mask=msk, other=0, cache_modifier=".cg")
            ms = tl.load(pf_ptr + off, mask=msk, other=float("-inf"), cache_modifier=".cg")
            ns = tl.load(pi_ptr + off, mask=msk, other=0, cache_modifier=".cg")
            ss = tl.load(pf_ptr + plane + off, mask=msk, other=0.0, cache_modifier=".cg")
            if CHECK_READS:
                # (poisoned buffers, the diagnosis) a partial read before its write shows as NaN
                # (floats) or -7 (ints), a word as another call's parity: error flag 3. Needed
                # because the merge below hides a NaN max: max() drops it and the where() drops
                # its sum, so the probabilities come out wrong but finite.
                early = msk & ((ms != ms) | (ss != ss) | (ns < 0) | (xs < 0))
                if GRID_SYNC:  # (with a launch per step, this launch's programs may read different epochs)
                    early = early | (msk & (((raw >> 63) & 1) != parity))
                tl.store(flag_ptr, 3, mask=tl.max(tl.max(early.to(tl.int32), axis=1), axis=0) > 0)
            # Single-operand reductions: with a multi-operand tl.reduce here, ids came out wrong
            # on the H200 at batch 16, Vd = 4096 while the chain itself was right.
            w = tl.max(words, axis=1)  # words of distinct slices never tie
            x = tl.max(tl.where(words == w[:, None], xs, -1), axis=1)
            m = tl.max(ms, axis=1)
            n_inf = tl.sum(ns, axis=1)
            scale = exp_exact(ms - m[:, None])
            s = tl.sum(tl.where(ms > float("-inf"), ss * scale, 0.0), axis=1)
            if pid_v == 0:  # the last step's id (earlier ones were written as the chain read them)
                tl.store(ids_ptr + row * GAMMA + kk, w & TID_MASK, mask=pm & (kk == GAMMA - 1))
            c = (w >> 61)[:, None] - 1
            g_row = (tl.load(temp_ptr + row, mask=pm, other=0.0) == 0.0)[:, None]
            # this slice's factor exp(m_loc - m) / s, picked out of the row of factors
            mine = tl.sum(tl.where(sl[None, :] == pid_v, scale, 0.0), axis=1)
            fm = pm[:, None] & cmask[None, :]
            ptr = probs_ptr + ((row * GAMMA + kk) * Vd)[:, None] + cols[None, :]
            st = tl.load(ptr, mask=fm, other=0.0)
            p = tl.where(c == 2, tl.where(st == float("inf"), 1.0 / n_inf.to(tl.float32)[:, None], 0.0),
                         tl.where(c == 1, st * (mine / s)[:, None], 1.0 / Vd))
            p = tl.where(g_row, tl.where(cols[None, :] == x[:, None], 1.0, 0.0), p)
            tl.store(ptr, p, mask=fm)


# ----------------------------------------------------------------------------- wrapper
def _identity(kernel):
    return kernel


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def default_config(B: int, Vd: int, rank: int, device: torch.device,
                   weight_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Launch configuration, from the sweeps on the H200 (benchmarks/markov.py, γ = 7, Vd = 32768,
    r = 256; warm L2, a kept workspace): batch 1 keeps its W2 slice resident in shared memory and
    runs the GEMV on the tensor cores (``MMA``: 27.5–27.6 µs, against 29.7–29.9 with the slice in
    registers as bf16 pairs, 36.6 with 16 warps, 41.6 reading W2 from L2 every step); batches 2–16
    share a W2 tile through tensor cores (98.1–98.3 µs at batch 8); larger batches use 512-column
    slices (173 µs at batch 32, vs 326 with 32-row blocks), except with fp32 weights, whose
    512-column tiles need more shared memory than an SM has (264 KB). Every batch: the counting
    grid barrier (``COUNT_BARRIER``) and one max-reduction per poll (``POLL_MAX``), 0.9 and 0.4 µs
    less at batch 1 than the sense-reversing barrier and a count of missing words."""
    common = dict(GRID_SYNC=True, COUNT_BARRIER=True, POLL_MAX=True, num_warps=8)
    if B == 1:
        return dict(common, BLOCK_B=1, BLOCK_V=min(256, triton.next_power_of_2(max(Vd, 16))), RESIDENT=True, MMA=True)
    block_v = 256 if B <= 16 or weight_dtype == torch.float32 else 512
    return dict(common, BLOCK_B=16, BLOCK_V=min(block_v, triton.next_power_of_2(max(Vd, 16))), RESIDENT=False,
                MMA=False)


def supported(Vd: int, vocab: int) -> bool:
    """Whether the word packing holds for every default configuration: target ids < 2^20 and
    at most 511 slices of 256 columns (Vd ≤ 130816)."""
    return vocab <= MAX_TARGET_VOCAB and triton.cdiv(Vd, 256) <= 511


def workspace_words(B: int, gamma: int, Vd: int, rank: int, device: torch.device,
                    weight_dtype: torch.dtype = torch.bfloat16, config: dict | None = None) -> int:
    """int64 elements of the workspace a call of this shape needs (control words + step words)."""
    cfg = dict(default_config(B, Vd, rank, device, weight_dtype), **(config or {}))
    return CTL_WORDS + B * gamma * triton.cdiv(Vd, cfg["BLOCK_V"])


def launch_markov_sample(
    base_logits: torch.Tensor,  # [B, γ, Vd] fp32
    anchor: torch.Tensor,  # [B] int64
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [Vd, r]
    d2t: torch.Tensor,  # [Vd] int64
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64
    temperature: torch.Tensor,  # [B]
    wrap=_identity,
    config: dict | None = None,
    interpret: bool = False,
    check: bool = False,
    spin_limit: int = SPIN_LIMIT,
    workspace: torch.Tensor | None = None,
    poison: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vanilla-head Markov loop → (ids [B, γ] int64 target vocabulary, probs [B, γ, Vd] fp32).

    ``wrap`` is ``torch.library.wrap_triton`` inside the registered op. The
    caller checks ``supported(Vd, V)``. ``check`` (tests and diagnosis; it
    synchronizes): raise if a program gave up waiting for the others (the
    kernel's error flag), which happens only when not all programs were
    resident at once, or a step word was never written; ``spin_limit``: polls
    before a program gives up (diagnosis runs use a small one). ``workspace``: int64
    [≥ ``workspace_words(...)``], zeroed once and then kept by the caller for calls of this one
    shape (an engine's batch bucket), so that no call zeroes it again; None: a zeroed one per call.
    ``poison`` (a diagnosis mode): fill the softmax partials and the
    probabilities with NaN (the partials' ints with −7) before the launch, so that a read of any of
    them before its write shows in the results instead of reading the last call's values; the
    kernel then also checks every partial and step word its final phase reads (error flag 3,
    raised with ``check``): a NaN max is otherwise dropped by the merge, not shown.
    """
    B, gamma, Vd = base_logits.shape
    rank = w1.shape[1]
    dev = base_logits.device
    ids = torch.empty((B, gamma), dtype=torch.int64, device=dev)
    probs = torch.empty((B, gamma, Vd), dtype=torch.float32, device=dev)
    if B == 0 or gamma == 0:
        return ids, probs.zero_()
    cfg = dict(default_config(B, Vd, rank, dev, w1.dtype))
    cfg.update(config or {})
    block_v, block_b = cfg["BLOCK_V"], cfg["BLOCK_B"]
    ns = triton.cdiv(Vd, block_v)
    if w1.shape[0] > MAX_TARGET_VOCAB or ns > 511 or block_v > 512:
        raise ValueError(f"markov kernel: target vocabulary {w1.shape[0]} (max {MAX_TARGET_VOCAB}), {ns} slices of "
                         f"{block_v} columns (max 511 of 512) do not fit the step words")
    grid = (ns, triton.cdiv(B, block_b))
    # The step words are polled and the final barrier spins: every program must be resident at
    # once, one per SM at most. Otherwise: one launch per step (the interpreter runs programs in turn).
    grid_sync = cfg["GRID_SYNC"] and not interpret and grid[0] * grid[1] <= _sm_count(dev)
    U = base_logits.float()
    if U.stride(-1) != 1:
        U = U.contiguous()
    resident = (cfg["RESIDENT"] and block_b == 1 and rank > 0 and rank % 2 == 0 and w1.dtype == torch.bfloat16
                and w2.dtype == torch.bfloat16)
    mma = resident and bool(cfg["MMA"])
    if rank > 0:
        w1, w2 = w1.contiguous(), w2.to(w1.dtype).contiguous()  # no-ops for engine weights
        if resident and not mma:  # bf16 pairs as int32: [V, r/2], [Vd, r/2]
            w1, w2 = w1.view(torch.int32), w2.view(torch.int32)
    else:
        w1 = w2 = U  # never read; an empty tensor may have no valid pointer to pass
    rank_w = w1.shape[1] if rank > 0 else 0
    # Control words + step words (module docstring): the caller's, or zeroed for this call.
    n_ws = CTL_WORDS + B * gamma * ns
    if workspace is None:
        words = torch.zeros((n_ws,), dtype=torch.int64, device=dev)
    elif workspace.dtype != torch.int64 or workspace.dim() != 1 or workspace.numel() < n_ws:
        raise ValueError(f"markov kernel: workspace must be int64 [≥ {n_ws}], got {workspace.dtype} "
                         f"{list(workspace.shape)}")
    else:
        words = workspace
    pf = torch.empty((2, B, gamma, ns), dtype=torch.float32, device=dev)
    pi = torch.empty((2, B, gamma, ns), dtype=torch.int32, device=dev)
    if poison:
        pf.fill_(float("nan"))
        pi.fill_(-7)
        probs.fill_(float("nan"))
    rank_p2 = triton.next_power_of_2(max(rank, 2))
    block_r = min(rank_p2, 32) if block_b == 1 else min(max(rank_p2, 16), 64)
    if mma:
        rank_p2 = max(rank_p2, 16)  # an MMA's K
    consts = dict(
        RANK_P2=max(rank_p2, block_r), NS_P2=triton.next_power_of_2(ns), BLOCK_B=block_b, BLOCK_V=block_v,
        BLOCK_R=block_r, FINAL_ROWS=triton.next_power_of_2(gamma) if block_b == 1 else block_b, SALT=SALT_KEY,
        HAS_MARKOV=rank > 0, RESIDENT=resident, IEEE_DOT=w1.dtype == torch.float32 or interpret, SPIN=spin_limit,
        COUNT_BARRIER=bool(cfg["COUNT_BARRIER"]), POLL_MAX=bool(cfg["POLL_MAX"]), MMA=mma, CHECK_READS=poison,
        num_warps=cfg["num_warps"],
    )
    args = (U, anchor.to(torch.int64), w1, w2, d2t.to(torch.int64), seeds.to(torch.int64),
            positions.to(torch.int64), temperature.float(), ids, probs, words, pf, pi, B, Vd, gamma, rank, ns)
    tail = (U.stride(0), U.stride(1), rank_w)
    kernel = wrap(_markov_kernel)
    if grid_sync:
        # One persistent launch: γ steps chained through the polled words, one barrier, the final phase.
        kernel[grid](*args, 0, gamma, *tail, GRID_SYNC=True, FINAL=True, **consts)
    else:
        # γ step launches, then the final phase: kernel boundaries order everything.
        for k in range(gamma):
            kernel[grid](*args, k, k + 1, *tail, GRID_SYNC=False, FINAL=False, **consts)
        kernel[grid](*args, gamma, gamma, *tail, GRID_SYNC=False, FINAL=True, **consts)
    if check and int(words[2]):
        # Which (request, step, slice) words were never written: not of this call's parity.
        n_prog = grid[0] * grid[1]
        epoch = int(words[0]) // n_prog if cfg["COUNT_BARRIER"] else int(words[1])
        parity = 1 - ((epoch - 1) & 1)
        step_words = words[CTL_WORDS:n_ws].view(B, gamma, ns)
        missing = (((step_words >> 63) & 1) != parity).nonzero().tolist()
        if int(words[2]) == 3:
            raise RuntimeError(f"markov kernel: the final phase read a softmax partial or step word before it was "
                               f"written (error flag 3, poisoned buffers); grid {grid}, config {cfg}")
        raise RuntimeError(f"markov kernel: a program gave up waiting for the others (error flag "
                           f"{int(words[2])}: 1 = step words, 2 = final barrier); grid {grid}, config {cfg}; "
                           f"{len(missing)} step words never written (request, step, slice): {missing[:12]}")
    return ids, probs


def launch_keyed_gumbel(seeds: torch.Tensor, positions: torch.Tensor, salt: int, n: int) -> torch.Tensor:
    """The kernel's noise [B, n] for (seeds, positions) [B]; a test hook (compare with keyed_gumbel)."""
    B = seeds.shape[0]
    out = torch.empty((B, n), dtype=torch.float32, device=seeds.device)
    block = 1024
    _keyed_gumbel_kernel[(B, triton.cdiv(n, block))](
        seeds.to(torch.int64), positions.to(torch.int64), out, n, SALT=(salt * GOLDEN) & MASK32, BLOCK=block)
    return out
