"""End-to-end generation: generated tokens/s of speculative decoding against the target alone, at the
acceptance a pair really has.

    python benchmarks/generation.py (--pair DIR | --engine DIR) [--backend aoti|eager] [--device cuda|cpu] \
        [--batches 1,8,32] [--max-tokens 256] [--prompt-len 32] [--prefill-batch P] [--work-dir D] \
        [--out-dir benchmarks/results] [--markdown F]

``--pair``: a folder of ``muse-spark make-pair`` (its drafts agree with the target at a chosen rate);
an engine is built from it first (aoti on CUDA, eager on the CPU) with max_batch the largest batch and
the window the run needs. ``--engine``: an engine directory, loaded as it is.

At each batch size B: B prompts of ``--prompt-len`` tokens drawn from the draft vocabulary (so the
pair's acceptance holds from the first step), seeded; a short warm-up of both sides, then, timed
(wall clock, the device synchronized before and after), greedy with EOS ignored so every request
generates ``--max-tokens``:

* speculative: ``Generator(engine).generate`` (in-flight batching, the engine's steps; every prompt
  prefilled in its first round, ``PREFILL_ALL``);
* target-only: ``TargetOnlyDecoder`` (one token a step; on CUDA each batch size's step replayed from
  a CUDA graph);

reported: generated tokens/s (B·max_tokens over the wall time), decode-only tokens/s (the tokens after
each request's first, over the time after the last prefill: every prefill is timed as it returns,
and both sides prefill all B prompts before their first step), the mean step time, for speculative
decoding the accepted drafts and emitted tokens per step (``acceptance_stats``), and the ratios
speculative / target-only. The two sides' outputs must be identical token for token: the run fails
(exit 1) where they are not. The result goes to ``benchmarks/results/`` in the common schema
(``benchmarks/results.py``); ``--markdown`` also writes the table.

``--prefill-batch P`` (an aoti engine built from ``--pair``): the engine is built with a prefill of up to P
chunks a call (``build --prefill-batch``), and each batch size runs twice, side by side: prefilling one
chunk a call, then P (the ``prefill`` column); both sides of a row prefill the same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)
from pairs import (add_engine_arguments, build_from_pair, check_pair, default_backend,  # noqa: E402
                   default_device, pair_gamma, pair_summary, parse_engine_arguments, window)
from timing import batch_list, host_description  # noqa: E402

COLUMNS = [("schedule", "schedule", "{}"), ("batch", "batch", "{}"),
           ("spec tok/s", ("speculative", "tokens_per_s"), "{:.1f}"),
           ("spec decode tok/s", ("speculative", "decode_tokens_per_s"), "{:.1f}"),
           ("spec step ms", ("speculative", "mean_step_ms"), "{:.3f}"),
           ("accepted/step", ("speculative", "mean_accepted_per_step"), "{:.2f}"),
           ("verified/step", ("speculative", "mean_verified_per_step"), "{:.2f}"),
           ("emitted/step", ("speculative", "mean_emitted_per_step"), "{:.2f}"),
           ("target tok/s", ("target_only", "tokens_per_s"), "{:.1f}"),
           ("target decode tok/s", ("target_only", "decode_tokens_per_s"), "{:.1f}"),
           ("target step ms", ("target_only", "mean_step_ms"), "{:.3f}"),
           ("speedup", "speedup", "{:.2f}×"), ("decode speedup", "decode_speedup", "{:.2f}×"),
           ("prefill", "prefill_batch", "{}"), ("identical", "outputs_identical", "{}")]


def cells(row: dict) -> list[str]:
    out = []
    for _, key, fmt in COLUMNS:
        v = row[key[0]][key[1]] if isinstance(key, tuple) else row[key]
        out.append(fmt.format(v))
    return out


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"# Generation: speculative vs target-only\n\n{title}\n",
             "| " + " | ".join(name for name, _, _ in COLUMNS) + " |",
             "|" + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# The speculative side prefills every prompt in its first round, before its first step, as the
# target-only decoder does: "decode" then means the same on both sides.
PREFILL_ALL = 1 << 30


class Clock:
    """The wall time of a generation and when its last prefill returned (``engine.prefill_chunks``, the
    engines' one way in to prefill, wrapped: synchronized and stamped as it returns; its caller reads
    the first tokens right after, a sync anyway)."""

    def __init__(self, engine):
        import torch

        self.cuda = engine.device.type == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(engine.device)) if self.cuda else (lambda: None)
        self.prefilled: list[float] = []
        prefill = engine.prefill_chunks

        def stamped(*args, **kw):
            out = prefill(*args, **kw)
            self.sync()
            self.prefilled.append(time.perf_counter())
            return out

        engine.prefill_chunks = stamped  # (an instance attribute: the Generator and the decoder reach it)

    def time(self, run):
        """→ (run()'s requests, seconds, seconds after the last prefill)."""
        self.prefilled.clear()
        self.sync()
        t0 = time.perf_counter()
        reqs = run()
        self.sync()
        t1 = time.perf_counter()
        return reqs, t1 - t0, t1 - max(self.prefilled, default=t0)


def figures(reqs, seconds: float, decode_seconds: float, step_times: list[float]) -> dict:
    tokens = sum(len(r.output) for r in reqs)
    return {"generated_tokens": tokens, "seconds": round(seconds, 4),
            "prefill_seconds": round(seconds - decode_seconds, 4),
            "tokens_per_s": round(tokens / seconds, 2),
            "decode_tokens_per_s": round((tokens - len(reqs)) / max(decode_seconds, 1e-9), 2),
            "steps": len(step_times),
            "mean_step_ms": round(1e3 * statistics.mean(step_times), 4) if step_times else None}


def measure(engine, decoder, clock: Clock, prompts: list[list[int]], max_tokens: int) -> dict:
    from muse_spark.runtime import Generator, SamplingParams
    from muse_spark.runtime.acceptance import acceptance_stats

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=min(max_tokens, 2 * (engine.gamma + 1)), ignore_eos=True)
    # (first launches; the decoder captures this batch's graph)
    Generator(engine, prefill_budget=PREFILL_ALL).generate(prompts, warm)
    decoder.generate(prompts, warm)

    gen = Generator(engine, prefill_budget=PREFILL_ALL)
    spec, secs, decode = clock.time(lambda: gen.generate(prompts, params))
    s = figures(spec, secs, decode, gen.step_times)
    acc = acceptance_stats(spec, engine.gamma)
    s.update({k: acc[k] for k in ("mean_accepted_per_step", "mean_emitted_per_step", "acceptance_per_position")})
    s["mean_verified_per_step"] = acc.get("mean_verified_per_step", float(engine.gamma))
    if "verified_counts" in acc:  # (steps that report their width: scheduled ones)
        s["verified_counts"] = acc["verified_counts"]
    if "confidence" in acc:  # (steps that reported the head's values: its calibration, AUROC)
        s["confidence"] = acc["confidence"]

    decoder.step_times.clear()
    base, secs, decode = clock.time(lambda: decoder.generate(prompts, params))
    t = figures(base, secs, decode, decoder.step_times)
    return {"schedule": engine.schedule.mode, "batch": len(prompts),
            "prefill_batch": getattr(engine, "prefill_batch", 1) if getattr(engine, "prefill_batch_fn", None) else 1,
            "speculative": s, "target_only": t,
            "speedup": round(s["tokens_per_s"] / t["tokens_per_s"], 3),
            "decode_speedup": round(s["decode_tokens_per_s"] / t["decode_tokens_per_s"], 3),
            "outputs_identical": [r.output for r in spec] == [r.output for r in base],
            "differing_requests": sum(a.output != b.output for a, b in zip(spec, base))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(p, work_dir="/tmp/muse-spark-generation")
    p.add_argument("--schedule", type=lambda v: v.split(","), default=["off"],
                   help="verification schedules to run, comma-separated: off, confidence (confidence needs a "
                        "draft with a confidence head; an aoti engine built from --pair gets the default "
                        "verification widths for it)")
    p.add_argument("--confidence-threshold", type=float, default=0.25)
    p.add_argument("--calibrate", action="store_true",
                   help="time the step by drafts verified first (muse-spark calibrate) and cut by that table")
    p.add_argument("--batches", type=batch_list, default=[1, 8, 32], help="comma-separated, e.g. 1,8,32")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    p.add_argument("--prefill-batch", type=int, default=1, metavar="P",
                   help="--pair, aoti: build with a prefill of up to P chunks a call, and run each batch size "
                        "prefilling one chunk a call and P")
    p.add_argument("--sampled-acceptance", type=int, default=64, metavar="N",
                   help="afterwards, the acceptance of N prompts sampled at temperature 1 (up to 64 tokens "
                        "each, schedule off; 0: skip)")
    p.add_argument("--out-dir", default=str(results.RESULTS),
                   help="where the result goes, in the common schema (default: benchmarks/results)")
    p.add_argument("--markdown", default=None, help="also write the table here (Markdown)")
    a = parse_engine_arguments(p, argv)
    if a.max_tokens < 1 or a.prompt_len < 1 or a.prefill_batch < 1:
        p.error("--max-tokens, --prompt-len and --prefill-batch must be positive")
    if a.prefill_batch > 1 and not a.pair:
        p.error("--prefill-batch applies to --pair (an --engine prefills as it was built)")
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[generation {time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    import torch

    from muse_spark.builder.pair import draft_token_ids, random_prompts
    from muse_spark.checkpoint import fp8_projections
    from muse_spark.runtime import load_engine
    from muse_spark.runtime.target_only import TargetOnlyDecoder
    from muse_spark.schedule import Schedule

    batches = sorted(a.batches)
    config = {k: v for k, v in vars(a).items() if k not in ("out_dir", "markdown")}
    if a.pair:
        pair = check_pair(a.pair)
        a.device = default_device(a.device)
        a.backend = a.backend or default_backend(a.device)
        max_seq = window(a.prompt_len, a.max_tokens, pair_gamma(pair))
        engine_dir = build_from_pair(pair, a.work_dir, backend=a.backend, device=a.device, max_batch=batches[-1],
                                     max_seq=max_seq, log=log, buckets=batches,
                                     verify_widths="default" if "confidence" in a.schedule else None,
                                     reuse=a.reuse_engine, kv_cache_dtype=a.kv_cache_dtype,
                                     prefill_batch=min(a.prefill_batch, batches[-1]))
        config["pair"] = pair_summary(pair)
    else:
        if a.backend:
            p.error("--backend applies to --pair (an --engine runs with its own backend)")
        engine_dir = a.engine
    log(f"loading {engine_dir}")
    engine = load_engine(engine_dir, device=a.device)
    if batches[-1] > engine.max_batch:
        p.error(f"batch {batches[-1]} exceeds the engine's max_batch {engine.max_batch}")
    if a.pair:
        vocab = draft_token_ids(a.pair)
    else:
        d2t = engine.draft.d2t.cpu()
        vocab = (d2t + torch.arange(len(d2t))).tolist()
    config["engine"] = {"backend": engine.backend, "device": str(engine.device), "gamma": engine.gamma,
                        "max_batch": engine.max_batch, "max_seq": engine.max_seq,
                        "dtype": str(engine.target.dtype).removeprefix("torch."),
                        "kv_cache_dtype": engine.target.cfg.kv_cache_dtype,
                        "fp8_projections": fp8_projections(engine.target.cfg),
                        "options": engine.options.to_dict(),
                        "cuda_graphs": bool(getattr(engine, "cuda_graphs", False))}
    config["host"] = host_description(engine.device.type)
    doc = results.record("generation", config, {}, device=None if engine.device.type == "cuda" else results.cpu_name())
    title = (f"{engine.backend} engine on {doc['device']}, γ = {engine.gamma}"
             + (f", pair acceptance {config['pair'].get('acceptance')} ({config['pair'].get('preset')})"
                if a.pair else "") + f"; prompts of {a.prompt_len} tokens, {a.max_tokens} generated, greedy")
    log(title)

    clock, decoder = Clock(engine), TargetOnlyDecoder(engine)
    rows: list[dict] = []
    widths = [max(len(name), 9) for name, _, _ in COLUMNS]
    print("  ".join(n.rjust(w) for (n, _, _), w in zip(COLUMNS, widths)), flush=True)
    schedules = [Schedule.from_dict({**engine.schedule.to_dict(), "mode": m, "threshold": a.confidence_threshold})
                 for m in a.schedule]
    if a.calibrate and "confidence" in a.schedule:
        from muse_spark.runtime.calibrate import cost_table

        log("calibrating: the step's time by drafts verified, at each batch size")
        table = cost_table(engine, batches, log=log)
        schedules = [s.replace(cost_ms=table) if s.mode == "confidence" else s for s in schedules]
        config["cost_ms"] = table
    batched = getattr(engine, "prefill_batch_fn", None)  # (the engine's prefill of several chunks a call)
    prefills = [None, batched] if batched is not None else [None]
    for schedule, b, prefill in [(s, b, f) for s in schedules for b in batches for f in prefills]:
        engine.set_schedule(schedule)
        if batched is not None:
            engine.prefill_batch_fn = prefill
        prompts = random_prompts(vocab, b, a.prompt_len, seed=a.seed + b)
        row = measure(engine, decoder, clock, prompts, a.max_tokens)
        rows.append(row)
        print("  ".join(c.rjust(w) for c, w in zip(cells(row), widths)), flush=True)
        if not row["outputs_identical"]:
            log(f"MISMATCH at batch {b}: {row['differing_requests']} of {b} speculative outputs differ from the "
                "target-only ones")
        doc["results"] = {"batches": rows, "outputs_identical": all(r["outputs_identical"] for r in rows)}
        path = results.write(doc, Path(a.out_dir))  # (rewritten after each batch: a run cut short keeps them)
        if a.markdown:
            Path(a.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(a.markdown).write_text(markdown(rows, title))
    if a.sampled_acceptance > 0:
        from muse_spark.runtime.acceptance import measure_acceptance

        engine.set_schedule(Schedule.from_dict({**engine.schedule.to_dict(), "mode": "off"}))
        prompts = random_prompts(vocab, a.sampled_acceptance, a.prompt_len, seed=a.seed + 10**6)
        tokens = min(64, engine.max_seq - a.prompt_len - engine.gamma)  # (what the engine's window holds)
        log(f"sampled acceptance: {len(prompts)} prompts at temperature 1, {tokens} tokens each")
        acc = measure_acceptance(engine, prompts, tokens, temperature=1.0, seed=a.seed)
        doc["results"]["sampled_acceptance"] = {k: acc[k] for k in ("temperature", "max_tokens", "steps", "requests",
                                                                     "mean_accepted_per_step",
                                                                     "acceptance_per_position")}
        path = results.write(doc, Path(a.out_dir))
        log(f"sampled acceptance (T = 1): {acc['mean_accepted_per_step']:.2f} accepted drafts per step, per position "
            + " ".join(f"{x:.2f}" for x in acc["acceptance_per_position"] if x is not None))
    log(f"wrote {path}" + (f" and {a.markdown}" if a.markdown else ""))
    if not doc["results"]["outputs_identical"]:
        log("FAILED: speculative and target-only greedy outputs differ (see MISMATCH above)")
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
