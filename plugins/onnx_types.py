"""ONNX ``TensorProto`` type codes of the tensors the plugin nodes take and give (torch dtype ↔ code)."""

from __future__ import annotations

import torch

_TORCH_TO_ONNX = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16, torch.int64: 7, torch.int32: 6}


def onnx_dtype(dtype) -> int:
    """A torch dtype (or an ONNX ``TensorProto`` type already) → its ONNX ``TensorProto`` type."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_ONNX:
            raise ValueError(f"no ONNX type for {dtype}")
        return _TORCH_TO_ONNX[dtype]
    return int(dtype)


def torch_of_onnx(code: int) -> torch.dtype:
    for t, c in _TORCH_TO_ONNX.items():
        if c == int(code):
            return t
    raise ValueError(f"ONNX type {code} is not one the plugins take")
