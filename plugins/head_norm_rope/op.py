"""torch.library registration of the attention's per-head q/k RMS norm and RoPE, on its kernel
(``triton_kernel``):

* ``muse_spark::head_norm_rope_triton`` — the norm and RoPE in one pass, which
  ``models.layers.head_norm_rope`` calls in bf16/fp16 on CUDA. Its reference is
  ``reference.head_norm_rope_reference``;
* ``muse_spark::head_norm_rope_cache_triton`` — the same, also writing the k heads and v into the
  KV caches (the layer's cache write, in the same kernel). Its reference is
  ``reference.head_norm_rope_cache_reference``.

The input checks of the ops that write the caches are here too (``plugins.attention.op`` uses
them). ``register_triton`` registers the ops; only ``plugins.triton_ops`` calls it, so importing this
module never imports Triton.
"""

from __future__ import annotations

import torch

from muse_spark.plugins.head_norm_rope.reference import head_norm_rope_cache_reference, head_norm_rope_reference


def _check_heads(op: str, x: torch.Tensor) -> None:
    from muse_spark.plugins.head_norm_rope.triton_kernel import fits

    if not fits(x):
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


def _check_cache_write(op: str, B: int, S: int, kv: int, dh: int, dtype: torch.dtype, positions: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
    """The contract of an op that writes K/V of ``kv`` heads of ``dh`` into the caches [N, T, kv, dh]
    (``dtype``, last dim contiguous; an FP8 cache's float8_e4m3fn with its scales ``k_scale``/``v_scale``,
    float32 [kv]) at rows ``slots`` [B] int64 (or through block tables [B, n] into pools of blocks
    [blocks, P, kv, dh]) and positions [B, S] int64 → the scales' pair, or None."""
    scales = None
    if k_scale is not None or v_scale is not None or k_cache.dtype == torch.float8_e4m3fn:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is None or t.dtype != torch.float32 or tuple(t.shape) != (kv,) or t.device != k_cache.device:
                shown = None if t is None else f"{t.dtype} {list(t.shape)} on {t.device}"
                raise ValueError(f"{op}: an FP8 cache is written with {name} float32 [{kv}] on {k_cache.device}, "
                                 f"got {shown}")
        scales, dtype = (k_scale, v_scale), torch.float8_e4m3fn
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[2:]) != (kv, dh) or c.dtype != dtype or c.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be {dtype} [N, T, {kv}, {dh}] with a contiguous last dim, got "
                             f"{c.dtype} {list(c.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} differ")
    if slots.dtype != torch.int64 or slots.dim() not in (1, 2) or slots.shape[0] != B:
        raise ValueError(f"{op}: slots must be int64 [{B}] (cache rows) or [{B}, n] (block tables), got "
                         f"{slots.dtype} {list(slots.shape)}")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (B, S):
        raise ValueError(f"{op}: positions must be int64 {[B, S]}, got {positions.dtype} {list(positions.shape)}")
    return scales


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


def register_triton(runs_kernels, launch_head_norm_rope, launch_head_norm_rope_cache) -> None:
    """Registers ``muse_spark::head_norm_rope_triton`` and ``muse_spark::head_norm_rope_cache_triton``:
    their kernel launches (``plugins.triton_ops``) where ``runs_kernels(x)``, else their references."""
    from torch.library import triton_op

    @triton_op("muse_spark::head_norm_rope_triton", mutates_args=())
    def _head_norm_rope_op(x: torch.Tensor, positions: torch.Tensor, eps: float, theta: float,
                           use_rope: bool) -> torch.Tensor:
        _check_heads("head_norm_rope", x)
        if positions.dtype != torch.int64 or tuple(positions.shape) != tuple(x.shape[:2]):
            raise ValueError(f"head_norm_rope: positions must be int64 {list(x.shape[:2])}, got {positions.dtype} "
                             f"{list(positions.shape)}")
        if not runs_kernels(x):
            return head_norm_rope_reference(x, positions, eps, theta, use_rope)
        return launch_head_norm_rope(x, positions, eps, theta, use_rope)

    @triton_op("muse_spark::head_norm_rope_cache_triton", mutates_args=("k_cache", "v_cache"))
    def _head_norm_rope_cache_op(x: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, eps: float,
                                 theta: float, use_rope: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor, rope_cos: torch.Tensor | None = None,
                                 rope_sin: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``head_norm_rope_triton`` of x [B, S, H + KV, Dh] (q and k heads) whose k heads, and v [B, S,
        KV, Dh], go straight into the caches [N, T, KV, Dh] at rows ``slots`` [B], positions
        ``positions`` [B, S] (the layers' ``k_cache[slots[:, None], positions] = k``): one kernel
        instead of the norm and two index_put kernels. → the normed q [B, S, H, Dh]. Its reference is
        ``plugins.head_norm_rope.reference.head_norm_rope_cache_reference``. ``rope_cos``/``rope_sin``: the
        step's RoPE table of ``positions`` ([B·S, Dh/2] fp32, ``linear_rope_table_triton``), read
        instead of computing the angles (the same bits). ``k_scale``/``v_scale`` float32 [KV]: the caches are
        an FP8 cache's (float8_e4m3fn), the keys and values written quantized (``reference.quantize_kv``)."""
        _check_heads("head_norm_rope", x)
        _check_new_v("head_norm_rope", x, v, q_heads=False)
        B, S, _, dh = x.shape
        scales = _check_cache_write("head_norm_rope", B, S, v.shape[2], dh, x.dtype, positions, k_cache, v_cache,
                                    slots, k_scale, v_scale)
        table = _check_rope_table("head_norm_rope", rope_cos, rope_sin, B * S, dh, x.device)
        if not runs_kernels(x):
            return head_norm_rope_cache_reference(x, v, positions, eps, theta, use_rope, k_cache, v_cache, slots,
                                                  scales)
        return launch_head_norm_rope_cache(x, v, positions, eps, theta, use_rope, k_cache, v_cache, slots,
                                           table=table, scales=scales)
