"""The Triton implementations of the plugin ops (``muse_spark::*_triton``), registered with
``torch.library.triton_op``: the one entry point that registers them all.

Importing this module imports Triton and calls ``register_triton`` of each op folder's ``op.py``,
the one place that states the op's schema, input checks and reference fallbacks (beside its
reference op, where it has one):

* ``plugins/gated_residual/op.py`` — ``muse_spark::gated_residual_add_triton``;
* ``plugins/markov/op.py`` — ``muse_spark::markov_sample_triton`` (and ``markov_workspace_words``);
* ``plugins/acceptance/op.py`` — ``muse_spark::accept_triton``;
* ``plugins/attention/op.py`` — ``muse_spark::attention_triton``, ``muse_spark::attention_bounds_triton``
  and ``muse_spark::attention_cache_triton``;
* ``plugins/head_norm_rope/op.py`` — ``muse_spark::head_norm_rope_triton`` and
  ``muse_spark::head_norm_rope_cache_triton``;
* ``plugins/linear/op.py`` — ``muse_spark::linear_triton``, ``muse_spark::linear_fp8_triton``,
  ``muse_spark::linear_w8a8_triton``, ``muse_spark::linear_rope_table_triton`` and
  ``muse_spark::linear_fp8_rope_table_triton``.

Each gets the launch of its kernels from here, which binds ``wrap_triton``, the interpreter and
the PDL mode (``_pdl``): every launch of a ``plugins.pdl.PDL_KERNELS`` kernel is in this module.
The functions below (``attention``, ``head_norm_rope``, ``gated_residual_add``, ...) call the ops
with the signatures the models and ``plugins.dispatch`` use.

Because they are ``triton_op``s, ``torch.export`` keeps them as ops and AOTInductor compiles their
kernels *into* the package, so a CUDA engine runs them without this module (or Triton) at load time.

Only ``plugins.dispatch`` (and the layers, builder and benchmarks on their Triton paths) imports
this module, lazily, when the ``"triton"`` implementation is selected; ``import muse_spark.plugins``
never does.

Where a kernel's assumptions do not hold the op says so and stays exact:
* ``markov_sample`` with a gated or rnn head runs the reference loop (logged
  once); with ``topk > 0`` it raises, as vLLM's fused path does;
* on a CPU tensor (no Triton interpreter) the ops run their references.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from muse_spark.options import current_options
from muse_spark.plugins.acceptance import op as acceptance_op
from muse_spark.plugins.acceptance.op import check_accept_inputs  # noqa: F401
from muse_spark.plugins.acceptance.triton_kernel import launch_accept
from muse_spark.plugins.attention import op as attention_op
from muse_spark.plugins.attention.reference import KeyBounds
from muse_spark.plugins.attention.triton_kernel import launch_attention
from muse_spark.plugins.gated_residual import op as gated_residual_op
from muse_spark.plugins.gated_residual.triton_kernel import launch_gated_residual_add
from muse_spark.plugins.head_norm_rope import op as head_norm_rope_op
from muse_spark.plugins.head_norm_rope import triton_kernel as head_norm_rope_kernel
from muse_spark.plugins.linear import op as linear_op
from muse_spark.plugins.linear.triton_kernel import launch_linear, launch_linear_rope_table
from muse_spark.plugins.markov import op as markov_op
from muse_spark.plugins.markov.op import TOPK_ERROR, markov_workspace_words  # noqa: F401
from muse_spark.plugins.markov.triton_kernel import launch_markov_sample
from muse_spark.plugins.pdl import pdl_active
from muse_spark.plugins.triton_math import interpreting


def _runs_kernels(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or interpreting()


def _pdl(small: bool = False) -> int:
    """The ``PDL`` mode the ops compile ``plugins.pdl.PDL_KERNELS`` with (``triton_math.pdl_enter``),
    from the current kernel options (``muse_spark.options``): under ``pdl`` (the default) on sm_90+,
    1 (trigger the dependents, then wait) for a kernel that is not a GEMM (``small``) under
    ``pdl_trigger`` (the default), else 2 (wait only); a GEMM 3 (wait, then trigger after its weight
    stream) under ``pdl_gemm_trigger`` (the default), else 2; 0 without PDL, on an older GPU, or
    under the interpreter (no inline asm)."""
    options = current_options()
    if not pdl_active(options) or interpreting():
        return 0
    if small:
        return 1 if options.pdl_trigger else 2
    return 3 if options.pdl_gemm_trigger else 2


# The kernels' launches inside the ops (``register_triton`` of each op folder's ``op.py``): every one
# traced through ``wrap_triton`` and compiled with the current PDL mode.

def _launch_gated_residual_add(*args, **kwargs):
    return launch_gated_residual_add(*args, wrap=wrap_triton, pdl=_pdl(small=True), **kwargs)


def _launch_markov_sample(*args, workspace):
    return launch_markov_sample(*args, wrap=wrap_triton, interpret=interpreting(), workspace=workspace)


def _launch_accept(*args):
    return launch_accept(*args, wrap=wrap_triton)


def _launch_attention(*args, **kwargs):
    return launch_attention(*args, wrap=wrap_triton, interpret=interpreting(), pdl=_pdl(small=True), **kwargs)


def _launch_head_norm_rope(*args):
    return head_norm_rope_kernel.launch_head_norm_rope(*args, wrap=wrap_triton, pdl=_pdl(small=True))


def _launch_head_norm_rope_cache(*args, table, scales=None):
    return head_norm_rope_kernel.launch_head_norm_rope_cache(*args, wrap=wrap_triton, pdl=_pdl(small=True),
                                                            table=table, scales=scales)


def _launch_linear(*args, scale=None, w8a8=False, input_scale=None, rows=None):
    return launch_linear(*args, wrap=wrap_triton, interpret=interpreting(), pdl=_pdl(), scale=scale, w8a8=w8a8,
                         input_scale=input_scale, rows=rows)


def _launch_linear_rope_table(*args, scale=None, w8a8=False, input_scale=None):
    return launch_linear_rope_table(*args, wrap=wrap_triton, interpret=interpreting(), pdl=_pdl(), scale=scale,
                                    w8a8=w8a8, input_scale=input_scale)


gated_residual_op.register_triton(_runs_kernels, _launch_gated_residual_add)
markov_op.register_triton(_runs_kernels, _launch_markov_sample)
acceptance_op.register_triton(_runs_kernels, _launch_accept)
attention_op.register_triton(_runs_kernels, _launch_attention)
head_norm_rope_op.register_triton(_runs_kernels, _launch_head_norm_rope, _launch_head_norm_rope_cache)
linear_op.register_triton(_runs_kernels, _launch_linear, _launch_linear_rope_table)


def attention(q, k, v, mask, slots=None, scales=None):
    """``models.layers.attend``'s signature; runs ``muse_spark::attention_triton`` (a ``KeyBounds``
    mask: ``muse_spark::attention_bounds_triton``). ``scales``: an FP8 cache's (k_scale, v_scale)."""
    ks, vs = scales or (None, None)
    if isinstance(mask, KeyBounds):
        return torch.ops.muse_spark.attention_bounds_triton(q, k, v, mask.last, mask.width, slots, ks, vs)
    return torch.ops.muse_spark.attention_triton(q, k, v, mask, slots, ks, vs)


def attention_cache(x, v, positions, eps, theta, use_rope, k_cache, v_cache, slots, bounds, rope_cos=None,
                    rope_sin=None, scales=None):
    """``muse_spark::attention_cache_triton`` with the mask a ``KeyBounds`` (and the step's RoPE
    table, where the qkv projection wrote it; ``scales``: an FP8 cache's (k_scale, v_scale))."""
    ks, vs = scales or (None, None)
    return torch.ops.muse_spark.attention_cache_triton(x, v, positions, eps, theta, use_rope, k_cache, v_cache, slots,
                                                       bounds.last, bounds.width, rope_cos, rope_sin, ks, vs)


def head_norm_rope(x, positions, eps, theta, use_rope):
    """``models.layers.head_norm_rope``'s signature; runs ``muse_spark::head_norm_rope_triton``."""
    return torch.ops.muse_spark.head_norm_rope_triton(x, positions, eps, theta, use_rope)


def gated_residual_add(stream, branch, gate, norm_weight, eps, zero_centered, apply_norm, out_dtype,
                       branch_norm_weight=None, norm_branch=False):
    """Same signature as ``gated_residual_add_ref``; runs ``muse_spark::gated_residual_add_triton``."""
    return torch.ops.muse_spark.gated_residual_add_triton(stream, branch, gate, norm_weight, eps, zero_centered,
                                                          apply_norm, out_dtype, branch_norm_weight, norm_branch)


def gated_residual_add_rows(stream, branch, gate, norm_weight, eps, zero_centered, out_dtype, branch_norm_weight=None,
                            norm_branch=False, input_scale=None):
    """``gated_residual_add`` with the norm applied, its normed rows also quantized for a W8A8 product (per token, or
    with the static ``input_scale``) → (new stream, normed, E4M3 codes [N, D], fp32 scales [N]); runs
    ``muse_spark::gated_residual_add_rows_triton``."""
    return torch.ops.muse_spark.gated_residual_add_rows_triton(stream, branch, gate, norm_weight, eps, zero_centered,
                                                               out_dtype, branch_norm_weight, norm_branch, input_scale)


def markov_sample(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w,
                  head_b, topk, workspace=None):
    """``markov_sample_ref``'s signature and the kept workspace (None or empty: zeroed per call); runs
    ``muse_spark::markov_sample_triton``."""
    if workspace is None:
        workspace = torch.empty(0, dtype=torch.int64, device=base_logits.device)
    return torch.ops.muse_spark.markov_sample_triton(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions,
                                                     temperature, head_type, head_w, head_b, topk, workspace)


def accept(logits, multiplier, draft_ids, draft_probs, d2t, temperature, seeds, anchor_pos):
    """``muse_spark::accept_triton`` (``plugins.acceptance.reference.accept`` on the target head's raw output)."""
    return torch.ops.muse_spark.accept_triton(logits, float(multiplier), draft_ids, draft_probs, d2t, temperature,
                                              seeds, anchor_pos)
