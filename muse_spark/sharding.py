"""How the target splits across tensor-parallel ranks (Megatron style): the arithmetic the builder
(``build --tp``: per-rank weight files) and the runtime (``runtime/tensor_parallel.py``) share.

Rank ``r`` of ``world`` holds the stacked q/k/v/o_gate projection's rows of q heads
``[r·H/world, (r+1)·H/world)`` with their gate rows and the K/V heads they read (its share where
there are at least ``world`` KV heads, else the one its q heads share), ``gate_proj``/``up_proj``'s
rows of its FFN slice, and the matching input columns of ``o_proj`` and ``down_proj``; every other
tensor whole. FP8 projections (docs/fp8.md) split their E4M3 weights so, the per-channel
``weight_scale`` going with the rows it scales (the column-parallel projections' rows; all of a
row-parallel projection's), a static ``input_scale`` whole; an FP8 KV cache's ``k_scale``/``v_scale`` those of
the rank's KV heads. An untied ``lm_head`` splits by vocabulary
rows (``vocab_split``: rank ``r`` computes the logits of ids ``[r·n, (r+1)·n)``, n = ⌈V/world⌉, and the
ranks gather them); the embedding stays whole, since the replicated draft reads it too.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


class TensorParallelError(ValueError):
    """A split the model or the machine cannot take."""


def check_split(cfg, world: int) -> None:
    """Refuse a world size the target's heads and FFN do not divide, with the reason."""
    H, KV, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if world < 1:
        raise TensorParallelError(f"--tp must be at least 1, got {world}")
    if H % world:
        raise TensorParallelError(f"--tp {world}: the target's {H} attention heads do not split over {world} ranks")
    if (KV >= world and KV % world) or (KV < world and world % KV):
        raise TensorParallelError(f"--tp {world}: the target's {KV} KV heads neither split over nor replicate evenly "
                                  f"on {world} ranks")
    if inter % world:
        raise TensorParallelError(f"--tp {world}: the FFN width {inter} does not split over {world} ranks")


def shard_config(cfg, world: int):
    check_split(cfg, world)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world,
                               num_key_value_heads=max(cfg.num_key_value_heads // world, 1),
                               intermediate_size=cfg.intermediate_size // world)


def vocab_split(cfg, world: int) -> bool:
    """Whether the target's ``lm_head`` splits by vocabulary rows over ``world`` ranks: an untied head (a tied
    head is the embedding, which stays whole). Each rank holds ``vocab_rows`` rows; where the vocabulary
    does not divide evenly, the last rank's slice ends in zero rows, whose logits the gather drops."""
    return world > 1 and not cfg.tie_word_embeddings


def vocab_rows(cfg, world: int) -> int:
    """The lm_head rows one rank holds under ``vocab_split``: ⌈vocab / world⌉."""
    return -(-cfg.vocab_size // world)


def fit_lm_head(module: nn.Module, sd: dict[str, torch.Tensor]) -> bool:
    """Give ``module`` (a target built on meta) an ``lm_head`` of the rows ``sd`` holds: the whole vocabulary,
    or one rank's slice of it (``vocab_split``) → whether it is a slice."""
    w = sd.get("lm_head.weight")
    if w is None or module.lm_head is None or w.shape[0] == module.lm_head.out_features:
        return False
    with torch.device("meta"):
        module.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False)
    return True


def shard_target(target, rank: int, world: int, group):
    """A new target module holding rank ``rank``'s slice, its layers all-reducing over ``group``."""
    from muse_spark.checkpoint import materialize
    from muse_spark.models.target import MuseSpark1xForCausalLM

    cfg = shard_config(target.cfg, world)
    sd = shard_state_dict(target.state_dict(), target.cfg, rank, world)
    with torch.device("meta"):
        part = MuseSpark1xForCausalLM(cfg, target.aux_layer_ids)
    vocab = fit_lm_head(part, sd)
    # (FP8 projections become Fp8Linear as the loader makes them; the slices stay on the target's device)
    materialize(part, sd, target.model.embed_tokens.weight.device, target.model.embed_tokens.weight.dtype)
    set_group(part, group, vocab)
    return part


def set_group(part, group, vocab: bool) -> None:
    """A rank's target slice all-reduces its layers' partial products over ``group``, and gathers its logits
    there where ``vocab`` (its lm_head a vocabulary slice)."""
    for layer in part.model.layers:
        layer.tp_group = group
    part.vocab_group = group if vocab else None


def shard_state_dict(sd: dict[str, torch.Tensor], cfg, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of the target's canonical state dict (the layout above)."""
    H, KV, Dh, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    Hr, Ir = H // world, inter // world
    kv_heads = (list(range(rank * KV // world, (rank + 1) * KV // world)) if KV >= world
                else [rank * Hr // (H // KV)])
    q_rows = torch.arange(rank * Hr * Dh, (rank + 1) * Hr * Dh)
    kv_rows = torch.cat([torch.arange(h * Dh, (h + 1) * Dh) for h in kv_heads])
    out = {}
    for name, t in sd.items():
        if name.endswith(("self_attn.o_proj.weight_scale", "feed_forward.down_proj.weight_scale")):
            out[name] = t  # (FP8: a row-parallel projection keeps every output channel, so all its scales)
        elif name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.weight_scale")):
            q_end, k_end, v_end = H * Dh, H * Dh + KV * Dh, H * Dh + 2 * KV * Dh
            parts = [t[:q_end][q_rows], t[q_end:k_end][kv_rows], t[k_end:v_end][kv_rows]]
            if cfg.attn_output_gate:
                parts.append(t[v_end:][q_rows])
            out[name] = torch.cat(parts)
        elif name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
            out[name] = t[kv_heads]  # (an FP8 KV cache's scales: those of the rank's KV heads)
        elif name.endswith("self_attn.o_proj.weight"):
            out[name] = t[:, q_rows]
        elif name.endswith(("feed_forward.gate_up_proj.weight", "feed_forward.gate_up_proj.weight_scale")):
            out[name] = torch.cat([t[rank * Ir : (rank + 1) * Ir], t[inter + rank * Ir : inter + (rank + 1) * Ir]])
        elif name.endswith("feed_forward.down_proj.weight"):
            out[name] = t[:, rank * Ir : (rank + 1) * Ir]
        elif name == "lm_head.weight" and vocab_split(cfg, world):
            rows = vocab_rows(cfg, world)
            part = t[rank * rows : (rank + 1) * rows]
            out[name] = torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])])
        else:
            out[name] = t
    return {k: v.contiguous() for k, v in out.items()}


def check_engine_split(manifest: dict, world: int, where) -> None:
    """Refuse to run the engine ``manifest`` describes over ``world`` ranks where it cannot: one built for
    another count (``tensor_parallel.world``), a compiled engine built for one device (its graphs have the
    whole layers' shapes: build it for the ranks), or a split its target does not take."""
    from muse_spark.engine_format import configs_from_manifest, tp_world

    built = tp_world(manifest)
    if built != world and built != 1:
        raise TensorParallelError(f"{where}: this engine is split for {built} ranks, not {world}: run it with --tp {built}")
    if world != 1 and built == 1 and manifest["backend"] != "eager":
        raise TensorParallelError(f"{where}: this {manifest['backend']} engine was compiled for one device; --tp splits "
                                  f"eager engines at load, or build one for the ranks "
                                  f"(`muse-spark build --backend {manifest['backend']} --tp {world}`)")
    check_split(configs_from_manifest(manifest)[0], world)
