"""Triton kernels of the acceptance rule: ``plugins.acceptance.reference.accept`` (the spec) in three launches.

The spec, per request b with γ drafts t_1 … t_γ (target ids) drawn from q_0 … q_{γ−1} (draft
vocabulary, scattered into the target's through d2t) and the target logits z_0 … z_γ [V]:

* P_k = softmax(sanitize(z_k) / T), T = 1 where the request is greedy (T = 0);
* greedy: t_{k+1} accepted while it is argmax sanitize(z_k); the bonus is that argmax at the first
  mismatch n (or at γ);
* sampled: t_{k+1} accepted while u_k·q_k(t) < P_k(t), u_k keyed (seed, p + 1 + k, SALT_ACCEPT);
  the bonus is argmax(log r + Gumbel) keyed (seed, p + n + 1, SALT_TARGET), r = max(P_n − q_n, 0)
  if any of it is > 0, else P_n (q_γ = 0).

Why: compiled by Inductor the rule was ~20 kernels and ≈ 45 µs of the batch-1 step on the H200
(docs/log.md): a full softmax of every row, a 4 MB zero-filled scatter of q into the target
vocabulary, row-wide reductions with one program per row. Here:

1. ``_stats_kernel``, one program per (row, chunk of ``CHUNK`` columns): the chunk's sanitize
   classes and softmax partials (max of z/T, the first index holding it, Σ exp(z/T − max), the
   count and first index of +inf), and a share of the inverse map ``t2d`` (target id → draft id
   + 1, 0 where none; zeroed by the caller), which d2t's injectivity (``checkpoint.check_d2t``)
   makes well defined;
2. ``_accept_kernel``, one program per (request, chunk): every program merges the row partials (the
   same loads in the same order: the same bits in every program), decides n from the γ drafted
   entries, then on its chunk of row n the residual's Gumbel scores, both with r and with P_n,
   keeping each one's first maximum;
3. ``_finish_kernel``, one program per request: the first maximum over the chunks, the residual's
   scores where any of r is > 0, else P_n's; greedy rows take the target's argmax at n.

Numerics: z·multiplier, z/T (IEEE division), exp and log are the spec's fp32 operations with
torch's bits (``triton_math``: libdevice on the GPU); the Gumbel noise and the uniforms are
``keyed_random``'s murmur3 chain bit for bit. Only the softmax's sum is taken in another order
(chunk partials rescaled to the row maximum), so P differs from torch's by rounding, and a token
differs only where an acceptance test or the residual's argmax is decided within that rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse_spark.plugins.keyed_random import GOLDEN, MASK32, SALT_ACCEPT, SALT_TARGET
from muse_spark.plugins.markov.triton_kernel import _fmix32, _gumbel, _key_hash, _uniform
from muse_spark.plugins.triton_math import add_rn, div_rn, exp_exact, log_exact, mul_rn

CHUNK = 2048  # columns of the target vocabulary a program takes (64 chunks at V = 131072)
T2D_BLOCK = 64  # draft ids a stats program scatters into t2d per pass
# keyed_random.key_hash's first key words (passed as constexprs: Inductor re-emits a kernel's
# source without this module's globals)
ACCEPT_KEY = (SALT_ACCEPT * GOLDEN) & MASK32
TARGET_KEY = (SALT_TARGET * GOLDEN) & MASK32


@triton.jit
def _load_z(logits_ptr, b, k, cols, cmask, sl_b, sl_g, MULT: tl.constexpr):
    """Row k of request b's logits at ``cols``, times the output multiplier, in fp32 (masked: −inf)."""
    z = tl.load(logits_ptr + b.to(tl.int64) * sl_b + k.to(tl.int64) * sl_g + cols, mask=cmask,
                other=float("-inf")).to(tl.float32)
    if MULT != 1.0:
        z = mul_rn(z, tl.full(z.shape, MULT, tl.float32))
    return z


@triton.jit
def _prob(z, t, row_max, row_sum, n_inf, all_neg, V):
    """P(z) of a row from its merged statistics: the spec's softmax of sanitize(z) / t."""
    zero = tl.zeros(z.shape, tl.float32)  # (the row's statistics broadcast to z's shape)
    finite = (z == z) & (z != float("inf")) & (z != float("-inf"))
    x = div_rn(z, zero + t)
    m_ref = tl.where(row_max == float("-inf"), 0.0, row_max)
    p_fin = tl.where(finite, div_rn(exp_exact(x - m_ref), zero + row_sum), 0.0)
    one = zero + 1.0
    p_inf = tl.where(z == float("inf"), div_rn(one, zero + n_inf.to(tl.float32)), 0.0)  # uniform over the +inf
    p_all = div_rn(one, zero + V)  # every entry −inf or NaN: uniform
    return tl.where(n_inf > 0, p_inf, tl.where(all_neg, p_all, p_fin))


@triton.jit
def _stats_kernel(logits_ptr, temp_ptr, d2t_ptr, t2d_ptr, mx_ptr, sm_ptr, am_ptr, ni_ptr, fi_ptr,
                  G1, V, VD, NC, sl_b, sl_g, MULT: tl.constexpr, CHUNK: tl.constexpr, T2D_BLOCK: tl.constexpr):
    row = tl.program_id(0)  # b·(γ+1) + k
    c = tl.program_id(1)
    b = row // G1
    k = row % G1
    cols = c * CHUNK + tl.arange(0, CHUNK)
    cmask = cols < V
    z = _load_z(logits_ptr, b, k, cols, cmask, sl_b, sl_g, MULT)
    t = tl.load(temp_ptr + b)
    t = tl.where(t > 0, t, 1.0)
    finite = (z == z) & (z != float("inf")) & (z != float("-inf"))
    x = tl.where(finite, div_rn(z, tl.zeros(z.shape, tl.float32) + t), float("-inf"))
    mx = tl.max(x, axis=0)
    am = tl.argmax(x, axis=0, tie_break_left=True)
    m_ref = tl.where(mx == float("-inf"), 0.0, mx)
    sm = tl.sum(tl.where(finite, exp_exact(x - m_ref), 0.0), axis=0)
    pinf = (z == float("inf")) & cmask
    at = row * NC + c
    tl.store(mx_ptr + at, mx)
    tl.store(sm_ptr + at, sm)
    tl.store(am_ptr + at, (c * CHUNK + am).to(tl.int32))
    tl.store(ni_ptr + at, tl.sum(pinf.to(tl.int32), axis=0))
    tl.store(fi_ptr + at, tl.min(tl.where(pinf, cols, V), axis=0).to(tl.int32))
    # this program's share of t2d: target id d + d2t[d] ← d + 1
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    for d0 in range(at * T2D_BLOCK, VD, n_prog * T2D_BLOCK):
        d = d0 + tl.arange(0, T2D_BLOCK)
        dm = d < VD
        tgt = d + tl.load(d2t_ptr + d, mask=dm, other=0)
        tl.store(t2d_ptr + tgt, (d + 1).to(tl.int32), mask=dm & (tgt >= 0) & (tgt < V))


@triton.jit
def _accept_kernel(logits_ptr, ids_ptr, probs_ptr, t2d_ptr, temp_ptr, seed_ptr, apos_ptr,
                   mx_ptr, sm_ptr, am_ptr, ni_ptr, fi_ptr, rv_ptr, ri_ptr, pv_ptr, pi_ptr, ar_ptr, nb_ptr,
                   GAMMA, V, VD, NC, sl_b, sl_g, MULT: tl.constexpr, CHUNK: tl.constexpr,
                   G1_P2: tl.constexpr, NC_P2: tl.constexpr, ACCEPT_KEY: tl.constexpr, TARGET_KEY: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    G1 = GAMMA + 1
    t_in = tl.load(temp_ptr + b)
    greedy = t_in == 0
    t = tl.where(t_in > 0, t_in, 1.0)
    seed = tl.load(seed_ptr + b + tl.arange(0, 1))  # [1]
    apos = tl.load(apos_ptr + b + tl.arange(0, 1))
    # This chunk's draft ids (t2d), loaded with the statistics: they depend on nothing, so the sampled
    # rows' gather of q_n below waits on n alone (one dependent memory round trip fewer)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    cmask = cols < V
    dn = tl.load(t2d_ptr + cols, mask=cmask, other=0) - 1
    # ---- every row's statistics, merged (the same in every program of the request)
    rows = tl.arange(0, G1_P2)
    ch = tl.arange(0, NC_P2)
    m2 = (rows < G1)[:, None] & (ch < NC)[None, :]
    at = (b * G1 + rows)[:, None] * NC + ch[None, :]
    mx = tl.load(mx_ptr + at, mask=m2, other=float("-inf"))
    sm = tl.load(sm_ptr + at, mask=m2, other=0.0)
    am = tl.load(am_ptr + at, mask=m2, other=0)
    ni = tl.load(ni_ptr + at, mask=m2, other=0)
    fi = tl.load(fi_ptr + at, mask=m2, other=V)
    row_max = tl.max(mx, axis=1)  # [G1_P2]
    m_ref = tl.where(row_max == float("-inf"), 0.0, row_max)
    scaled = mul_rn(sm, exp_exact(mx - m_ref[:, None]))
    row_sum = tl.sum(tl.where(mx == float("-inf"), 0.0, scaled), axis=1)
    n_inf = tl.sum(ni, axis=1)
    all_neg = (n_inf == 0) & (row_max == float("-inf"))
    first_chunk = tl.min(tl.where((mx == row_max[:, None]) & m2, ch[None, :], NC_P2), axis=1)
    at_max = tl.sum(tl.where(ch[None, :] == first_chunk[:, None], am, 0), axis=1)
    argmax = tl.where(n_inf > 0, tl.min(fi, axis=1), tl.where(all_neg, 0, at_max))  # sanitized argmax per row
    # ---- n: the drafts' acceptance tests, k = 0 … γ−1 (rows padded to G1_P2 ≥ γ + 1 > γ)
    kk = rows
    km = kk < GAMMA
    sel = kk[:, None] == rows[None, :]  # [k, row]: row k's statistics at k
    tok = tl.load(ids_ptr + b * GAMMA + kk, mask=km, other=0)
    tokc = tl.minimum(tl.maximum(tok, 0), V - 1)
    ok_greedy = tok == tl.sum(tl.where(sel, argmax[None, :], 0), axis=1)
    zt = _load_z(logits_ptr, b, kk, tokc, km, sl_b, sl_g, MULT)
    p_t = _prob(zt, t, tl.max(tl.where(sel, row_max[None, :], float("-inf")), axis=1),
                tl.sum(tl.where(sel, row_sum[None, :], 0.0), axis=1), tl.sum(tl.where(sel, n_inf[None, :], 0), axis=1),
                tl.max(tl.where(sel, all_neg[None, :].to(tl.int32), 0), axis=1) > 0, V)
    dq = tl.load(t2d_ptr + tokc, mask=km, other=0) - 1
    q_t = tl.load(probs_ptr + (b * GAMMA + kk).to(tl.int64) * VD + dq, mask=km & (dq >= 0), other=0.0)
    key = _key_hash(seed, apos + 1 + kk, ACCEPT_KEY)  # [G1_P2]
    u = _uniform(_fmix32(key))  # keyed_random.keyed_uniform, index 0
    ok = tl.where(greedy, ok_greedy, mul_rn(u, q_t) < p_t)
    n = tl.min(tl.where(km & ~ok, kk, GAMMA), axis=0)
    if c == 0:
        bonus_greedy = tl.sum(tl.where(rows == n, argmax, 0), axis=0)
        tl.store(nb_ptr + 2 * b, n.to(tl.int64))
        tl.store(nb_ptr + 2 * b + 1, bonus_greedy.to(tl.int64))
    if t_in != 0:
        # ---- row n on this chunk: the residual's and P_n's Gumbel scores
        on = rows == n
        rmax = tl.max(tl.where(on, row_max, float("-inf")), axis=0)
        rsum = tl.sum(tl.where(on, row_sum, 0.0), axis=0)
        rinf = tl.sum(tl.where(on, n_inf, 0), axis=0)
        rneg = tl.max(tl.where(on, all_neg.to(tl.int32), 0), axis=0) > 0
        z = _load_z(logits_ptr, b, n, cols, cmask, sl_b, sl_g, MULT)
        p = _prob(z, t, rmax, rsum, rinf, rneg, V)
        q = tl.load(probs_ptr + (b * GAMMA + n).to(tl.int64) * VD + dn, mask=cmask & (dn >= 0) & (n < GAMMA),
                    other=0.0)
        r = tl.maximum(p - q, 0.0)
        g = tl.reshape(_gumbel(_key_hash(seed, apos + n + 1, TARGET_KEY), cols), (CHUNK,))
        sr = tl.where(cmask, add_rn(log_exact(r), g), float("-inf"))
        sp = tl.where(cmask, add_rn(log_exact(p), g), float("-inf"))
        out = b * NC + c
        tl.store(rv_ptr + out, tl.max(sr, axis=0))
        tl.store(ri_ptr + out, (c * CHUNK + tl.argmax(sr, axis=0, tie_break_left=True)).to(tl.int32))
        tl.store(pv_ptr + out, tl.max(sp, axis=0))
        tl.store(pi_ptr + out, (c * CHUNK + tl.argmax(sp, axis=0, tie_break_left=True)).to(tl.int32))
        tl.store(ar_ptr + out, tl.max((r > 0.0).to(tl.int32), axis=0))


@triton.jit
def _finish_kernel(temp_ptr, rv_ptr, ri_ptr, pv_ptr, pi_ptr, ar_ptr, nb_ptr, n_ptr, bonus_ptr, NC,
                   NC_P2: tl.constexpr):
    b = tl.program_id(0)
    n = tl.load(nb_ptr + 2 * b)
    bonus = tl.load(nb_ptr + 2 * b + 1)
    if tl.load(temp_ptr + b) != 0:
        ch = tl.arange(0, NC_P2)
        cm = ch < NC
        use_r = tl.max(tl.load(ar_ptr + b * NC + ch, mask=cm, other=0), axis=0) > 0
        v = tl.where(use_r, tl.load(rv_ptr + b * NC + ch, mask=cm, other=float("-inf")),
                     tl.load(pv_ptr + b * NC + ch, mask=cm, other=float("-inf")))
        i = tl.where(use_r, tl.load(ri_ptr + b * NC + ch, mask=cm, other=0), tl.load(pi_ptr + b * NC + ch, mask=cm,
                                                                                     other=0))
        best = tl.max(v, axis=0)
        first = tl.min(tl.where(cm & (v == best), ch, NC_P2), axis=0)
        bonus = tl.sum(tl.where(ch == first, i, 0), axis=0).to(tl.int64)
    tl.store(n_ptr + b, n)
    tl.store(bonus_ptr + b, bonus)


def launch_accept(logits: torch.Tensor, multiplier: float, draft_ids: torch.Tensor, draft_probs: torch.Tensor,
                  d2t: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, anchor_pos: torch.Tensor,
                  wrap=lambda f: f, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """``plugins.acceptance.reference.accept(output_transform(logits, multiplier, None), ...)`` → (n, bonus) [B] int64.

    logits [B, γ+1, V] (any float dtype; last dim contiguous), draft_ids [B, γ] int64,
    draft_probs [B, γ, Vd] fp32, d2t [Vd] int64 (injective into [0, V): ``checkpoint.check_d2t``),
    temperature [B] fp32, seeds / anchor_pos [B] int64. ``wrap``: ``torch.library.wrap_triton``
    inside the op."""
    B, G1, V = logits.shape
    gamma = G1 - 1
    Vd = draft_probs.shape[-1]
    dev = logits.device
    n = torch.empty(B, dtype=torch.int64, device=dev)
    bonus = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return n, bonus
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    draft_ids = draft_ids.contiguous()
    draft_probs = draft_probs.contiguous()
    nc = triton.cdiv(V, chunk)
    rows = B * G1
    f32 = dict(dtype=torch.float32, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    t2d = torch.zeros(V, **i32)
    mx, sm = torch.empty(rows, nc, **f32), torch.empty(rows, nc, **f32)
    am, ni, fi = (torch.empty(rows, nc, **i32) for _ in range(3))
    rv, pv = torch.empty(B, nc, **f32), torch.empty(B, nc, **f32)
    ri, pi, ar = (torch.empty(B, nc, **i32) for _ in range(3))
    nb = torch.empty(B, 2, dtype=torch.int64, device=dev)
    mult = float(multiplier)
    wrap(_stats_kernel)[(rows, nc)](logits, temperature, d2t, t2d, mx, sm, am, ni, fi, G1, V, Vd, nc,
                                    logits.stride(0), logits.stride(1), MULT=mult, CHUNK=chunk, T2D_BLOCK=T2D_BLOCK,
                                    num_warps=4)
    wrap(_accept_kernel)[(B, nc)](logits, draft_ids, draft_probs, t2d, temperature, seeds, anchor_pos, mx, sm, am, ni,
                                  fi, rv, ri, pv, pi, ar, nb, gamma, V, Vd, nc, logits.stride(0), logits.stride(1),
                                  MULT=mult, CHUNK=chunk, G1_P2=max(2, triton.next_power_of_2(G1)),
                                  NC_P2=max(2, triton.next_power_of_2(nc)), ACCEPT_KEY=ACCEPT_KEY,
                                  TARGET_KEY=TARGET_KEY, num_warps=4)
    wrap(_finish_kernel)[(B,)](temperature, rv, ri, pv, pi, ar, nb, n, bonus, nc,
                               NC_P2=max(2, triton.next_power_of_2(nc)), num_warps=1)
    return n, bonus
