"""torch.library registration of ``muse_spark::markov_sample`` and ``muse_spark::markov_sample_triton``.

``muse_spark::markov_sample`` (registered at import) runs the reference loop. ``register_triton``
registers ``muse_spark::markov_sample_triton``, the same schema plus the kernel's kept workspace, on
the fused DSpark Markov loop (``triton_kernel``); only ``plugins.triton_ops`` calls it, so importing
this module never imports Triton.

Where the kernel's assumptions do not hold the Triton op says so and stays exact: with a gated or
rnn head it runs the reference loop (logged once); with ``topk > 0`` it raises, as vLLM's fused
path does; on a CPU tensor (no Triton interpreter) it runs the reference.
"""

from __future__ import annotations

import logging

import torch

from muse_spark.plugins.markov.reference import markov_sample_ref

HEAD_TYPES = ("vanilla", "gated", "rnn")

log = logging.getLogger("muse_spark.plugins.triton_ops")  # the Triton ops' logger
_logged: set[str] = set()

TOPK_ERROR = (
    "The Muse Spark specialized decode runs the fused DSpark Markov loop, which does not run here: "
    "dspark_draft_topk is set"
)


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.warning("markov_sample_triton: %s; running the reference Markov loop", reason)


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


def markov_workspace_words(B: int, gamma: int, Vd: int, vocab: int, rank: int, head_type: str,
                           device: torch.device, weight_dtype: torch.dtype) -> int:
    """int64 words of the workspace ``markov_sample_triton`` keeps for calls of batch ``B`` (0 where
    the op runs the reference loop: not CUDA, not the vanilla head, ids the kernel cannot pack)."""
    from muse_spark.plugins.markov.triton_kernel import supported, workspace_words

    if (torch.device(device).type != "cuda" or (head_type != "vanilla" and rank > 0)
            or not supported(Vd, vocab)):
        return 0
    return workspace_words(B, gamma, Vd, rank, torch.device(device), weight_dtype)


def register_triton(runs_kernels, launch) -> None:
    """Registers ``muse_spark::markov_sample_triton``: the fused DSpark Markov loop
    (``launch(base_logits, anchor, w1, w2, d2t, seeds, positions, temperature, workspace=)``,
    ``plugins.triton_ops``) where ``runs_kernels(base_logits)`` and the kernel covers the call, else
    the reference loop."""
    from torch.library import triton_op

    from muse_spark.plugins.markov.triton_kernel import supported

    @triton_op("muse_spark::markov_sample_triton", mutates_args=("workspace",))
    def _markov_sample_op(
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
        workspace: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``workspace``: the kernel's int64 words, zeroed once and kept by the caller for calls of one
        shape (an engine's batch bucket: ``markov_workspace_words``), so no call zeroes one; empty: a
        zeroed one per call. The reference paths do not use it."""
        check_markov_inputs(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type,
                            head_w, head_b)
        if topk > 0:
            raise ValueError(TOPK_ERROR)
        args = (base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w, head_b,
                topk)
        if head_type != "vanilla" and w1.shape[1] > 0:
            _log_once(f"the fused kernel covers the vanilla head only, not {head_type!r}")
            return markov_sample_ref(*args)
        if not runs_kernels(base_logits):
            return markov_sample_ref(*args)
        if not supported(base_logits.shape[-1], w1.shape[0]):
            _log_once(f"draft vocabulary {base_logits.shape[-1]} / target vocabulary {w1.shape[0]} exceed the "
                      "kernel's id packing (< 2^20 target ids)")
            return markov_sample_ref(*args)
        return launch(base_logits, anchor, w1, w2, d2t, seeds, positions, temperature,
                      workspace=workspace if workspace.numel() else None)
