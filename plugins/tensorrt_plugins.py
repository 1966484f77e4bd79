"""TensorRT plugins for the ONNX graphs' ``muse_spark`` nodes (``builder.onnx_export``).

Written against TensorRT's quickly deployable plugin API (``tensorrt.plugin``, TensorRT ≥ 10.9):
``@register`` gives each node's output shapes and types, ``@impl`` runs it on TensorRT's stream
with this project's Triton kernels (``plugins.triton_ops``, through ``plugins.dispatch``), on
tensors viewed in place with ``torch.as_tensor``. The ONNX parser maps a node to the plugin of its
``op_type`` in the namespace of its ``plugin_namespace`` attribute: ``muse_spark::GatedResidualAdd``
and ``muse_spark::MarkovSample``. Their contract is ``graphs.onnx_parts``' (an input the torch op
takes as None is an empty tensor).

**Unverified here**: TensorRT does not install in this workplace (its wheels come from NVIDIA's
own index), so this module has not been imported against a real ``tensorrt``; the ONNX graphs it
serves are tested on CPU (``tests/test_onnx_export.py``). Importing it registers the plugins;
a process that builds or deserializes a plan with these nodes must import it first.
"""

from __future__ import annotations

from typing import Tuple

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from muse_spark.plugins import dispatch
from muse_spark.plugins.onnx_types import torch_of_onnx

# ONNX TensorProto type codes (the nodes' out_dtype) → TensorRT's
_TRT = {1: trt.float32, 10: trt.float16, 16: trt.bfloat16, 7: trt.int64}


def _view(t: "trtp.Tensor") -> torch.Tensor | None:
    """A plugin tensor as a torch tensor on its memory (None for an absent input: empty)."""
    return None if t.numel() == 0 else torch.as_tensor(t, device="cuda")


@trtp.register("muse_spark::GatedResidualAdd")
def gated_residual_add_desc(residual: trtp.TensorDesc, branch: trtp.TensorDesc, gate: trtp.TensorDesc,
                            norm_weight: trtp.TensorDesc, branch_norm_weight: trtp.TensorDesc, eps: float,
                            zero_centered: int, apply_norm: int, out_dtype: int,
                            norm_branch: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    normed = trtp.from_shape_expr(residual.shape_expr if apply_norm else (0,), dtype=_TRT[out_dtype])
    return residual.like(), normed


@trtp.impl("muse_spark::GatedResidualAdd")
def gated_residual_add_impl(residual: trtp.Tensor, branch: trtp.Tensor, gate: trtp.Tensor, norm_weight: trtp.Tensor,
                            branch_norm_weight: trtp.Tensor, eps: float, zero_centered: int, apply_norm: int,
                            out_dtype: int, norm_branch: int, outputs: Tuple[trtp.Tensor], stream: int) -> None:
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)), dispatch.plugin_impl("triton"):
        out, normed = dispatch.gated_residual_add(
            _view(residual), _view(branch), _view(gate), _view(norm_weight), eps, bool(zero_centered),
            bool(apply_norm), torch_of_onnx(out_dtype), _view(branch_norm_weight), bool(norm_branch))
        _view(outputs[0]).copy_(out)
        if apply_norm:
            _view(outputs[1]).copy_(normed)


@trtp.register("muse_spark::MarkovSample")
def markov_sample_desc(base_logits: trtp.TensorDesc, hidden: trtp.TensorDesc, anchor: trtp.TensorDesc,
                       w1: trtp.TensorDesc, w2: trtp.TensorDesc, d2t: trtp.TensorDesc, seeds: trtp.TensorDesc,
                       positions: trtp.TensorDesc, temperature: trtp.TensorDesc, head_w: trtp.TensorDesc,
                       head_b: trtp.TensorDesc, head_type: str,
                       topk: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    shape = base_logits.shape_expr  # [B, γ, Vd]
    return (trtp.from_shape_expr((shape[0], shape[1]), dtype=trt.int64),
            trtp.from_shape_expr(shape, dtype=trt.float32))


@trtp.impl("muse_spark::MarkovSample")
def markov_sample_impl(base_logits: trtp.Tensor, hidden: trtp.Tensor, anchor: trtp.Tensor, w1: trtp.Tensor,
                       w2: trtp.Tensor, d2t: trtp.Tensor, seeds: trtp.Tensor, positions: trtp.Tensor,
                       temperature: trtp.Tensor, head_w: trtp.Tensor, head_b: trtp.Tensor, head_type: str, topk: int,
                       outputs: Tuple[trtp.Tensor], stream: int) -> None:
    # (the fused kernel's workspace zeroed per call: a plan keeps no state between calls; topk is 0:
    # the export refuses a draft with dspark_draft_topk, which the fused kernel does not take)
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)), dispatch.plugin_impl("triton"):
        ids, probs = dispatch.markov_sample(
            *(_view(t) for t in (base_logits, hidden, anchor, w1, w2, d2t, seeds, positions, temperature)),
            head_type, _view(head_w), _view(head_b), topk)
        _view(outputs[0]).copy_(ids)
        _view(outputs[1]).copy_(probs)
