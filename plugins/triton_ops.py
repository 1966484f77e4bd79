"""The Triton implementations of the plugin ops, registered with ``torch.library.triton_op``.

Importing this module imports Triton and registers

* ``muse_spark::gated_residual_add_triton`` — gated FP32 residual add fused with the branch's own
  output norm before it and the next RMSNorm after it;
* ``muse_spark::markov_sample_triton`` — the fused DSpark Markov loop;
* ``muse_spark::linear_rope_table_triton`` — the skinny linear layer plus, from one more program,
  the step's RoPE table for ``head_norm_rope_cache_triton`` (the default; off with the kernel option
  ``rope_table`` false);
* ``muse_spark::linear_triton`` — the skinny linear layer (≤ 16 rows), silu·mul optionally fused,
  which ``models.layers.linear`` calls in bf16/fp16 on CUDA for at most 16 rows (the default; the
  kernel option ``linear="cublas"`` selects ``F.linear``);
* ``muse_spark::head_norm_rope_triton`` — the attention's per-head q/k RMS norm and RoPE in one
  pass, which ``models.layers.head_norm_rope`` calls in bf16/fp16 on CUDA. Its reference is
  ``plugins.head_norm_rope.reference.head_norm_rope_reference``. ``muse_spark::head_norm_rope_cache_triton`` also
  writes the k heads and v into the KV caches (the layer's cache write, in the same kernel);
* ``muse_spark::attention_cache_triton`` — ``head_norm_rope_cache_triton`` and the attention of its
  q over the caches in one launch of the attention's partial kernel (the default, off with the
  kernel option ``attention_cache`` false: the layers call it where both kernels fit and the mask is in
  bounds form);
* ``muse_spark::accept_triton`` — the speculative step's acceptance rule (``plugins.acceptance.reference.accept``)
  on the target head's output, in three kernels (``plugins/acceptance``);
* ``muse_spark::attention_triton`` — masked GQA attention over a static KV window (split-KV),
  which ``models.layers.attend`` calls in bf16/fp16 on CUDA (the default; the kernel option
  ``attention="sdpa"`` selects SDPA instead). Its reference is ``plugins.attention.reference.attend_reference``.
  ``muse_spark::attention_bounds_triton`` is the same kernel with the mask in bounds form
  (``plugins.attention.reference.KeyBounds``: the models' masks), so no mask tensor is built or read.

Their schemas are those of the reference ops (``muse_spark::gated_residual_add``,
``muse_spark::markov_sample``). Because they are ``triton_op``s, ``torch.export``
keeps them as ops and AOTInductor compiles their kernels *into* the package, so
a CUDA engine runs them without this module (or Triton) at load time.

Only ``plugins.dispatch`` imports this module, lazily, when the ``"triton"``
implementation is selected; ``import muse_spark.plugins`` never does.

Where a kernel's assumptions do not hold the op says so and stays exact:
* ``markov_sample`` with a gated or rnn head runs the reference loop (logged
  once); with ``topk > 0`` it raises, as vLLM's fused path does;
* on a CPU tensor (no Triton interpreter) both ops run their references.
"""

from __future__ import annotations

import logging

import torch
from torch.library import triton_op, wrap_triton

from muse_spark.plugins.acceptance.reference import accept_reference
from muse_spark.plugins.attention.reference import KeyBounds, attend_reference, cache_rows, triton_attention_fits
from muse_spark.plugins.head_norm_rope.reference import (head_norm_rope_cache_reference, head_norm_rope_reference,
                                                         rope_table_reference)
from muse_spark.plugins.linear.reference import linear_reference
from muse_spark.plugins.pdl import pdl_active
from muse_spark.options import current_options
from muse_spark.plugins.acceptance.triton_kernel import launch_accept
from muse_spark.plugins.attention.triton_kernel import launch_attention
from muse_spark.plugins.head_norm_rope import triton_kernel as head_norm_rope_kernel
from muse_spark.plugins.gated_residual.op import check_gated_residual_inputs
from muse_spark.plugins.gated_residual.reference import gated_residual_add_ref
from muse_spark.plugins.gated_residual.triton_kernel import launch_gated_residual_add
from muse_spark.plugins.linear.triton_kernel import MAX_ROWS, fits, launch_linear, launch_linear_rope_table
from muse_spark.plugins.markov.op import check_markov_inputs
from muse_spark.plugins.markov.reference import markov_sample_ref
from muse_spark.plugins.markov.triton_kernel import launch_markov_sample, supported, workspace_words
from muse_spark.plugins.triton_math import interpreting

log = logging.getLogger(__name__)
_logged: set[str] = set()

TOPK_ERROR = (
    "The Muse Spark specialized decode runs the fused DSpark Markov loop, which does not run here: "
    "dspark_draft_topk is set"
)


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.warning("markov_sample_triton: %s; running the reference Markov loop", reason)


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


@triton_op("muse_spark::gated_residual_add_triton", mutates_args=())
def _gated_residual_add_op(
    stream: torch.Tensor,
    branch: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    zero_centered: bool,
    apply_norm: bool,
    out_dtype: torch.dtype,
    branch_norm_weight: torch.Tensor | None = None,
    norm_branch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_gated_residual_inputs(stream, branch, gate, norm_weight, branch_norm_weight)
    args = (stream, branch, gate, norm_weight, eps, zero_centered, apply_norm, out_dtype, branch_norm_weight,
            norm_branch)
    if not _runs_kernels(stream):
        return gated_residual_add_ref(*args)
    return launch_gated_residual_add(*args, wrap=wrap_triton, pdl=_pdl(small=True))


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
    check_markov_inputs(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w,
                        head_b)
    if topk > 0:
        raise ValueError(TOPK_ERROR)
    args = (base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w, head_b, topk)
    if head_type != "vanilla" and w1.shape[1] > 0:
        _log_once(f"the fused kernel covers the vanilla head only, not {head_type!r}")
        return markov_sample_ref(*args)
    if not _runs_kernels(base_logits):
        return markov_sample_ref(*args)
    if not supported(base_logits.shape[-1], w1.shape[0]):
        _log_once(f"draft vocabulary {base_logits.shape[-1]} / target vocabulary {w1.shape[0]} exceed the kernel's "
                  "id packing (< 2^20 target ids)")
        return markov_sample_ref(*args)
    return launch_markov_sample(base_logits, anchor, w1, w2, d2t, seeds, positions, temperature, wrap=wrap_triton,
                                interpret=interpreting(), workspace=workspace if workspace.numel() else None)


def markov_workspace_words(B: int, gamma: int, Vd: int, vocab: int, rank: int, head_type: str,
                           device: torch.device, weight_dtype: torch.dtype) -> int:
    """int64 words of the workspace ``markov_sample_triton`` keeps for calls of batch ``B`` (0 where
    the op runs the reference loop: not CUDA, not the vanilla head, ids the kernel cannot pack)."""
    if (torch.device(device).type != "cuda" or (head_type != "vanilla" and rank > 0)
            or not supported(Vd, vocab)):
        return 0
    return workspace_words(B, gamma, Vd, rank, torch.device(device), weight_dtype)


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


@triton_op("muse_spark::accept_triton", mutates_args=())
def _accept_op(logits: torch.Tensor, multiplier: float, draft_ids: torch.Tensor, draft_probs: torch.Tensor,
               d2t: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
               anchor_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``plugins.acceptance.reference.accept`` on ``output_transform(logits, multiplier, None)`` → (n, bonus) [B]
    int64. d2t must map the draft ids into distinct target ids (``checkpoint.check_d2t``)."""
    check_accept_inputs(logits, draft_ids, draft_probs, d2t, temperature, seeds, anchor_pos)
    if not _runs_kernels(logits):

        return accept_reference(logits, multiplier, None, draft_ids, draft_probs, d2t, temperature, seeds, anchor_pos)
    return launch_accept(logits, multiplier, draft_ids, draft_probs, d2t, temperature, seeds, anchor_pos,
                         wrap=wrap_triton)


def _check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None) -> None:
    B, S, H, dh = q.shape
    per_request = slots is None  # k/v [B, T, KV, Dh]; else whole caches, any number of rows
    if k.dim() != 4 or k.shape != v.shape or (per_request and k.shape[0] != B) or k.shape[3] != dh or H % k.shape[2]:
        raise ValueError(f"attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: expected k and v "
                         f"[{'B' if per_request else 'N'}, T, KV, {dh}] with KV dividing {H}")
    if not triton_attention_fits(q, k, v):
        raise ValueError(f"attention: head_dim {dh} (a power of two in [16, 256]) and dtypes q {q.dtype}, "
                         f"k {k.dtype}, v {v.dtype} (all the same) are what the kernel takes")
    if slots is not None and (slots.dtype != torch.int64 or tuple(slots.shape) != (B,)):
        raise ValueError(f"attention: slots must be int64 [{B}], got {slots.dtype} {list(slots.shape)}")


@triton_op("muse_spark::attention_triton", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  slots: torch.Tensor | None = None) -> torch.Tensor:
    B, S = q.shape[:2]
    if mask.dtype != torch.bool or mask.dim() != 3 or tuple(mask.shape[:2]) != (B, S) or mask.shape[2] > k.shape[1]:
        raise ValueError(f"attention: mask must be bool [B, S, T] = [{B}, {S}, T ≤ {k.shape[1]}], got {mask.dtype} "
                         f"{list(mask.shape)}")
    _check_attention(q, k, v, slots)
    if not _runs_kernels(q):
        return attend_reference(q, *cache_rows(k, v, mask, slots), mask)
    return launch_attention(q, k, v, mask, slots, wrap=wrap_triton, interpret=interpreting(), pdl=_pdl(small=True))


def _check_bounds(op: str, last: torch.Tensor, B: int, S: int, window: int, length: int) -> None:
    """The bounds form of a mask (``plugins.attention.reference.KeyBounds``): last [B, S] int64 and a key window
    within the caches' ``length``."""
    if last.dtype != torch.int64 or tuple(last.shape) != (B, S):
        raise ValueError(f"{op}: last must be int64 [B, S] = [{B}, {S}], got {last.dtype} {list(last.shape)}")
    if not 0 <= window <= length:
        raise ValueError(f"{op}: the key window {window} must be in [0, {length}] (the cache's length)")


def _attend_bounds_reference(q, k, v, last, window, slots):
    """The bounds-form attention's reference: its dense mask, the rows of the caches, the fp32 einsums."""
    mask = KeyBounds(last, window).dense()
    return attend_reference(q, *cache_rows(k, v, mask, slots), mask)


@triton_op("muse_spark::attention_bounds_triton", mutates_args=())
def _attention_bounds_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor, window: int,
                         slots: torch.Tensor | None = None) -> torch.Tensor:
    """``attention_triton`` with the mask in bounds form (``plugins.attention.reference.KeyBounds``): key t <
    ``window`` is visible to query (b, s) iff t ≤ last[b, s]. The same attention as the dense mask,
    within rounding: on the H200 the bits differ at head_dim 128 (docs/log.md,
    2026-12-03); its own bits do not depend on batch, queries or window, as the dense form's."""
    _check_bounds("attention", last, *q.shape[:2], window, k.shape[1])
    _check_attention(q, k, v, slots)
    if not _runs_kernels(q):
        return _attend_bounds_reference(q, k, v, last, window, slots)
    return launch_attention(q, k, v, last, slots, wrap=wrap_triton, interpret=interpreting(), window=window,
                            pdl=_pdl(small=True))


def _check_heads(op: str, x: torch.Tensor) -> None:
    if not head_norm_rope_kernel.fits(x):
        raise ValueError(f"{op}: x {list(x.shape)} {x.dtype}: the kernel takes [B, S, heads, Dh] in bf16 or fp16 with "
                         "Dh a power of two in [2, 512]")


def _check_new_v(op: str, x: torch.Tensor, v: torch.Tensor, q_heads: bool) -> None:
    """v [B, S, KV, Dh] beside x's heads [B, S, NH, Dh], in x's dtype; ``q_heads``: x must also hold
    query heads (KV < NH), else KV ≤ NH."""
    B, S, NH, dh = x.shape
    kv = v.shape[2] if v.dim() == 4 else 0
    if (v.dim() != 4 or tuple(v.shape[:2]) != (B, S) or v.shape[3] != dh or v.dtype != x.dtype
            or not 0 < kv <= NH - int(q_heads)):
        raise ValueError(f"{op}: v must be {x.dtype} [{B}, {S}, KV {'<' if q_heads else '≤'} {NH}, {dh}], got "
                         f"{v.dtype} {list(v.shape)}")


@triton_op("muse_spark::head_norm_rope_triton", mutates_args=())
def _head_norm_rope_op(x: torch.Tensor, positions: torch.Tensor, eps: float, theta: float,
                       use_rope: bool) -> torch.Tensor:
    _check_heads("head_norm_rope", x)
    if positions.dtype != torch.int64 or tuple(positions.shape) != tuple(x.shape[:2]):
        raise ValueError(f"head_norm_rope: positions must be int64 {list(x.shape[:2])}, got {positions.dtype} "
                         f"{list(positions.shape)}")
    if not _runs_kernels(x):
        return head_norm_rope_reference(x, positions, eps, theta, use_rope)
    return head_norm_rope_kernel.launch_head_norm_rope(x, positions, eps, theta, use_rope, wrap=wrap_triton,
                                                      pdl=_pdl(small=True))


def _check_cache_write(op: str, B: int, S: int, kv: int, dh: int, dtype: torch.dtype, positions: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The contract of an op that writes K/V of ``kv`` heads of ``dh`` into the caches [N, T, kv, dh]
    (``dtype``, last dim contiguous) at rows ``slots`` [B] int64 and positions [B, S] int64."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[2:]) != (kv, dh) or c.dtype != dtype or c.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be {dtype} [N, T, {kv}, {dh}] with a contiguous last dim, got "
                             f"{c.dtype} {list(c.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} differ")
    if slots.dtype != torch.int64 or tuple(slots.shape) != (B,):
        raise ValueError(f"{op}: slots must be int64 [{B}], got {slots.dtype} {list(slots.shape)}")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (B, S):
        raise ValueError(f"{op}: positions must be int64 {[B, S]}, got {positions.dtype} {list(positions.shape)}")


@triton_op("muse_spark::head_norm_rope_cache_triton", mutates_args=("k_cache", "v_cache"))
def _head_norm_rope_cache_op(x: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, eps: float, theta: float,
                             use_rope: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slots: torch.Tensor, rope_cos: torch.Tensor | None = None,
                             rope_sin: torch.Tensor | None = None) -> torch.Tensor:
    """``head_norm_rope_triton`` of x [B, S, H + KV, Dh] (q and k heads) whose k heads, and v [B, S,
    KV, Dh], go straight into the caches [N, T, KV, Dh] at rows ``slots`` [B], positions
    ``positions`` [B, S] (the layers' ``k_cache[slots[:, None], positions] = k``): one kernel
    instead of the norm and two index_put kernels. → the normed q [B, S, H, Dh]. Its reference is
    ``plugins.head_norm_rope.reference.head_norm_rope_cache_reference``. ``rope_cos``/``rope_sin``: the step's RoPE
    table of ``positions`` ([B·S, Dh/2] fp32, ``linear_rope_table_triton``), read instead of
    computing the angles (the same bits)."""
    _check_heads("head_norm_rope", x)
    _check_new_v("head_norm_rope", x, v, q_heads=False)
    B, S, _, dh = x.shape
    _check_cache_write("head_norm_rope", B, S, v.shape[2], dh, x.dtype, positions, k_cache, v_cache, slots)
    table = _check_rope_table("head_norm_rope", rope_cos, rope_sin, B * S, dh, x.device)
    if not _runs_kernels(x):
        return head_norm_rope_cache_reference(x, v, positions, eps, theta, use_rope, k_cache, v_cache, slots)
    return head_norm_rope_kernel.launch_head_norm_rope_cache(x, v, positions, eps, theta, use_rope, k_cache, v_cache,
                                                            slots, wrap=wrap_triton, pdl=_pdl(small=True), table=table)


def _check_rope_table(op: str, cos, sin, rows: int, dh: int, device) -> tuple | None:
    """A RoPE table given to ``op``: both halves or neither, each [rows, dh/2] fp32 contiguous on
    ``device`` → (cos, sin) or None."""
    if cos is None and sin is None:
        return None
    want = (rows, dh // 2)
    for name, t in (("rope_cos", cos), ("rope_sin", sin)):
        if t is None or tuple(t.shape) != want or t.dtype != torch.float32 or not t.is_contiguous() \
                or t.device != device:
            got = "none" if t is None else f"{t.dtype} {list(t.shape)} on {t.device}"
            raise ValueError(f"{op}: {name} must be a contiguous float32 {list(want)} on {device} "
                             f"(the RoPE table of the B·S positions), got {got}")
    return cos, sin


def _check_linear(x: torch.Tensor, w: torch.Tensor) -> None:
    """What the skinny linear kernel takes (``plugins.linear.triton_kernel.fits``), or a clear error."""
    if not fits(x, w):
        raise ValueError(f"linear: x {list(x.shape)} {x.dtype} and weight {list(w.shape)} {w.dtype}: the kernel takes "
                         f"at most {MAX_ROWS} rows of x [..., K] and a contiguous weight [N, K], both bf16 or fp16")


@triton_op("muse_spark::linear_rope_table_triton", mutates_args=())
def _linear_rope_table_op(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, theta: float,
                          head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_triton(x, w)`` (the attention's qkv projection) and the RoPE table of ``positions``
    (one per row of x) from one more program of the same launch → (y, cos, sin), the table [rows,
    head_dim/2] fp32 as the norm kernels compute the angles in place (the same bits), for
    ``head_norm_rope_cache_triton(rope_cos=, rope_sin=)``. Its reference: ``F.linear`` and
    ``plugins.head_norm_rope.reference.rope_table_reference``."""
    _check_linear(x, w)
    rows = x.numel() // x.shape[-1]
    if positions.dtype != torch.int64 or positions.numel() != rows:
        raise ValueError(f"linear_rope_table: positions must be int64, one per row of x ({rows}), got "
                         f"{positions.dtype} {list(positions.shape)}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"linear_rope_table: head_dim {head_dim} must be a power of two")
    if not _runs_kernels(x):
        cos, sin = rope_table_reference(positions, theta, head_dim)
        return linear_reference(x, w), cos, sin
    return launch_linear_rope_table(x, w, positions, theta, head_dim, wrap=wrap_triton, interpret=interpreting(),
                                    pdl=_pdl())


@triton_op("muse_spark::attention_cache_triton", mutates_args=("k_cache", "v_cache"))
def _attention_cache_op(x: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, eps: float, theta: float,
                        use_rope: bool, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        last: torch.Tensor, window: int, rope_cos: torch.Tensor | None = None,
                        rope_sin: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's attention from its raw q and k heads x [B, S, H + KV, Dh] and v [B, S, KV, Dh]:
    ``head_norm_rope_cache_triton`` (q and k normed and rotated, k and v written into the caches
    [N, T, KV, Dh] at rows ``slots``, positions ``positions``), then ``attention_bounds_triton``
    of the normed q over the caches, in one launch of the attention's partial kernel (and its
    merge) → [B, S, H, Dh]. Its reference is those two references in that order.
    ``rope_cos``/``rope_sin``: the step's RoPE table, as ``head_norm_rope_cache_triton`` takes it."""
    _check_heads("attention_cache", x)
    _check_new_v("attention_cache", x, v, q_heads=True)
    B, S, NH, dh = x.shape
    kv = v.shape[2]
    _check_cache_write("attention_cache", B, S, kv, dh, x.dtype, positions, k_cache, v_cache, slots)
    _check_attention(x[:, :, : NH - kv], k_cache, v_cache, slots)  # (the q heads)
    _check_bounds("attention_cache", last, B, S, window, k_cache.shape[1])
    table = _check_rope_table("attention_cache", rope_cos, rope_sin, B * S, dh, x.device)
    if not _runs_kernels(x):
        q = head_norm_rope_cache_reference(x, v, positions, eps, theta, use_rope, k_cache, v_cache, slots)
        return _attend_bounds_reference(q, k_cache, v_cache, last, window, slots)
    return launch_attention(x, k_cache, v_cache, last, slots, wrap=wrap_triton, interpret=interpreting(),
                            window=window, new_kv=(v, positions, eps, theta, use_rope), pdl=_pdl(small=True), table=table)


@triton_op("muse_spark::linear_triton", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    _check_linear(x, w)
    if silu_mul and w.shape[0] % 2:
        raise ValueError(f"linear: silu_mul needs an even number of weight rows (gate | up), got {w.shape[0]}")
    if not _runs_kernels(x):
        return linear_reference(x, w, silu_mul)
    return launch_linear(x, w, silu_mul, wrap=wrap_triton, interpret=interpreting(), pdl=_pdl())


def attention(q, k, v, mask, slots=None):
    """``models.layers.attend``'s signature; runs ``muse_spark::attention_triton`` (a ``KeyBounds``
    mask: ``muse_spark::attention_bounds_triton``)."""
    if isinstance(mask, KeyBounds):
        return torch.ops.muse_spark.attention_bounds_triton(q, k, v, mask.last, mask.width, slots)
    return torch.ops.muse_spark.attention_triton(q, k, v, mask, slots)


def attention_cache(x, v, positions, eps, theta, use_rope, k_cache, v_cache, slots, bounds, rope_cos=None,
                    rope_sin=None):
    """``muse_spark::attention_cache_triton`` with the mask a ``KeyBounds`` (and the step's RoPE
    table, where the qkv projection wrote it)."""
    return torch.ops.muse_spark.attention_cache_triton(x, v, positions, eps, theta, use_rope, k_cache, v_cache, slots,
                                                       bounds.last, bounds.width, rope_cos, rope_sin)


def head_norm_rope(x, positions, eps, theta, use_rope):
    """``models.layers.head_norm_rope``'s signature; runs ``muse_spark::head_norm_rope_triton``."""
    return torch.ops.muse_spark.head_norm_rope_triton(x, positions, eps, theta, use_rope)


def gated_residual_add(stream, branch, gate, norm_weight, eps, zero_centered, apply_norm, out_dtype,
                       branch_norm_weight=None, norm_branch=False):
    """Same signature as ``gated_residual_add_ref``; runs ``muse_spark::gated_residual_add_triton``."""
    return torch.ops.muse_spark.gated_residual_add_triton(stream, branch, gate, norm_weight, eps, zero_centered,
                                                          apply_norm, out_dtype, branch_norm_weight, norm_branch)


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
