"""What a program outside this Python runtime needs to drive an ``aoti`` engine's packages.

The C++ embedding (``cxx/``, docs/cxx.md) loads the packages with the AOTI C++
loader and calls them as ``muse_spark/graphs/parts.py``'s ``LayeredPrefill`` and
``LayeredStep`` do. It holds no model code, so the builder writes down, in the
manifest's ``embedding`` section, everything the Python runtime derives from its
reference modules:

* ``weight_sources``: for each of the graphs' flat weights (``aoti.weights``, in
  order), the engine file and tensor it is read from, cast to the weight's dtype.
  Tensors the runtime computes at load time (the materialized residual gates
  ``g = residual_multiplier · gate``, the residual kernels' zeroed words) are
  written by the builder into ``derived.safetensors``, with the same values.
* ``head_weights``, ``layer_weights``: the indices into that flat list of the
  weights each part reads (``part_weight_names``); ``aux_layer_ids``: the target
  layers whose output streams the draft reads.
* ``prefill_embed``: the prompt chunk's uncompiled start, the embedding gather
  and layer 0's input norm (``embed_and_norm``: ``plugins/norm.py``'s formula).
* ``caches``: the KV caches' shapes and dtype (allocated once, zeroed).
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from muse_spark.graphs.parts import (EMBED, INPUT_NORM, LAYER_PREFIX, SpecPair, _Layered, weight_names,
                                            weight_tensors)

DERIVED_FILE = "derived.safetensors"
# The section's own version: a C++ library of another version refuses the engine ("rebuild it").
EMBEDDING_VERSION = 1


def embedding_section(target, draft, out_dir: Path, *, cache_slots: int, max_seq: int) -> dict:
    """Write ``derived.safetensors`` into ``out_dir`` (beside ``target``/``draft.safetensors``, which
    hold ``target.state_dict()`` / ``draft.state_dict()``) → the manifest's ``embedding`` section."""
    pair = SpecPair(target, draft)
    names = weight_names(pair)
    tensors = weight_tensors(pair, names)
    files = {"target": ("target.safetensors", set(target.state_dict())),
             "draft": ("draft.safetensors", set(draft.state_dict()))}
    sources, derived, seen = [], {}, {}
    for name, t in zip(names, tensors):
        root, _, key = name.partition(".")
        file, keys = files[root]
        same = (t.data_ptr(), t.dtype, tuple(t.shape))  # (a tied weight: the same tensor under another name)
        if key in keys:
            src = [file, key]
        elif same in seen and t.numel():
            src = seen[same]
        else:
            derived[name] = t.detach().contiguous().cpu().clone()
            src = [DERIVED_FILE, name]
        seen.setdefault(same, src)
        sources.append(src)
    save_file(derived, str(out_dir / DERIVED_FILE))

    parts = _Layered(names, target.cfg.num_hidden_layers, target.aux_layer_ids, None)
    where = {n: i for i, n in enumerate(names)}
    norm = f"{LAYER_PREFIX}0.{INPUT_NORM}"

    def cache(model) -> dict:
        c = model.allocate_cache(cache_slots, max_seq, "meta")
        return {"layers": len(c.k), "shape": list(c.k[0].shape), "dtype": str(c.k[0].dtype).removeprefix("torch.")}

    return {
        "version": EMBEDDING_VERSION,
        "weight_sources": sources,
        "head_weights": parts.head_idx,
        "layer_weights": parts.layer_idx,
        "aux_layer_ids": sorted(parts.aux_layer_ids),
        "prefill_embed": {"embedding": where[EMBED], "norm": where.get(norm), "eps": target.cfg.rms_norm_eps,
                          "zero_centered": bool(target.cfg.norm_zero_centered_gamma)},
        "caches": {"target": cache(target), "draft": cache(draft)},
    }
