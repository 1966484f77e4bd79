"""torch.library registration of the attention's ops, on its split-KV kernel (``triton_kernel``):

* ``muse_spark::attention_triton`` — masked GQA attention over a static KV window, which
  ``models.layers.attend`` calls in bf16/fp16 on CUDA (the default; the kernel option
  ``attention="sdpa"`` selects SDPA instead). Its reference is ``reference.attend_reference``;
* ``muse_spark::attention_bounds_triton`` — the same kernel with the mask in bounds form
  (``reference.KeyBounds``: the models' masks), so no mask tensor is built or read;
* ``muse_spark::attention_cache_triton`` — ``head_norm_rope_cache_triton`` and the attention of its
  q over the caches in one launch of the attention's partial kernel (the default, off with the
  kernel option ``attention_cache`` false: the layers call it where both kernels fit and the mask is
  in bounds form).

``register_triton`` registers them; only ``plugins.triton_ops`` calls it, so importing this module
never imports Triton.
"""

from __future__ import annotations

import torch

from muse_spark.plugins.attention.reference import KeyBounds, attend_reference, cache_rows, triton_attention_fits
from muse_spark.plugins.head_norm_rope.op import _check_cache_write, _check_heads, _check_new_v, _check_rope_table
from muse_spark.plugins.head_norm_rope.reference import head_norm_rope_cache_reference


def _check_scales(k: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """An FP8 cache (float8_e4m3fn k/v) is read with its scales, float32 [KV] each; a cache of the compute dtype
    without any → the (k_scale, v_scale) pair, or None."""
    if k.dtype != torch.float8_e4m3fn:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"attention: KV scales are for an FP8 (float8_e4m3fn) cache, and k/v are {k.dtype}")
        return None
    kv = k.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.dtype != torch.float32 or tuple(s.shape) != (kv,) or s.device != k.device:
            shown = None if s is None else f"{s.dtype} {list(s.shape)} on {s.device}"
            raise ValueError(f"attention: an FP8 cache is read with {name} float32 [{kv}] on {k.device}, got {shown}")
    return k_scale, v_scale


def _check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None) -> None:
    B, S, H, dh = q.shape
    per_request = slots is None  # k/v [B, T, KV, Dh]; else whole caches (or pools of blocks), any number of rows
    if k.dim() != 4 or k.shape != v.shape or (per_request and k.shape[0] != B) or k.shape[3] != dh or H % k.shape[2]:
        raise ValueError(f"attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: expected k and v "
                         f"[{'B' if per_request else 'N'}, T, KV, {dh}] with KV dividing {H}")
    if not triton_attention_fits(q, k, v):
        raise ValueError(f"attention: head_dim {dh} (a power of two in [16, 256]) and dtypes q {q.dtype}, "
                         f"k {k.dtype}, v {v.dtype} (all the same, or k/v an FP8 cache's float8_e4m3fn) are what "
                         "the kernel takes")
    if slots is not None and (slots.dtype != torch.int64 or slots.dim() not in (1, 2) or slots.shape[0] != B):
        raise ValueError(f"attention: slots must be int64 [{B}] (cache rows) or [{B}, n] (block tables), got "
                         f"{slots.dtype} {list(slots.shape)}")


def _keys_held(k: torch.Tensor, slots: torch.Tensor | None) -> int:
    """The positions a request's keys may take: the caches' length, or its block table's blocks × P."""
    return k.shape[1] * (slots.shape[1] if slots is not None and slots.dim() == 2 else 1)


def _check_bounds(op: str, last: torch.Tensor, B: int, S: int, window: int, length: int) -> None:
    """The bounds form of a mask (``plugins.attention.reference.KeyBounds``): last [B, S] int64 and a key window
    within the caches' ``length``."""
    if last.dtype != torch.int64 or tuple(last.shape) != (B, S):
        raise ValueError(f"{op}: last must be int64 [B, S] = [{B}, {S}], got {last.dtype} {list(last.shape)}")
    if not 0 <= window <= length:
        raise ValueError(f"{op}: the key window {window} must be in [0, {length}] (the cache's length)")


def _attend_bounds_reference(q, k, v, last, window, slots, scales=None):
    """The bounds-form attention's reference: its dense mask, the rows of the caches (dequantized with an FP8
    cache's ``scales``), the fp32 einsums."""
    mask = KeyBounds(last, window).dense()
    return attend_reference(q, *cache_rows(k, v, mask, slots, scales, q.dtype), mask)


def register_triton(runs_kernels, launch) -> None:
    """Registers ``muse_spark::attention_triton``, ``muse_spark::attention_bounds_triton`` and
    ``muse_spark::attention_cache_triton``: the kernel (``launch(q, k, v, mask or last, slots, **kw)``,
    ``plugins.triton_ops``) where ``runs_kernels(q)``, else their references."""
    from torch.library import triton_op

    @triton_op("muse_spark::attention_triton", mutates_args=())
    def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      slots: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Masked GQA attention (``attend_reference``). ``k_scale``/``v_scale`` [KV] float32: k/v are an FP8
        cache's E4M3 codes, each tile dequantized as it is loaded (``reference.dequantize_kv``)."""
        B, S = q.shape[:2]
        if slots is not None and slots.dim() == 2:
            raise ValueError("attention: block tables take the mask in bounds form (attention_bounds_triton)")
        if mask.dtype != torch.bool or mask.dim() != 3 or tuple(mask.shape[:2]) != (B, S) \
                or mask.shape[2] > k.shape[1]:
            raise ValueError(f"attention: mask must be bool [B, S, T] = [{B}, {S}, T ≤ {k.shape[1]}], got "
                             f"{mask.dtype} {list(mask.shape)}")
        _check_attention(q, k, v, slots)
        scales = _check_scales(k, k_scale, v_scale)
        if not runs_kernels(q):
            return attend_reference(q, *cache_rows(k, v, mask, slots, scales, q.dtype), mask)
        return launch(q, k, v, mask, slots, scales=scales)

    @triton_op("muse_spark::attention_bounds_triton", mutates_args=())
    def _attention_bounds_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor, window: int,
                             slots: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_triton`` with the mask in bounds form (``plugins.attention.reference.KeyBounds``): key
        t < ``window`` is visible to query (b, s) iff t ≤ last[b, s]. The same attention as the dense
        mask, within rounding: on the H200 the bits differ at head_dim 128 (docs/log.md,
        2026-12-03); its own bits do not depend on batch, queries or window, as the dense form's."""
        _check_attention(q, k, v, slots)
        _check_bounds("attention", last, *q.shape[:2], window, _keys_held(k, slots))
        scales = _check_scales(k, k_scale, v_scale)
        if not runs_kernels(q):
            return _attend_bounds_reference(q, k, v, last, window, slots, scales)
        return launch(q, k, v, last, slots, window=window, scales=scales)

    @triton_op("muse_spark::attention_cache_triton", mutates_args=("k_cache", "v_cache"))
    def _attention_cache_op(x: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, eps: float, theta: float,
                            use_rope: bool, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            last: torch.Tensor, window: int, rope_cos: torch.Tensor | None = None,
                            rope_sin: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """A layer's attention from its raw q and k heads x [B, S, H + KV, Dh] and v [B, S, KV, Dh]:
        ``head_norm_rope_cache_triton`` (q and k normed and rotated, k and v written into the caches
        [N, T, KV, Dh] at rows ``slots``, positions ``positions``), then ``attention_bounds_triton``
        of the normed q over the caches, in one launch of the attention's partial kernel (and its
        merge) → [B, S, H, Dh]. Its reference is those two references in that order.
        ``rope_cos``/``rope_sin``: the step's RoPE table, as ``head_norm_rope_cache_triton`` takes it.
        ``k_scale``/``v_scale`` float32 [KV]: the caches are an FP8 cache's, written quantized and read
        dequantized."""
        _check_heads("attention_cache", x)
        _check_new_v("attention_cache", x, v, q_heads=True)
        B, S, NH, dh = x.shape
        kv = v.shape[2]
        scales = _check_cache_write("attention_cache", B, S, kv, dh, x.dtype, positions, k_cache, v_cache, slots,
                                    k_scale, v_scale)
        _check_attention(x[:, :, : NH - kv], k_cache, v_cache, slots)  # (the q heads)
        _check_bounds("attention_cache", last, B, S, window, _keys_held(k_cache, slots))
        table = _check_rope_table("attention_cache", rope_cos, rope_sin, B * S, dh, x.device)
        if not runs_kernels(x):
            q = head_norm_rope_cache_reference(x, v, positions, eps, theta, use_rope, k_cache, v_cache, slots,
                                               scales)
            return _attend_bounds_reference(q, k_cache, v_cache, last, window, slots, scales)
        return launch(x, k_cache, v_cache, last, slots, window=window, new_kv=(v, positions, eps, theta, use_rope),
                      table=table, scales=scales)
