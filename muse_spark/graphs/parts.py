"""The two functions an ``aoti`` engine compiles, written once over the reference modules.

The builder exports these with ``torch.export`` and compiles them with
AOTInductor (or exports them to ONNX); the runtime uses the same module to name
the weights it feeds the compiled graphs, to check what a package expects and to
compose the parts into a step. Both import it; it imports neither.

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
from muse_spark.plugins import dispatch
from muse_spark.plugins.acceptance.processing import Processing, logprobs, process_logits
from muse_spark.plugins.acceptance.reference import accept, sample_tokens

EMBED = "target.model.embed_tokens.weight"
# The packages' calling convention; an engine of another layout is refused ("rebuild it").
# "layered-2": the layer package takes and returns the normed input (the next norm fused in).
# "layered-3": step_draft and step_finish take the Markov kernel's kept workspace (``markov_ws``).
# "layered-4": each decoder layer's weights include its two residual kernel words (``sync_attn``,
# ``sync_ffn``: int32 [2], zero).
# "layered-5": step_finish split into step_verify (the target's head and the acceptance) and
# step_context (the draft context K/V of the block's tokens), which the runtime runs side by side.
# "layered-6": the decoder layers' residual kernel words are gone (no package takes them).
# "layered-7": step_draft also returns the confidence head's values; step_verify verifies the first
# ``h.shape[1] − 1`` drafts (an engine may hold step packages for several verification widths).
LAYOUT = "layered-7"
MARKOV_ERROR_WORD = 2  # the Markov kernel's workspace: [counter, epoch, error flag, 0, step words…]
# The sampling controls' per-slot state (``step_verify_ctl``): the columns of its two parameter tables.
CTL_FLOATS = ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
CTL_INTS = ("top_k", "min_tokens", "out_len")
LOGPROBS_TOP = 20  # the most alternatives a controlled step reports per position (OpenAI's top_logprobs ≤ 20)


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

    # A speculative step is step_draft → layer × L → step_verify, with step_context beside the layers
    # after the last aux layer and step_verify; a prompt chunk is
    # (embedding) → layer × L → prefill_finish. Composed, they are EagerEngine.step and
    # EagerEngine.prefill with kv_len = max_seq (the runtime composes them: ``LayeredStep``).
    def step_draft(self, dk, dv, markov_ws, anchor, anchor_pos, slots, seeds, temperature, positions):
        """Draft block + Markov loop, and the target's input stream.

        anchor, anchor_pos, slots, seeds [B] int64; temperature [B] fp32; positions [B, γ+1] int64,
        ``anchor_pos + [0 … γ]`` (``step_positions``: made once by the runtime and passed to every
        part as a graph input, so that no compiled part makes its own copy per kernel that reads
        it); dk/dv: the draft's per-layer context caches [slots, max_seq, KV, Dh] (read; the
        block's K/V are written at its positions, which step_context overwrites); markov_ws: the
        fused Markov kernel's int64 words, zeroed once by the runtime and kept for the bucket
        (mutated in place; empty where the engine runs the reference loop).
        → (ids [B, γ] int64 target ids, probs [B, γ, Vd] fp32, stream [B, γ+1, D] fp32,
        x [B, γ+1, D] (layer 0's normed input, compute dtype), confidence [B, γ] fp32 (the confidence
        head's values; zeros for a draft without the head)).
        """
        dcache = KVCache(list(dk), list(dv), window=key_window(dk[0], slots) if slots.dim() == 2 else None)
        ids, probs, conf = self.draft.propose(anchor, anchor_pos, slots, dcache, dcache.max_seq, seeds, temperature,
                                              markov_ws, positions)
        if conf is None:
            conf = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        tokens = torch.cat([anchor[:, None], ids], 1)  # [B, γ+1]
        stream = self.target.embed_stream(tokens)
        # (the compute dtype from a weight this part reads: layer 0's projections stay on meta)
        return ids, probs, stream, self.target.model.layers[0].input_norm(stream, self.target.dtype), conf.float()

    def layer(self, k, v, stream, x, positions, slots):
        """One target layer (layer 0's weights stand for whichever layer the runtime feeds, and the
        final norm's weight for whichever norm reads its output: ``NEXT_NORM``): k/v [slots,
        max_seq, KV, Dh] written in place; stream [B, S, D] fp32 and x, its normed input →
        (the next stream, its norm: the next layer's input, or after the last layer h)."""
        return self.target.layer_forward(0, stream, x, positions, slots, k, v, key_window(k, slots),
                                         next_norm=self.target.model.norm)

    def step_verify(self, markov_ws, h, ids, probs, positions, seeds, temperature):
        """Verify and accept the first K drafts, K = ``h.shape[1] − 1`` (the step's verification width:
        γ, or fewer in an engine built with narrower widths; drafts past K are not candidates, and
        when all K are accepted the bonus comes from the target's distribution at the cut, as
        ``plugins.acceptance.reference.accept`` with ``verify = K`` for every row).

        h: the final norm of the last layer's stream [B, K+1, D]; ids [B, γ], probs [B, γ, Vd]:
        step_draft's; positions [B, K+1]; markov_ws: step_draft's (read: its error flag).
        → packed [B, γ+2] int64: γ draft tokens (target ids), n accepted, bonus. n is −1 in every
        row when the fused Markov kernel raised its error flag (a program gave up waiting for the
        others: they were not all resident at once): the drafts are not valid and the step must
        run again (``runtime.cuda_graph.StaticStep`` does, on a zeroed workspace).
        """
        anchor_pos, drafts = positions[:, 0], ids
        K = h.shape[1] - 1
        if K < ids.shape[1]:  # (a narrower width: the kernels read contiguous rows)
            ids, probs = ids[:, :K].contiguous(), probs[:, :K].contiguous()
        cfg = self.target.cfg  # (the Triton build: muse_spark::accept_triton's kernels, the multiplier in them)
        n, bonus = dispatch.accept(self.target.raw_logits(h), cfg.output_multiplier, cfg.output_soft_cap_temp,
                                   ids, probs, self.draft.d2t, temperature, seeds, anchor_pos)
        if markov_ws.numel():  # (the reference loop keeps no workspace: an empty one)
            n = torch.where(markov_ws[MARKOV_ERROR_WORD] != 0, -1, n)
        return torch.cat([drafts, n[:, None], bonus[:, None]], 1)

    def step_verify_ctl(self, markov_ws, h, ids, probs, positions, seeds, temperature, slots, ctl_floats, ctl_ints,
                        seen, counts, stops):
        """``step_verify`` under the requests' sampling controls, from per-slot state kept on the device.

        ctl_floats [slots, 5] fp32 (``CTL_FLOATS``), ctl_ints [slots, 3] int64 (``CTL_INTS``: out_len is
        the tokens output so far), seen [slots, V] bool (prompt and output tokens), counts [slots, V]
        fp32 (output tokens), stops [slots, V] bool (the tokens min_tokens holds back): the
        ``Processing`` of the rows' slots. The target's distribution at each position is processed
        (``process_logits``: the drafts before a position count as output) and the reference rule
        accepts on it, as the eager engine does. The emitted tokens (the accepted drafts and the
        bonus) are then added to their slots' seen, counts and out_len, in place, so the next step
        needs nothing from the host.
        → (packed [B, γ+2] as ``step_verify``'s; the emitted tokens' log-probabilities [B, K+1], the
        ``LOGPROBS_TOP`` most likely tokens' log-probabilities and ids [B, K+1, LOGPROBS_TOP], per
        position 0 … K, position j's token being draft j+1 while j < n and the bonus at j = n)."""
        anchor_pos, drafts = positions[:, 0], ids
        K = h.shape[1] - 1
        if K < ids.shape[1]:
            ids, probs = ids[:, :K].contiguous(), probs[:, :K].contiguous()
        f, i = ctl_floats.index_select(0, slots), ctl_ints.index_select(0, slots)
        proc = Processing(top_k=i[:, 0], top_p=f[:, 0], min_p=f[:, 1], repetition=f[:, 2], presence=f[:, 3],
                          frequency=f[:, 4], min_tokens=i[:, 1], out_len=i[:, 2], seen=seen.index_select(0, slots),
                          counts=counts.index_select(0, slots), stops=stops.index_select(0, slots))
        z = process_logits(self.target.logits(h), ids, proc, temperature)
        n, bonus = accept(z, ids, probs, self.draft.d2t, temperature, seeds, anchor_pos)
        if markov_ws.numel():
            n = torch.where(markov_ws[MARKOV_ERROR_WORD] != 0, -1, n)
        at = torch.arange(K + 1, device=n.device)[None, :]
        chosen = torch.where(at < n[:, None], torch.cat([ids, bonus[:, None]], 1), bonus[:, None])  # [B, K+1]
        lp = logprobs(z, temperature)
        top = lp.topk(min(LOGPROBS_TOP, lp.shape[-1]), -1)
        # the emitted tokens join their slots' history (none where the step failed: n = −1)
        emitted = (at <= n[:, None]).float()  # [B, K+1]
        rows = slots[:, None].expand_as(chosen)
        counts.index_put_((rows, chosen), emitted, accumulate=True)
        seen.index_put_((slots,), seen.index_select(0, slots) | (counts.index_select(0, slots) > 0))
        ctl_ints.index_put_((slots, torch.full_like(slots, 2)), i[:, 2] + n + 1, accumulate=False)
        return (torch.cat([drafts, n[:, None], bonus[:, None]], 1), lp.gather(-1, chosen[..., None])[..., 0],
                top.values, top.indices)

    def step_context(self, dk, dv, aux, positions, slots):
        """Store the draft context K/V of the block's tokens (all γ+1: the positions past the accepted
        ones lie past the next anchor, where no draft query looks, and later steps overwrite them).

        aux: the streams after the draft's target layers (list of [B, γ+1, D] fp32). It reads nothing
        ``step_verify`` writes, nor the reverse: the runtime runs it beside the last target layers
        and the verification (``LayeredStep``). → nothing (the caches are written in place)."""
        self.draft.store_context(self.target.cat_aux(list(aux), positions), positions, slots, KVCache(list(dk), list(dv)))
        return ()

    def prefill_finish(self, dk, dv, h, aux, positions, slots, last, seeds, temperature):
        """The end of one prompt chunk: store its draft context K/V, sample the token after ``last``.

        h [P, C, D]: the final norm of the last layer's stream, P chunks (1, or the engine's prefill batch);
        aux as in ``step_context``; positions [P, C] (a short last chunk is padded: its pad positions lie
        past the prompt, where no query looks, and later steps overwrite them); slots, last, seeds [P] int64
        (``last``: index of each chunk's last real token); temperature [P] fp32.
        → [P] int64: the token after each chunk's ``last`` (used from a prompt's last chunk).
        """
        self.draft.store_context(self.target.cat_aux(list(aux), h), positions, slots, KVCache(list(dk), list(dv)))
        h_last = h.gather(1, last[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0]  # [P, D]
        at = positions.gather(1, last[:, None])[:, 0]  # [P]
        return sample_tokens(self.target.logits(h_last), temperature, seeds, at + 1)


def key_window(cache: torch.Tensor, slots: torch.Tensor) -> int:
    """The positions a request's keys may take: a slot cache's length, or (paged: ``slots`` the requests'
    block tables [B, n] into pools [blocks, P, …]) n · P."""
    return cache.shape[1] * (slots.shape[1] if slots.dim() == 2 else 1)


LAYER_PREFIX = "target.model.layers."
# The layer package's last weight: the norm that reads the layer's output. It was compiled under
# the final norm's name; the runtime feeds the next layer's input norm there, the final norm's
# after the last layer (``next_norm_name``).
NEXT_NORM = "target.model.norm.weight"
INPUT_NORM = "self_attn.pre_qkv_proj_norm.weight"


def next_norm_name(names: list[str], layer: int, layers: int) -> str | None:
    """The weight of the norm that reads layer ``layer``'s output (None: the norms have no weight)."""
    name = f"{LAYER_PREFIX}{layer + 1}.{INPUT_NORM}" if layer + 1 < layers else NEXT_NORM
    return name if name in names else None


def part_weight_names(names: list[str], fn: str, layer: int = 0, layers: int = 1) -> list[str]:
    """The weights one compiled part reads, in its graph-input order.

    ``layer``: layer ``layer``'s tensors, then the weight of the norm that reads its output (the
    runtime's feed for the one layer package, compiled over layer 0's names and ``NEXT_NORM``;
    the suffixes and their order are the same for every layer; ``layers``: how many there are).
    Every other part: everything but the target layers (the draft, the embedding, the final norm,
    the head), then layer 0's input norm (``step_draft`` normalizes the stream entering layer 0).
    """
    if fn == "layer":
        prefix = f"{LAYER_PREFIX}{layer}."
        nxt = next_norm_name(names, layer, layers)
        return [n for n in names if n.startswith(prefix)] + ([nxt] if nxt else [])
    first = f"{LAYER_PREFIX}0.{INPUT_NORM}"
    return [n for n in names if not n.startswith(LAYER_PREFIX)] + ([first] if first in names else [])


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
    "step_draft": ["weights[head]", "draft_k[]", "draft_v[]", "markov_workspace", "anchor", "anchor_pos", "slots",
                   "seeds", "temperature", "positions"],
    "layer": ["weights[layer i]", "target_k[i]", "target_v[i]", "stream", "x", "positions", "slots"],
    "step_verify": ["weights[head]", "markov_workspace", "h", "ids", "probs", "positions", "seeds", "temperature"],
    "step_verify_ctl": ["weights[head]", "markov_workspace", "h", "ids", "probs", "positions", "seeds", "temperature",
                        "slots", "ctl_floats", "ctl_ints", "seen", "counts", "stops"],
    "step_context": ["weights[head]", "draft_k[]", "draft_v[]", "aux[]", "positions", "slots"],
    "prefill_finish": ["weights[head]", "draft_k[]", "draft_v[]", "h", "aux[]", "positions", "slots", "last",
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
        self.layer_idx = [[where[n] for n in part_weight_names(names, "layer", i, layers)] for i in range(layers)]
        if len({len(ix) for ix in self.layer_idx}) > 1:
            raise ValueError("the target layers do not all have the same tensors: one layer package cannot serve them")
        self.aux_layer_ids = set(aux_layer_ids)
        if not self.aux_layer_ids or not self.aux_layer_ids <= set(range(layers)):
            raise ValueError(f"aux layer ids {sorted(self.aux_layer_ids)}: expected some, each in [0, {layers})")
        self.last_aux = max(self.aux_layer_ids)
        self.layer_fn = layer_fn

    def layers(self, weights, tk, tv, stream, x, positions, slots, after_aux=None, layer_fn=None):
        """Run the layer package (``layer_fn``, default this step's) over every layer (x: layer 0's
        normed input); → (h, the final norm of the last stream; aux streams). ``after_aux``: called
        with the aux streams as soon as the last aux layer has run."""
        aux = []
        layer_fn = layer_fn or self.layer_fn
        for i, ix in enumerate(self.layer_idx):
            stream, x = layer_fn([weights[j] for j in ix], tk[i], tv[i], stream, x, positions, slots)
            if i in self.aux_layer_ids:
                aux.append(stream)
            if i == self.last_aux and after_aux is not None:
                after_aux(aux)
        return x, aux


def step_positions(anchor_pos: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The positions of a step's γ+1 verified tokens, ``anchor_pos + [0 … γ]`` [B, γ+1] int64, read by
    every part. ``offsets``: ``[0 … γ]`` on anchor_pos's device, made once by the caller (``LayeredStep``),
    so that a captured step graph holds one kernel here, the sum, not an arange before it."""
    return anchor_pos[:, None] + offsets


class LayeredStep(_Layered):
    """A speculative step from its compiled parts, called as the eager step's graph would be:
    ``fn(weights, tk, tv, dk, dv, markov_ws, anchor, anchor_pos, slots, seeds, temperature)`` → packed
    ``[B, γ+2]``. Under a CUDA graph capture, every part's kernels are captured.

    The step is its two halves, which a scheduling runner calls apart (``runtime/cuda_graph.py``):
    ``draft`` (the draft block and the Markov loop: the drafts and their confidences) and
    ``verify`` (the target over the anchor and the first K drafts, the acceptance, the draft context).
    ``widths``: the verification widths K < γ the engine holds packages for, {K: (layer_fn,
    verify_fn, context_fn)}; the full width γ is the constructor's parts. ``ctl_fn``: the full width's
    verification under the sampling controls (``SpecPair.step_verify_ctl``), which a step called with
    ``ctl`` (the controls' per-slot state tensors) runs instead of ``verify_fn``.

    ``side``: a CUDA stream on which the context part (the draft context K/V of the block's tokens)
    runs beside the target layers after the last aux layer and the verification part (the target's
    head and the acceptance). Neither reads what the other writes, so the context's short,
    latency-bound kernels can overlap the head's weight stream. It is forked from the caller's
    stream after the last aux layer and joined into it before the call returns (a captured graph
    holds both branches); the tensors the side stream reads stay referenced until the join, so the
    allocator hands none of them to the main stream's later work. None: the parts run one after the
    other on the caller's stream (the same results: the step's outputs and caches do not depend on it)."""

    def __init__(self, names, layers, aux_layer_ids, draft_fn, layer_fn, verify_fn, context_fn, gamma: int,
                 side: "torch.cuda.Stream | None" = None, widths: dict | None = None, ctl_fn=None):
        super().__init__(names, layers, aux_layer_ids, layer_fn)
        self.ctl_fn = ctl_fn
        self.gamma = gamma
        self.draft_fn, self.verify_fn, self.context_fn = draft_fn, verify_fn, context_fn
        bad = [K for K in (widths or {}) if not 1 <= K < gamma]
        if bad:
            raise ValueError(f"verification widths {bad}: each must be in [1, γ={gamma})")
        self.widths = {gamma: (layer_fn, verify_fn, context_fn), **(widths or {})}
        self.side = side
        self._offsets: dict[torch.device, torch.Tensor] = {}  # [0 … γ] by device (``step_positions``)
        # paged caches (the engine's block tables [slots, n]): the parts address the caches by the rows'
        # tables, gathered from the slots inside the step (a captured graph reads the tables as they are)
        self.table: torch.Tensor | None = None

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """What the parts address the caches by: the slots, or their block tables."""
        return slots if self.table is None else self.table.index_select(0, slots)

    def _context(self, context_fn, head, dk, dv, aux, positions, slots):
        """Start ``context_fn``: on the side stream (→ the caller's stream, to join) or in order (→ None)."""
        if self.side is None:
            context_fn(head, dk, dv, aux, positions, slots)
            return None
        main = torch.cuda.current_stream(self.side.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            context_fn(head, dk, dv, aux, positions, slots)
        return main

    def draft(self, weights, dk, dv, markov_ws, anchor, anchor_pos, slots, seeds, temperature) -> tuple:
        """The step's first half → (positions [B, γ+1], ids [B, γ], probs [B, γ, Vd], stream, x,
        confidence [B, γ]): what ``verify`` takes."""
        head = [weights[j] for j in self.head_idx]
        offsets = self._offsets.get(anchor_pos.device)
        if offsets is None:  # (made on a first, uncaptured call: a capture warms up first, ``cuda_graph.capture``)
            offsets = self._offsets[anchor_pos.device] = torch.arange(self.gamma + 1, device=anchor_pos.device)
        positions = step_positions(anchor_pos, offsets)
        return (positions, *self.draft_fn(head, dk, dv, markov_ws, anchor, anchor_pos, self.rows(slots), seeds,
                                          temperature, positions))

    def verify(self, weights, tk, tv, dk, dv, markov_ws, slots, seeds, temperature, drafted: tuple,
               K: int | None = None, ctl: tuple | None = None):
        """The step's second half over ``draft``'s output, verifying the first ``K`` drafts of every row
        (a width the engine holds; None: γ) → packed ``[B, γ+2]``; with ``ctl`` (the sampling controls'
        state, ``SpecPair.step_verify_ctl``'s last five inputs; the full width only) → its four outputs."""
        K = self.gamma if K is None else K
        if K not in self.widths:
            raise ValueError(f"verification width {K}: this step holds widths {sorted(self.widths)}")
        if ctl is not None and (self.ctl_fn is None or K != self.gamma):
            raise ValueError("a controlled step runs at the full width of a step built with the controls' part")
        layer_fn, verify_fn, context_fn = self.widths[K]
        positions, ids, probs, stream, x, _conf = drafted
        if K < self.gamma:  # (the anchor and the first K drafts, as the narrower packages take them)
            positions, stream, x = (t[:, :K + 1].contiguous() for t in (positions, stream, x))
        head = [weights[j] for j in self.head_idx]
        forked = []  # the caller's stream, where the context was forked from it
        rows = self.rows(slots)
        h, aux = self.layers(weights, tk, tv, stream, x, positions, rows, layer_fn=layer_fn,
                             after_aux=lambda aux: forked.append(
                                 self._context(context_fn, head, dk, dv, aux, positions, rows)))
        if ctl is None:
            packed = verify_fn(head, markov_ws, h, ids, probs, positions, seeds, temperature)
        else:
            packed = self.ctl_fn(head, markov_ws, h, ids, probs, positions, seeds, temperature, slots, *ctl)
        if forked[0] is not None:
            forked[0].wait_stream(self.side)  # (aux and positions are referenced until here)
        return packed

    def __call__(self, weights, tk, tv, dk, dv, markov_ws, anchor, anchor_pos, slots, seeds, temperature, ctl=None):
        drafted = self.draft(weights, dk, dv, markov_ws, anchor, anchor_pos, slots, seeds, temperature)
        return self.verify(weights, tk, tv, dk, dv, markov_ws, slots, seeds, temperature, drafted, ctl=ctl)


def embed_and_norm(target: MuseSpark1xForCausalLM):
    """tokens → (the FP32 stream entering layer 0, its input norm): ``LayeredPrefill``'s ``embed``."""

    def embed(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stream = target.embed_stream(tokens)
        return stream, target.model.layers[0].input_norm(stream, target.dtype)

    return embed


class LayeredPrefill(_Layered):
    """Prompt chunks from their compiled parts (one, or the engine's prefill batch P: the packages' batch):
    ``fn(weights, tk, tv, dk, dv, tokens, positions, slots, last, seeds, temperature)`` → ``[P]``. The embedding lookup and layer 0's input norm
    (``embed``: tokens → the FP32 stream and its norm, the reference modules') run uncompiled: a
    gather and a norm."""

    def __init__(self, names, layers, aux_layer_ids, embed, layer_fn, finish_fn):
        super().__init__(names, layers, aux_layer_ids, layer_fn)
        self.embed, self.finish_fn = embed, finish_fn
        self.table: torch.Tensor | None = None  # paged caches: the engine's block tables (``LayeredStep.table``)

    def __call__(self, weights, tk, tv, dk, dv, tokens, positions, slots, last, seeds, temperature, with_h=False):
        """→ the token after each chunk's ``last`` ([P]); ``with_h``: (it, h [P, C, D]: the final norm of the
        chunks' last stream, for a caller that samples a first token itself)."""
        head = [weights[j] for j in self.head_idx]
        stream, x = self.embed(tokens)
        if self.table is not None:
            slots = self.table.index_select(0, slots)
        h, aux = self.layers(weights, tk, tv, stream, x, positions, slots)
        first = self.finish_fn(head, dk, dv, h, aux, positions, slots, last, seeds, temperature)
        return (first, h) if with_h else first
