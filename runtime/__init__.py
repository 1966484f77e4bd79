"""The Muse Spark runtime: engine directories → lossless speculative generation.

    from muse_spark.runtime import load_engine, Generator, SamplingParams
    engine = load_engine("engines/tiny")
    gen = Generator(engine)
    for tokens in gen.stream([1, 2, 3], SamplingParams(max_tokens=32)):
        ...

The runtime reads engine directories only; it never imports builder code.
"""

from __future__ import annotations

from pathlib import Path

from muse_spark.engine_format import EngineError, read_manifest
from muse_spark.runtime.engine import EagerEngine
from muse_spark.runtime.generator import Generator, Request, RequestError, SamplingParams, StepRecord

__all__ = [
    "EagerEngine",
    "EngineError",
    "Generator",
    "Request",
    "RequestError",
    "SamplingParams",
    "StepRecord",
    "load_engine",
    "load_tokenizer",
]


def load_engine(engine_dir: str | Path, device: str | None = None, **kw):
    """Load an engine directory with the backend its manifest names. ``kv_tokens`` (or ``kv_memory_fraction``:
    that fraction of the memory available once the weights are loaded) and ``kv_block_size``: paged KV caches
    of an eager engine, a pool of that many positions (``runtime/kv_blocks.py``). ``swap_space``: GiB of host
    memory for the K/V of requests preempted from a paged pool, any backend's (default 4; past it a preempted
    request is recomputed)."""
    m = read_manifest(engine_dir)
    backend = m["backend"]
    if kw.get("kv_tokens") is None and kw.get("kv_memory_fraction") is None:
        for k in ("kv_tokens", "kv_memory_fraction", "kv_block_size"):
            kw.pop(k, None)
    elif backend != "eager":
        raise EngineError(f"{engine_dir}: a {backend!r} engine's KV caches are laid out when it is built (a paged "
                          f"pool: `muse-spark build --backend aoti --kv-cache-tokens N`); only an eager engine takes "
                          f"a pool when it is loaded")
    if backend == "eager":
        return EagerEngine.from_dir(engine_dir, device=device, **kw)
    if backend == "aoti":
        from muse_spark.runtime.aoti_engine import AOTIEngine  # loads torch._inductor: only when needed

        return AOTIEngine.from_dir(engine_dir, device=device, **kw)
    if backend == "tensorrt":
        from muse_spark.runtime.tensorrt_engine import TensorRTEngine

        return TensorRTEngine.from_dir(engine_dir, device=device, **kw)
    if backend == "migraphx":
        from muse_spark.runtime.migraphx_engine import MIGraphXEngine

        return MIGraphXEngine.from_dir(engine_dir, device=device, **kw)
    raise EngineError(f"{engine_dir}: engine backend {backend!r} is not supported by this runtime")


def load_tokenizer(path: str | Path | None):
    """The ``tokenizers`` tokenizer at ``path``, or None where there is no file; a file that is not a
    tokenizer raises ``EngineError``."""
    if path is None or not Path(path).is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # (tokenizers raises plain Exception)
        raise EngineError(f"{path}: not a readable tokenizer.json ({e})") from None
