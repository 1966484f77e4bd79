"""The attention's spec: masked GQA attention in fp32 (``attend_reference``), the key sets it reads
(``KeyBounds``, a boolean mask, or whole slot-indexed caches through ``CacheKV``) and what the Triton
kernel takes (``triton_attention_fits``). The Triton kernel (``triton_kernel``) must match it."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch


class KeyBounds(NamedTuple):
    """Which keys each query sees, without a [B, S, T] mask tensor: key t (of the first ``width``) is
    visible to query (b, s) iff t ≤ ``last[b, s]``. Every mask the models build has this form (a
    query sees the keys up to its own position, or up to the draft block's end), so the Triton
    attention kernel takes it as is (no mask kernel, no mask reads); the other paths expand it
    (``dense``)."""

    last: torch.Tensor  # [B, S] int64
    width: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.last.shape, self.width)

    def dense(self) -> torch.Tensor:
        """The boolean mask [B, S, width]."""
        return torch.arange(self.width, device=self.last.device)[None, None, :] <= self.last[:, :, None]


Mask = "torch.Tensor | KeyBounds"


# (k_new [B,S,KV,Dh], v_new) -> (keys, values, mask, slots): the mask [B,S,T] bool or KeyBounds;
# keys/values [B,T,KV,Dh] with slots None, or whole caches [N,≥T,KV,Dh] of which request b reads
# row slots[b] ([B] int64)
KVProvider = Callable[[torch.Tensor, torch.Tensor],
                      tuple[torch.Tensor, torch.Tensor, Mask, "torch.Tensor | None"]]


FP8_MAX = 448.0  # E4M3's largest finite value
KVScales = "tuple[torch.Tensor, torch.Tensor] | None"  # (k_scale, v_scale) [KV] float32 of an FP8 cache


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K or V [..., KV, Dh] → the FP8 cache's E4M3 codes: ``x / scale`` per KV head in float32 (``scale`` [KV]),
    saturated to ±448 and rounded to nearest even (the write every path of an FP8 cache makes)."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 codes [..., KV, Dh] → ``codes · scale`` in float32, rounded once to ``dtype`` (the compute dtype):
    the keys and values an FP8 cache holds, as the attention reads them."""
    return (codes.float() * scale[:, None]).to(dtype)


def cache_write(cache: torch.Tensor, at: tuple, x: torch.Tensor, scale: "torch.Tensor | None") -> None:
    """``cache[at] = x``, quantized where the cache is FP8 (``scale``: its [KV] scales)."""
    if cache.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError("an FP8 KV cache is written with its scales (k_scale/v_scale), and none were given")
        x = quantize_kv(x, scale)
    cache[at] = x


class CacheKV(NamedTuple):
    """The ``KVProvider`` of a layer over slot-indexed KV caches: ``kv(k, v)`` writes the new K/V at
    ``positions`` of rows ``slots`` (``k_cache[slots[:, None], positions] = k``) and lets attention
    read those rows in place over the keys ``mask`` shows. ``Attention`` may instead have the
    q/k norm kernel write them (``muse_spark::head_norm_rope_cache_triton``), which it can because
    the caches, rows and positions are named here."""

    k_cache: torch.Tensor  # [N, T, KV, Dh]
    v_cache: torch.Tensor
    slots: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B, S] int64
    mask: Mask  # None where the provider only writes (the references)
    scales: KVScales = None  # an FP8 cache's (k_scale, v_scale): the writes quantize, the attention dequantizes

    @staticmethod
    def at(kv: "KVProvider", positions: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether ``kv`` is a ``CacheKV`` (or a ``PagedKV``: its ``slots`` are block tables) at
        ``positions`` (the layer's own) with caches of ``dtype`` (or an FP8 cache with its scales): then a
        kernel may write the layer's K/V into them itself."""
        return isinstance(kv, (CacheKV, PagedKV)) and kv.positions is positions and (
            kv.k_cache.dtype == dtype or (kv.k_cache.dtype == torch.float8_e4m3fn and kv.scales is not None))

    def __call__(self, k_new: torch.Tensor, v_new: torch.Tensor):
        at = (self.slots[:, None], self.positions)
        ks, vs = self.scales or (None, None)
        cache_write(self.k_cache, at, k_new, ks)
        cache_write(self.v_cache, at, v_new, vs)
        return self.attended()

    def attended(self):
        """What the attention reads once the layer's K/V are in the caches: (keys, values, mask, slots)."""
        return self.k_cache, self.v_cache, self.mask, self.slots


class PagedKV(NamedTuple):
    """The ``KVProvider`` of a layer over paged KV caches: pools of fixed-size blocks
    ``[blocks, P, KV, Dh]`` and each request's block table (``table[b, j]``: the block holding its
    positions ``j·P … j·P + P − 1``). ``kv(k, v)`` writes the new K/V at ``positions`` through the
    tables, and attention reads each request's first ``T`` positions (``mask``'s width) gathered from
    its blocks. A table entry past a request's own blocks names block 0, which no request owns: what
    lands there (a padded prefill's positions past its prompt) is never visible to a query."""

    k_cache: torch.Tensor  # [blocks, P, KV, Dh]
    v_cache: torch.Tensor
    table: torch.Tensor  # [B, blocks per request] int64
    positions: torch.Tensor  # [B, S] int64
    mask: Mask  # None where the provider only writes
    scales: KVScales = None  # as CacheKV's

    def __call__(self, k_new: torch.Tensor, v_new: torch.Tensor):
        P = self.k_cache.shape[1]
        blocks = self.table.gather(1, torch.div(self.positions, P, rounding_mode="floor"))
        at = (blocks, self.positions % P)
        ks, vs = self.scales or (None, None)
        cache_write(self.k_cache, at, k_new, ks)
        cache_write(self.v_cache, at, v_new, vs)
        return self.attended()

    @property
    def slots(self) -> torch.Tensor:
        """The tables, where the kernels take the caches' rows (a [B, n] tensor is block tables to them)."""
        return self.table

    def attended(self):
        """(the pools, the pools, mask, the tables): attention reads each request's first T positions (the
        mask's width) through its table (the Triton kernel in place; the other paths gather them)."""
        return self.k_cache, self.v_cache, self.mask, self.table


def cache_rows(k: torch.Tensor, v: torch.Tensor, mask: Mask, slots: torch.Tensor | None,
               scales: KVScales = None, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``attend`` reads, [B, T, KV, Dh] each (T = mask's last dim): rows
    ``slots`` of whole caches (a gathered copy), the blocks of block tables ``slots`` [B, n] of pools
    [blocks, P, KV, Dh], or the first T positions of per-request k/v. ``scales`` (an FP8 cache's): the
    rows dequantized to ``dtype`` (``dequantize_kv``)."""
    T = mask.shape[-1]
    if slots is None:
        k, v = k[:, :T], v[:, :T]
    elif slots.dim() == 2:  # block tables into pools of blocks (``PagedKV``)
        ids = slots[:, : -(-T // k.shape[1])]
        k, v = k[ids].flatten(1, 2)[:, :T], v[ids].flatten(1, 2)[:, :T]
    else:
        k, v = k[slots, :T], v[slots, :T]
    if scales is not None:
        k, v = dequantize_kv(k, scales[0], dtype), dequantize_kv(v, scales[1], dtype)
    return k, v


def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``attend`` in fp32 einsums: the spec every attention kernel is tested against."""
    B, S, H, dh = q.shape
    kv = k.shape[2]
    rep = H // kv
    qf = q.float().view(B, S, kv, rep, dh)
    scores = torch.einsum("bskrd,btkd->bkrst", qf, k.float()) * (1.0 / math.sqrt(dh))
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A query with no visible key (cannot happen for valid inputs) yields zeros, not NaN.
    probs = torch.nan_to_num(probs, nan=0.0)
    # Masked keys get weight 0, but 0·NaN is NaN: zero the values no query may read,
    # so stale garbage in a reused cache slot can never leak into a request.
    key_visible = mask.any(1)[:, :, None, None]  # [B, T, 1, 1]
    vf = torch.where(key_visible, v.float(), 0.0)
    out = torch.einsum("bkrst,btkd->bskrd", probs, vf)
    return out.reshape(B, S, H, dh).to(q.dtype)


def triton_attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """What the Triton attention kernel takes: head_dim a power of two in [16, 256], k/v in q's dtype (or an
    FP8 cache's float8_e4m3fn, read with its scales), KV heads dividing the query heads."""
    dh = q.shape[-1]
    return (16 <= dh <= 256 and dh & (dh - 1) == 0 and k.dtype == v.dtype
            and k.dtype in (q.dtype, torch.float8_e4m3fn) and q.shape[2] % k.shape[2] == 0)
