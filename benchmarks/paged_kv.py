"""Paged KV caches against a window per slot, in one memory budget: how many requests of a mixed-length
workload run at once, their tokens/s and step time, and the first token's latency behind a shared system
prompt; or (``--backend aoti``) the compiled engine's speculative step, paged against slot caches.

    python benchmarks/paged_kv.py (--pair DIR | --engine DIR) [--memory-tokens N] [--block-size 16] \
        [--slots 32] [--requests 64] [--prompt-len 16:512] [--max-tokens 16:256] [--system-prompt 1024] \
        [--device cuda|cpu] [--out-dir benchmarks/results]
    python benchmarks/paged_kv.py --backend aoti --pair DIR [--step-batches 1,8,32] [--context 1024] \
        [--steps 32] [--block-size 16] [--work-dir D] [--reuse-engine] [--device cuda|cpu] [--out-dir …]
    python benchmarks/paged_kv.py --render [--plot docs/bench-paged.png] [--device NAME]

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

``--backend aoti`` (``--pair`` only): two aoti engines built from the pair (``pairs.build_from_pair``, into
``--work-dir``; ``--reuse-engine`` takes the ones an earlier run built there), with max_batch the largest
of ``--step-batches``, batch buckets those sizes and one window (``--context`` + the steps' tokens):
*slot*, a window of max_seq positions per slot; *paged*, a pool of the same positions (max_batch ×
max_seq) in blocks of ``--block-size``. Their weight files are hard links to one copy where the manifests
hash them alike. At each batch size B, on each engine in turn: B prompts of ``--context`` tokens (the draft
vocabulary, seeded) prefilled, a warm-up, then ``--steps`` steady-state steps of the Generator, each timed
synchronized (the device waited for before and after), greedy with EOS ignored, no request finishing or
preempted meanwhile: both unchained (the ratio is the step's own cost), then both with their chained steps
(the runtime's default: ``--steps`` steps between two synchronizations; a paged engine reserves the chained
step's blocks first). Reported per batch: the median, mean and least step time of each unchained run, the
chained means, the ratios paged / slot unchained and chained, and whether the tokens of the four runs are
identical (they must be: the run fails otherwise); a table on stdout; the result in the common schema
(benchmark ``paged_kv_step``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)
from pairs import build_from_pair, check_pair, default_device, pair_gamma, pair_summary, window  # noqa: E402
from timing import batch_list, host_description  # noqa: E402


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


# ---- --backend aoti: the compiled engine's step, paged against slot caches --------------------------------
STEP_COLUMNS = [("batch", ("batch",), "{}"), ("slot ms", ("slot", "median_ms"), "{:.3f}"),
                ("slot chained ms", ("slot_chained", "mean_ms"), "{:.3f}"),
                ("paged ms", ("paged", "median_ms"), "{:.3f}"), ("paged chained ms", ("paged_chained", "mean_ms"), "{:.3f}"),
                ("paged/slot", ("paged_over_slot",), "{:.3f}"),
                ("paged/slot chained", ("paged_over_slot_chained",), "{:.3f}"),
                ("identical", ("outputs_identical",), "{}")]


def share_weights(src: Path, dst: Path, log) -> None:
    """Make ``dst``'s weight files hard links to ``src``'s where the two manifests hash them alike (one copy on
    the disk; each engine still checks its files' hashes when it loads)."""
    a, b = (json.loads((d / "manifest.json").read_text())["files"] for d in (src, dst))
    for name, digest in b.items():
        if not name.endswith(".safetensors") or a.get(name) != digest or os.path.samefile(src / name, dst / name):
            continue
        try:
            os.link(src / name, dst / f"{name}.link")
            os.replace(dst / f"{name}.link", dst / name)
            log(f"{dst / name}: a hard link to {src / name}")
        except OSError as e:  # (another file system: two copies, as built)
            log(f"{dst / name} stays a copy of its own ({e})")


def steady_steps(engine, prompts: list[list[int]], max_tokens: int, warmup: int, steps: int, sync,
                 chained: bool) -> dict:
    """``steps`` speculative steps of the Generator over ``prompts`` (all prefilled first, then ``warmup``
    steps), none finishing or preempted: each timed synchronized (``chained`` off), or all ``steps`` between
    two synchronizations with the engine's chained steps on → figures (ms) and the requests' tokens."""
    from muse_spark.runtime import Generator, SamplingParams

    engine.options = dataclasses.replace(engine.options, chained_steps=chained)
    gen = Generator(engine, prefill_budget=sum(len(p) for p in prompts))  # (every prompt in the first round)
    reqs = [gen.add(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    while gen.waiting or gen.prefilling:
        gen.step()
    for _ in range(warmup):
        gen.step()
    times = []
    sync()
    if chained:
        t0 = time.perf_counter()
        for _ in range(steps):
            gen.step()
        sync()
        times.append((time.perf_counter() - t0) / steps)
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            gen.step()
            sync()
            times.append(time.perf_counter() - t0)
    if any(r.finished for r in reqs) or len(gen.active) != len(reqs) or gen.preemptions:
        raise SystemExit(f"paged_kv: the batch of {len(reqs)} did not stay running through the timed steps "
                         f"(finished, waiting or preempted): raise --context's window or lower --steps")
    outputs = [list(r.output) for r in reqs]
    for r in reqs:
        gen.cancel(r)
    gen.step()  # (reads a chained step still in flight)
    ms = [1e3 * t for t in times]
    out = {"mean_ms": round(statistics.mean(ms), 4), "steps": steps}
    if not chained:
        out.update(median_ms=round(statistics.median(ms), 4), min_ms=round(min(ms), 4))
    return {**out, "_outputs": outputs}


def step_table(rows: list[dict]) -> str:
    def cell(row, path, fmt):
        v = row
        for k in path:
            v = v[k]
        return fmt.format(v)

    widths = [max(len(name), 9) for name, _, _ in STEP_COLUMNS]
    lines = ["  ".join(n.rjust(w) for (n, _, _), w in zip(STEP_COLUMNS, widths))]
    lines += ["  ".join(cell(r, path, fmt).rjust(w) for (_, path, fmt), w in zip(STEP_COLUMNS, widths)) for r in rows]
    return "\n".join(lines)


def aoti_steps(a, p) -> int:
    """``--backend aoti``: the module doc's second part."""
    import torch

    from muse_spark.builder.pair import draft_token_ids
    from muse_spark.engine_format import EngineError, kv_pool_blocks
    from muse_spark.runtime import load_engine

    t_start = time.perf_counter()

    def log(msg):
        print(f"[paged_kv {time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    if not a.pair:
        p.error("--backend aoti builds its two engines from a --pair")
    if a.context < 1 or a.steps < 1 or a.warmup_steps < 0:
        p.error("--context and --steps must be positive, --warmup-steps >= 0")
    pair = check_pair(a.pair)
    device = default_device(a.device)
    batches = sorted(set(a.step_batches))
    gamma = pair_gamma(pair)
    # (the tokens a request may emit before and through the timed steps, and one step more: none finishes)
    max_tokens = (a.warmup_steps + a.steps + 2) * (gamma + 1)
    max_seq = window(a.context, max_tokens, gamma)
    try:
        pool = [kv_pool_blocks(batches[-1] * max_seq, a.block_size, max_seq), a.block_size]
    except EngineError as e:
        p.error(str(e))
    build = dict(backend="aoti", device=device, max_batch=batches[-1], max_seq=max_seq, log=log, buckets=batches,
                 reuse=a.reuse_engine)
    dirs = {"slot": build_from_pair(pair, a.work_dir, **build),
            "paged": build_from_pair(pair, a.work_dir, kv_pool=pool, **build)}
    share_weights(dirs["slot"], dirs["paged"], log)
    engines = {}
    for name, d in dirs.items():
        engines[name] = load_engine(d, device=device)
        log(f"{name}: {d}; {engines[name].kv_description()}")
    if engines["paged"].kv is None or engines["slot"].kv is not None:
        raise SystemExit(f"paged_kv: {dirs['paged']} should be paged and {dirs['slot']} not")
    sync = (lambda: torch.cuda.synchronize(device)) if device == "cuda" else (lambda: None)
    vocab = draft_token_ids(pair)
    config = {k: v for k, v in vars(a).items() if k != "out_dir"}
    config.update(device=device, max_seq=max_seq, max_tokens=max_tokens, kv_pool=pool,
                  pool_tokens=(pool[0] - 1) * pool[1], slot_tokens=batches[-1] * max_seq,
                  engines={k: str(v) for k, v in dirs.items()}, host=host_description(device),
                  pair=pair_summary(pair), gamma=gamma)
    doc = results.record("paged_kv_step", config, {}, device=None if device == "cuda" else results.cpu_name())
    rows = []
    for b in batches:
        rng = random.Random(a.seed + b)
        prompts = [[rng.choice(vocab) for _ in range(a.context)] for _ in range(b)]
        run = dict(prompts=prompts, max_tokens=max_tokens, warmup=a.warmup_steps, steps=a.steps, sync=sync)
        row = {"batch": b, "slot": steady_steps(engines["slot"], chained=False, **run),
               "slot_chained": steady_steps(engines["slot"], chained=True, **run),
               "paged": steady_steps(engines["paged"], chained=False, **run),
               "paged_chained": steady_steps(engines["paged"], chained=True, **run)}
        outs = [row[k].pop("_outputs") for k in ("slot", "slot_chained", "paged", "paged_chained")]
        row["paged_over_slot"] = round(row["paged"]["median_ms"] / row["slot"]["median_ms"], 4)
        row["paged_over_slot_chained"] = round(row["paged_chained"]["mean_ms"] / row["slot_chained"]["mean_ms"], 4)
        row["outputs_identical"] = all(o == outs[0] for o in outs)
        rows.append(row)
        log(f"batch {b}: slot {row['slot']['median_ms']} ms (chained {row['slot_chained']['mean_ms']}), paged "
            f"{row['paged']['median_ms']} ms (chained {row['paged_chained']['mean_ms']}): paged/slot "
            f"{row['paged_over_slot']} (chained {row['paged_over_slot_chained']}); identical {row['outputs_identical']}")
        doc["results"] = {"batches": rows, "kv": {k: e.kv_description() for k, e in engines.items()},
                          "outputs_identical": all(r["outputs_identical"] for r in rows)}
        path = results.write(doc, Path(a.out_dir))  # (after every batch: a run cut short keeps what it measured)
    title = (f"aoti engine's speculative step on {doc['device']}, γ = {gamma}, {a.context} tokens of context, "
             f"paged: blocks of {a.block_size} (ms per step, median of {a.steps})")
    print(title + "\n" + step_table(rows), flush=True)
    log(f"wrote {path}")
    return 0 if doc["results"]["outputs_identical"] else 1


def plot(step: dict | None, work: dict | None, png: Path) -> Path:
    """The committed figures as one picture: the compiled step's time by batch, slot caches against the pool,
    unchained and chained (left, from a ``paged_kv_step`` result), and requests running at once in one memory
    budget with the later requests' TTFT behind a shared prompt (right, from a ``paged_kv`` result)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    if step:
        rows = step["results"]["batches"]
        xs = [r["batch"] for r in rows]
        for side, color in (("slot", "tab:blue"), ("paged", "tab:orange")):
            left.plot(xs, [r[side]["median_ms"] for r in rows], marker="o", color=color, label=f"{side}, each step synced")
            left.plot(xs, [r[f"{side}_chained"]["mean_ms"] for r in rows], marker="s", ls="--", color=color,
                      label=f"{side}, chained steps")
        for r in rows:
            left.annotate(f"×{r['paged_over_slot_chained']:.3f}", (r["batch"], r["paged_chained"]["mean_ms"]),
                          textcoords="offset points", xytext=(4, -12), fontsize=8)
        left.set_xscale("log", base=2)
        left.set_xticks(xs, [str(x) for x in xs])
        left.set_xlabel("batch")
        left.set_ylabel("ms per speculative step")
        left.set_title(f"aoti step, {step['config']['context']} tokens of context ({step['device']}, {step['commit']})",
                       fontsize=9)
        left.legend(fontsize=8)
    if work:
        res = work["results"]
        names = ["contiguous", "paged"]
        peak = [res[n]["workload"]["peak_running"] for n in names]
        mean = [res[n]["workload"]["mean_running"] for n in names]
        ttft = [res[n]["shared_prompt"]["mean_later_ttft_ms"] for n in names]
        at = range(len(names))
        right.bar([i - 0.2 for i in at], peak, width=0.4, label="requests running, peak")
        right.bar([i + 0.2 for i in at], mean, width=0.4, label="requests running, mean")
        for i in at:
            right.annotate(f"TTFT behind the shared prompt: {ttft[i]:.0f} ms", (i, peak[i]), ha="center",
                           textcoords="offset points", xytext=(0, 4), fontsize=8)
        right.set_xticks(list(at), names)
        right.set_ylim(0, max(peak) * 1.25)
        c = work["config"]
        right.set_title(f"{c['requests']} requests in {c['memory_tokens']} positions of KV "
                        f"({work['device']}, {work['commit']})", fontsize=9)
        right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def render(png: Path, device: str | None) -> int:
    """``--render``: the latest committed ``paged_kv_step`` and ``paged_kv`` results (of ``device`` where given)
    drawn into ``png``."""
    def latest(name):
        docs = [d for d in results.load(benchmark=name) if device is None or d["device"] == device]
        return docs[-1] if docs else None

    step, work = latest("paged_kv_step"), latest("paged_kv")
    if step is None and work is None:
        print("no paged_kv or paged_kv_step results to draw", file=sys.stderr)
        return 1
    print(plot(step, work, png))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--render" in argv:
        r = argparse.ArgumentParser(description="draw the committed paged-KV results")
        r.add_argument("--render", action="store_true")
        r.add_argument("--plot", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "bench-paged.png")
        r.add_argument("--device", default=None, help="the results of this device only (e.g. 'NVIDIA H100 80GB HBM3')")
        a = r.parse_args(argv)
        return render(a.plot, a.device)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pair", help="a folder of `muse-spark make-pair` (its target/ and draft/)")
    src.add_argument("--engine", help="an eager engine directory")
    p.add_argument("--backend", choices=["eager", "aoti"], default="eager",
                   help="eager (default): the memory-budget workload; aoti: the compiled engine's step time, paged "
                        "against slot caches (two engines built from --pair)")
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
    g = p.add_argument_group("--backend aoti")
    g.add_argument("--step-batches", type=batch_list, default=[1, 8, 32], metavar="B,B",
                   help="batch sizes whose step is timed (default 1,8,32; the engines' max_batch is the largest)")
    g.add_argument("--context", type=int, default=1024, help="prompt tokens of each request before the timed steps")
    g.add_argument("--steps", type=int, default=32, help="timed steps per batch size and engine")
    g.add_argument("--warmup-steps", type=int, default=4)
    g.add_argument("--work-dir", default="/tmp/muse-spark-paged-kv", help="where the two engines are built")
    g.add_argument("--reuse-engine", action="store_true",
                   help="use the engines an earlier run built in --work-dir instead of building again")
    a = p.parse_args(argv)
    if a.backend == "aoti":
        return aoti_steps(a, p)
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
