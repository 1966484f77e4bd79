"""The ``tensorrt`` engine: the ``aoti`` engine's runtime over TensorRT plans.

A ``tensorrt`` engine directory holds the engine weights, each part as ONNX
(``builder.onnx_export``) and as a TensorRT plan (``builder.tensorrt``), and a manifest whose
``tensorrt`` section has the ``aoti`` section's keys. So ``AOTIEngine`` composes the parts
(``LayeredStep`` / ``LayeredPrefill``), slots, buckets and padding rows as it does for its packages;
only the parts differ: each is a ``TensorRTPart``, a plan run by an execution context on the
current CUDA stream, its updated caches (the graph's last outputs, ``onnx_parts.MUTATED``) copied
back into the engine's caches.

Thin on purpose, and **unverified here**: TensorRT does not install in this workplace. What can
run here is tested: the ONNX graphs, composed the same way on ``onnx.reference``
(``tests/test_onnx_export.py``). Known costs of this first form (docs/tensorrt.md): the steps
are not captured in CUDA graphs (the plugins are Python callbacks), and every cache a part writes
is copied back whole (ONNX has no in-place update; plugins that own the cache writes, with
TensorRT's aliased plugin outputs, would remove the copy).
"""

from __future__ import annotations

from pathlib import Path

import torch

from muse_spark.runtime.aoti_engine import AOTIEngine
from muse_spark.engine_format import EngineError
from muse_spark.graphs.onnx_parts import finish_part, part_leaves


def import_tensorrt():
    try:
        import tensorrt as trt

        import muse_spark.plugins.tensorrt_plugins  # noqa: F401  (the plans' plugins, registered)
    except ImportError as e:
        raise EngineError(f"a tensorrt engine needs TensorRT's Python package (tensorrt >= 10.9), which does not "
                          f"import here ({e})") from None
    return trt


class TensorRTPart:
    """One plan, called as the AOTI package of the same part is (``part(weights, *inputs)``)."""

    def __init__(self, path: Path, entry: dict, device: torch.device):
        trt = import_tensorrt()
        self.path, self.fn, self.device = Path(path), entry["fn"], device
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise EngineError(f"{self.path}: TensorRT cannot deserialize this plan (another TensorRT or GPU?); "
                              "rebuild the engine")
        self.context = self.engine.create_execution_context()
        self.inputs, self.outputs = entry["input_names"], entry["output_names"]
        self.types = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                      trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}
        self.placeholder = torch.zeros(16, dtype=torch.int64, device=device)  # (an address for empty tensors)

    def _address(self, t: torch.Tensor) -> int:
        return t.data_ptr() if t.numel() else self.placeholder.data_ptr()

    def __call__(self, weights, *inputs):
        leaves = part_leaves(self.path, len(self.inputs), weights, inputs)
        for name, t in zip(self.inputs, leaves):
            if not t.is_contiguous():
                raise ValueError(f"{self.path.name}: input {name} is not contiguous")
            self.context.set_tensor_address(name, self._address(t))
        outs = []
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            out = torch.empty(shape, dtype=self.types[self.engine.get_tensor_dtype(name)], device=self.device)
            self.context.set_tensor_address(name, self._address(out))
            outs.append(out)
        if not self.context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise EngineError(f"{self.path.name}: TensorRT's execute_async_v3 failed (its log says why)")
        return finish_part(self.fn, inputs, outs)


class TensorRTEngine(AOTIEngine):
    backend = "tensorrt"
    section = "tensorrt"

    def __init__(self, *args, cuda_graphs: bool = True, **kw):
        # (no CUDA graphs: the plugins run as Python callbacks, which a graph replay would not call)
        super().__init__(*args, cuda_graphs=False, **kw)

    def part_loader(self, d: Path, section: dict):
        graphs = section["graphs"]

        def load(name: str) -> TensorRTPart:
            if name not in graphs:
                raise EngineError(f"{d}: the manifest names no plan for part {name!r}; rebuild the engine")
            return TensorRTPart(d / graphs[name]["file"], graphs[name], self.device)

        return load

    @classmethod
    def check_section(cls, manifest: dict, where: str) -> None:
        if manifest.get("device", {}).get("kind") != "cuda":
            raise EngineError(f"{where}: a tensorrt engine runs on a CUDA GPU; this one's manifest says it was built "
                              f"for {manifest.get('device', {}).get('kind')!r}: rebuild it with --device cuda")
        trt = import_tensorrt()
        built = manifest["tensorrt"].get("tensorrt_version")
        if built != trt.__version__:
            raise EngineError(f"{where}: the plans were built with TensorRT {built}, this runtime has "
                              f"{trt.__version__}: a plan runs only on the TensorRT that built it; rebuild the engine")
