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

    def step(self, tk, tv, dk, dv, anchor, anchor_pos, slots, seeds, temperature):
        """One speculative step over the static window: EagerEngine.step with kv_len = max_seq.

        anchor, anchor_pos, slots, seeds [B] int64; temperature [B] fp32;
        tk/tv/dk/dv: per-layer caches [slots, max_seq, KV, Dh] (written in place).
        → packed [B, γ+2] int64: γ draft tokens (target ids), n accepted, bonus.
        """
        g = self.draft.cfg.block_size
        max_seq = tk[0].shape[1]
        tcache, dcache = KVCache(list(tk), list(tv)), KVCache(list(dk), list(dv))
        ids, probs, _conf = self.draft.propose(anchor, anchor_pos, slots, dcache, max_seq, seeds, temperature)
        tokens = torch.cat([anchor[:, None], ids], 1)  # [B, γ+1]
        positions = anchor_pos[:, None] + torch.arange(g + 1, device=anchor.device)
        h, aux = self.target(tokens, positions, slots, tcache, max_seq)
        n, bonus = accept(self.target.logits(h), ids, probs, self.draft.d2t, temperature, seeds, anchor_pos)
        self.draft.store_context(aux, positions, slots, dcache)
        return torch.cat([ids, n[:, None], bonus[:, None]], 1)

    def prefill(self, tk, tv, dk, dv, tokens, positions, slots, last, seeds, temperature):
        """One prompt chunk for one request: EagerEngine.prefill's loop body.

        tokens, positions [1, C] int64 (a short last chunk is padded: its pad
        positions lie past the prompt, where no query looks, and are overwritten
        by later steps); slots, last, seeds [1] int64 (``last``: index of the
        chunk's last real token); temperature [1] fp32.
        → [1] int64: the token after ``last`` (used from the prompt's last chunk).
        """
        max_seq = tk[0].shape[1]
        tcache, dcache = KVCache(list(tk), list(tv)), KVCache(list(dk), list(dv))
        h, aux = self.target(tokens, positions, slots, tcache, max_seq)
        self.draft.store_context(aux, positions, slots, dcache)
        h_last = h.index_select(1, last)[:, 0]  # [1, D]
        return sample_tokens(self.target.logits(h_last), temperature, seeds, positions.index_select(1, last)[:, 0] + 1)


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


# Per-request graph inputs after (weights, tk, tv, dk, dv), with their dtypes; B is the bucket.
STEP_INPUTS = (("anchor", "int64"), ("anchor_pos", "int64"), ("slots", "int64"), ("seeds", "int64"),
               ("temperature", "float32"))
# Prefill: tokens/positions [1, C], the rest [1].
PREFILL_INPUTS = (("tokens", "int64"), ("positions", "int64"), ("slots", "int64"), ("last", "int64"),
                  ("seeds", "int64"), ("temperature", "float32"))


def build_pair(tcfg, dcfg, device="meta") -> SpecPair:
    """Reference modules for ``tcfg``/``dcfg`` (meta by default: export needs structure, not weights)."""
    with torch.device(device):
        return SpecPair(MuseSpark1xForCausalLM(tcfg, dcfg.target_layer_ids), MuseSparkDSparkForCausalLM(dcfg))


class GraphFn(nn.Module):
    """``SpecPair.<fn>`` with the weights as a flat list input (what torch.export sees).

    The pair is held in a tuple so that its parameters are *not* registered here:
    export must not lift them as constants.
    """

    def __init__(self, pair: SpecPair, fn: str, names: list[str]):
        super().__init__()
        self._pair = (pair,)
        self.fn = fn
        self.names = list(names)

    def forward(self, weights: list[torch.Tensor], tk, tv, dk, dv, *inputs):
        params = dict(zip(self.names, weights))
        return torch.func.functional_call(self._pair[0], params, (self.fn, tk, tv, dk, dv, *inputs), strict=True)
