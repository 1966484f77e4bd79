"""The engine's ONNX parts (``builder.onnx_export``) run on CPU with ``onnx.reference`` or onnxruntime.

This is how the ``tensorrt`` backend's input is tested where TensorRT cannot run: each part's ONNX
graph, its ``muse_spark`` plugin nodes computed by the plugins' reference functions
(``plugin_ops``; on onnxruntime the same functions as onnxruntime-extensions Python ops),
composed by the very ``LayeredStep`` / ``LayeredPrefill`` that compose the AOTI packages, so a step
from the ONNX graphs can be compared with the eager engine's: its rows bit for bit, in float32.
(``onnx.reference`` is numpy, written for checking, not speed: tiny models only.)

The plugin nodes' contract (the schemas a TensorRT plugin implements, ``builder.tensorrt``):

* ``GatedResidualAdd(stream, branch, gate, norm_weight, branch_norm_weight)`` → ``(stream_out,
  normed)``, attributes ``eps``, ``zero_centered``, ``apply_norm``, ``out_dtype`` (an ONNX
  ``TensorProto`` type), ``norm_branch``: ``torch.ops.muse_spark.gated_residual_add``.
* ``MarkovSample(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature,
  head_w, head_b)`` → ``(ids, probs)``, attributes ``head_type``, ``topk``:
  ``torch.ops.muse_spark.markov_sample``.

An input the op takes as None is an empty tensor (shape [0]); every node also carries
``plugin_namespace = "muse_spark"``, by which TensorRT's ONNX parser finds the plugin.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from muse_spark.plugins.onnx_types import torch_of_onnx

PLUGIN_DOMAIN = "muse_spark"
ONNX_LAYOUT = "onnx-1"
# Per part: the indices of its (non-weight) inputs it writes, returned in this order after its outputs.
MUTATED = {"layer": (0, 1), "step_draft": (0, 1, 2), "step_context": (0, 1), "prefill_finish": (0, 1),
           "step_verify": ()}
RETURNS = {"layer": "tuple", "step_draft": "tuple", "step_context": "none", "prefill_finish": "tensor",
           "step_verify": "tensor"}

def register_plugin_schemas() -> None:
    """Register the ``muse_spark`` nodes' schemas with ``onnx.defs`` (once a process), so that
    exporters and checkers know their inputs, outputs and attributes."""
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has("GatedResidualAdd", PLUGIN_DOMAIN):
        return
    A, P = OpSchema.AttrType, OpSchema.FormalParameterOption
    types = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(int64)"]

    def schema(name, inputs, outputs, attrs, doc):
        attrs = attrs + [("plugin_namespace", A.STRING)]  # (TensorRT's ONNX parser: the plugin's namespace)
        onnx.defs.register_schema(OpSchema(
            name, PLUGIN_DOMAIN, 1, doc=doc,
            inputs=[OpSchema.FormalParameter(n, f"I{i}", param_option=P.Single) for i, n in enumerate(inputs)],
            outputs=[OpSchema.FormalParameter(n, f"O{i}") for i, n in enumerate(outputs)],
            type_constraints=[(f"I{i}", types, "") for i in range(len(inputs))]
            + [(f"O{i}", types, "") for i in range(len(outputs))],
            attributes=[OpSchema.Attribute(a, t, a) for a, t in attrs]))

    schema("GatedResidualAdd", ["stream", "branch", "gate", "norm_weight", "branch_norm_weight"],
           ["stream_out", "normed"],
           [("eps", A.FLOAT), ("zero_centered", A.INT), ("apply_norm", A.INT), ("out_dtype", A.INT),
            ("norm_branch", A.INT)], "muse_spark::gated_residual_add: the gated FP32 residual add and the norm after it")
    schema("MarkovSample", "base_logits hidden anchor w1 w2 d2t seeds positions temperature head_w head_b".split(),
           ["ids", "probs"], [("head_type", A.STRING), ("topk", A.INT)],
           "muse_spark::markov_sample: the draft's γ-step Markov loop, keyed Gumbel sampling")


# ---- numpy <-> torch (onnx.reference holds bfloat16 as ml_dtypes' numpy type) --------------------
def to_torch(a) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import onnx.helper

        return t.view(torch.int16).numpy().view(onnx.helper.tensor_dtype_to_np_dtype(16))
    return t.numpy()


def _absent(a):  # an input the op took as None: an empty tensor in the graph
    return None if a is None or np.asarray(a).size == 0 else to_torch(a)


def gated_residual_add_np(stream, branch, gate, norm_weight, branch_norm_weight, eps, zero_centered, apply_norm,
                          out_dtype, norm_branch):
    """``GatedResidualAdd`` on numpy arrays: ``gated_residual_add_ref``."""
    from muse_spark.plugins.gated_residual.reference import gated_residual_add_ref

    out, normed = gated_residual_add_ref(to_torch(stream), to_torch(branch), to_torch(gate), _absent(norm_weight),
                                         float(eps), bool(zero_centered), bool(apply_norm), torch_of_onnx(out_dtype),
                                         _absent(branch_norm_weight), bool(norm_branch))
    return to_numpy(out), to_numpy(normed)


def markov_sample_np(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_w, head_b,
                     head_type, topk):
    """``MarkovSample`` on numpy arrays: ``markov_sample_ref``."""
    from muse_spark.plugins.markov.reference import markov_sample_ref

    head_type = head_type.decode() if isinstance(head_type, bytes) else head_type
    ids, probs = markov_sample_ref(*(to_torch(a) for a in (base_logits, hidden, anchor, w1, w2, d2t, seeds, positions,
                                                            temperature)),
                                   head_type, _absent(head_w), _absent(head_b), int(topk))
    return to_numpy(ids), to_numpy(probs)


def plugin_ops() -> list[type]:
    """``onnx.reference`` implementations of the ``muse_spark`` nodes: the plugins' references."""
    from onnx.reference.op_run import OpRun

    class GatedResidualAdd(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, stream, branch, gate, norm_weight, branch_norm_weight, eps=None, zero_centered=None,
                 apply_norm=None, out_dtype=None, norm_branch=None, plugin_namespace=None):
            return gated_residual_add_np(stream, branch, gate, norm_weight, branch_norm_weight, eps, zero_centered,
                                         apply_norm, out_dtype, norm_branch)

    class MarkovSample(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_w, head_b,
                 head_type=None, topk=None, plugin_namespace=None):
            return markov_sample_np(base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature, head_w,
                                    head_b, head_type, topk)

    class GatherElements(OpRun):
        # onnx.reference's own does not normalize a negative axis (it compares the index's shape
        # with the data's around axis -1 as a slice bound, and refuses valid inputs): numpy's
        # take_along_axis is the operator's definition
        op_domain = ""

        def _run(self, data, indices, axis=None):
            return (np.take_along_axis(data, indices.astype(np.int64), axis=int(axis or 0) % data.ndim),)

    return [GatedResidualAdd, MarkovSample, GatherElements]


_ORT_DOMAIN = "ai.onnx.contrib"  # (onnxruntime-extensions' Python ops live in this domain)
_ORT_REGISTERED: list = []  # (True once the ops are registered: they are global to the process)


def register_onnxruntime_ops() -> str:
    """The ``muse_spark`` nodes as onnxruntime-extensions Python ops (float32 graphs: their input
    types are fixed), computed by the plugins' references (``plugin_ops``); → the extensions'
    library for ``SessionOptions.register_custom_ops_library``. Once a process."""
    from onnxruntime_extensions import PyCustomOpDef as T
    from onnxruntime_extensions import get_library_path, onnx_op

    if not _ORT_REGISTERED:
        f, i, text = T.dt_float, T.dt_int64, T.dt_string
        onnx_op(op_type="GatedResidualAdd", inputs=[f] * 5, outputs=[f, f],
                attrs={"eps": f, "zero_centered": i, "apply_norm": i, "out_dtype": i, "norm_branch": i,
                       "plugin_namespace": text})(_without_namespace(gated_residual_add_np))
        onnx_op(op_type="MarkovSample", inputs=[f, f, i, f, f, i, i, i, f, f, f], outputs=[i, f],
                attrs={"head_type": text, "topk": i, "plugin_namespace": text})(_without_namespace(markov_sample_np))
        _ORT_REGISTERED.append(True)
    return get_library_path()


def _without_namespace(fn):
    def op(*inputs, plugin_namespace=None, **attrs):
        return fn(*inputs, **attrs)

    return op


class OnnxPart:
    """One ONNX part, called as the AOTI package of the same name is (``part(weights, *inputs)`` →
    its outputs), on ``onnx.reference`` or (``runtime="onnxruntime"``, float32 graphs) on
    onnxruntime with its extensions' Python ops for the plugin nodes (moved to their domain in a
    copy of the graph); the caches it returns are written back into its inputs."""

    def __init__(self, path: str | Path, fn: str, runtime: str = "reference"):
        import onnx

        self.path, self.fn, self.runtime = Path(path), fn, runtime
        model = onnx.load(str(self.path))
        self.inputs = [i.name for i in model.graph.input]
        self.outputs = [o.name for o in model.graph.output]
        if runtime == "reference":
            from onnx.reference import ReferenceEvaluator

            self.session = ReferenceEvaluator(model, new_ops=plugin_ops())
        elif runtime == "onnxruntime":
            import onnxruntime as ort

            for node in model.graph.node:
                if node.domain == PLUGIN_DOMAIN:
                    node.domain = _ORT_DOMAIN
            for imp in model.opset_import:
                if imp.domain == PLUGIN_DOMAIN:
                    imp.domain = _ORT_DOMAIN
            options = ort.SessionOptions()
            options.register_custom_ops_library(register_onnxruntime_ops())
            self.session = ort.InferenceSession(model.SerializeToString(), options,
                                                providers=["CPUExecutionProvider"])
        else:
            raise ValueError(f"unknown ONNX runtime {runtime!r} (expected 'reference' or 'onnxruntime')")

    def __call__(self, weights, *inputs):
        leaves = part_leaves(self.path, len(self.inputs), weights, inputs)
        out = self.session.run(None, {n: to_numpy(t) for n, t in zip(self.inputs, leaves)})
        return finish_part(self.fn, inputs, [to_torch(a) for a in out])


def part_leaves(path: Path, n: int, weights, inputs) -> list[torch.Tensor]:
    """A part's call as its graph's flat inputs (the weights, then every input's tensors in order)."""
    leaves = torch.utils._pytree.tree_leaves((list(weights), *inputs))
    if len(leaves) != n:
        raise ValueError(f"{path.name}: {len(leaves)} inputs given, the graph takes {n}")
    return leaves


def finish_part(fn: str, inputs, outs: list[torch.Tensor]):
    """A part's graph outputs → what its AOTI package returns: the updated caches (the last
    outputs, ``MUTATED[fn]``) written back into the inputs they replace, then the part's own
    outputs as ``SpecPair.<fn>`` returns them."""
    dst = torch.utils._pytree.tree_leaves([inputs[i] for i in MUTATED[fn]])
    k = len(outs) - len(dst)
    for d, new in zip(dst, outs[k:]):
        d.copy_(new.to(d.dtype))
    own = outs[:k]
    return {"tuple": tuple(own), "tensor": own[0] if own else None, "none": None}[RETURNS[fn]]
