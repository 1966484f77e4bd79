"""The ``tensorrt`` backend's build: the ONNX parts (``builder.onnx_export``) → TensorRT plans.

Each ONNX part is parsed by TensorRT's ONNX parser (its ``muse_spark`` nodes found as the plugins
of ``plugins.tensorrt_plugins``) into a strongly typed network (the ONNX graph's own types: no
precision is chosen for it) and built into a serialized plan, ``<part>.plan``, beside the ONNX file.
The plans are specific to the GPU and the TensorRT version they were built with; the manifest
records both and the runtime (``runtime.tensorrt_engine``) refuses another.

**Unverified here**: TensorRT does not install in this workplace (its wheels come from NVIDIA's
own index). The ONNX graphs are tested on CPU (``tests/test_onnx_export.py``); this module's calls
are TensorRT 10's Python API as documented, not run. ``require_tensorrt`` gives the reason a
build cannot start.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from muse_spark.graphs.parts import LAYOUT

TENSORRT_LAYOUT = "tensorrt-1"


def require_tensorrt():
    """→ the ``tensorrt`` module, or a ``ValueError`` saying why a build cannot use it."""
    try:
        import tensorrt as trt
        import tensorrt.plugin  # noqa: F401  (the quickly deployable plugins: TensorRT ≥ 10.9)
    except ImportError as e:
        raise ValueError(
            f"backend 'tensorrt' needs TensorRT's Python package with tensorrt.plugin (TensorRT >= 10.9), which "
            f"does not import here ({e}). It installs from NVIDIA's index (pip install tensorrt "
            "--extra-index-url https://pypi.nvidia.com). `muse-spark export-onnx` writes the ONNX graphs a "
            "TensorRT build takes; --backend aoti is the tested NVIDIA path") from None
    return trt


def build_plan(trt, onnx_path: Path, plan_path: Path, workspace_gb: float, logger) -> float:
    """One ONNX part → a serialized plan; → seconds."""
    t0 = time.perf_counter()
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser refused {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT could not build a plan from {onnx_path.name} (its log above says why)")
    plan_path.write_bytes(bytes(plan))
    return time.perf_counter() - t0


def build_tensorrt(target, draft, out_dir: Path, *, max_batch: int, max_seq: int, buckets: list[int] | None = None,
                   prefill_chunk: int | None = None, workspace_gb: float = 4.0,
                   log: Callable[[str], None] = lambda m: None) -> dict:
    """The ONNX parts and their plans into ``out_dir``; → the manifest's ``tensorrt`` section (the
    ``aoti`` section's keys, so that the runtime composes the parts as the aoti engine's)."""
    trt = require_tensorrt()
    import muse_spark.plugins.tensorrt_plugins  # noqa: F401  (registers the plugins with TensorRT)
    from muse_spark.builder.onnx_export import export_onnx

    section = export_onnx(target, draft, out_dir, max_batch=max_batch, max_seq=max_seq, buckets=buckets,
                          prefill_chunk=prefill_chunk, log=log)
    logger = trt.Logger(trt.Logger.WARNING)
    graphs = {}
    for i, (name, g) in enumerate(section["graphs"].items(), 1):
        plan = f"{name}.plan"
        seconds = build_plan(trt, out_dir / g["file"], out_dir / plan, workspace_gb, logger)
        graphs[name] = dict(g, file=plan, onnx=g["file"])
        log(f"tensorrt [{i}/{len(section['graphs'])}] {plan} ({seconds:.1f} s)")
    return dict(section, layout=LAYOUT, onnx_layout=section["layout"], tensorrt_layout=TENSORRT_LAYOUT,
                tensorrt_version=trt.__version__, graphs=graphs,
                markov_workspace_words={str(b): 0 for b in section["batch_buckets"]})
