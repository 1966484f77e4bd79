"""The two functions an ``aoti`` engine compiles, written once over the reference modules.

The builder exports these with ``torch.export`` and compiles them with
AOTInductor; the runtime uses the same module to name the weights it feeds the
compiled graphs and to check what a package expects. (Runtime code, so the
builder imports it, never the other way round.)

Why the graphs look like this:

* **Weights are graph inputs**, not constants baked into the package: an 8B
  target is 16 GB, and the prefill graph plus one step graph per batch bucket
  would each carry a copy. Every package reads the one set of weights the
  runtime loads from ``target.safetensors``/``draft.safetensors``, and the
  torch 2.11 / 2.13 constant-loading APIs (``load_constants``, user-managed
  constants, constants on disk), which differ between versions, are not needed.
  The flat order is ``weight_names()``, recorded in the manifest.
* **Caches are graph inputs mutated in place** (``index_put_`` into
  ``[slots, max_seq, KV, Dh]`` per layer): AOTInductor writes them in the
  caller's memory, which a CUDA graph replay needs.
* **Static shapes**: the eager engine reads keys ``[0, kv_len)`` with a Python
  ``kv_len``; here every query attends over the whole static window
  ``[0, max_seq)`` with the position mask (a key is visible iff its position
  is ≤ the query's, or < the anchor's for the draft context), which selects the
  same keys. Per-request values (anchor, position, slot, seed, temperature)
  are tensors, so one captured graph serves every step of a batch bucket.
"""

from __future__ import annotations

import torch
from torch import nn

from muse_spark.models.draft import MuseSparkDSparkForCausalLM
from muse_spark.models.target import KVCache, MuseSpark1xForCausalLM
from muse_spark.runtime.sampling import accept, sample_tokens

EMBED = "target.model.embed_tokens.weight"


class SpecPair(nn.Module):
    """Target + draft under one root, so one flat weight list names both."""

    def __init__(self, target: MuseSpark1xForCausalLM, draft: MuseSparkDSparkForCausalLM):
        super().__init__()
        self.target = target
        self.draft = draft

    # ---- the functions that are exported ------------------------------------------------
    def forward(self, fn: str, *args):
        # The draft embeds with the target's embed_tokens: a plain attribute that
        # functional_call does not swap, so point it at the (swapped) parameter.
        # (Set through __dict__: nn.Module would register a Parameter as the draft's own.)
        saved = self.draft.embed_weight
        self.draft.__dict__["embed_weight"] = self.target.model.embed_tokens.weight
        try:
            return getattr(self, fn)(*args)
        finally:
            self.draft.__dict__["embed_weight"] = saved

    # A speculative step is step_draft → layer × L → step_finish; a prompt chunk is
    # (embedding) → layer × L → prefill_finish. Composed, they are EagerEngine.step and
    # EagerEngine.prefill with kv_len = max_seq (the runtime composes them: ``LayeredStep``).
    def step_draft(self, dk, dv, anchor, anchor_pos, slots, seeds, temperature):
        """Draft block + Markov loop, and the target's input stream.

        anchor, anchor_pos, slots, seeds [B] int64; temperature [B] fp32; dk/dv: the draft's
        per-layer context caches [slots, max_seq, KV, Dh] (read).
        → (ids [B, γ] int64 target ids, probs [B, γ, Vd] fp32, stream [B, γ+1, D] fp32,
        positions [B, γ+1] int64).
        """
        g = self.draft.cfg.block_size
        dcache = KVCache(list(dk), list(dv))
        ids, probs, _conf = self.draft.propose(anchor, anchor_pos, slots, dcache, dk[0].shape[1], seeds, temperature)
        tokens = torch.cat([anchor[:, None], ids], 1)  # [B, γ+1]
        positions = anchor_pos[:, None] + torch.arange(g + 1, device=anchor.device)
        return ids, probs, self.target.embed_stream(tokens), positions

    def layer(self, k, v, stream, positions, slots):
        """One target layer (layer 0's weights stand for whichever layer the runtime feeds):
        k/v [slots, max_seq, KV, Dh] written in place; stream [B, S, D] fp32 → the next stream."""
        return self.target.layer_forward(0, stream, positions, slots, k, v, k.shape[1])

    def step_finish(self, dk, dv, stream, aux, ids, probs, positions, slots, seeds, temperature):
        """Verify and accept, then store the draft context K/V of the block's tokens.

        aux: the streams after the draft's target layers (list of [B, γ+1, D] fp32).
        → packed [B, γ+2] int64: γ draft tokens (target ids), n accepted, bonus.
        """
        h = self.target.final_norm(stream)
        anchor_pos = positions[:, 0]
        n, bonus = accept(self.target.logits(h), ids, probs, self.draft.d2t, temperature, seeds, anchor_pos)
        self.draft.store_context(self.target.cat_aux(list(aux), stream), positions, slots,
                                 KVCache(list(dk), list(dv)))
        return torch.cat([ids, n[:, None], bonus[:, None]], 1)

    def prefill_finish(self, dk, dv, stream, aux, positions, slots, last, seeds, temperature):
        """The end of one prompt chunk: store its draft context K/V, sample the token after ``last``.

        stream [1, C, D] fp32 after the last layer; aux as in ``step_finish``; positions [1, C]
        (a short last chunk is padded: its pad positions lie past the prompt, where no query
        looks, and later steps overwrite them); slots, last, seeds [1] int64 (``last``: index
        of the chunk's last real token); temperature [1] fp32.
        → [1] int64: the token after ``last`` (used from the prompt's last chunk).
        """
        self.draft.store_context(self.target.cat_aux(list(aux), stream), positions, slots,
                                 KVCache(list(dk), list(dv)))
        h_last = self.target.final_norm(stream.index_select(1, last))[:, 0]  # [1, D]
        return sample_tokens(self.target.logits(h_last), temperature, seeds, positions.index_select(1, last)[:, 0] + 1)


LAYER_PREFIX = "target.model.layers."


def part_weight_names(names: list[str], fn: str, layer: int = 0) -> list[str]:
    """The weights one compiled part reads, in its graph-input order.

    ``layer``: layer ``layer``'s tensors (the runtime's feed for the one layer package, which was
    compiled over layer 0's names; the suffixes and their order are the same for every layer).
    Every other part: everything but the target layers (the draft, the embedding, the final norm,
    the head).
    """
    if fn == "layer":
        prefix = f"{LAYER_PREFIX}{layer}."
        return [n for n in names if n.startswith(prefix)]
    return [n for n in names if not n.startswith(LAYER_PREFIX)]


def weight_names(pair: SpecPair) -> list[str]:
    """Every tensor the graphs read, in the flat order of their ``weights`` input."""
    names = [n for n, _ in pair.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in pair.named_buffers(remove_duplicate=False)]
    return names


def weight_tensors(pair: SpecPair, names: list[str]) -> list[torch.Tensor]:
    state = dict(pair.named_parameters(remove_duplicate=False))
    state.update(pair.named_buffers(remove_duplicate=False))
    missing = [n for n in names if n not in state]
    if missing:
        raise KeyError(f"the engine's graphs read weights this model does not have: {missing[:5]}")
    return [state[n] for n in names]


def tensor_spec(t: torch.Tensor) -> list:
    """[shape, dtype name]: what a compiled graph assumes about one input."""
    return [list(t.shape), str(t.dtype).removeprefix("torch.")]


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16', 'int64', … → the torch dtype (inverse of ``tensor_spec``'s names)."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def weight_specs(pair: SpecPair) -> list[list]:
    """[[name, shape, dtype], …] in graph-input order (recorded in the manifest)."""
    names = weight_names(pair)
    return [[n, *tensor_spec(t)] for n, t in zip(names, weight_tensors(pair, names))]


# Each part's flat graph inputs, in order (recorded in the manifest for embedders).
GRAPH_INPUTS = {
    "step_draft": ["weights[head]", "draft_k[]", "draft_v[]", "anchor", "anchor_pos", "slots", "seeds",
                   "temperature"],
    "layer": ["weights[layer i]", "target_k[i]", "target_v[i]", "stream", "positions", "slots"],
    "step_finish": ["weights[head]", "draft_k[]", "draft_v[]", "stream", "aux[]", "ids", "probs", "positions",
                    "slots", "seeds", "temperature"],
    "prefill_finish": ["weights[head]", "draft_k[]", "draft_v[]", "stream", "aux[]", "positions", "slots", "last",
                       "seeds", "temperature"],
}


def build_pair(tcfg, dcfg, device="meta") -> SpecPair:
    """Reference modules for ``tcfg``/``dcfg`` (meta by default: export needs structure, not weights)."""
    with torch.device(device):
        return SpecPair(MuseSpark1xForCausalLM(tcfg, dcfg.target_layer_ids), MuseSparkDSparkForCausalLM(dcfg))


class GraphFn(nn.Module):
    """``SpecPair.<fn>`` with its weights as a flat list input (what torch.export sees).

    The pair is held in a tuple so that its parameters are *not* registered here:
    export must not lift them as constants. ``names`` are the part's weights
    (``part_weight_names``); the pair's other tensors stay on the meta device, so a
    part that touched one would fail to compile rather than bake it in.
    """

    def __init__(self, pair: SpecPair, fn: str, names: list[str]):
        super().__init__()
        self._pair = (pair,)
        self.fn = fn
        self.names = list(names)

    def forward(self, weights: list[torch.Tensor], *inputs):
        params = dict(zip(self.names, weights))
        return torch.func.functional_call(self._pair[0], params, (self.fn, *inputs), strict=False)


class _Layered:
    """What the parts share: the weight sublists each part reads, by index into the flat list."""

    def __init__(self, names: list[str], layers: int, aux_layer_ids, layer_fn):
        where = {n: i for i, n in enumerate(names)}
        self.head_idx = [where[n] for n in part_weight_names(names, "head")]
        self.layer_idx = [[where[n] for n in part_weight_names(names, "layer", i)] for i in range(layers)]
        if len({len(ix) for ix in self.layer_idx}) > 1:
            raise ValueError("the target layers do not all have the same tensors: one layer package cannot serve them")
        self.aux_layer_ids = set(aux_layer_ids)
        self.layer_fn = layer_fn

    def layers(self, weights, tk, tv, stream, positions, slots):
        """Run the layer package over every layer; → (last stream, aux streams)."""
        aux = []
        for i, ix in enumerate(self.layer_idx):
            stream = self.layer_fn([weights[j] for j in ix], tk[i], tv[i], stream, positions, slots)
            if i in self.aux_layer_ids:
                aux.append(stream)
        return stream, aux


class LayeredStep(_Layered):
    """A speculative step from its compiled parts, called as the eager step's graph would be:
    ``fn(weights, tk, tv, dk, dv, anchor, anchor_pos, slots, seeds, temperature)`` → packed
    ``[B, γ+2]``. Under a CUDA graph capture, every part's kernels are captured in order."""

    def __init__(self, names, layers, aux_layer_ids, draft_fn, layer_fn, finish_fn):
        super().__init__(names, layers, aux_layer_ids, layer_fn)
        self.draft_fn, self.finish_fn = draft_fn, finish_fn

    def __call__(self, weights, tk, tv, dk, dv, anchor, anchor_pos, slots, seeds, temperature):
        head = [weights[j] for j in self.head_idx]
        ids, probs, stream, positions = self.draft_fn(head, dk, dv, anchor, anchor_pos, slots, seeds, temperature)
        stream, aux = self.layers(weights, tk, tv, stream, positions, slots)
        return self.finish_fn(head, dk, dv, stream, aux, ids, probs, positions, slots, seeds, temperature)


class LayeredPrefill(_Layered):
    """One prompt chunk from its compiled parts: ``fn(weights, tk, tv, dk, dv, tokens, positions,
    slots, last, seeds, temperature)`` → ``[1]``. The embedding lookup (``embed``: tokens → the
    FP32 stream, the reference module's) runs uncompiled: it is one gather."""

    def __init__(self, names, layers, aux_layer_ids, embed, layer_fn, finish_fn):
        super().__init__(names, layers, aux_layer_ids, layer_fn)
        self.embed, self.finish_fn = embed, finish_fn

    def __call__(self, weights, tk, tv, dk, dv, tokens, positions, slots, last, seeds, temperature):
        head = [weights[j] for j in self.head_idx]
        stream, aux = self.layers(weights, tk, tv, self.embed(tokens), positions, slots)
        return self.finish_fn(head, dk, dv, stream, aux, positions, slots, last, seeds, temperature)
