"""Target-only decoding: the output speculative decoding must reproduce.

Greedy speculative output must equal this token for token; sampled output must
have the same distribution (and, keyed by the same seed, shares the bonus
noise stream ``SALT_TARGET`` position by position).
"""

from __future__ import annotations

import torch

from muse_spark.runtime.generator import Generator, SamplingParams


def generate_target_only(engine, prompt: list[int], params: SamplingParams, slot: int = 0) -> list[int]:
    gen = Generator(engine)
    req = gen.add(prompt, params)  # same validation and stop handling as the speculative path
    gen.waiting.remove(req)
    p, dev = req.params, engine.device
    seeds = torch.tensor([p.seed], device=dev, dtype=torch.int64)
    temps = torch.tensor([float(p.temperature)], device=dev, dtype=torch.float32)
    slots = torch.tensor([slot], device=dev)
    tok = engine.prefill(req.prompt, slot, p.seed, float(p.temperature))
    pos = len(req.prompt)
    gen._emit(req, [int(tok.item())])
    while not req.finished:
        tok = engine.target_step(tok, torch.tensor([pos], device=dev), slots, seeds, temps, pos + 1)
        pos += 1
        gen._emit(req, [int(tok.item())])
    return req.output
