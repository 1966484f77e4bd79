"""The DSpark draft (``MuseSparkDSparkForCausalLM``) in plain PyTorch (docs/design.md).

* ``store_context``: vLLM's ``precompute_and_store_context_kv``: target
  aux hidden states → ``hidden_norm(fc(·))`` → per-layer
  ``pre_qkv_proj_norm`` → the k/v rows of the stacked projection; K gets the
  weightless per-head norm and RoPE at its own position. Only these context
  K/V persist across steps.
* ``block``: the γ-slot block ``[a, mask, …]`` at positions ``p … p+γ−1``,
  attending to cached context at positions ``< p`` and to the block (causally
  when ``causal``; the block's K/V are written into the cache at its positions,
  which ``store_context`` overwrites after verification); returns ``h_k`` and the
  transformed base logits ``U_k``.
* ``propose``: block → Markov loop (``torch.ops.muse_spark.markov_sample``).
"""

from __future__ import annotations

import torch
from torch import nn

from muse_spark.config import MuseSparkDSparkConfig
from muse_spark.models.layers import DecoderLayer, linear, make_norm
from muse_spark.plugins.acceptance.reference import output_transform
from muse_spark.models.target import KVCache, LayerStackLM
from muse_spark.plugins import dispatch


class _Proj(nn.Module):
    """A bare weight (+ optional bias) so state-dict names match the checkpoint."""

    def __init__(self, out_f: int, in_f: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_f, in_f))
        self.bias = nn.Parameter(torch.empty(out_f)) if bias else None


class MarkovHead(nn.Module):
    def __init__(self, cfg: MuseSparkDSparkConfig):
        super().__init__()
        r, d = cfg.markov_rank, cfg.hidden_size
        self.head_type = cfg.markov_head_type
        self.markov_w1 = _Proj(cfg.vocab_size, r)
        self.markov_w2 = _Proj(cfg.draft_vocab_size, r)
        self.gate_proj = _Proj(r, d + r, bias=True) if cfg.markov_head_type == "gated" and r else None
        self.joint_proj = _Proj(3 * r, 2 * r + d, bias=True) if cfg.markov_head_type == "rnn" and r else None

    def head_params(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        p = self.gate_proj or self.joint_proj
        return (p.weight, p.bias) if p is not None else (None, None)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = _Proj(1, width, bias=True)


class DSparkModel(nn.Module):
    def __init__(self, cfg: MuseSparkDSparkConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.target_hidden_size * len(cfg.target_layer_ids), cfg.hidden_size, bias=False)
        self.hidden_norm = make_norm(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg)
        self.markov_head = MarkovHead(cfg)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            width = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width)


class MuseSparkDSparkForCausalLM(LayerStackLM):
    def __init__(self, cfg: MuseSparkDSparkConfig):
        super().__init__()
        self.cfg = cfg
        self.model = DSparkModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("draft_id_to_target_id", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        # The target's embed_tokens (shared, not owned): set by ``bind_target_embeddings``.
        self.embed_weight: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft_id_to_target_id

    def bind_target_embeddings(self, embed_weight: torch.Tensor) -> None:
        if embed_weight.shape != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(
                f"draft: expected target embed_tokens of shape [{self.cfg.vocab_size}, {self.cfg.hidden_size}], "
                f"got {list(embed_weight.shape)}"
            )
        self.embed_weight = embed_weight.detach()  # shared storage; a plain tensor is not registered

    # ---- context K/V ------------------------------------------------------------------
    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """aux [B, S, Dt·L] fp32, positions [B, S] → per-layer K, V [B, S, KV, Dh] (K normed + roped)."""
        c = self.cfg
        dt = self.dtype
        fc_out = linear(aux.to(self.model.fc.weight.dtype), self.model.fc.weight)
        h = self.model.hidden_norm(fc_out, dt)
        ks, vs = [], []
        B, S, _ = aux.shape
        for layer in self.model.layers:
            attn = layer.self_attn
            ctx = attn.pre_qkv_proj_norm(h, dt)
            kv = linear(ctx, attn.kv_weight())  # contiguous rows of the qkv weight: the skinny kernel where it fits
            k = kv[..., : c.kv_size].reshape(B, S, c.num_key_value_heads, c.head_dim)
            v = kv[..., c.kv_size :].reshape(B, S, c.num_key_value_heads, c.head_dim)
            ks.append(attn.normalize_heads(k, positions))
            vs.append(v)
        return ks, vs

    def store_context(self, aux: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache) -> None:
        ks, vs = self.context_kv(aux, positions)
        for i in range(len(ks)):
            self.cache_kv(cache.k[i], cache.v[i], slots, positions, None)(ks[i], vs[i])

    # ---- block ------------------------------------------------------------------------
    def block(
        self,
        anchor: torch.Tensor,  # [B] int64 target id
        anchor_pos: torch.Tensor,  # [B] int64 p
        slots: torch.Tensor,  # [B]
        cache: KVCache,
        ctx_len: int,  # context keys [0, ctx_len) are read; ≥ max(p)
        positions: torch.Tensor | None = None,  # [B, ≥γ] int64 p, p+1, …: given, or made here
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (h [B, γ, D] compute dtype, U [B, γ, Vd] fp32 transformed base logits).

        The block's K/V are written into the draft cache at the block's positions ``p … p+γ−1``
        (which ``store_context`` overwrites with the verified tokens' context before any later
        block can read them), and each layer attends in place over the key window
        ``[0, min(ctx_len + γ, max_seq))``: the context below ``p`` and the block (causally when
        ``causal``). No gathered copy of the window, as the target's layers."""
        c = self.cfg
        gamma = c.block_size
        B = anchor.shape[0]
        dev = anchor.device
        if self.embed_weight is None:
            raise RuntimeError("draft: bind_target_embeddings() was not called")
        tokens = torch.full((B, gamma), c.mask_token_id, dtype=torch.int64, device=dev)
        tokens[:, 0] = anchor
        if positions is None:
            positions = anchor_pos[:, None] + torch.arange(gamma, device=dev)  # [B, γ]
        else:  # (a compiled step passes the target's [B, γ+1] in: one tensor, not one copy per kernel)
            positions = positions[:, :gamma]
        stream = torch.nn.functional.embedding(tokens, self.embed_weight).to(torch.float32)
        # a query at p+s sees the context (< p) and the block up to itself (causal) or all of it
        last_seen = positions if c.causal else (anchor_pos + gamma - 1)[:, None].expand(B, gamma)
        mask = self.key_mask(last_seen, min(ctx_len + gamma, cache.max_seq))  # [B, γ, window]
        x = self.model.layers[0].input_norm(stream, self.dtype)
        for i, layer in enumerate(self.model.layers):
            kv = self.cache_kv(cache.k[i], cache.v[i], slots, positions, mask)
            # the next layer's input norm (the last layer: the final norm) fused into this one's residual
            stream, x = layer(stream, positions, kv, x, self.next_norm(i))
        return x, self.base_logits(x)  # x: the final norm of the stream

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        raw = linear(h.to(self.lm_head.weight.dtype), self.lm_head.weight)
        return output_transform(raw, self.cfg.output_multiplier, self.cfg.output_soft_cap_temp)

    def markov(
        self,
        h: torch.Tensor,
        U: torch.Tensor,
        anchor: torch.Tensor,
        anchor_pos: torch.Tensor,
        seeds: torch.Tensor,
        temperature: torch.Tensor,
        workspace: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Markov loop → (draft ids in target vocabulary [B, γ], draft probs [B, γ, Vd]).
        ``workspace``: the fused kernel's kept words for this batch shape (an engine's bucket;
        ``plugins.dispatch.markov_sample``); None or empty: zeroed per call."""
        mh = self.model.markov_head
        head_w, head_b = mh.head_params()
        return dispatch.markov_sample(
            U, h, anchor, mh.markov_w1.weight, mh.markov_w2.weight, self.d2t, seeds, anchor_pos,
            temperature, mh.head_type, head_w, head_b, self.cfg.dspark_draft_topk or 0, workspace,
        )

    def confidence(self, h: torch.Tensor, anchor: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor | None:
        """c_k = σ(w·[h_k ; W1[prev_k]] + b), prev_k the token before slot k → [B, γ] fp32, or None."""
        head = self.model.confidence_head
        if head is None:
            return None
        feats = h.float()
        if self.cfg.confidence_head_with_markov:
            prev = torch.cat([anchor[:, None], draft_ids[:, :-1]], 1)
            feats = torch.cat([feats, self.model.markov_head.markov_w1.weight[prev].float()], -1)
        return torch.sigmoid(feats @ head.proj.weight.float().T + head.proj.bias.float()).squeeze(-1)

    def propose(self, anchor, anchor_pos, slots, cache, ctx_len, seeds, temperature, markov_workspace=None,
                positions=None):
        h, U = self.block(anchor, anchor_pos, slots, cache, ctx_len, positions)
        ids, probs = self.markov(h, U, anchor, anchor_pos, seeds, temperature, markov_workspace)
        return ids, probs, self.confidence(h, anchor, ids)
