"""Which implementation of each plugin the models call.

* ``"op"`` (default): the registered ``torch.ops.muse_spark.*`` custom ops
  (reference implementation on every device; eager engines).
* ``"inline"``: the plain-torch reference function called directly, so that
  ``torch.export`` traces *through* it and an AOTInductor package needs no
  Python-registered op at run time (CPU AOTI builds, C++ embedding).
* ``"triton"``: the Triton kernels registered with ``torch.library.triton_op``
  (``muse_spark::*_triton``), compiled into CUDA AOTI packages.

Tests use ``plugin_impl(...)`` to force a path and compare it with another.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from muse_spark.options import current_options
from muse_spark.plugins.acceptance.reference import accept_reference, output_transform
from muse_spark.plugins.gated_residual.reference import gated_residual_add_ref
from muse_spark.plugins.markov.reference import markov_sample_ref

IMPLS = ("op", "inline", "triton")
_current = {"impl": "op"}


@contextlib.contextmanager
def plugin_impl(impl: str) -> Iterator[None]:
    if impl not in IMPLS:
        raise ValueError(f"unknown plugin implementation {impl!r} (expected one of {list(IMPLS)})")
    prev = _current["impl"]
    _current["impl"] = impl
    try:
        yield
    finally:
        _current["impl"] = prev


def current_impl() -> str:
    return _current["impl"]


def _triton_ops():
    # Imported lazily: no GPU/Triton work at import time.
    from muse_spark.plugins import triton_ops  # noqa: F401

    return triton_ops


def gated_residual_add(stream, branch, gate, norm_weight, eps, zero_centered, apply_norm, out_dtype,
                       branch_norm_weight=None, norm_branch=False):
    impl = _current["impl"]
    args = (stream, branch, gate, norm_weight, eps, zero_centered, apply_norm, out_dtype, branch_norm_weight,
            norm_branch)
    if impl == "inline":
        return gated_residual_add_ref(*args)
    if impl == "triton":
        return _triton_ops().gated_residual_add(*args)
    import torch

    return torch.ops.muse_spark.gated_residual_add(*args)


def markov_sample(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w,
                  head_b, topk, workspace=None):
    """``workspace``: the Triton kernel's kept int64 words (``triton_ops.markov_workspace_words``);
    None or empty: zeroed per call. The references do not use it."""
    impl = _current["impl"]
    args = (base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w, head_b, topk)
    if impl == "inline":
        return markov_sample_ref(*args)
    if impl == "triton":
        return _triton_ops().markov_sample(*args, workspace)
    import torch

    return torch.ops.muse_spark.markov_sample(*args)


def accept(raw_logits, multiplier, soft_cap, draft_ids, draft_probs, d2t, temperature, seeds, anchor_pos):
    """The acceptance rule (``plugins.acceptance.reference.accept``) on the target head's output before its
    transform (``plugins.acceptance.reference.output_transform(raw_logits, multiplier, soft_cap)``): the reference
    (``"op"``, ``"inline"``, and ``"triton"`` with the kernel option ``accept_kernels`` false), or under
    ``"triton"`` by default (``muse_spark.options``) ``muse_spark::accept_triton``'s
    kernels, which apply the multiplier themselves (a soft cap is applied before them).
    → (n accepted [B], bonus token [B]) int64."""
    if _current["impl"] == "triton" and current_options().accept_kernels:
        if soft_cap is not None:
            raw_logits, multiplier = output_transform(raw_logits, multiplier, soft_cap), 1.0
        return _triton_ops().accept(raw_logits, multiplier, draft_ids, draft_probs, d2t, temperature, seeds,
                                    anchor_pos)
    return accept_reference(raw_logits, multiplier, soft_cap, draft_ids, draft_probs, d2t, temperature, seeds,
                            anchor_pos)
