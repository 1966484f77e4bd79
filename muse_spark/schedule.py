"""Confidence-scheduled verification: how many of each request's γ drafts a step sends to the target.

DSpark's confidence head estimates, for each draft position, the probability that the draft there is
accepted given that the ones before it were: ``c_k = σ(w·[h_k; W1[prev_k]] + b)``. Its cumulative
product ``C_k = c_0 ⋯ c_{k−1}`` estimates the probability that the first ``k`` drafts are all
accepted. The scheduler

1. gives each request ``k_i`` = the number of leading positions with ``C ≥ threshold`` (its own
   drafts only: without a budget, a request's tokens never depend on its batch mates), and
2. with a cost table (the step's measured time against the drafts verified per request, for the
   batch size), cuts every request at the ``K ≤ max k_i`` that maximizes the expected tokens per
   millisecond, ``Σ_i (1 + Σ_{j<min(k_i, K)} C_ij) / cost(B, K)``: at batch 1, where verification is
   bandwidth-bound, extra rows are nearly free and ``K`` stays high; at large batches, where the
   target's GEMMs are compute-bound, low-confidence rows are dropped. The cut couples the requests of
   a batch: each request's output distribution stays exactly the target's, but its sampled tokens
   may then depend on which requests share its steps.

Any ``k`` chosen from the draft's side alone keeps the output exact (``accept``'s ``verify``): the
target samples the bonus from its own distribution at the cut. ``mode="off"`` verifies all γ drafts:
today's step, token for token; ``mode="fixed"`` verifies the first ``length`` drafts of every request
(a shorter draft; ``muse-spark calibrate`` times the step this way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MODES = ("off", "confidence", "fixed")
# A cost row this flat: no cut can pay for planning it (``Schedule.flat``). Measured on the compiled engine
# (8B shapes, H100, acceptance 0.6): rows 14 % and 21 % from cheapest to full width (batch 8 and 32) lost
# 9 % and 5 % of tokens/s to the plan's wait and its cuts, so a row must span more than that to plan.
FLAT_WITHIN = 0.25


@dataclass(frozen=True)
class Schedule:
    """The verification policy of an engine (its manifest's ``schedule``) or of one run.

    ``threshold``: verify while the cumulative confidence is at least this. ``budget``: cut the batch
    by the cost table when there is one. ``cost_ms``: the measured step time by batch size (a string
    key, the engine's buckets) and drafts verified per request (a list over 0 … γ), from
    ``muse-spark calibrate``; empty: no cut beyond the threshold's."""

    mode: str = "off"
    threshold: float = 0.25
    budget: bool = True
    cost_ms: dict[str, list[float]] = field(default_factory=dict)
    length: int = 0  # mode "fixed": the drafts verified per request

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown schedule {self.mode!r}: expected one of {', '.join(MODES)}")
        if not (isinstance(self.threshold, (int, float)) and 0.0 <= self.threshold <= 1.0):
            raise ValueError(f"confidence threshold must be in [0, 1], got {self.threshold!r}")
        if not (isinstance(self.length, int) and self.length >= 0):
            raise ValueError(f"fixed schedule: length must be a count of drafts ≥ 0, got {self.length!r}")
        for key, row in self.cost_ms.items():
            if not (str(key).isdigit() and isinstance(row, list) and row
                    and all(isinstance(x, (int, float)) and x > 0 and math.isfinite(x) for x in row)):
                raise ValueError(f"schedule cost table: batch {key!r} must map to a list of positive step times "
                                 f"(ms by drafts verified per request), got {row!r}")

    @property
    def on(self) -> bool:
        return self.mode != "off"

    @property
    def needs_confidence(self) -> bool:
        return self.mode == "confidence"

    def to_dict(self) -> dict:
        return {"mode": self.mode, "threshold": self.threshold, "budget": self.budget, "cost_ms": self.cost_ms,
                "length": self.length}

    @classmethod
    def from_dict(cls, d: dict | None) -> "Schedule":
        d = d or {}
        if not isinstance(d, dict):
            raise ValueError(f"schedule must be an object, got {d!r}")
        return cls(mode=d.get("mode", "off"), threshold=float(d.get("threshold", 0.25)),
                   budget=bool(d.get("budget", True)), cost_ms=dict(d.get("cost_ms") or {}),
                   length=int(d.get("length", 0)))

    def replace(self, **kw) -> "Schedule":
        return Schedule(**{**self.to_dict(), **{k: v for k, v in kw.items() if v is not None}})

    def flat(self, batch: int, within: float = FLAT_WITHIN) -> bool:
        """Whether the cost table says verification width hardly matters at ``batch``: every entry of its
        row within ``within`` (relative) of the cheapest, so no cut can gain more than that (verification
        is bandwidth-bound there). A compiled engine then runs its plain step at that batch size: no
        planning, no wait for the confidences. False without a table, and for ``fixed``."""
        row = self.cost_row(batch) if self.mode == "confidence" and self.budget else None
        return bool(row) and max(row) <= min(row) * (1 + within)

    def cost_row(self, batch: int) -> list[float] | None:
        """The cost table's row for ``batch``: the smallest measured batch size ≥ it (the bucket the
        engine runs it in), else the largest. None without a table."""
        if not self.cost_ms:
            return None
        sizes = sorted(int(k) for k in self.cost_ms)
        size = next((s for s in sizes if s >= batch), sizes[-1])
        return self.cost_ms[str(size)]


def verify_counts(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """[B, γ] confidences → [B] int64: the leading positions whose cumulative product is ≥ threshold."""
    cum = torch.cumprod(confidence.float(), -1)
    return (cum >= threshold).to(torch.int64).cumprod(-1).sum(-1)


def best_cut(confidence: torch.Tensor, counts: torch.Tensor, cost: list[float]) -> int:
    """The ``K`` (0 … max count) maximizing expected tokens per ms with every request cut at ``K``."""
    cum = torch.cumprod(confidence.float(), -1)  # [B, γ]
    top = int(counts.max())
    best, best_rate = top, -1.0
    for K in range(top + 1):
        k = torch.clamp(counts, max=K)
        keep = torch.arange(cum.shape[1], device=cum.device)[None, :] < k[:, None]
        expected = float(counts.numel() + (cum * keep).sum())
        rate = expected / cost[min(K, len(cost) - 1)]
        if rate > best_rate * (1 + 1e-9):  # (ties go to the smaller K: the same tokens for less)
            best, best_rate = K, rate
    return best


def plan(confidence: torch.Tensor | None, schedule: Schedule, batch: int, gamma: int,
         device=None) -> tuple[torch.Tensor, int]:
    """→ (verify [B] int64, K = max verify): the drafts each request sends to the target this step."""
    if schedule.mode == "fixed":
        K = min(schedule.length, gamma)
        return torch.full((batch,), K, dtype=torch.int64, device=device), K
    counts = verify_counts(confidence, schedule.threshold)
    cost = schedule.cost_row(confidence.shape[0]) if schedule.budget else None
    K = best_cut(confidence, counts, cost) if cost else int(counts.max())
    return torch.clamp(counts, max=K), K
