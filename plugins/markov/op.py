"""torch.library registration of ``muse_spark::markov_sample``.

The default implementation is the reference loop; the Triton kernel registers
a CUDA implementation of the same schema.
"""

from __future__ import annotations

import torch

from muse_spark.plugins.markov.reference import markov_sample_ref

HEAD_TYPES = ("vanilla", "gated", "rnn")


def check_markov_inputs(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w, head_b):
    if base_logits.dim() != 3:
        raise ValueError(f"markov_sample: expected base_logits [B, γ, Vd], got {list(base_logits.shape)}")
    B, gamma, Vd = base_logits.shape
    if hidden.shape[:2] != (B, gamma):
        raise ValueError(f"markov_sample: expected hidden of shape [{B}, {gamma}, D], got {list(hidden.shape)}")
    for name, t in (("anchor", anchor), ("seeds", seeds), ("positions", positions), ("temperature", temperature)):
        if t.shape != (B,):
            raise ValueError(f"markov_sample: expected {name} of shape [B]=[{B}], got {list(t.shape)}")
    if d2t.shape != (Vd,):
        raise ValueError(f"markov_sample: expected d2t of shape [Vd]=[{Vd}], got {list(d2t.shape)}")
    if w1.dim() != 2 or w2.dim() != 2 or w2.shape != (Vd, w1.shape[1]):
        raise ValueError(
            f"markov_sample: expected w1 [V, r] and w2 [Vd={Vd}, r], got {list(w1.shape)} and {list(w2.shape)}"
        )
    if head_type not in HEAD_TYPES:
        raise ValueError(f"markov_sample: unknown head type {head_type!r}")
    if head_type != "vanilla" and w1.shape[1] > 0 and (head_w is None or head_b is None):
        raise ValueError(f"markov_sample: the {head_type} head needs its projection weight and bias")


@torch.library.custom_op("muse_spark::markov_sample", mutates_args=())
def markov_sample(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchor: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    d2t: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature: torch.Tensor,
    head_type: str,
    head_w: torch.Tensor | None,
    head_b: torch.Tensor | None,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_markov_inputs(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w, head_b)
    return markov_sample_ref(
        base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w, head_b, topk
    )


@markov_sample.register_fake
def _(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w, head_b, topk):
    B, gamma, Vd = base_logits.shape
    ids = base_logits.new_empty((B, gamma), dtype=torch.int64)
    return ids, base_logits.new_empty((B, gamma, Vd), dtype=torch.float32)
