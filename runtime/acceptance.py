"""Measured acceptance of an engine's pair: accepted drafts per step, per position, and how well the
draft's confidence head predicts acceptance (its calibration and AUROC).

A draft position is *decided* in a step when every draft before it was accepted: positions
``0 … accepted`` (the last of them rejected when ``accepted < γ``). The confidence at a decided
position is scored against whether it was accepted; undecided positions (after the first
rejection) say nothing about the head and are left out.
"""

from __future__ import annotations

from muse_spark.runtime.generator import Generator, SamplingParams, confidence_figures, decided_confidences


def auroc(positives: list[float], negatives: list[float]) -> float | None:
    """The probability that a random positive scores above a random negative (ties count half):
    the Mann-Whitney statistic. None when either side is empty."""
    if not positives or not negatives:
        return None
    scored = sorted([(s, 1) for s in positives] + [(s, 0) for s in negatives])
    rank_sum, i = 0.0, 0
    while i < len(scored):  # average ranks over ties
        j = i
        while j < len(scored) and scored[j][0] == scored[i][0]:
            j += 1
        mean_rank = (i + 1 + j) / 2
        rank_sum += mean_rank * sum(label for _, label in scored[i:j])
        i = j
    n_pos, n_neg = len(positives), len(negatives)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def acceptance_stats(requests, gamma: int) -> dict:
    """Acceptance figures over the steps of finished requests (``Request.steps``)."""
    steps = [s for r in requests for s in r.steps]
    n = max(len(steps), 1)
    accepted = [s.accepted for s in steps]
    out = {
        "steps": len(steps),
        "requests": len(requests),
        "generated_tokens": sum(len(r.output) for r in requests),
        "mean_accepted_per_step": sum(accepted) / n,
        "mean_emitted_per_step": sum(len(s.emitted) for s in steps) / n,
        # P(draft k accepted | drafts before it accepted): the conditional rate at each position
        "acceptance_per_position": [
            (sum(1 for a in accepted if a > k) / d) if (d := sum(1 for a in accepted if a >= k)) else None
            for k in range(gamma)],
    }
    verified = [s.verified for s in steps if s.verified is not None]
    if verified:
        out["mean_verified_per_step"] = sum(verified) / len(verified)
        # how often each width ran: [k] = the request-steps that sent k drafts to the target (a mean of 3.7
        # may be every step at 4, or a mix of 1 and 7)
        out["verified_counts"] = [sum(1 for v in verified if v == k) for k in range(gamma + 1)]
    yes, no = decided_confidences(steps, gamma)
    if yes or no:
        out["confidence"] = {**confidence_figures(yes, no), "auroc": auroc(yes, no)}
    return out


def measure_acceptance(engine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
                       seed: int = 0) -> dict:
    """Generate ``max_tokens`` (EOS ignored) for every prompt with the engine's own scheduler, and
    return ``acceptance_stats`` of the run (request ``i`` seeded ``seed + i``)."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i, ignore_eos=True)
              for i in range(len(prompts))]
    reqs = Generator(engine).generate([list(p) for p in prompts], params)
    return dict(acceptance_stats(reqs, engine.gamma), temperature=temperature, max_tokens=max_tokens)
