"""Target-side sampling and the lossless acceptance rule (docs/design.md, verification).

Everything is batch-vectorized and free of host synchronisation, so the same
code runs eagerly, under ``torch.export`` and inside a captured CUDA graph.
Randomness is keyed by (request seed, position): a request's output does not
depend on its batch mates, and target-only sampling with the same seed draws
the same bonus noise.

The rule, per request with γ draft tokens t_1 … t_γ drawn from q_0 … q_{γ−1}
and target distributions P_0 … P_γ over ``[a, t_1 … t_γ]``:

* greedy (T = 0): accept t_{k+1} while t_{k+1} == argmax P_k; the bonus is
  argmax P_n at the first mismatch n (or P_γ when all match);
* sampling: accept t_{k+1} with probability min(1, P_k(t)/q_k(t)), q scattered
  into the target vocabulary through d2t; at the first rejection n sample the
  bonus from normalize(max(P_n − q_n, 0)); if all γ are accepted, from P_γ.
"""

from __future__ import annotations

import torch

from muse_spark.plugins.keyed_random import SALT_ACCEPT, SALT_TARGET, keyed_gumbel, keyed_uniform
from muse_spark.plugins.markov.reference import sanitize_logits


ARGMAX_CHUNK = 2048


def argmax_last(x: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """``x.argmax(-1)``, computed in two stages when the last dimension is a multiple of ``chunk``
    (and longer): per chunk the maximum and the first index holding it, then the first chunk
    holding the largest of those maxima. The first index of the maximum overall, as ``argmax``
    (a NaN counts as the maximum in both; +0 and −0 tie). Why: compiled, a reduction over a
    131072-entry vocabulary has one row per (request, position) to spread over the GPU — 8 at
    batch 1 — and Inductor fused the step's softmax and argmaxes into one such kernel (0.1 ms of
    the batch-1 step on the H200); the first stage has 64 rows per row instead."""
    V = x.shape[-1]
    if V <= chunk or V % chunk:
        return x.argmax(-1)
    best, where = torch.max(x.unflatten(-1, (V // chunk, chunk)), -1)  # [..., V/chunk]
    c = best.argmax(-1, keepdim=True)
    return (c * chunk + where.gather(-1, c)).squeeze(-1)


def target_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) in fp32; logits [B, S, V], temperature [B] (>0 rows; T = 0 rows use T = 1)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    return torch.softmax(sanitize_logits(logits.float()) / t[:, None, None], -1)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Exact categorical sample by the Gumbel-max trick, keyed (seed, position, SALT_TARGET).

    probs [B, V] (need not be normalized); → [B] int64.
    """
    noise = keyed_gumbel(seeds, positions, SALT_TARGET, probs.shape[-1])
    return argmax_last(torch.log(probs) + noise)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Next token from target logits [B, V] for the token at ``positions`` [B]: greedy where T = 0."""
    greedy = argmax_last(sanitize_logits(logits.float()))
    sampled = sample_from_probs(target_probs(logits[:, None], temperature)[:, 0], seeds, positions)
    return torch.where(temperature == 0, greedy, sampled)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p − q, 0), unnormalized (the Gumbel-max sampler needs no normalization).
    Where p == q exactly nothing is left (rejection then had probability 0): use p."""
    resid = torch.clamp(p - q, min=0.0)
    return torch.where(resid.sum(-1, keepdim=True) > 0, resid, p)


def at_the_cut(q_n: torch.Tensor, n: torch.Tensor, verify: torch.Tensor) -> torch.Tensor:
    """The draft distribution the bonus is taken against at position ``n``: none (zero) where every
    verified draft was accepted (``n == verify``: nothing was proposed at the cut, so the bonus comes
    from p itself); ``q_n`` where the draft there was rejected (the residual)."""
    return torch.where((n == verify)[:, None], torch.zeros_like(q_n), q_n)


def accept(
    target_logits: torch.Tensor,  # [B, γ+1, V] transformed fp32 logits over [a, t_1 … t_γ]
    draft_ids: torch.Tensor,  # [B, γ] int64 target ids
    draft_probs: torch.Tensor,  # [B, γ, Vd] fp32 distributions the drafts were sampled from
    d2t: torch.Tensor,  # [Vd] int64 offsets
    temperature: torch.Tensor,  # [B] fp32
    seeds: torch.Tensor,  # [B] int64
    anchor_pos: torch.Tensor,  # [B] int64 p
    verify: torch.Tensor | None = None,  # [B] int64 k ≤ γ: only t_1 … t_k are verified (None: all γ)
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (n accepted [B] int64, bonus token [B] int64).

    ``verify``: the drafts the scheduler sent to the target (a prefix, chosen from the draft's side
    alone). Drafts past ``k`` are not candidates (``n ≤ k``); when all ``k`` are accepted the bonus
    comes from ``P_k`` itself (nothing was proposed there: the cut is the end of a shorter draft),
    and at a rejection before the cut from the residual as usual. Exact for any ``k`` that does not
    depend on the target's randomness. Only ``P_0 … P_k`` are read: ``target_logits`` may hold
    just the first ``max(k) + 1`` positions (with ``draft_ids``/``draft_probs`` cut to ``max(k)``)."""
    B, g1, V = target_logits.shape
    gamma = g1 - 1
    draft_ids, draft_probs = draft_ids[:, :gamma], draft_probs[:, :gamma]
    Vd = draft_probs.shape[-1]
    dev = target_logits.device
    ar = torch.arange(gamma, device=dev)
    greedy_row = temperature == 0

    # ---- greedy ------------------------------------------------------------------------
    tgt_argmax = argmax_last(sanitize_logits(target_logits.float()))  # [B, γ+1]
    ok_greedy = draft_ids == tgt_argmax[:, :gamma]

    # ---- sampling ----------------------------------------------------------------------
    P = target_probs(target_logits, temperature)  # [B, γ+1, V]
    draft_target_ids = torch.arange(Vd, device=dev) + d2t.to(torch.int64)  # [Vd]
    zeros = torch.zeros(B, g1, V, device=dev, dtype=torch.float32)
    # q scattered into the target vocabulary; row γ stays zero (no draft after t_γ).
    Q = torch.cat([zeros[:, :gamma].index_add(-1, draft_target_ids, draft_probs.float()), zeros[:, gamma:]], 1)
    p_t = P[:, :gamma].gather(-1, draft_ids[..., None]).squeeze(-1)  # [B, γ]
    q_t = Q[:, :gamma].gather(-1, draft_ids[..., None]).squeeze(-1)
    u = keyed_uniform(seeds[:, None], anchor_pos[:, None] + 1 + ar, SALT_ACCEPT, 1).squeeze(-1)  # [B, γ]
    # u < p/q  ⇔  u·q < p  (q > 0 for every sampled token; q = 0 would reject)
    ok_sample = u * q_t < p_t

    # (a select in logic ops, not a where on booleans: the same values, and an ONNX Where over bool
    # tensors has no onnxruntime CPU kernel)
    ok = (greedy_row[:, None] & ok_greedy) | (~greedy_row[:, None] & ok_sample)
    if verify is not None:
        ok = ok & (ar[None, :] < verify[:, None])
    n = torch.cumprod(ok.to(torch.int64), -1).sum(-1)  # [B] leading accepts

    # ---- bonus -------------------------------------------------------------------------
    idx = n[:, None, None].expand(B, 1, V)
    p_n = P.gather(1, idx).squeeze(1)  # [B, V]
    q_n = Q.gather(1, idx).squeeze(1)  # zero row when n == γ
    if verify is not None:
        q_n = at_the_cut(q_n, n, verify)
    resid = residual_distribution(p_n, q_n)
    bonus_sampled = sample_from_probs(resid, seeds, anchor_pos + n + 1)
    bonus_greedy = tgt_argmax.gather(1, n[:, None]).squeeze(1)
    bonus = torch.where(greedy_row, bonus_greedy, bonus_sampled)
    return n, bonus


def output_transform(logits: torch.Tensor, multiplier: float, soft_cap: float | None) -> torch.Tensor:
    """The target's output-distribution transform, shared by target and draft."""
    logits = logits.float() * multiplier
    if soft_cap is not None:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    return logits


def accept_reference(raw_logits, multiplier, soft_cap, draft_ids, draft_probs, d2t, temperature, seeds, anchor_pos):
    """``accept`` on ``output_transform(raw_logits, multiplier, soft_cap)`` → (n [B], bonus [B]) int64: the
    spec of ``muse_spark::accept_triton``, and its fallback where its kernels do not run."""
    return accept(output_transform(raw_logits, multiplier, soft_cap), draft_ids, draft_probs, d2t, temperature,
                  seeds, anchor_pos)
