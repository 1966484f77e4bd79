"""``muse-spark calibrate``: the step's measured cost against the drafts it verifies, per batch size,
the table a confidence schedule cuts its batches by (``muse_spark.schedule``).

For each batch size B and each K = 0 … γ, the engine's step runs with every request verifying
exactly K drafts (``Schedule("fixed", length=K)``) on B prompts already prefilled, and the median of
``iters`` timed steps (the device synchronized around each) is the table's entry. A compiled engine
verifies only the widths it was built with (``verify_widths``): those are timed, and each K's entry is
the time of the narrowest width ≥ K (the step that runs when the plan cuts at K). The table is
written into the engine's manifest (``schedule.cost_ms``) with the policy, so every load of the engine
schedules by it; measure on the machine that will serve (the table is that device's).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from muse_spark.engine_format import EngineError, read_manifest
from muse_spark.schedule import Schedule


def median_ms(fn, device: torch.device, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls after one warm-up, the device synchronized
    around each (wall clock: what a caller waits)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(iters + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cost_table(engine, batches: list[int], iters: int = 5, prompt_len: int = 16,
               log: Callable[[str], None] = lambda s: None) -> dict[str, list[float]]:
    """{str(B): [median step ms verifying K drafts per request, for K = 0 … γ]} on ``engine``."""
    if iters < 1:
        raise ValueError(f"calibrate: iters must be at least 1, got {iters}")
    dev, g = engine.device, engine.gamma
    saved = engine.schedule
    table = {}
    try:
        for B in batches:
            if not 1 <= B <= engine.max_batch:
                raise ValueError(f"calibrate: batch {B} is outside the engine's 1 … {engine.max_batch}")
            gen = torch.Generator().manual_seed(B)
            prompt = torch.randint(0, engine.tcfg.vocab_size, (prompt_len,), generator=gen).tolist()
            for slot in range(B):
                engine.prefill(prompt, slot, slot, 0.0)
            args = [torch.full((B,), prompt[-1], device=dev), torch.full((B,), prompt_len, device=dev),
                    torch.arange(B, device=dev), torch.arange(B, device=dev), torch.zeros(B, device=dev)]
            widths = getattr(engine, "verify_widths", None) or list(range(g + 1))
            timed = {}
            for K in widths:
                engine.set_schedule(Schedule("fixed", length=K))
                # (the same position each time: the step rewrites its own rows)
                timed[K] = round(median_ms(lambda: engine.step(*args, prompt_len + g + 1), dev, iters), 4)
            row = [timed[next(w for w in widths if w >= K)] for K in range(g + 1)]
            engine.take_step_info()
            table[str(B)] = row
            log(f"batch {B}: step ms by drafts verified 0…{g}: " + " ".join(f"{x:.3f}" for x in row))
    finally:
        engine.set_schedule(saved)
    return table


def write_schedule(engine_dir: str | Path, schedule: Schedule) -> None:
    """Record ``schedule`` as the engine's default (its manifest's ``schedule``), replacing the
    manifest atomically."""
    d = Path(engine_dir)
    m = read_manifest(d)
    widths = (m.get(m["backend"]) or {}).get("verify_widths") or []
    if m["backend"] != "eager" and schedule.on and len(widths) < 2:
        raise EngineError(f"{d}: this {m['backend']} engine's compiled step verifies every draft; schedule "
                          f"{schedule.mode!r} needs narrower verification widths: rebuild it with --verify-widths "
                          "(or --schedule confidence)")
    m["schedule"] = schedule.to_dict()
    tmp = d / "manifest.json.tmp"
    tmp.write_text(json.dumps(m, indent=2) + "\n")
    os.replace(tmp, d / "manifest.json")
