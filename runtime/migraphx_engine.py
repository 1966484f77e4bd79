"""The ``migraphx`` engine: the ROCm fallback (docs/design.md).

An engine directory like the eager backend's (the canonical weights, the manifest), run by the
reference modules; where ``torch_migraphx`` is installed on a ROCm GPU, the speculative step is
compiled through MIGraphX with ``torch.compile(backend="migraphx")`` (importing ``torch_migraphx``
registers that dynamo backend), else it runs as plain eager, with the reason logged once.

The compiled step is the eager step's body (``EagerEngine.step``) traced whole (``fullgraph``: a
graph break would fall back to Python between MIGraphX programs) over a static key window, every
query attending over ``[0, max_seq)`` with the position mask as the aoti packages do, so one
compiled graph serves every step of a batch size; each batch size compiles once. The KV caches
are static addresses (written in place). The plugins run their reference functions inline
(``plugin_impl("inline")``), so the captured graph holds aten ops only; on ROCm the attention and
linear layers run their reference forms too (the Triton kernels are the NVIDIA path:
``models.layers.attention_path``). The prompt's prefill runs eager (its chunk lengths vary).

Not verified here: this workplace has no AMD GPU and ``migraphx`` is a PyPI placeholder. What is
tested (``tests/test_migraphx.py``, on CPU) is everything up to the backend: the build, the
fallback and its reason, and the compiled path through ``torch.compile`` with the backend swapped
for torch's own ``"eager"`` backend (the same dynamo graph capture, run by torch), whose tokens
equal the eager engine's.
"""

from __future__ import annotations

import inspect
import logging

import torch

from muse_spark.plugins.dispatch import plugin_impl
from muse_spark.runtime.engine import EagerEngine, with_options

log = logging.getLogger(__name__)

MIGRAPHX_BACKEND = "migraphx"


def migraphx_unavailable(device: torch.device) -> str | None:
    """Why the step cannot be compiled through MIGraphX here, or None where it can."""
    if device.type != "cuda" or torch.version.hip is None:
        where = f"a {device.type} device" if device.type != "cuda" else "a CUDA (not ROCm) build of torch"
        return f"MIGraphX compiles for ROCm GPUs, this engine runs on {where}"
    try:
        import torch_migraphx  # noqa: F401  (registers the "migraphx" torch.compile backend)
    except ImportError as e:
        return f"torch_migraphx does not import ({e}); pip install torch_migraphx for the compiled step"
    return None


def compile_step(engine: EagerEngine, backend: str):
    """``engine``'s speculative step compiled by ``torch.compile`` with ``backend``, over the static key
    window ``[0, max_seq)``: ``fn(anchor, anchor_pos, slots, seeds, temperature)`` → packed ``[B, γ+2]``."""
    for cache in (engine.target_cache, engine.draft_cache):
        for t in (*cache.k, *cache.v):
            torch._dynamo.mark_static_address(t)  # written in place, never copied
    body = inspect.unwrap(EagerEngine.step)  # (without its decorators: the caller holds inference mode and the options)
    max_seq = engine.max_seq

    def step(anchor, anchor_pos, slots, seeds, temperature):
        return body(engine, anchor, anchor_pos, slots, seeds, temperature, max_seq)

    # one graph per batch size (dynamic=False: MIGraphX compiles static shapes), each compiled once
    limit = max(torch._dynamo.config.recompile_limit, engine.max_batch + 1)
    torch._dynamo.config.recompile_limit = limit
    return torch.compile(step, backend=backend, fullgraph=True, dynamic=False)


class MIGraphXEngine(EagerEngine):
    backend = "migraphx"
    schedules = False  # (its compiled step verifies all γ drafts: schedule 'off')
    controls = False  # (its compiled step samples with temperature and seed only)

    def __init__(self, *args, compile_backend: str | None = MIGRAPHX_BACKEND, **kw):
        """``compile_backend``: the torch.compile backend of the step ("migraphx"; tests pass torch's
        "eager" to check the graph capture where MIGraphX is missing; None: plain eager)."""
        super().__init__(*args, **kw)
        self.compiled = None
        self.fallback = None  # why the step runs plain eager
        if compile_backend == MIGRAPHX_BACKEND:
            self.fallback = migraphx_unavailable(self.device)
        elif compile_backend is None:
            self.fallback = "no compile backend was asked for"
        if self.fallback is not None:
            log.warning("migraphx engine: %s; the speculative step runs the plain eager path", self.fallback)
        else:
            self.compiled = compile_step(self, compile_backend)

    @with_options
    @torch.inference_mode()
    def step(self, anchor, anchor_pos, slots, seeds, temperature, kv_len: int) -> torch.Tensor:
        """``EagerEngine.step``; compiled, over the static window (``kv_len`` only guards it)."""
        if self.compiled is None:
            return super().step(anchor, anchor_pos, slots, seeds, temperature, kv_len)
        if kv_len > self.max_seq:
            raise ValueError(f"kv_len {kv_len} exceeds the engine's max_seq {self.max_seq}")
        # The plugins' reference functions inline, so that the graph MIGraphX gets holds aten ops only,
        # not the Python-registered muse_spark ops it cannot compile.
        with plugin_impl("inline"):
            return self.compiled(anchor, anchor_pos, slots, seeds, temperature)
