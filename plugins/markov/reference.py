"""Reference (spec) of the DSpark Markov loop (docs/design.md, the DSpark draft).

For k = 0 … γ−1, with ``prev`` starting at the anchor (a TARGET id):

    e_k  = W1[prev]                                   # [B, r]
    bias = W2 @ e_k                                   # vanilla
         = W2 @ (σ(Wg[h_k; e_k] + bg) ⊙ e_k)          # gated
         = W2 @ tanh(o),  [g|c|o] = Wj[s; e_k; h_k] + bj,
           s = σ(g)⊙s + (1−σ(g))⊙tanh(c), s₀ = 0      # rnn
    z_k  = U_k + bias                                 # bias after the soft cap
    x_k  = argmax(z_k)                  if T == 0
         = argmax(z_k / T + Gumbel)     otherwise     # noise keyed (seed, p+k+1, SALT_DRAFT)
    q_k  = softmax(z_k / T)  (one-hot of x_k when T == 0)
    prev = x_k + d2t[x_k]

Only the loop over block positions is sequential; everything is vectorized
over the batch, with no host synchronisation (no ``.item()``), so the same
code can be traced, exported and captured in a CUDA graph.

Non-finite logits (a corrupt row must not crash the batch or emit a token of
zero probability): NaN counts as −inf; if a row has +inf entries its
distribution is uniform over them; if nothing finite is left, uniform over the
whole draft vocabulary. ``topk > 0`` keeps the top-k of ``z_k`` (ties broken by
index) and masks the rest to −inf before sampling.
"""

from __future__ import annotations

import torch

from muse_spark.plugins.keyed_random import SALT_DRAFT, keyed_gumbel


def sanitize_logits(z: torch.Tensor) -> torch.Tensor:
    """Map a row of logits [.., V] to finite-or-−inf values with a valid softmax."""
    # Built on the device (no host→device copy), so this is capturable in a CUDA graph.
    neg_inf = z.new_full((), float("-inf"))
    zero = z.new_zeros(())
    z = torch.where(torch.isnan(z), neg_inf, z)
    pos = z == float("inf")
    z = torch.where(pos.any(-1, keepdim=True), torch.where(pos, zero, neg_inf), z)
    return torch.where((z == float("-inf")).all(-1, keepdim=True), zero, z)


def apply_topk(z: torch.Tensor, topk: int) -> torch.Tensor:
    if topk <= 0 or topk >= z.shape[-1]:
        return z
    # Keep exactly the first `topk` entries in (value desc, index asc) order.
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices
    keep = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, order[..., :topk], True)
    return torch.where(keep, z, torch.full_like(z, float("-inf")))


def markov_bias(
    prev: torch.Tensor,  # [B] int64 target ids
    h: torch.Tensor,  # [B, D]
    state: torch.Tensor,  # [B, r] fp32 (rnn)
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [Vd, r]
    head_type: str,
    head_w: torch.Tensor | None,
    head_b: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Markov-head step → (bias [B, Vd] fp32, new rnn state)."""
    e = w1.index_select(0, prev).float()  # [B, r]
    if head_type == "gated":
        gate_in = torch.cat([h.float(), e], dim=-1)  # [B, D+r]
        e = torch.sigmoid(gate_in @ head_w.float().T + head_b.float()) * e
    elif head_type == "rnn":
        r = e.shape[-1]
        joint = torch.cat([state, e, h.float()], dim=-1) @ head_w.float().T + head_b.float()  # [B, 3r]
        g, c, o = joint[:, :r], joint[:, r : 2 * r], joint[:, 2 * r :]
        sg = torch.sigmoid(g)
        state = sg * state + (1.0 - sg) * torch.tanh(c)
        e = torch.tanh(o)
    elif head_type != "vanilla":
        raise ValueError(f"unknown markov head type {head_type!r}")
    return e @ w2.float().T, state


def markov_sample_ref(
    base_logits: torch.Tensor,  # [B, γ, Vd] fp32 (after the output transform)
    hidden: torch.Tensor,  # [B, γ, D] draft hidden states h_k
    anchor: torch.Tensor,  # [B] int64 target id of the anchor
    w1: torch.Tensor,  # [V, r]   (r may be 0: no Markov head)
    w2: torch.Tensor,  # [Vd, r]
    d2t: torch.Tensor,  # [Vd] int64 offsets: target = draft + d2t[draft]
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64 anchor position p
    temperature: torch.Tensor,  # [B] fp32, 0 = greedy
    head_type: str,
    head_w: torch.Tensor | None,
    head_b: torch.Tensor | None,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (draft ids in TARGET vocabulary [B, γ] int64, sampled-from probs [B, γ, Vd] fp32)."""
    B, gamma, Vd = base_logits.shape
    rank = w1.shape[-1]
    greedy = (temperature == 0).unsqueeze(-1)  # [B, 1]
    inv_t = torch.where(temperature > 0, 1.0 / temperature.clamp_min(1e-30), torch.ones_like(temperature))
    inv_t = inv_t.unsqueeze(-1).float()  # [B, 1]
    d2t = d2t.to(torch.int64)
    prev = anchor.to(torch.int64)
    state = base_logits.new_zeros((B, rank))
    ids, probs = [], []
    for k in range(gamma):
        z = base_logits[:, k].float()
        if rank > 0:
            bias, state = markov_bias(prev, hidden[:, k], state, w1, w2, head_type, head_w, head_b)
            z = z + bias
        z = apply_topk(sanitize_logits(z), topk)
        scaled = z * inv_t
        noise = keyed_gumbel(seeds, positions + k + 1, SALT_DRAFT, Vd)
        x = torch.where(greedy, z, scaled + noise).argmax(-1)  # [B]
        q = torch.where(greedy, torch.nn.functional.one_hot(x, Vd).float(), torch.softmax(scaled, -1))
        ids.append(x + d2t[x])
        probs.append(q)
        prev = ids[-1]
    return torch.stack(ids, 1), torch.stack(probs, 1)
