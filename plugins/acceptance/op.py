"""torch.library registration of ``muse_spark::accept_triton``: the speculative step's acceptance rule
(``reference.accept``) on the target head's output, in three kernels (``triton_kernel``).

Its reference is ``reference.accept_reference`` (``plugins.dispatch.accept`` calls it directly).
``register_triton`` registers the op; only ``plugins.triton_ops`` calls it, so importing this module
never imports Triton.
"""

from __future__ import annotations

import torch

from muse_spark.plugins.acceptance.reference import accept_reference


def check_accept_inputs(logits, draft_ids, draft_probs, d2t, temperature, seeds, anchor_pos) -> None:
    """The shapes ``plugins.acceptance.reference.accept`` takes, or a ValueError naming the argument."""
    if logits.dim() != 3 or logits.shape[1] < 1:
        raise ValueError(f"accept: expected logits [B, γ+1, V], got {list(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"accept: expected floating-point logits, got {logits.dtype}")
    B, g1, V = logits.shape
    if draft_ids.shape != (B, g1 - 1) or draft_ids.dtype != torch.int64:
        raise ValueError(f"accept: expected draft_ids [B, γ]=[{B}, {g1 - 1}] int64, got {list(draft_ids.shape)} "
                         f"{draft_ids.dtype}")
    if draft_probs.dim() != 3 or draft_probs.shape[:2] != (B, g1 - 1) or draft_probs.dtype != torch.float32:
        raise ValueError(f"accept: expected draft_probs [B, γ, Vd]=[{B}, {g1 - 1}, Vd] fp32, got "
                         f"{list(draft_probs.shape)} {draft_probs.dtype}")
    if d2t.shape != (draft_probs.shape[-1],):
        raise ValueError(f"accept: expected d2t [Vd]=[{draft_probs.shape[-1]}], got {list(d2t.shape)}")
    for name, t in (("temperature", temperature), ("seeds", seeds), ("anchor_pos", anchor_pos)):
        if t.shape != (B,):
            raise ValueError(f"accept: expected {name} of shape [B]=[{B}], got {list(t.shape)}")


def register_triton(runs_kernels, launch) -> None:
    """Registers ``muse_spark::accept_triton``: the kernels (``launch(*args)``, ``plugins.triton_ops``)
    where ``runs_kernels(logits)``, else the reference."""
    from torch.library import triton_op

    @triton_op("muse_spark::accept_triton", mutates_args=())
    def _accept_op(logits: torch.Tensor, multiplier: float, draft_ids: torch.Tensor, draft_probs: torch.Tensor,
                   d2t: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                   anchor_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``plugins.acceptance.reference.accept`` on ``output_transform(logits, multiplier, None)`` → (n, bonus)
        [B] int64. d2t must map the draft ids into distinct target ids (``checkpoint.check_d2t``)."""
        check_accept_inputs(logits, draft_ids, draft_probs, d2t, temperature, seeds, anchor_pos)
        if not runs_kernels(logits):
            return accept_reference(logits, multiplier, None, draft_ids, draft_probs, d2t, temperature, seeds,
                                    anchor_pos)
        return launch(logits, multiplier, draft_ids, draft_probs, d2t, temperature, seeds, anchor_pos)
