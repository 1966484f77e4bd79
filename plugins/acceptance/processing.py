"""Logit processing of the target's distribution: penalties, top-k, top-p, min-p and min_tokens,
per request, exact under speculative decoding (docs/design.md, "Sampling controls").

The processed distribution at a verification position depends on the tokens before it, including
the drafts the step would accept before it: position ``k`` of a step (predicting the token after
``t_k``) sees the request's history plus ``t_1 … t_k``. ``process_logits`` builds exactly that per
position, so every emitted token — an accepted draft, a residual sample or the bonus — comes from
the processed target distribution ``P'`` of its position. The draft keeps proposing from its own
``q``: the acceptance rule ``min(1, P'/q)`` with the residual ``max(P' − q, 0)`` is exact for any
``q`` a token was drawn from.

Order (as vLLM and TensorRT-LLM apply them): the repetition penalty (prompt and output tokens:
``z/r`` where ``z > 0``, ``z·r`` elsewhere), then the frequency and presence penalties (output
tokens: ``z − f·count − p·[count > 0]``), stop tokens masked while fewer than ``min_tokens`` are
out, then temperature, then top-k, top-p (the smallest set of tokens, most likely first, whose mass
reaches p) and min-p (tokens below ``min_p`` × the top probability go). Filtered tokens get −∞;
the returned logits are before the temperature (the samplers divide by it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class Processing:
    """Per-request controls of a batch, on the device ([B] each), and its token history:
    ``seen`` [B, V] bool (prompt and output tokens: the repetition penalty), ``counts`` [B, V] fp32
    (output tokens: frequency and presence), ``out_len`` [B] (tokens output so far), ``stops`` [B, V]
    bool (the tokens min_tokens holds back)."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    min_tokens: torch.Tensor
    out_len: torch.Tensor
    seen: torch.Tensor
    counts: torch.Tensor
    stops: torch.Tensor

    @classmethod
    def build(cls, rows: list[dict], vocab: int, device) -> "Processing":
        """``rows``: per request ``top_k, top_p, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, min_tokens`` and ``prompt``, ``output``, ``stop_ids`` (lists of ids)."""
        B = len(rows)

        def col(key, dtype):
            return torch.tensor([r[key] for r in rows], dtype=dtype, device=device)

        seen = torch.zeros(B, vocab, dtype=torch.bool)
        counts = torch.zeros(B, vocab, dtype=torch.float32)
        stops = torch.zeros(B, vocab, dtype=torch.bool)
        for i, r in enumerate(rows):
            if r["prompt"] or r["output"]:
                seen[i, torch.tensor(r["prompt"] + r["output"], dtype=torch.int64)] = True
            if r["output"]:
                counts[i].index_add_(0, torch.tensor(r["output"], dtype=torch.int64), torch.ones(len(r["output"])))
            if r["stop_ids"]:
                stops[i, torch.tensor(sorted(r["stop_ids"]), dtype=torch.int64)] = True
        return cls(col("top_k", torch.int64), col("top_p", torch.float32), col("min_p", torch.float32),
                   col("repetition_penalty", torch.float32), col("presence_penalty", torch.float32),
                   col("frequency_penalty", torch.float32), col("min_tokens", torch.int64),
                   torch.tensor([len(r["output"]) for r in rows], dtype=torch.int64, device=device),
                   seen.to(device), counts.to(device), stops.to(device))

    def select(self, rows: torch.Tensor) -> "Processing":
        return Processing(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))


def process_logits(logits: torch.Tensor, drafts: torch.Tensor, proc: Processing,
                   temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, S, V] (transformed) at S consecutive positions of a step, drafts [B, S−1] the
    tokens between them (position k sees ``t_1 … t_k`` as output) → the processed logits [B, S, V]
    (before the temperature; −∞ where filtered)."""
    B, S, V = logits.shape
    z = logits.float()
    # the history at each position: the request's, plus the drafts before the position
    add = torch.zeros(B, S, V, device=z.device)
    if S > 1:
        step = torch.zeros(B, S - 1, V, device=z.device).scatter_(-1, drafts[:, : S - 1, None], 1.0)
        add[:, 1:] = torch.cumsum(step, 1)
    counts = proc.counts[:, None, :] + add
    seen = proc.seen[:, None, :] | (add > 0)
    r = proc.repetition[:, None, None]
    z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
    z = z - proc.frequency[:, None, None] * counts - proc.presence[:, None, None] * (counts > 0).float()
    out_len = proc.out_len[:, None] + torch.arange(S, device=z.device)[None, :]  # tokens out before each position
    hold = (out_len < proc.min_tokens[:, None])[..., None] & proc.stops[:, None, :]
    z = torch.where(hold, torch.full_like(z, NEG_INF), z)
    return filter_logits(z, proc.top_k, proc.top_p, proc.min_p, temperature)


SCAN_CHUNK = 1024


def cumsum_last(p: torch.Tensor) -> torch.Tensor:
    """``torch.cumsum(p, -1)`` in chunks of ``SCAN_CHUNK`` plus the running total of the chunks before: one scan over
    a 131k vocabulary compiles (Inductor, CUDA) into a split scan whose code generation fails in torch 2.11 (an 8B
    pair's controlled verification package, H100); scans this short are not split."""
    V = p.shape[-1]
    if V <= SCAN_CHUNK:
        return torch.cumsum(p, -1)
    pad = -V % SCAN_CHUNK
    q = torch.nn.functional.pad(p, (0, pad)).reshape(*p.shape[:-1], -1, SCAN_CHUNK)
    inner = torch.cumsum(q, -1)
    totals = inner[..., -1]
    carry = torch.cumsum(totals, -1) - totals  # (the mass of the chunks before each)
    return (inner + carry[..., None]).reshape(*p.shape[:-1], -1)[..., :V]


def filter_logits(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  temperature: torch.Tensor) -> torch.Tensor:
    """top-k, top-p and min-p over the last dimension of z [B, S, V] (per request [B]; 0, 1, 0 = off),
    judged on softmax(z / T) (T = 1 for greedy rows: the argmax is kept whatever the filter)."""
    B, S, V = z.shape
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()[:, None, None]
    order = torch.sort(z, dim=-1, descending=True, stable=True)
    sorted_z = order.values
    probs = torch.softmax(sorted_z / t, -1)
    rank = torch.arange(V, device=z.device)[None, None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))[:, None, None]
    drop = (rank >= k).expand(B, S, V).clone()
    # top-p: keep a token while the mass before it is below p (the most likely token always stays)
    before = cumsum_last(probs) - probs
    drop |= before >= top_p[:, None, None]
    drop |= probs < min_p[:, None, None] * probs[..., :1]
    drop &= rank > 0
    keep = torch.zeros_like(drop).scatter_(-1, order.indices, ~drop)
    return torch.where(keep, z, torch.full_like(z, NEG_INF))


def logprobs(z: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log P' of processed logits z [B, S, V]: at the request's temperature (1 for greedy rows)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()[:, None, None]
    return torch.log_softmax(z / t, -1)
