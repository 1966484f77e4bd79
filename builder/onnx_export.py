"""The engine's parts as ONNX graphs with plugin nodes: the input of the ``tensorrt`` backend.

The ``tensorrt`` backend is ONNX with plugin nodes → TensorRT's ONNX parser + IPluginV3 plugins (docs/tensorrt.md).
This module writes the ONNX half. Each part the ``aoti`` engine compiles (``graph_plan_names``:
``prefill_layer``, ``prefill_finish``, and per batch bucket ``step_draft``, ``step_layer``,
``step_verify``, ``step_context``) is exported with ``torch.export`` exactly as for AOTInductor
(``graphs.parts.SpecPair``, the same flat weight inputs), with the plugins as their
``torch.ops.muse_spark`` custom ops (``plugin_impl("op")``), then translated by
``torch.onnx.export`` (the dynamo exporter) with those ops mapped to nodes of the ``muse_spark``
domain (``graphs.onnx_parts`` gives their contract): ``GatedResidualAdd`` and ``MarkovSample``, each
with the ``plugin_namespace`` attribute by which TensorRT's ONNX parser finds the plugin of that
name (``muse_spark::GatedResidualAdd``), and fixed inputs (an empty tensor where the op had None). A TensorRT build
(``builder.tensorrt``) implements them as plugins; ``graphs.onnx_parts`` runs them on CPU with
``onnx.reference`` and the plugins' reference functions.

What differs from the AOTI packages:

* **Caches are outputs too.** ONNX has no in-place update, and the exporter drops a mutation of
  a graph input. So each part that writes caches (``layer``: its K/V; ``step_draft`` and
  ``step_context``, ``prefill_finish``: the draft's K/V; ``step_draft``: the Markov workspace)
  returns the updated tensors after its own outputs, in the order of ``MUTATED``; the runner
  writes them back.
* Weights stay graph inputs (not initializers): an 8B target's 16 GB are not copied into every
  graph, and the files stay small.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from muse_spark.builder.limits import check_max_batch, check_max_seq
from muse_spark.graphs.parts import GraphFn, SpecPair, build_pair, weight_specs
from muse_spark.graphs.onnx_parts import MUTATED, ONNX_LAYOUT, PLUGIN_DOMAIN, register_plugin_schemas
from muse_spark.plugins.onnx_types import onnx_dtype

OPSET = 18


class FunctionalPart(nn.Module):
    """``GraphFn`` returning, after its outputs, the inputs it mutates (``MUTATED[fn]``): what an
    ONNX graph can express."""

    def __init__(self, graph_fn: GraphFn):
        super().__init__()
        self.graph_fn = graph_fn

    def forward(self, weights, *inputs):
        out = self.graph_fn(weights, *inputs)
        out = tuple(out) if isinstance(out, (tuple, list)) else (() if out is None else (out,))
        return (*out, *[inputs[i] for i in MUTATED[self.graph_fn.fn]])


def translation_table() -> dict:
    """torch ops → ONNX for ``torch.onnx.export``: the plugins as ``muse_spark`` nodes, and
    ``prims.prod`` (the acceptance's running product), for which torch 2.13's exporter has none."""
    import onnx
    import onnxscript
    from onnxscript import opset18 as op

    register_plugin_schemas()
    ms = onnxscript.values.Opset(PLUGIN_DOMAIN, 1)

    def absent(t):  # (a plugin node has fixed inputs, as a TensorRT plugin's signature: an empty tensor for none)
        return op.Constant(value=onnx.helper.make_tensor("absent", onnx.TensorProto.FLOAT, [0], [])) if t is None else t

    def gated_residual_add(stream, branch, gate, norm_weight, eps, zero_centered, apply_norm, out_dtype,
                           branch_norm_weight=None, norm_branch=False):
        return ms.GatedResidualAdd(stream, branch, gate, absent(norm_weight), absent(branch_norm_weight),
                                   eps=float(eps), zero_centered=int(zero_centered), apply_norm=int(apply_norm),
                                   out_dtype=onnx_dtype(out_dtype), norm_branch=int(norm_branch),
                                   plugin_namespace=PLUGIN_DOMAIN, _outputs=2)

    def markov_sample(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_type, head_w,
                      head_b, topk):
        return ms.MarkovSample(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, absent(head_w),
                               absent(head_b), head_type=str(head_type), topk=int(topk),
                               plugin_namespace=PLUGIN_DOMAIN, _outputs=2)

    def prod(x, dims, output_dtype=None):
        return op.ReduceProd(x, op.Constant(value_ints=[int(d) for d in dims]), keepdims=0)

    return {torch.ops.muse_spark.gated_residual_add.default: gated_residual_add,
            torch.ops.muse_spark.markov_sample.default: markov_sample,
            torch.ops.prims.prod.default: prod}


def export_part(job: dict, tcfg, dcfg, path: Path, table: dict) -> dict:
    """One part (a ``builder.aoti.graph_jobs`` job) → ``path`` (.onnx); → its graph entry.
    ``table``: ``translation_table()``."""
    import onnx

    from muse_spark.builder.aoti import fake_inputs
    from muse_spark.plugins.dispatch import plugin_impl

    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    t0 = time.perf_counter()
    pair = build_pair(tcfg, dcfg)
    names = [w[0] for w in job["weights"]]
    args = fake_inputs(job, tcfg, dcfg)
    with plugin_impl("op"):
        ep = torch.export.export(FunctionalPart(GraphFn(pair, job["fn"], names)), args, strict=False)
    program = torch.onnx.export(ep, dynamo=True, optimize=False, opset_version=OPSET,
                                custom_translation_table=table, verbose=False)
    model = program.model_proto
    onnx.save(model, str(path))
    n_in, n_args = len(model.graph.input), len(torch.utils._pytree.tree_leaves(args))
    if n_in != n_args:
        raise RuntimeError(f"{path.name}: the ONNX graph has {n_in} inputs, the part {n_args}"
                           " (an input the graph does not read was dropped?)")
    return {"file": path.name, "fn": job["fn"], "batch": job["batch"], "tokens": job["tokens"],
            "inputs": n_in, "outputs": len(model.graph.output), "mutated": len(MUTATED[job["fn"]]),
            "input_names": [i.name for i in model.graph.input], "output_names": [o.name for o in model.graph.output],
            "plugin_nodes": sorted({n.op_type for n in model.graph.node if n.domain == PLUGIN_DOMAIN}),
            "seconds": round(time.perf_counter() - t0, 1)}


def export_onnx(target, draft, out_dir: Path, *, max_batch: int, max_seq: int, buckets: list[int] | None = None,
                prefill_chunk: int | None = None, cache_slots: int | None = None, log: Callable[[str], None] = lambda m: None) -> dict:
    """Every part of the engine as ONNX into ``out_dir``; → the manifest's ``onnx`` section.
    ``cache_slots``: the caches' slots (default ``max_batch + 1``: a scratch slot for padding rows, as
    the ``aoti`` engine's)."""
    from muse_spark.builder.aoti import graph_jobs, graph_plan

    check_max_seq(target, draft, max_seq)
    if draft.cfg.dspark_draft_topk:
        raise ValueError("the MarkovSample plugin takes no dspark_draft_topk; it is not exported")
    if target.cfg.fp8_kv_cache:
        raise ValueError("the ONNX graphs keep the KV caches in the compute dtype: this target's FP8 KV cache "
                         "(its kv_cache_scheme) is not exported; export it with --kv-cache-dtype auto")
    device = "cpu"  # (the graphs are device-free: a TensorRT build places them)
    buckets, chunk = graph_plan("cuda", max_batch, max_seq, buckets, prefill_chunk)  # (a GPU's buckets: 1, 2, 4 …)
    wspecs = weight_specs(SpecPair(target, draft))
    cache_dtype = str(target.dtype).removeprefix("torch.")
    cache_slots = cache_slots or max_batch + 1
    jobs = graph_jobs(target.cfg, draft.cfg, wspecs, device=device, max_seq=max_seq, cache_slots=cache_slots,
                      buckets=buckets, prefill_chunk=chunk, impl="op", cache_dtype=cache_dtype, configs={},
                      out_dir=Path(out_dir))
    graphs, table = {}, translation_table()
    for i, job in enumerate(jobs, 1):
        graphs[job["name"]] = entry = export_part(job, target.cfg, draft.cfg, Path(out_dir) / f"{job['name']}.onnx",
                                                  table)
        log(f"onnx [{i}/{len(jobs)}] {job['name']}: {entry['inputs']} inputs, {entry['outputs']} outputs, "
            f"plugin nodes {entry['plugin_nodes'] or 'none'} ({entry['seconds']} s)")
    return {"layout": ONNX_LAYOUT, "opset": OPSET, "plugin_domain": PLUGIN_DOMAIN, "graphs": graphs,
            "batch_buckets": buckets, "prefill_chunk": chunk, "cache_slots": cache_slots, "scratch_slot": cache_slots - 1,
            "cache_dtype": cache_dtype, "weights": wspecs}


def new_out_dir(out: str | Path, max_batch: int) -> Path:
    """An export's checks before anything is loaded: ``max_batch``, and ``out`` new or empty (made)."""

    check_max_batch(max_batch)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def export_onnx_dir(target, draft, out: Path, *, max_batch: int, max_seq: int,
                    log: Callable[[str], None] = lambda m: None) -> dict:
    """``export_onnx`` into ``out`` (``new_out_dir``), with its section as ``onnx.json`` beside the graphs."""
    import json

    section = export_onnx(target, draft, out, max_batch=max_batch, max_seq=max_seq, log=log)
    (out / "onnx.json").write_text(json.dumps(section, indent=2) + "\n")
    return section
