"""The Muse Spark 1.x dense target (``MuseSpark1xForCausalLM``) in plain PyTorch.

One ``forward`` serves prefill (a chunk of prompt tokens) and multi-token
verification (``[a, t_1 … t_γ]``): tokens at explicit positions are written
into a slot-indexed KV cache and attend to every cached key at a position
≤ their own. It returns the final normed hidden states and the auxiliary
hidden states (the FP32 stream after each of ``aux_layer_ids``) that feed the
draft's context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from muse_spark.config import MuseSpark1xConfig
from muse_spark.models.layers import DecoderLayer, all_gather_last, linear, make_norm
from muse_spark.plugins.acceptance.reference import output_transform
from muse_spark.plugins.attention.reference import CacheKV, KeyBounds, PagedKV


@dataclass
class KVCache:
    """Per-layer K/V, allocated once: [slots, max_seq, KV, Dh] each, or (``paged``) pools of blocks
    [blocks, P, KV, Dh] that requests address through block tables (``runtime/kv_blocks.py``)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    window: int | None = None  # paged: the positions a request may have (its table's blocks × P)

    @classmethod
    def allocate(cls, layers: int, slots: int, max_seq: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        shape = (slots, max_seq, kv_heads, head_dim)
        return cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
        )

    @classmethod
    def allocate_paged(cls, layers: int, blocks: int, block_size: int, max_seq: int, kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        paged = cls.allocate(layers, blocks, block_size, kv_heads, head_dim, dtype, device)
        paged.window = max_seq
        return paged

    @property
    def paged(self) -> bool:
        return self.window is not None

    @property
    def max_seq(self) -> int:
        return self.window if self.window is not None else self.k[0].shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class MuseSpark1xModel(nn.Module):
    def __init__(self, cfg: MuseSpark1xConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg)


class LayerStackLM(nn.Module):
    """What the target and the draft share: a stack of ``DecoderLayer`` at
    ``self.model.layers`` and a KV cache shaped by ``self.cfg``."""

    cfg: MuseSpark1xConfig
    dtype: torch.dtype

    def after_load(self) -> None:
        for layer in self.model.layers:
            layer.materialize_residual_constants()

    def allocate_cache(self, slots: int, max_seq: int, device=None) -> KVCache:
        c = self.cfg
        device = device or next(self.parameters()).device
        return KVCache.allocate(c.num_hidden_layers, slots, max_seq, c.num_key_value_heads, c.head_dim,
                                c.cache_dtype(self.dtype), device)

    def allocate_paged_cache(self, blocks: int, block_size: int, max_seq: int, device=None) -> KVCache:
        c = self.cfg
        device = device or next(self.parameters()).device
        return KVCache.allocate_paged(c.num_hidden_layers, blocks, block_size, max_seq, c.num_key_value_heads,
                                      c.head_dim, c.cache_dtype(self.dtype), device)

    @staticmethod
    def key_mask(positions: torch.Tensor, kv_len: int) -> KeyBounds:
        """[B, S, kv_len] in bounds form: key j is visible to a query iff j ≤ ``positions`` (the
        query's position, or the last key it may see). Nothing is computed: the attention kernel
        reads the bounds (``plugins.attention.reference.KeyBounds``)."""
        return KeyBounds(positions, kv_len)

    @staticmethod
    def cache_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 mask: KeyBounds | None, scales=None) -> CacheKV | PagedKV:
        """The layer's ``kv``: write the new K/V at ``positions`` of rows ``slots`` of the caches, and
        let attention read those rows in place over the keys ``mask`` shows (``layers.CacheKV``).
        ``slots`` [B, n] instead of [B]: the requests' block tables into paged caches (``PagedKV``).
        ``scales``: an FP8 cache's (k_scale, v_scale) (``Attention.kv_scales``)."""
        if slots.dim() == 2:
            return PagedKV(k_cache, v_cache, slots, positions, mask, scales)
        return CacheKV(k_cache, v_cache, slots, positions, mask, scales)

    def next_norm(self, i: int) -> nn.Module:
        """The norm that reads layer ``i``'s output: layer ``i + 1``'s input norm, or the final norm."""
        layers = self.model.layers
        return layers[i + 1].self_attn.pre_qkv_proj_norm if i + 1 < len(layers) else self.model.norm


class MuseSpark1xForCausalLM(LayerStackLM):
    def __init__(self, cfg: MuseSpark1xConfig, aux_layer_ids: tuple[int, ...] = ()):
        super().__init__()
        self.cfg = cfg
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.model = MuseSpark1xModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Tensor parallelism with the lm_head split by vocabulary rows (``muse_spark.sharding.vocab_split``): the
        # ranks' group, over which ``raw_logits`` gathers each rank's slice of the logits
        self.vocab_group = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        tokens: torch.Tensor,  # [B, S] int64
        positions: torch.Tensor,  # [B, S] int64
        slots: torch.Tensor,  # [B] int64 cache rows
        cache: KVCache,
        kv_len: int,  # keys [0, kv_len) are read; must exceed every position
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (h = norm(stream) [B, S, D] compute dtype, aux [B, S, D·len(aux_layer_ids)] fp32)."""
        stream = self.embed_stream(tokens)
        x = self.model.layers[0].input_norm(stream, self.dtype)
        mask = self.key_mask(positions, kv_len)
        aux = []
        for i in range(len(self.model.layers)):
            stream, x = self.layer_forward(i, stream, x, positions, slots, cache.k[i], cache.v[i], kv_len, mask)
            if i in self.aux_layer_ids:
                aux.append(stream)
        return x, self.cat_aux(aux, stream)  # the last layer's x is the final norm's output

    # The pieces of ``forward`` (the aoti engine compiles them separately: one layer package serves
    # every layer, since the layers share one structure and their weights are graph inputs).
    def embed_stream(self, tokens: torch.Tensor) -> torch.Tensor:
        """The FP32 residual stream entering layer 0."""
        return self.model.embed_tokens(tokens).to(torch.float32)

    def layer_forward(self, i: int, stream, x, positions, slots, k_cache, v_cache, kv_len: int,
                      mask: KeyBounds | None = None,
                      next_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``: write its K/V for ``positions`` into rows ``slots`` of its caches, attend over
        keys ``[0, kv_len)`` visible to each query (``key_mask``), → (the new stream, its
        ``next_norm`` in the compute dtype: by default ``self.next_norm(i)``). ``x``: the layer's
        normed input (the previous layer's second result; None: computed from the stream)."""
        if mask is None:
            mask = self.key_mask(positions, kv_len)
        layer = self.model.layers[i]
        kv = self.cache_kv(k_cache, v_cache, slots, positions, mask,  # keys [0, kv_len): the mask's width
                           layer.self_attn.kv_scales())
        return layer(stream, positions, kv, x, self.next_norm(i) if next_norm is None else next_norm)

    @staticmethod
    def cat_aux(aux: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """The aux streams side by side, [B, S, D·len(aux)] fp32 (``like``: a [B, S, …] tensor for
        the empty case)."""
        return torch.cat(aux, -1) if aux else like.new_zeros(like.shape[:2] + (0,), dtype=torch.float32)

    def raw_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's output before ``output_transform`` (the compute dtype); with ``vocab_group``, this rank's
        vocabulary slice gathered from every rank in rank order (each logit the same dot product; the padding
        rows of an uneven split dropped)."""
        z = linear(h, self.lm_head_weight())
        if self.vocab_group is None:
            return z
        return all_gather_last(z, self.vocab_group)[..., : self.cfg.vocab_size]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Transformed fp32 logits over the target vocabulary."""
        return output_transform(self.raw_logits(h), self.cfg.output_multiplier, self.cfg.output_soft_cap_temp)
