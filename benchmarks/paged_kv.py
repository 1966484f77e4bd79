"""Paged KV caches against a window per slot, in one memory budget: how many requests of a mixed-length
workload run at once, their tokens/s and step time, and the first token's latency behind a shared system
prompt.

    python benchmarks/paged_kv.py (--pair DIR | --engine DIR) [--memory-tokens N] [--block-size 16] \
        [--slots 32] [--requests 64] [--prompt-len 16:512] [--max-tokens 16:256] [--system-prompt 1024] \
        [--device cuda|cpu] [--out-dir benchmarks/results]

Both sides are eager engines (the engine that runs a pool) with the same weights and window (max_seq):
*contiguous*, with as many slots as N positions hold when each slot owns a window (N // max_seq);
*paged*, with a pool of N positions in blocks of ``--block-size`` and ``--slots`` step slots.

1. **Workload.** ``--requests`` prompts (tokens of the draft vocabulary, seeded) with lengths and
   output lengths drawn uniformly from the ranges, all queued at once, greedy with EOS ignored; the
   Generator's own loop on each side. Reported: requests running at once (peak and mean over the steps),
   generated tokens/s, the mean step time, the preemptions, and whether both sides' outputs are
   identical (they must be: the run fails otherwise).
2. **Shared system prompt.** ``--shared`` requests of the same ``--system-prompt`` tokens and a
   16-token question each, one after another: the first token's latency (TTFT), paged (the prompt's
   blocks shared by reference from the second request on) against contiguous (each request prefills
   it), and the prompt tokens the paged side mapped in instead of prefilling.

The result goes to ``benchmarks/results/`` in the common schema (``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)
from pairs import check_pair, default_device, pair_summary  # noqa: E402
from timing import host_description  # noqa: E402


def span(text: str) -> tuple[int, int]:
    """``LO:HI`` (or one number) → (lo, hi), 1 ≤ lo ≤ hi."""
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI or N (positive integers), got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return a, b


def workload(vocab: list[int], n: int, prompt: tuple[int, int], tokens: tuple[int, int], seed: int):
    rng = random.Random(seed)
    return [([rng.choice(vocab) for _ in range(rng.randint(*prompt))], rng.randint(*tokens)) for _ in range(n)]


def run_workload(engine, work, sync) -> dict:
    """The Generator over every request of ``work`` queued at once → figures and the outputs."""
    from muse_spark.runtime import Generator, SamplingParams

    gen = Generator(engine)
    reqs = [gen.add(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in work]
    running = []
    sync()
    t0 = time.perf_counter()
    while gen.has_work():
        gen.step()
        running.append(len(gen.active))
    sync()
    secs = time.perf_counter() - t0
    tokens = sum(len(r.output) for r in reqs)
    return {"seconds": round(secs, 3), "generated_tokens": tokens, "tokens_per_s": round(tokens / secs, 2),
            "peak_running": max(running, default=0), "mean_running": round(statistics.mean(running), 2),
            "steps": len(gen.step_times),
            "mean_step_ms": round(1e3 * statistics.mean(gen.step_times), 3) if gen.step_times else None,
            "preemptions": gen.preemptions,
            "_outputs": [r.output for r in reqs]}


def run_shared(engine, system: list[int], questions: list[list[int]], sync) -> dict:
    """Requests of ``system`` + each question, one after another → TTFT per request (ms)."""
    from muse_spark.runtime import Generator, SamplingParams

    gen = Generator(engine)
    ttft = []
    outputs = []
    for q in questions:
        sync()
        t0 = time.perf_counter()
        req = gen.add(system + q, SamplingParams(max_tokens=8, ignore_eos=True))
        while not req.output:
            gen.step()
        sync()
        ttft.append(1e3 * (time.perf_counter() - t0))
        gen.run()
        outputs.append(req.output)
    later = ttft[1:] or ttft
    return {"ttft_ms": [round(x, 3) for x in ttft], "first_ttft_ms": round(ttft[0], 3),
            "mean_later_ttft_ms": round(statistics.mean(later), 3),
            "cached_prefill_tokens": gen.cached_prefill_tokens, "_outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pair", help="a folder of `muse-spark make-pair` (its target/ and draft/)")
    src.add_argument("--engine", help="an eager engine directory")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where there is one")
    p.add_argument("--memory-tokens", type=int, default=None,
                   help="the KV budget in positions, both sides (default: 4 × max_seq)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--slots", type=int, default=32, help="the paged side's step slots")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=span, default=(16, 512), metavar="LO:HI")
    p.add_argument("--max-tokens", type=span, default=(16, 256), metavar="LO:HI")
    p.add_argument("--system-prompt", type=int, default=1024, metavar="TOKENS")
    p.add_argument("--shared", type=int, default=4, help="requests behind the shared system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(results.RESULTS))
    a = p.parse_args(argv)
    if a.requests < 1 or a.shared < 1 or a.slots < 1 or a.system_prompt < 1:
        p.error("--requests, --shared, --slots and --system-prompt must be positive")

    import torch

    from muse_spark.runtime import load_engine
    from muse_spark.runtime.engine import EagerEngine

    device = default_device(a.device)
    if a.pair:
        pair = check_pair(a.pair)
        from muse_spark.builder.pair import draft_token_ids

        vocab = draft_token_ids(pair)
        probe = EagerEngine.from_checkpoints(pair / "target", pair / "draft", device=device, max_batch=1,
                                             max_seq=128)
    else:
        probe = load_engine(a.engine, device=device, max_batch=1)
        d2t = probe.draft.d2t.cpu()
        vocab = (d2t + torch.arange(len(d2t))).tolist()
    need = max(a.prompt_len[1] + a.max_tokens[1], a.system_prompt + 16 + 8) + probe.gamma + 1
    max_seq = -(-need // 128) * 128 if a.pair else probe.max_seq
    if need > max_seq:
        p.error(f"the longest request needs {need} positions; the engine's window is {max_seq}")
    budget = a.memory_tokens or 4 * max_seq
    if budget < max_seq + a.block_size:
        p.error(f"--memory-tokens {budget} must hold one request's window ({max_seq} positions) and a block")
    del probe

    def engine(**kw):
        if a.pair:
            return EagerEngine.from_checkpoints(pair / "target", pair / "draft", device=device, max_seq=max_seq, **kw)
        return load_engine(a.engine, device=device, **kw)

    def log(msg):
        print(f"[paged_kv] {msg}", file=sys.stderr, flush=True)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    slots = budget // max_seq
    sides = {"contiguous": dict(max_batch=slots),
             "paged": dict(max_batch=a.slots, kv_tokens=budget - a.block_size, kv_block_size=a.block_size)}
    work = workload(vocab, a.requests, a.prompt_len, a.max_tokens, a.seed)
    rng = random.Random(a.seed + 1)
    system = [rng.choice(vocab) for _ in range(a.system_prompt)]
    questions = [[rng.choice(vocab) for _ in range(16)] for _ in range(a.shared)]
    config = {k: v for k, v in vars(a).items() if k != "out_dir"}
    config.update(max_seq=max_seq, memory_tokens=budget, contiguous_slots=slots, device=device,
                  host=host_description(device), pair=pair_summary(pair) if a.pair else None)
    out: dict = {}
    for name, kw in sides.items():
        eng = engine(**kw)
        log(f"{name}: {kw}; {eng.kv_description()}")
        run_workload(eng, work[:2], sync)  # (warm-up: the first launches)
        out[name] = {"workload": run_workload(eng, work, sync), "shared_prompt": run_shared(eng, system, questions, sync),
                     "kv": eng.kv_description()}
        w = out[name]["workload"]
        log(f"{name}: {w['peak_running']} running at most ({w['mean_running']} mean), {w['tokens_per_s']} tok/s, "
            f"step {w['mean_step_ms']} ms, {w['preemptions']} preemptions; shared prompt TTFT "
            f"{out[name]['shared_prompt']['first_ttft_ms']} ms first, {out[name]['shared_prompt']['mean_later_ttft_ms']}"
            f" ms later")
        del eng
    same = (out["paged"]["workload"].pop("_outputs") == out["contiguous"]["workload"].pop("_outputs")
            and out["paged"]["shared_prompt"].pop("_outputs") == out["contiguous"]["shared_prompt"].pop("_outputs"))
    out["outputs_identical"] = same
    out["paged_over_contiguous"] = {
        "peak_running": round(out["paged"]["workload"]["peak_running"] / max(1, out["contiguous"]["workload"]["peak_running"]), 3),
        "tokens_per_s": round(out["paged"]["workload"]["tokens_per_s"] / out["contiguous"]["workload"]["tokens_per_s"], 3),
        "later_ttft": round(out["paged"]["shared_prompt"]["mean_later_ttft_ms"]
                            / out["contiguous"]["shared_prompt"]["mean_later_ttft_ms"], 3)}
    doc = results.record("paged_kv", config, out, device=None if device == "cuda" else results.cpu_name())
    path = results.write(doc, Path(a.out_dir))
    log(f"paged / contiguous: {out['paged_over_contiguous']}; outputs identical: {same}; wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
