"""Triton kernel of the fused DSpark Markov loop (vanilla head, greedy and sampled).

Reference (``reference.py``, the spec), for k = 0 … γ−1 with ``prev = anchor``::

    z_k  = sanitize(U_k + W2 @ W1[prev])           # NaN→−inf; +inf rows; all −inf rows
    x_k  = argmax(z_k)                   T == 0
         = argmax(z_k·(1/T) + Gumbel)    T > 0     # keyed (seed, p+k+1, SALT_DRAFT)
    q_k  = softmax(z_k·(1/T))  (one-hot when T == 0)
    prev = x_k + d2t[x_k]

Design. The work of one step is a GEMV over W2 ([Vd, r] bf16: 16 MB at
Vd = 32768, r = 256), which one SM cannot stream fast enough, followed by a
row-wide argmax / softmax. So the draft vocabulary is split into NS slices of
BLOCK_V columns (128 slices at Vd = 32768), one program per slice (and per
block of BLOCK_B requests). In step k each program

1. finds ``prev`` by reducing the NS partial results of step k−1 (every
   program does the same small reduction, so no extra launch is needed),
2. gathers ``W1[prev]`` and computes its slice of ``z_k = U_k + W2 @ e``
   (``tl.dot`` for BLOCK_B ≥ 16, a broadcast-multiply-sum for BLOCK_B = 1),
3. writes per-slice partials: the class/argmax/value of the sampling key and
   the max/sum-exp of the softmax, and stashes z_k in the probs buffer.

Steps are separated either by kernel boundaries (γ launches of the step
kernel, then one final launch: ``GRID_SYNC=False``) or by a grid-wide barrier
on an atomic counter inside one persistent launch (``GRID_SYNC=True``, only
when every program is resident at once: NS·NB ≤ #SMs). With the barrier, the
W2 slice can stay in registers across steps (``RESIDENT``). The final phase
reduces the partials of every step once more, writes the ids (in target
vocabulary) and normalizes the stashed z into the probabilities.

Memory traffic, per step: W2 Vd·r·2 B (16 MB; from L2 after the first step,
or once in total when RESIDENT), U_k B·Vd·4 B read, z_k B·Vd·4 B write,
W1 B·r·2 B, partials B·NS·28 B (tiny); final phase: B·γ·Vd·4 B read (z) and
B·γ·Vd·4 B write (probs).

Exactness: ties in every argmax go to the lowest index, as ``torch.argmax``;
the Gumbel noise is the reference's murmur3 chain in uint32 (wrapping) and
``-log(-log(u))`` with the accurate ``logf``; ``z·(1/T) + g`` is rounded twice,
never fused. Only the GEMV's summation order differs from torch's, so tokens
match unless two candidates are within that rounding of each other.
Sanitization is handled by a per-element class (2: +inf, 1: finite, 0: −inf
or NaN): the row's highest class present decides which elements compete, and
every other element loses (see ``_step``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse_spark.plugins.keyed_random import GOLDEN, MASK32, SALT_DRAFT
from muse_spark.plugins.triton_math import add_rn, exp_exact, log_exact, mul_rn

SALT_KEY = (SALT_DRAFT * GOLDEN) & MASK32  # the first key word, as keyed_random.key_hash
INT32_MAX = tl.constexpr(2**31 - 1)
N_FLOAT_FIELDS = 3  # partials: key value, softmax max, softmax sum
N_INT_FIELDS = 4  # partials: class, draft id, target id, count of +inf


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
    """keyed_random.key_hash: seed, pos int64 [BLOCK_B] → uint32 [BLOCK_B]."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = _fmix32(lo ^ SALT)
    h = _fmix32(h ^ hi)
    return _fmix32(h ^ (pos & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _gumbel(key, cols):
    """keyed_random.keyed_gumbel: key uint32 [BB], cols int32 [BV] → fp32 [BB, BV]."""
    h = _fmix32(key[:, None] ^ (cols.to(tl.uint32) * 0x9E3779B9)[None, :])
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -log_exact(-log_exact(u))


@triton.jit
def _keyed_gumbel_kernel(seed_ptr, pos_ptr, out_ptr, n, SALT: tl.constexpr, BLOCK: tl.constexpr):
    # A test hook: the kernel's noise, to compare bit for bit with keyed_gumbel.
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + row + tl.arange(0, 1))
    pos = tl.load(pos_ptr + row + tl.arange(0, 1))
    g = _gumbel(_key_hash(seed, pos, SALT), cols)
    tl.store(out_ptr + row * n + cols[None, :], g, mask=(cols < n)[None, :])


# ----------------------------------------------------------------------------- partials
@triton.jit
def _reduce_partials(pf_ptr, pi_ptr, rows, rmask, k, B, GAMMA: tl.constexpr, NS: tl.constexpr,
                     NS_P2: tl.constexpr):
    """Combine the NS slice partials of step k → per row: draft id, target id,
    class, softmax max, softmax sum, count of +inf.

    Partials are field-major [F, B, γ, NS]; ``.cg`` loads skip L1, which may
    hold nothing of them but other SMs write them in the same launch.
    """
    sl = tl.arange(0, NS_P2)
    msk = rmask[:, None] & (sl < NS)[None, :]
    off = (rows[:, None] * GAMMA + k) * NS + sl[None, :]
    plane = B * GAMMA * NS
    cls = tl.load(pi_ptr + off, mask=msk, other=-1, cache_modifier=".cg")
    val = tl.load(pf_ptr + off, mask=msk, other=float("-inf"), cache_modifier=".cg")
    idx = tl.load(pi_ptr + plane + off, mask=msk, other=INT32_MAX, cache_modifier=".cg")
    tid = tl.load(pi_ptr + 2 * plane + off, mask=msk, other=-1, cache_modifier=".cg")
    c = tl.max(cls, axis=1)
    competes = cls == c[:, None]
    val = tl.where(competes, val, float("-inf"))
    best = tl.max(val, axis=1)
    win = competes & (val == best[:, None])
    x = tl.min(tl.where(win, idx, INT32_MAX), axis=1)  # lowest index among equal keys
    t = tl.max(tl.where(win & (idx == x[:, None]), tid, -1), axis=1)
    # softmax over the finite class: online-softmax merge of (max, sum) pairs
    m_s = tl.load(pf_ptr + plane + off, mask=msk, other=float("-inf"), cache_modifier=".cg")
    s_s = tl.load(pf_ptr + 2 * plane + off, mask=msk, other=0.0, cache_modifier=".cg")
    m = tl.max(m_s, axis=1)
    s = tl.sum(tl.where(m_s > float("-inf"), s_s * exp_exact(m_s - m[:, None]), 0.0), axis=1)
    n_inf = tl.sum(tl.load(pi_ptr + 3 * plane + off, mask=msk, other=0, cache_modifier=".cg"), axis=1)
    return x, t, c, m, s, n_inf


@triton.jit
def _grid_barrier(sync_ptr, target):
    # All programs are resident (checked by the launcher). Stores before the
    # barrier are released at GPU scope by the counter increment; the spin
    # acquires them.
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    cnt = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    while cnt < target:
        cnt = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _markov_kernel(
    u_ptr,  # [B, γ, Vd] fp32 base logits (last dim contiguous)
    anchor_ptr,  # [B] int64 target ids
    w1_ptr,  # [V, r]
    w2_ptr,  # [Vd, r]
    d2t_ptr,  # [Vd] int64
    seed_ptr, pos_ptr,  # [B] int64
    temp_ptr,  # [B] fp32 temperature, 0 = greedy
    ids_ptr,  # [B, γ] int64 out
    probs_ptr,  # [B, γ, Vd] fp32 out (holds z until the final phase)
    pf_ptr, pi_ptr,  # partials [3, B, γ, NS] fp32 and [4, B, γ, NS] int32
    sync_ptr,  # [1] int32 zeroed counter (GRID_SYNC)
    B, Vd, k_begin, k_end, stride_ub, stride_uk, stride_w1, stride_w2,
    GAMMA: tl.constexpr, RANK: tl.constexpr, RANK_P2: tl.constexpr, NS: tl.constexpr, NS_P2: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, SALT: tl.constexpr,
    GRID_SYNC: tl.constexpr, RESIDENT: tl.constexpr, FINAL: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    pid_v = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < Vd
    m2 = rmask[:, None] & cmask[None, :]
    temp = tl.load(temp_ptr + rows, mask=rmask, other=0.0)
    greedy = (temp == 0.0)[:, None]
    # 1/T exactly as the reference: where(T > 0, 1 / T.clamp_min(1e-30), 1), IEEE division
    inv_t = tl.where(temp > 0.0, tl.div_rn(tl.full(temp.shape, 1.0, tl.float32), tl.maximum(temp, 1e-30)), 1.0)
    inv_t = inv_t[:, None]
    seed = tl.load(seed_ptr + rows, mask=rmask, other=0)
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0)
    d2t = tl.load(d2t_ptr + cols, mask=cmask, other=0)
    plane = B * GAMMA * NS
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    z_base = probs_ptr + (rows[:, None] * GAMMA) * Vd + cols[None, :]
    if RESIDENT:  # the W2 slice, read once for all γ steps (BLOCK_B == 1)
        rr = tl.arange(0, RANK_P2)
        w_res = tl.load(w2_ptr + cols[None, :] * stride_w2 + rr[:, None],
                        mask=(rr < RANK)[:, None] & cmask[None, :], other=0.0)

    for k in range(k_begin, k_end):
        # ---- prev: the anchor, or the winner of step k-1 (reduced from its partials)
        if k == 0:
            prev = tl.load(anchor_ptr + rows, mask=rmask, other=0)
        else:
            _x, t, _c, _m, _s, _n = _reduce_partials(pf_ptr, pi_ptr, rows, rmask, k - 1, B, GAMMA, NS, NS_P2)
            prev = t.to(tl.int64)
        # ---- z = U_k + W2 @ W1[prev]; read B·Vd·4 B of U and BLOCK_V·r·2 B of W2 per program
        z = tl.load(u_ptr + rows[:, None] * stride_ub + k * stride_uk + cols[None, :], mask=m2, other=0.0)
        if RANK > 0:
            if RESIDENT:
                e = tl.load(w1_ptr + prev[None, :] * stride_w1 + rr[:, None], mask=(rr < RANK)[:, None] & rmask[None, :],
                            other=0.0)  # [RANK_P2, 1]
                z = z + tl.sum(e.to(tl.float32) * w_res.to(tl.float32), axis=0)[None, :]
            else:
                acc = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
                for r0 in tl.static_range(0, RANK_P2, BLOCK_R):
                    rk = r0 + tl.arange(0, BLOCK_R)
                    rkm = rk < RANK
                    w = tl.load(w2_ptr + cols[None, :] * stride_w2 + rk[:, None], mask=rkm[:, None] & cmask[None, :],
                                other=0.0)  # [BLOCK_R, BLOCK_V]
                    if BLOCK_B == 1:
                        e = tl.load(w1_ptr + prev[None, :] * stride_w1 + rk[:, None], mask=rkm[:, None] & rmask[None, :],
                                    other=0.0)  # [BLOCK_R, 1]
                        acc += tl.sum(e.to(tl.float32) * w.to(tl.float32), axis=0)[None, :]
                    else:
                        e = tl.load(w1_ptr + prev[:, None] * stride_w1 + rk[None, :],
                                    mask=rmask[:, None] & rkm[None, :], other=0.0)  # [BLOCK_B, BLOCK_R]
                        if IEEE_DOT:  # fp32 weights (and the CPU interpreter, whose bf16 dot is broken)
                            acc = tl.dot(e.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
                        else:
                            acc = tl.dot(e, w, acc)
                z = z + acc
        # ---- sanitize: class 2 = +inf, 1 = finite, 0 = −inf/NaN, −1 = padding
        z = tl.where(z != z, float("-inf"), z)
        cls = tl.where(z == float("inf"), 2, tl.where(z == float("-inf"), 0, 1))
        cls = tl.where(m2, cls, -1)
        c_loc = tl.max(cls, axis=1)
        competes = cls == c_loc[:, None]
        # ---- sampling key: finite class → z (greedy) or z·(1/T) + g; the
        # sanitized value of the other classes is 0, so their key is 0 or g.
        g = _gumbel(_key_hash(seed, pos + k + 1, SALT), cols)
        scaled = mul_rn(z, inv_t)
        key = tl.where(cls == 1, tl.where(greedy, z, add_rn(scaled, g)), tl.where(greedy, 0.0, g))
        key = tl.where(competes, key, float("-inf"))
        best = tl.max(key, axis=1)
        arg = tl.argmax(key, axis=1)  # lowest index among ties
        x_loc = pid_v * BLOCK_V + arg
        t_loc = x_loc + tl.sum(tl.where(cols[None, :] == x_loc[:, None], d2t[None, :], 0), axis=1)
        # ---- softmax partials over the finite class
        sm = tl.where(cls == 1, scaled, float("-inf"))
        m_loc = tl.max(sm, axis=1)
        s_loc = tl.sum(tl.where(cls == 1, exp_exact(sm - m_loc[:, None]), 0.0), axis=1)
        n_loc = tl.sum((cls == 2).to(tl.int32), axis=1)
        # ---- write partials (B·28 B) and stash z (B·BLOCK_V·4 B)
        off = (rows * GAMMA + k) * NS + pid_v
        tl.store(pf_ptr + off, best, mask=rmask)
        tl.store(pf_ptr + plane + off, m_loc, mask=rmask)
        tl.store(pf_ptr + 2 * plane + off, s_loc, mask=rmask)
        tl.store(pi_ptr + off, c_loc, mask=rmask)
        tl.store(pi_ptr + plane + off, x_loc, mask=rmask)
        tl.store(pi_ptr + 2 * plane + off, t_loc.to(tl.int32), mask=rmask)
        tl.store(pi_ptr + 3 * plane + off, n_loc, mask=rmask)
        tl.store(z_base + k * Vd, z, mask=m2)
        if GRID_SYNC:
            _grid_barrier(sync_ptr, (k - k_begin + 1) * n_prog)

    if FINAL:
        # ---- ids and probabilities: read B·γ·BLOCK_V·4 B of z, write as much of q
        for k in range(0, GAMMA):
            x, t, c, m, s, n_inf = _reduce_partials(pf_ptr, pi_ptr, rows, rmask, k, B, GAMMA, NS, NS_P2)
            if pid_v == 0:
                tl.store(ids_ptr + rows * GAMMA + k, t.to(tl.int64), mask=rmask)
            z = tl.load(z_base + k * Vd, mask=m2, other=float("-inf"))
            c = c[:, None]
            p_fin = tl.where(z > float("-inf"), exp_exact(mul_rn(z, inv_t) - m[:, None]) / s[:, None], 0.0)
            p_inf = tl.where(z == float("inf"), 1.0 / n_inf.to(tl.float32)[:, None], 0.0)
            p = tl.where(c == 2, p_inf, tl.where(c == 1, p_fin, 1.0 / Vd))
            p = tl.where(greedy, tl.where(cols[None, :] == x[:, None], 1.0, 0.0), p)
            tl.store(z_base + k * Vd, p, mask=m2)


# ----------------------------------------------------------------------------- wrapper
def _identity(kernel):
    return kernel


def default_config(B: int, Vd: int, rank: int, device: torch.device, interpret: bool) -> dict:
    """Launch configuration (measured on the H200: plugins/markov/bench.py)."""
    block_v = min(256, triton.next_power_of_2(max(Vd, 16)))
    block_b = 1 if B == 1 else (16 if B <= 16 else 32)
    ns = triton.cdiv(Vd, block_v)
    nb = triton.cdiv(B, block_b)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    grid_sync = (not interpret) and device.type == "cuda" and ns * nb <= sms
    rank_p2 = triton.next_power_of_2(max(rank, 1))
    resident = grid_sync and block_b == 1 and rank > 0 and rank_p2 * block_v <= 256 * 256
    return dict(BLOCK_V=block_v, BLOCK_B=block_b, GRID_SYNC=grid_sync, RESIDENT=resident,
                num_warps=16 if resident else 8)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vanilla-head Markov loop → (ids [B, γ] int64 target vocabulary, probs [B, γ, Vd] fp32).

    ``wrap`` is ``torch.library.wrap_triton`` inside the registered op.
    """
    B, gamma, Vd = base_logits.shape
    rank = w1.shape[1]
    dev = base_logits.device
    ids = torch.empty((B, gamma), dtype=torch.int64, device=dev)
    probs = torch.empty((B, gamma, Vd), dtype=torch.float32, device=dev)
    if B == 0 or gamma == 0:
        return ids, probs.zero_()
    cfg = dict(default_config(B, Vd, rank, dev, interpret))
    cfg.update(config or {})
    U = base_logits.float()
    if U.stride(-1) != 1:
        U = U.contiguous()
    if rank > 0:
        w1 = w1 if w1.stride(-1) == 1 else w1.contiguous()
        w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
        if w2.dtype != w1.dtype:
            w2 = w2.to(w1.dtype)
    block_v, block_b = cfg["BLOCK_V"], cfg["BLOCK_B"]
    ns = triton.cdiv(Vd, block_v)
    grid = (ns, triton.cdiv(B, block_b))
    pf = torch.empty((N_FLOAT_FIELDS, B, gamma, ns), dtype=torch.float32, device=dev)
    pi = torch.empty((N_INT_FIELDS, B, gamma, ns), dtype=torch.int32, device=dev)
    sync = torch.zeros((1,), dtype=torch.int32, device=dev)
    rank_p2 = triton.next_power_of_2(max(rank, 1))
    if block_b == 1:
        block_r = min(rank_p2, 32)
    else:
        block_r = min(max(rank_p2, 16), 64)
    consts = dict(
        GAMMA=gamma, RANK=rank, RANK_P2=max(rank_p2, block_r), NS=ns, NS_P2=triton.next_power_of_2(ns),
        BLOCK_B=block_b, BLOCK_V=block_v, BLOCK_R=block_r, SALT=SALT_KEY,
        RESIDENT=bool(cfg["RESIDENT"]), IEEE_DOT=w1.dtype == torch.float32 or interpret,
        num_warps=cfg["num_warps"],
    )
    args = (U, anchor.to(torch.int64), w1, w2, d2t.to(torch.int64), seeds.to(torch.int64),
            positions.to(torch.int64), temperature.float(), ids, probs, pf, pi, sync,
            B, Vd)
    strides = (U.stride(0), U.stride(1), w1.stride(0) if rank > 0 else 0, w2.stride(0) if rank > 0 else 0)
    kernel = wrap(_markov_kernel)
    if cfg["GRID_SYNC"]:
        # One persistent launch: γ steps separated by grid barriers, then the final phase.
        kernel[grid](*args, 0, gamma, *strides, GRID_SYNC=True, FINAL=True, **consts)
    else:
        # γ step launches, then the final phase: the kernel boundary is the barrier.
        for k in range(gamma):
            kernel[grid](*args, k, k + 1, *strides, GRID_SYNC=False, FINAL=False, **consts)
        kernel[grid](*args, gamma, gamma, *strides, GRID_SYNC=False, FINAL=True, **consts)
    return ids, probs


def launch_keyed_gumbel(seeds: torch.Tensor, positions: torch.Tensor, salt: int, n: int) -> torch.Tensor:
    """The kernel's noise [B, n] for (seeds, positions) [B]; a test hook (compare with keyed_gumbel)."""
    B = seeds.shape[0]
    out = torch.empty((B, n), dtype=torch.float32, device=seeds.device)
    block = 1024
    _keyed_gumbel_kernel[(B, triton.cdiv(n, block))](
        seeds.to(torch.int64), positions.to(torch.int64), out, n, SALT=(salt * GOLDEN) & MASK32, BLOCK=block)
    return out
