"""The C++ embedding against the Python runtime on one engine: step latency and generated tokens/s.

    python benchmarks/cxx_step.py (--engine DIR | --pair DIR) --cxx-build build/cxx [--batches 1,8,32] \
        [--max-tokens 128] [--prompt-len 64] [--warmup 3] [--out-dir benchmarks/results]

One workload, three runners, in one process call: ``muse_spark_bench`` (the C++ library, its steps
replayed from CUDA graphs and chained), ``muse_spark_bench --no-cuda-graphs`` (its packages called one
by one) and the Python runtime's ``Generator`` driven the way the C++ program drives its own. At each
batch size B: B requests of the same prompt (``--prompt-len`` ids, (7 + 31·j) mod vocab), greedy, EOS
ignored, ``--max-tokens`` each; a warm-up of ``--warmup`` steps, then the admission (every prefill) and
one timed scheduler iteration after another, the device synchronized after each (the median and mean
are the speculative steps'; tokens/s counts every token over the time from the admission to the last
step). The rows are alike, so every request takes every step.

Reported per batch size and runner: ``step_ms_median``, ``step_ms_mean``, ``tokens_per_s``, ``steps``,
``accepted_per_step``; and the ratios C++ / Python (step time and tokens/s). The Python and C++ runs
must give the same steps and accepted drafts (the same tokens): the run fails (exit 1) where they do
not. The result goes to ``benchmarks/results/`` in the common schema (``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402
from pairs import (add_engine_arguments, build_from_pair, check_pair, default_device, pair_gamma,  # noqa: E402
                   pair_summary, parse_engine_arguments, window)

RUNNERS = ("cxx", "cxx_no_graphs", "python")


def bench_prompt(length: int, vocab: int) -> list[int]:
    """``muse_spark_bench``'s prompt: ids (7 + 31·j) mod vocab."""
    return [(7 + 31 * j) % vocab for j in range(length)]


def python_run(engine, batch: int, prompt: list[int], max_tokens: int, warmup: int) -> dict:
    """The C++ program's loop over the Python runtime's Generator (every prompt prefilled in the first
    iterations, then one timed iteration after another, synchronized)."""
    import torch

    from muse_spark.runtime import Generator, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    cuda = str(getattr(engine, "device", "cpu")).startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def admitted(gen) -> Generator:
        while gen.waiting or gen.prefilling:  # (the admission: every request's prefill, no step yet)
            gen.step()
        return gen

    if warmup:
        gen = Generator(engine, prefill_budget=1 << 30)
        for _ in range(batch):
            gen.add(prompt, params)
        admitted(gen)
        for _ in range(warmup):
            if gen.has_work():
                gen.step()
        sync()  # (the warm-up's requests are dropped with their generator, as the C++ program drops them)
    gen = Generator(engine, prefill_budget=1 << 30)
    reqs = [gen.add(prompt, params) for _ in range(batch)]
    sync()
    start = time.perf_counter()
    admitted(gen)
    sync()
    step_ms = []
    while gen.has_work():
        t0 = time.perf_counter()
        gen.step()
        sync()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    seconds = time.perf_counter() - start
    steps = sum(len(r.steps) for r in reqs)
    return {"batch": batch, "step_ms_median": statistics.median(step_ms) if step_ms else None,
            "step_ms_mean": statistics.fmean(step_ms) if step_ms else None,
            "tokens_per_s": sum(len(r.output) for r in reqs) / seconds, "steps": len(step_ms),
            "accepted_per_step": sum(s.accepted for r in reqs for s in r.steps) / steps if steps else 0.0,
            "tokens": sum(len(r.output) for r in reqs), "seconds": seconds}


def cxx_run(build: Path, engine_dir: Path, batches: list[int], a, graphs: bool) -> list[dict]:
    exe = build / "muse_spark_bench"
    if not exe.is_file():
        raise SystemExit(f"--cxx-build {build}: no muse_spark_bench there (build it with scripts/build_cxx.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [str(exe), "--engine", str(engine_dir), "--batches", ",".join(map(str, batches)), "--max-tokens",
               str(a.max_tokens), "--prompt-len", str(a.prompt_len), "--warmup", str(a.warmup), "--json", str(out),
               *([] if graphs else ["--no-cuda-graphs"]), *(["--threads", str(a.threads)] if a.threads else [])]
        r = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=sys.stderr)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}: exit status {r.returncode}")
        return json.loads(out.read_text())


def table(rows: list[dict]) -> str:
    def f(v, nd=2):
        return "-" if v is None else f"{v:,.{nd}f}"

    lines = ["| batch | Python step ms | C++ step ms (graphs) | C++ step ms (no graphs) | C++ / Python step | "
             "Python tok/s | C++ tok/s | C++ / Python tok/s |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p, c, n = r["python"], r["cxx"], r["cxx_no_graphs"]
        lines.append(f"| {r['batch']} | {f(p['step_ms_median'], 3)} | {f(c['step_ms_median'], 3)} | "
                     f"{f(n['step_ms_median'], 3)} | {f(r['step_ratio'], 3)} | {f(p['tokens_per_s'], 1)} | "
                     f"{f(c['tokens_per_s'], 1)} | {f(r['tokens_per_s_ratio'], 3)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p)
    p.add_argument("--cxx-build", default="build/cxx", help="the C++ build folder (scripts/build_cxx.sh)")
    p.add_argument("--batches", default="1,8,32", help="batch sizes (default 1,8,32)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, at each batch size (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch's intra-op threads of the C++ runs")
    p.add_argument("--out-dir", default=str(results.RESULTS), help="folder for the result JSON")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_engine_arguments(p, argv)
    batches = sorted({int(b) for b in a.batches.split(",") if b})
    if not batches or batches[0] < 1 or a.max_tokens < 1 or a.prompt_len < 1 or a.warmup < 0:
        p.error("--batches, --max-tokens and --prompt-len must be >= 1, --warmup >= 0")

    def log(msg: str) -> None:
        print(f"[cxx-step] {msg}", file=sys.stderr, flush=True)

    from muse_spark.runtime import load_engine

    with tempfile.TemporaryDirectory(prefix="cxx-step-") as tmp:
        if a.pair:
            pair = check_pair(a.pair)
            device = default_device(a.device)
            engine_dir = build_from_pair(pair, a.work_dir or tmp, backend="aoti", device=device,
                                         max_batch=max(batches), log=log, buckets=batches, reuse=a.reuse_engine,
                                         kv_cache_dtype=a.kv_cache_dtype,
                                         max_seq=window(a.prompt_len, a.max_tokens, pair_gamma(pair)))
        else:
            engine_dir = Path(a.engine)
        manifest = json.loads((Path(engine_dir) / "manifest.json").read_text())
        if manifest.get("backend") != "aoti":
            p.error(f"{engine_dir}: the C++ embedding runs aoti engines, this one is {manifest.get('backend')!r}")
        batches = [b for b in batches if b <= manifest["max_batch"]]
        runs = {"cxx": cxx_run(Path(a.cxx_build), Path(engine_dir), batches, a, graphs=True),
                "cxx_no_graphs": cxx_run(Path(a.cxx_build), Path(engine_dir), batches, a, graphs=False)}
        engine = load_engine(engine_dir)
        prompt = bench_prompt(a.prompt_len, engine.tcfg.vocab_size)
        runs["python"] = []
        for b in batches:
            log(f"Python runtime, batch {b}")
            runs["python"].append(python_run(engine, b, prompt, a.max_tokens, a.warmup))
    rows, mismatched = [], []
    for i, b in enumerate(batches):
        row = {"batch": b, **{k: runs[k][i] for k in RUNNERS}}
        p_, c_ = row["python"], row["cxx"]
        for k in ("cxx", "cxx_no_graphs"):
            if (row[k]["steps"], round(row[k]["accepted_per_step"], 4)) != (p_["steps"],
                                                                            round(p_["accepted_per_step"], 4)):
                mismatched.append(f"batch {b}: {k} took {row[k]['steps']} steps of {row[k]['accepted_per_step']:.4f} "
                                  f"accepted drafts, Python {p_['steps']} of {p_['accepted_per_step']:.4f}")
        row["step_ratio"] = (c_["step_ms_median"] / p_["step_ms_median"]
                             if c_["step_ms_median"] and p_["step_ms_median"] else None)
        row["tokens_per_s_ratio"] = c_["tokens_per_s"] / p_["tokens_per_s"]
        rows.append(row)
    print(table(rows), flush=True)
    config = {"engine": str(engine_dir), "batches": batches, "max_tokens": a.max_tokens, "prompt_len": a.prompt_len,
              "warmup": a.warmup, "backend": manifest["backend"], "device": manifest.get("device", {}).get("kind")}
    if a.pair:
        config["pair_summary"] = pair_summary(a.pair)
    doc = results.record("cxx-step", config, {"rows": rows}, command=["python benchmarks/cxx_step.py", *argv],
                         device=None if str(config["device"]).startswith("cuda") else results.cpu_name())
    log(f"wrote {results.write(doc, Path(a.out_dir))}")
    if mismatched:
        log("FAILED: the C++ and Python runs differ: " + "; ".join(mismatched))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
