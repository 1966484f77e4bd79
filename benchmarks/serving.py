"""Serving throughput: the Triton server (``muse-spark serve``) against the in-process ``Generator``.

    python benchmarks/serving.py (--engine engines/tiny | --pair DIR) [--concurrency 8] [--requests 64] \
        [--max-tokens 64]

``--pair``: a ``muse-spark make-pair`` folder; an engine is built from it first (``benchmarks/pairs.py``:
aoti on CUDA, eager on the CPU, max_batch ``--concurrency``) into ``--work-dir`` or a temporary folder.

Both sides run the same requests (greedy, fixed prompt and output lengths, ``ignore_eos``) with at
most ``--concurrency`` in flight: in process, a request joins the ``Generator`` as soon as another
finishes; through the server, ``--concurrency`` HTTP clients each send their next request as soon as
the last one is answered. Reported: requests/s, generated tokens/s, mean latency, and the server's
fraction of the in-process rate. The server's outputs must equal the in-process ones token for token
(the run fails otherwise). The result goes to ``benchmarks/results/`` in the common schema.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)
from pairs import (add_engine_arguments, build_from_pair, check_pair, default_backend,  # noqa: E402
                   default_device, pair_gamma, pair_summary, parse_engine_arguments, window)
from server_process import post, triton_server  # noqa: E402


def workload(vocab: int, n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]


def in_process(engine_dir: str, device: str | None, prompts, max_tokens: int, concurrency: int) -> dict:
    """The Generator with at most ``concurrency`` requests in it → figures and outputs."""
    import torch

    from muse_spark.runtime import Generator, SamplingParams, load_engine

    engine = load_engine(engine_dir, device=device)
    gen = Generator(engine)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    gen.generate([prompts[0]], params)  # warm-up (CUDA graphs, first launches)
    pending, live, done = list(enumerate(prompts)), {}, {}
    latencies = []
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i, p = pending.pop(0)
            live[i] = (gen.add(p, params), time.perf_counter())
        gen.step()
        for i, (req, t_in) in list(live.items()):
            if req.finished:
                done[i] = req.output
                latencies.append(time.perf_counter() - t_in)
                del live[i]
    elapsed = time.perf_counter() - t0
    del gen, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"figures": figures(len(prompts), sum(len(o) for o in done.values()), elapsed, latencies),
            "outputs": [done[i] for i in range(len(prompts))]}


def figures(n: int, tokens: int, elapsed: float, latencies: list[float]) -> dict:
    return {"requests": n, "generated_tokens": tokens, "seconds": round(elapsed, 4),
            "requests_per_s": round(n / elapsed, 3), "tokens_per_s": round(tokens / elapsed, 2),
            "mean_latency_s": round(statistics.mean(latencies), 4),
            "p90_latency_s": round(sorted(latencies)[int(0.9 * (len(latencies) - 1))], 4)}


def through_server(engine_dir: str, device: str | None, prompts, max_tokens: int, concurrency: int,
                   serve_args: list[str], work: Path, log) -> dict:
    """``muse-spark triton-repo`` + ``serve``, then ``concurrency`` HTTP clients → figures and outputs."""
    with triton_server(engine_dir, device, work, log, serve_args=serve_args) as srv:
        base = srv.model_url
        post(f"{base}/generate", {"input_ids": prompts[0], "max_tokens": max_tokens, "ignore_eos": True})  # warm-up

        def one(p):
            t = time.perf_counter()
            body = post(f"{base}/generate", {"input_ids": p, "max_tokens": max_tokens, "ignore_eos": True})
            ids = body["output_ids"]
            return ([ids] if isinstance(ids, int) else ids), time.perf_counter() - t

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            out = list(pool.map(one, prompts))
        elapsed = time.perf_counter() - t0
    outputs = [o for o, _ in out]
    return {"figures": figures(len(prompts), sum(len(o) for o in outputs), elapsed, [t for _, t in out]),
            "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(p)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--stub-numpy", default=None, help="passed to muse-spark serve")
    p.add_argument("--out", default=str(results.RESULTS), help="folder for the result JSON")
    a = parse_engine_arguments(p, argv)

    def log(msg: str) -> None:
        print(f"[serving-bench] {msg}", file=sys.stderr, flush=True)

    if a.backend and not a.pair:
        p.error("--backend applies to --pair (an --engine runs with its own backend)")
    with tempfile.TemporaryDirectory(prefix="serving-bench-engine-") as tmp:
        if a.pair:
            pair = check_pair(a.pair)
            a.device = default_device(a.device)
            a.engine = str(build_from_pair(pair, a.work_dir or tmp, backend=a.backend or default_backend(a.device),
                                           device=a.device, max_batch=a.concurrency,
                                           max_seq=window(a.prompt_len, a.max_tokens, pair_gamma(pair)), log=log,
                                           reuse=a.reuse_engine, kv_cache_dtype=a.kv_cache_dtype))
        return run(a, log)


def run(a, log) -> int:
    manifest = json.loads((Path(a.engine) / "manifest.json").read_text())
    vocab = manifest["target_config"]["vocab_size"]
    prompts = workload(vocab, a.requests, a.prompt_len)
    log(f"in process: {a.requests} requests, concurrency {a.concurrency}")
    local = in_process(a.engine, a.device, prompts, a.max_tokens, a.concurrency)
    log(f"in process: {local['figures']}")
    serve_args = ["--stub-numpy", a.stub_numpy] if a.stub_numpy else []
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as work:
        remote = through_server(a.engine, a.device, prompts, a.max_tokens, a.concurrency, serve_args, Path(work), log)
    log(f"server: {remote['figures']}")
    same = remote["outputs"] == local["outputs"]
    config = {k: v for k, v in vars(a).items() if k != "out"}
    if a.pair:
        config["pair_summary"] = pair_summary(a.pair)
    doc = results.record("serving", config,
                         {"in_process": local["figures"], "server": remote["figures"],
                          "server_over_in_process_tokens_per_s": round(
                              remote["figures"]["tokens_per_s"] / local["figures"]["tokens_per_s"], 3),
                          "outputs_identical": same})
    path = results.write(doc, Path(a.out))
    log(f"wrote {path}")
    if not same:
        bad = sum(x != y for x, y in zip(remote["outputs"], local["outputs"]))
        log(f"FAILED: {bad} of {len(prompts)} server outputs differ from the in-process ones")
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
