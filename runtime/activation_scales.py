"""Static activation scales for FP8 checkpoints (``muse-spark quantize --calibrate``): the bf16 pair's speculative
decoding on a few prompts with every quantizable projection's input observed (``observe_linear_inputs``); the
builder turns each projection's largest input |x| into its ``input_scale`` (docs/fp8.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from muse_spark.checkpoint import checkpoint_name, checkpoint_parts
from muse_spark.config import quantizable
from muse_spark.models.layers import observe_linear_inputs
from muse_spark.runtime.engine import EagerEngine
from muse_spark.runtime.generator import Generator, SamplingParams


def measure_input_amax(target: str | Path, draft: str | Path, prompts: list[list[int]], max_tokens: int = 32,
                       device: str = "cpu", log: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """Static activation scales' measurements: the bf16 pair's speculative decoding (greedy, ``max_tokens`` tokens of
    each of ``prompts``: the target's prefill and verification rows, the draft's blocks and context) with every
    quantizable projection's input observed → {"target": …, "draft": …}, each {checkpoint module name: the largest
    |x| its projection saw}, under both the stacked name (``self_attn.qkv_proj``) and its parts' (``q_proj`` …)."""
    if not prompts or not all(prompts):
        raise ValueError("calibration needs at least one non-empty prompt")
    longest = max(len(p) for p in prompts)
    engine = EagerEngine.from_checkpoints(target, draft, device=device, max_batch=min(8, len(prompts)),
                                          max_seq=longest + max_tokens + 64)
    owners: dict[int, tuple[str, str]] = {}  # a weight's storage → (target|draft, canonical module)
    for what, model in (("target", engine.target), ("draft", engine.draft)):
        for name, module in model.named_modules():
            if quantizable(name) and isinstance(module, torch.nn.Linear):
                owners[module.weight.untyped_storage().data_ptr()] = (what, name)
    amax: dict[tuple[str, str], float] = {}

    def observe(w, x):
        key = owners.get(w.untyped_storage().data_ptr()) if isinstance(w, torch.Tensor) else None
        if key is not None and x.numel():
            amax[key] = max(amax.get(key, 0.0), x.detach().abs().amax().float().item())

    t0 = time.perf_counter()
    with observe_linear_inputs(observe):
        reqs = Generator(engine).generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    missing = sorted(name for key, name in owners.values() if (key, name) not in amax)
    if missing:
        raise ValueError(f"calibration saw no input for {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}")
    out: dict[str, dict[str, float]] = {"target": {}, "draft": {}}
    for (what, name), value in amax.items():
        cfg = engine.tcfg if what == "target" else engine.dcfg
        for ck in [checkpoint_name(cfg, name)] + checkpoint_parts(cfg, name):
            out[what][ck] = value
    log(f"[calibrate] measured {len(amax)} projections' activation scales on {len(prompts)} prompts "
        f"({sum(len(r.output) for r in reqs)} tokens generated) in {time.perf_counter() - t0:.1f}s")
    return out
