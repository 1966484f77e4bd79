"""What a serving user sees under load: throughput, time to first token, inter-token and end-to-end
latency, in process or through the Triton server.

    muse-spark bench-serving (--engine DIR | --pair DIR) --mode inprocess|triton-http|triton-grpc \\
        --concurrency N --num-requests M --prompt-len L --output-len K [--request-rate R] \\
        [--lengths fixed|uniform|FILE.jsonl] [--seed S] [--json FILE] [--out-dir benchmarks/results] \\
        [--plot FILE.png] [--device cpu|cuda]

(or ``python benchmarks/bench_serving.py ...``). ``--mode``, ``--concurrency`` and ``--request-rate`` take
comma lists: one run per combination, each a row of the table and a point of the plot. ``--pair``: a
``muse-spark make-pair`` folder, built first into an engine (aoti on CUDA, eager on the CPU; max_batch the
largest ``--concurrency``, max_seq what the longest request needs).

Modes
  * ``inprocess``: the serving scheduler thread (``muse_spark.serving.scheduler.Scheduler``, the one the
    Triton model runs) over the engine in this process; each client thread submits a request with a sink
    that timestamps every chunk the scheduler hands it. No server, no network, no (de)serialization.
  * ``inprocess-target-only``: the same, the engine decoding with the target alone (one token per request
    per step: ``runtime.target_only.TargetOnlyEngine``): the baseline without speculation.
  * ``triton-http``: ``muse-spark serve`` (the real tritonserver) on free loopback ports, each request a
    streamed ``POST /v2/models/muse_spark/generate_stream`` (server-sent events, read line by line as
    they arrive; tritonclient.http has no client for this endpoint). Each request opens its connection,
    as curl does.
  * ``triton-grpc``: the same server through ``tritonclient.grpc``: a pool of bidirectional streams
    (``start_stream``), opened before the timing, each request ``async_stream_infer`` on an idle one.
  The Triton modes of one invocation share one server.

Request stream
  Without ``--request-rate``: a closed loop of ``--concurrency`` clients, each sending its next request as
  soon as its last one has finished. With ``--request-rate R``: requests arrive as a Poisson process of R
  requests/s (exponential gaps, seeded, the first at 0), at most ``--concurrency`` in flight; an arrival
  that finds all of them busy waits for one (``client_wait_ms``: time from arrival to send).
  Lengths: ``fixed`` (every prompt ``--prompt-len``, every output ``--output-len`` tokens), ``uniform``
  (each drawn uniformly from [L/2, 3L/2], integers) or a JSONL file of ``{"prompt_len", "output_len"}``
  rows (used in order, repeated if there are fewer than ``--num-requests``). Prompts are drawn from the
  engine's draft vocabulary (the target ids the draft can propose), so acceptance holds from the first
  step; every request has its own sampling seed (``--seed`` and ``--temperature``: greedy by default);
  EOS is ignored, so each request generates exactly its output length. Every run of an invocation sends
  the same requests. One untimed warm-up round (the largest concurrency, 8 tokens each) precedes each
  mode's runs.

Metrics (per run; the JSON holds them with every request's own figures)
  * times are taken on the client (``time.perf_counter``) from the moment the request is sent; a chunk
    is a streamed response (in process: one ``Sink.deliver``): the prefill token, then one per speculative
    step, the tokens that step accepted plus its bonus token;
  * duration: from the run's start to its last final response;
  * request throughput: completed requests / duration; output tokens/s: tokens received / duration;
  * TTFT: arrival of the first chunk that carries tokens − send;
  * e2e latency: arrival of the final response − send;
  * inter-token latency (ITL), per token: between consecutive token-carrying chunks of a request, the
    gap between their arrivals divided by the number of tokens in the later chunk, counted once for each
    of those tokens (a step that delivers 4 tokens 20 ms after the last chunk gives four samples of
    5 ms); the first chunk's tokens have none (TTFT covers them). Percentiles are over all tokens of the
    run, so long requests weigh by their length;
  * TPOT, per request: (e2e − TTFT) / (tokens − 1) (requests of one token have none); its percentiles are
    over requests;
  * mean accepted length: tokens per speculative step, 1 + accepted draft tokens / steps, summed over
    the completed requests (in process from the ``Request``'s steps; through Triton from the final
    response's ``num_steps`` and ``accepted_draft_tokens`` outputs);
  * failures: requests that got an error, no final response (or more than one), or a number of tokens
    other than their output length. Percentiles (numpy, linear interpolation) cover completed requests.

A long prompt (``--long-prompt L``): in each run, one more request of an L-token prompt (and 8 output
tokens) is sent once ``--concurrency`` requests are streaming; the run's ``long_prompt`` gives the other
requests' inter-token latencies while it was served (from its send to its final response) against as long a
window just before, and its own TTFT. It is not counted in the run's other figures.

Output: progress on stderr while a run goes; a summary table on stdout; the result JSON in the common
schema (``benchmarks/results.py``, benchmark ``bench-serving``) under ``--out-dir``, copied to ``--json``;
with ``--plot``, output tokens/s against p99 inter-token latency, one line per mode (and concurrency,
where rates are swept), one point per concurrency or rate. Exit status 1 when any request failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import json
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from muse_spark.runtime import SamplingParams, load_engine
from muse_spark.runtime.target_only import TargetOnlyEngine
from muse_spark.serving.scheduler import Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)
from pairs import (add_engine_arguments, build_from_pair, check_pair, default_backend,  # noqa: E402
                   default_device, pair_gamma, pair_summary, parse_engine_arguments, window)
from server_process import check_tritonserver, triton_server  # noqa: E402

MODES = ("inprocess", "inprocess-target-only", "triton-http", "triton-grpc")
PERCENTILES = (50, 90, 99)
WARMUP_TOKENS = 8
LONG_PROMPT_OUTPUT = 8  # the --long-prompt request's output tokens


# ---- the request stream ---------------------------------------------------------------------
@dataclass(frozen=True)
class Work:
    """One request of the stream."""

    index: int
    prompt: list[int]
    output_len: int
    seed: int


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of ``n`` requests of a Poisson process of ``rate`` requests/s: exponential gaps of
    mean 1/rate, seeded; the first request arrives at 0."""
    if not rate > 0 or not np.isfinite(rate):
        raise ValueError(f"the request rate must be a positive number, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    if n:
        gaps[0] = 0.0
    return np.cumsum(gaps)


def request_lengths(spec: str, n: int, prompt_len: int, output_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt length, output length) of ``n`` requests: ``fixed``, ``uniform`` (each from [L/2, 3L/2]) or
    a JSONL file of ``{"prompt_len", "output_len"}`` rows, used in order and repeated as needed."""
    if spec == "fixed":
        return [(prompt_len, output_len)] * n
    if spec == "uniform":
        rng = np.random.default_rng([seed, 1])

        def draw(length: int) -> np.ndarray:
            return rng.integers(max(1, length // 2), max(1, length + length // 2) + 1, n)

        return list(zip(draw(prompt_len).tolist(), draw(output_len).tolist()))
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(f"--lengths {spec}: neither fixed, uniform nor a file")
    rows = []
    for k, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            p, o = int(row["prompt_len"]), int(row["output_len"])
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--lengths {spec}, line {k}: expected {{\"prompt_len\": N, \"output_len\": N}} ({e})")
        if p < 1 or o < 1:
            raise SystemExit(f"--lengths {spec}, line {k}: lengths must be >= 1, got {p}, {o}")
        rows.append((p, o))
    if not rows:
        raise SystemExit(f"--lengths {spec}: the file holds no rows")
    return [rows[i % len(rows)] for i in range(n)]


def draft_vocabulary(engine_dir: str | Path) -> list[int]:
    """The target ids the engine's draft can propose (its ``d2t`` map), from the engine's draft weights;
    where there are none, every id but the EOS ids."""
    weights = Path(engine_dir) / "draft.safetensors"
    if weights.is_file():
        with safe_open(str(weights), "np") as f:
            if "draft_id_to_target_id" in f.keys():
                d2t = f.get_tensor("draft_id_to_target_id").astype(np.int64)
                return (d2t + np.arange(len(d2t))).tolist()
    cfg = json.loads((Path(engine_dir) / "manifest.json").read_text())["target_config"]
    eos = set(cfg.get("eos_token_id") or [])
    return [t for t in range(cfg["vocab_size"]) if t not in eos]


def make_works(vocab: list[int], lengths: list[tuple[int, int]], seed: int = 0) -> list[Work]:
    rng = np.random.default_rng([seed, 2])
    ids = np.asarray(vocab)
    seeds = rng.integers(0, 2**31, len(lengths))
    return [Work(i, ids[rng.integers(0, len(ids), p)].tolist(), o, int(s))
            for i, ((p, o), s) in enumerate(zip(lengths, seeds))]


# ---- one request's outcome and the statistics -----------------------------------------------
@dataclass
class Outcome:
    index: int
    prompt_len: int
    output_len: int
    arrival: float | None = None  # scheduled arrival (Poisson stream), perf_counter
    sent: float | None = None  # perf_counter when the request went out
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) of each response
    finals: int = 0  # final responses (an error answer is one)
    end: float | None = None  # arrival of the (first) final response
    finish_reason: str | None = None
    error: str | None = None
    steps: int | None = None
    accepted: int | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    def finish(self, t: float, *, reason: str | None = None, error: str | None = None) -> None:
        self.finals += 1
        if self.end is None:
            self.end = t
        if error is not None and self.error is None:
            self.error = error
        if reason is not None:
            self.finish_reason = reason

    def failure(self) -> str | None:
        """Why this request failed, or None."""
        if self.error is not None:
            return self.error
        if self.finals != 1:
            return f"{self.finals} final responses"
        if self.tokens != self.output_len:
            return f"{self.tokens} tokens of {self.output_len} (finish reason {self.finish_reason})"
        return None


def percentiles(values, ps=PERCENTILES) -> dict[str, float | None]:
    """``{"p50": …, "p90": …, "p99": …, "mean": …}`` of ``values`` (numpy, linear interpolation); None each
    where there are no values."""
    v = np.asarray(list(values), dtype=np.float64)
    out: dict[str, float | None] = {f"p{p:g}": (float(np.percentile(v, p)) if v.size else None) for p in ps}
    out["mean"] = float(v.mean()) if v.size else None
    return out


def inter_token_latencies(chunks: list[tuple[float, int]]) -> list[float]:
    """Per-token inter-token latencies of one request's chunks ``(arrival, tokens)``: for each chunk with
    tokens after the first such chunk, (its arrival − the previous token-carrying chunk's) / its tokens,
    once per token. Chunks without tokens are skipped."""
    out: list[float] = []
    last = None
    for t, n in chunks:
        if n <= 0:
            continue
        if last is not None:
            out.extend([(t - last) / n] * n)
        last = t
    return out


def ttft(o: Outcome) -> float | None:
    return next((t - o.sent for t, n in o.chunks if n > 0), None)


def tpot(ttft_s: float | None, e2e_s: float | None, tokens: int) -> float | None:
    """Time per output token after the first: (e2e − TTFT) / (tokens − 1); None under two tokens."""
    if ttft_s is None or e2e_s is None or tokens < 2:
        return None
    return (e2e_s - ttft_s) / (tokens - 1)


def _ms(d: dict) -> dict:
    return {k: (None if v is None else round(v * 1e3, 4)) for k, v in d.items()}


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    """A run's figures (times in ms) and its requests' own."""
    ok = [o for o in outcomes if o.failure() is None]
    failed = [o for o in outcomes if o.failure() is not None]
    tokens = sum(o.tokens for o in outcomes)
    ttfts = [ttft(o) for o in ok]
    e2es = [o.end - o.sent for o in ok]
    tpots = [x for x in (tpot(a, b, o.tokens) for a, b, o in zip(ttfts, e2es, ok)) if x is not None]
    itls = [x for o in ok for x in inter_token_latencies(o.chunks)]
    steps = [o.steps for o in ok]
    out = {
        "num_requests": len(outcomes),
        "completed": len(ok),
        "failures": len(failed),
        "failure_examples": sorted({o.failure() for o in failed})[:5],
        "duration_s": round(duration, 4),
        "request_throughput": round(len(ok) / duration, 4) if duration > 0 else None,
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / duration, 3) if duration > 0 else None,
        "ttft_ms": _ms(percentiles(ttfts)),
        "itl_ms": _ms(percentiles(itls)),
        "tpot_ms": _ms(percentiles(tpots)),
        "e2e_ms": _ms(percentiles(e2es)),
    }
    if ok and all(s is not None for s in steps) and sum(steps) > 0:
        out["mean_accepted_length"] = round(1 + sum(o.accepted for o in ok) / sum(steps), 4)
    if any(o.arrival is not None for o in outcomes):
        out["client_wait_ms"] = _ms(percentiles(o.sent - o.arrival for o in outcomes
                                                if o.arrival is not None and o.sent is not None))
    t0 = min((o.arrival if o.arrival is not None else o.sent) for o in outcomes if o.sent is not None) \
        if any(o.sent is not None for o in outcomes) else 0.0

    def one(o: Outcome) -> dict:
        first = ttft(o)
        e2e = None if o.end is None or o.sent is None else o.end - o.sent
        t = tpot(first, e2e, o.tokens)
        return {"prompt_len": o.prompt_len, "output_len": o.output_len, "tokens": o.tokens,
                "chunks": sum(1 for _, n in o.chunks if n > 0), "final_responses": o.finals,
                "sent_s": None if o.sent is None else round(o.sent - t0, 6),
                "ttft_ms": None if first is None else round(first * 1e3, 4),
                "e2e_ms": None if e2e is None else round(e2e * 1e3, 4),
                "tpot_ms": None if t is None else round(t * 1e3, 4),
                "finish_reason": o.finish_reason, "steps": o.steps, "accepted_draft_tokens": o.accepted,
                "error": o.failure()}

    out["requests"] = [one(o) for o in outcomes]
    return out


# ---- clients ----------------------------------------------------------------------------------
class _TimestampSink:
    """A ``Sink`` of the serving scheduler that timestamps each chunk it is handed."""

    def __init__(self, out: Outcome):
        self.out, self.done = out, threading.Event()

    def deliver(self, req, new_tokens: list[int]) -> None:
        t = time.perf_counter()
        self.out.chunks.append((t, len(new_tokens)))
        if req.finished:
            self.out.steps = len(req.steps)
            self.out.accepted = sum(s.accepted for s in req.steps)
            self.out.finish(t, reason=req.finish_reason)
            self.done.set()

    def fail(self, message: str, kind: str) -> None:
        self.out.finish(time.perf_counter(), error=f"{kind}: {message}")
        self.done.set()

    def cancelled(self) -> bool:
        return False


class InProcessClient:
    """Requests submitted to the serving scheduler thread over an engine loaded here (``target_only``: the
    engine decoding with the target alone, ``runtime.target_only.TargetOnlyEngine``: the baseline)."""

    def __init__(self, engine_dir: str, device: str | None, max_queue: int, temperature: float,
                 target_only: bool = False):
        self.engine = load_engine(engine_dir, device=device)
        served = TargetOnlyEngine(self.engine) if target_only else self.engine
        self.scheduler = Scheduler(served, max_queue=max_queue, log=lambda m: print(m, file=sys.stderr))
        self.scheduler.start()
        self.temperature = temperature

    def send(self, w: Work, out: Outcome, timeout: float) -> None:
        sink = _TimestampSink(out)
        params = SamplingParams(max_tokens=w.output_len, temperature=self.temperature, seed=w.seed, ignore_eos=True)
        out.sent = time.perf_counter()
        self.scheduler.submit(w.prompt, params, sink)
        if not sink.done.wait(timeout):
            out.error = f"no final response within {timeout:g} s"

    def close(self) -> None:
        self.scheduler.stop()
        del self.scheduler, self.engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class HttpStreamClient:
    """``POST …/generate_stream`` with ``stream: true``: the server-sent events read as they arrive."""

    def __init__(self, model_url: str, temperature: float):
        u = urllib.parse.urlsplit(model_url)
        self.host, self.port, self.path = u.hostname, u.port, f"{u.path}/generate_stream"
        self.temperature = temperature

    def send(self, w: Work, out: Outcome, timeout: float) -> None:
        body = json.dumps({"input_ids": w.prompt, "max_tokens": w.output_len, "ignore_eos": True, "stream": True,
                           "seed": w.seed, "temperature": self.temperature}).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            out.sent = time.perf_counter()
            conn.request("POST", self.path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                out.finish(time.perf_counter(), error=f"HTTP {resp.status}: "
                                                      f"{resp.read()[:300].decode(errors='replace')}")
                return
            while True:
                line = resp.readline()
                if not line:
                    break
                t = time.perf_counter()
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    out.finish(t, error=str(event["error"]))
                    continue
                ids = event.get("output_ids", [])  # the endpoint turns a one-element array into a scalar
                out.chunks.append((t, 1 if isinstance(ids, int) else len(ids)))
                if event.get("finish_reason"):
                    out.steps, out.accepted = event.get("num_steps"), event.get("accepted_draft_tokens")
                    out.finish(t, reason=event["finish_reason"])
            if out.finals == 0:
                out.error = "the event stream ended without a final response"
        except (OSError, http.client.HTTPException, ValueError) as e:
            out.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()

    def close(self) -> None:
        pass


class GrpcStreamClient:
    """``tritonclient.grpc``: a pool of streams (``start_stream``), opened before the timing starts; each
    request takes an idle stream, sends itself with ``async_stream_infer`` and gives the stream back once
    its final response is in."""

    def __init__(self, url: str, model: str, temperature: float, streams: int):
        import tritonclient.grpc as grpcclient

        self.grpc, self.url, self.model, self.temperature = grpcclient, url, model, temperature
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._open: list = []
        for _ in range(streams):
            self._idle.put(self._new_stream())

    def _new_stream(self):
        client = self.grpc.InferenceServerClient(self.url)
        responses: queue.SimpleQueue = queue.SimpleQueue()
        client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
        with self._lock:
            self._open.append(client)
        return client, responses

    def _close_stream(self, client) -> None:
        with self._lock:
            if client in self._open:
                self._open.remove(client)
        try:
            client.stop_stream(cancel_requests=True)
            client.close()
        except Exception:
            pass

    def _input(self, name: str, arr: np.ndarray, dtype: str):
        t = self.grpc.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    def send(self, w: Work, out: Outcome, timeout: float) -> None:
        try:
            client, responses = self._idle.get_nowait()
        except queue.Empty:  # more clients than streams opened: open one (outside a timed request)
            client, responses = self._new_stream()
        inputs = [self._input("input_ids", np.array([w.prompt], np.int32), "INT32"),
                  self._input("max_tokens", np.array([[w.output_len]], np.int32), "INT32"),
                  self._input("ignore_eos", np.array([[True]]), "BOOL"),
                  self._input("stream", np.array([[True]]), "BOOL"),
                  self._input("seed", np.array([[w.seed]], np.uint64), "UINT64"),
                  self._input("temperature", np.array([[self.temperature]], np.float32), "FP32")]
        healthy = False
        try:
            out.sent = time.perf_counter()
            client.async_stream_infer(self.model, inputs, request_id=str(w.index), enable_empty_final_response=True)
            healthy = self._receive(responses, out, out.sent + timeout)
        finally:
            if healthy:
                self._idle.put((client, responses))
            else:  # a stream that failed or may still carry this request's responses is not reused
                self._close_stream(client)

    def _receive(self, responses, out: Outcome, deadline: float) -> bool:
        """Read one request's responses → whether its stream may serve the next request."""
        while True:
            try:
                t, result, error = responses.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                out.error = f"no final response within {deadline - out.sent:g} s"
                return False
            if error is not None:
                out.finish(t, error=str(error))
                return False
            ids = result.as_numpy("output_ids")
            if ids is not None:
                out.chunks.append((t, int(ids.size)))
            params = result.get_response().parameters
            if "triton_final_response" not in params or params["triton_final_response"].bool_param:
                steps, accepted = result.as_numpy("num_steps"), result.as_numpy("accepted_draft_tokens")
                if steps is not None and accepted is not None:
                    out.steps, out.accepted = int(steps.reshape(-1)[0]), int(accepted.reshape(-1)[0])
                reason = result.as_numpy("finish_reason")
                out.finish(t, reason=None if reason is None else reason.reshape(-1)[0].decode())
                return True

    def close(self) -> None:
        with self._lock:
            clients, self._open = self._open, []
        for c in clients:
            try:
                c.stop_stream()
                c.close()
            except Exception:
                pass


# ---- the load ---------------------------------------------------------------------------------
class Progress:
    """Requests done / total and the elapsed time on stderr, at most once a second and at the end."""

    def __init__(self, label: str, total: int, log, every: float = 1.0):
        self.label, self.total, self.log, self.every = label, total, log, every
        self.done = self.failed = 0
        self.t0 = self.last = time.perf_counter()
        self._lock = threading.Lock()

    def tick(self, o: Outcome) -> None:
        with self._lock:
            self.done += 1
            self.failed += o.failure() is not None
            now = time.perf_counter()
            if self.done == self.total or now - self.last >= self.every:
                self.last = now
                failed = f", {self.failed} failed" if self.failed else ""
                self.log(f"{self.label}: {self.done}/{self.total} requests done{failed}, {now - self.t0:.1f} s")


def run_load(client, works: list[Work], concurrency: int, rate: float | None, *, seed: int = 0,
             timeout: float = 600, progress: Progress | None = None,
             intruder: Work | None = None) -> tuple[list[Outcome], float, Outcome | None]:
    """Send ``works`` through ``client`` → (their outcomes, the run's duration in s, the intruder's outcome).
    ``intruder``: one more request (a long prompt), sent once ``concurrency`` requests are streaming (each has
    had tokens and none has finished), or not at all if the run ends first (``long_prompt_figures``)."""
    outcomes = [Outcome(w.index, len(w.prompt), w.output_len) for w in works]
    intruded = None if intruder is None else Outcome(-1, len(intruder.prompt), intruder.output_len)
    stop_watch = threading.Event()

    def watch() -> None:
        want = min(concurrency, len(works))
        while not stop_watch.wait(0.002):
            if sum(1 for o in outcomes if o.end is None and any(n > 0 for _, n in o.chunks)) >= want:
                try:
                    client.send(intruder, intruded, timeout)
                except Exception as e:
                    intruded.error = intruded.error or f"{type(e).__name__}: {e}"
                return

    watcher = threading.Thread(target=watch, daemon=True) if intruder is not None else None
    if watcher is not None:
        watcher.start()

    def one(i: int) -> None:
        try:
            client.send(works[i], outcomes[i], timeout)
        except Exception as e:  # a client bug or a refused connection fails this request alone
            outcomes[i].error = outcomes[i].error or f"{type(e).__name__}: {e}"
        if progress is not None:
            progress.tick(outcomes[i])

    t0 = time.perf_counter()
    if rate is None:  # closed loop: each client sends its next request when its last one is answered
        order, lock = iter(range(len(works))), threading.Lock()

        def client_loop() -> None:
            while True:
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                one(i)

        threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(min(concurrency, len(works)))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    else:
        with ThreadPoolExecutor(concurrency) as pool:  # an arrival waits while all of its clients are busy
            for i, at in enumerate(poisson_arrivals(len(works), rate, seed)):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                outcomes[i].arrival = t0 + at
                pool.submit(one, i)
    ends = [o.end for o in outcomes if o.end is not None]
    duration = (max(ends) if ends else time.perf_counter()) - t0
    if watcher is not None:
        stop_watch.set()
        watcher.join()
    return outcomes, duration, intruded


def long_prompt_figures(outcomes: list[Outcome], intruder: Outcome) -> dict:
    """What a long prompt arriving into running streams does to them: the inter-token latencies of the
    other requests' chunks that arrived while it was served (from its send to its final response:
    its prefill, then its few tokens) against those in as long a window just before it was sent."""
    if intruder.sent is None or intruder.end is None or intruder.failure() is not None:
        return {"prompt_len": intruder.prompt_len, "sent": intruder.sent is not None, "error": intruder.failure()}
    start, end = intruder.sent, intruder.end
    during, before = [], []
    for o in outcomes:
        last = None
        for t, n in o.chunks:
            if n <= 0:
                continue
            if last is not None:
                if start <= t <= end:
                    during.extend([(t - last) / n] * n)
                elif start - (end - start) <= t < start:
                    before.extend([(t - last) / n] * n)
            last = t
    first = ttft(intruder)
    out = {"prompt_len": intruder.prompt_len, "sent": True, "ttft_ms": round(first * 1e3, 4),
           "served_ms": round((end - start) * 1e3, 4), "itl_before_ms": _ms(percentiles(before)),
           "itl_during_ms": _ms(percentiles(during))}
    b, d = out["itl_before_ms"], out["itl_during_ms"]
    if b["p50"] and d["p99"] is not None:  # (the p50 before: the step time the streams saw)
        out["p99_during_over_p50_before"] = round(d["p99"] / b["p50"], 3)
    return out


def sweep(client, mode: str, works: list[Work], concurrencies: list[int], rates: list[float | None], a,
          log) -> list[dict]:
    warm = [Work(w.index, w.prompt, min(w.output_len, WARMUP_TOKENS), w.seed) for w in works[:max(concurrencies)]]
    log(f"{mode}: warm-up ({len(warm)} requests of {WARMUP_TOKENS} tokens)")
    run_load(client, warm, max(concurrencies), None, timeout=a.request_timeout)
    runs = []
    for c in concurrencies:
        for r in rates:
            label = f"{mode} concurrency {c}" + ("" if r is None else f" rate {r:g}/s")
            outcomes, duration, intruded = run_load(client, works, c, r, seed=a.seed, timeout=a.request_timeout,
                                                    progress=Progress(label, len(works), log),
                                                    intruder=getattr(a, "intruder", None))
            run = {"mode": mode, "concurrency": c, "request_rate": r, **summarize(outcomes, duration)}
            if intruded is not None:
                run["long_prompt"] = long_prompt_figures(outcomes, intruded)
                lp = run["long_prompt"]
                if lp.get("itl_during_ms"):
                    log(f"{label}: a {lp['prompt_len']}-token prompt served in {lp['served_ms']:.1f} ms: the streams' "
                        f"p99 inter-token latency {lp['itl_during_ms']['p99']} ms (p50 before it "
                        f"{lp['itl_before_ms']['p50']} ms)")
            runs.append(run)
            log(f"{label}: {run['request_throughput']} req/s, {run['output_tokens_per_s']} tok/s, "
                f"{run['failures']} failed")
    return runs


def run_modes(a, engine_dir: str, works: list[Work], log, save=lambda runs: None) -> list[dict]:
    """Every mode's runs in the order given, the Triton modes through one server (started for the first
    of them). ``save`` gets the runs so far after each mode: a sweep cut short by a time limit keeps
    what it measured."""
    runs = []
    with contextlib.ExitStack() as stack:
        srv = None
        for mode in a.mode:
            if mode.startswith("inprocess"):
                client = InProcessClient(engine_dir, a.device, max(256, max(a.concurrency)), a.temperature,
                                         target_only=mode == "inprocess-target-only")
            else:
                if srv is None:
                    repo_args = ["--max-queue", str(max(256, max(a.concurrency)))]
                    if a.torch_threads:
                        repo_args += ["--torch-threads", str(a.torch_threads)]
                    serve_args = ["--stub-numpy", a.stub_numpy] if a.stub_numpy else []
                    work = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-serving-"))
                    srv = stack.enter_context(triton_server(engine_dir, a.device, Path(work), log,
                                                            repo_args=repo_args, serve_args=serve_args))
                client = (HttpStreamClient(srv.model_url, a.temperature) if mode == "triton-http"
                          else GrpcStreamClient(srv.grpc, srv.model, a.temperature, max(a.concurrency)))
            try:
                runs += sweep(client, mode, works, a.concurrency, a.request_rate, a, log)
            finally:
                client.close()
            save(runs)
    return runs


# ---- the report -------------------------------------------------------------------------------
def table(runs: list[dict]) -> str:
    def f(v, nd=1):
        return "-" if v is None else f"{v:.{nd}f}"

    head = ["mode", "conc", "rate", "ok/fail", "req/s", "tok/s", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
            "TPOT p50 ms", "E2E p50/p99 ms", "acc len"]
    rows = [head]
    for r in runs:
        rows.append([r["mode"], str(r["concurrency"]), "-" if r["request_rate"] is None else f"{r['request_rate']:g}",
                     f"{r['completed']}/{r['failures']}", f(r["request_throughput"], 2), f(r["output_tokens_per_s"]),
                     "/".join(f(r["ttft_ms"][k]) for k in ("p50", "p90", "p99")),
                     "/".join(f(r["itl_ms"][k], 2) for k in ("p50", "p90", "p99")),
                     f(r["tpot_ms"]["p50"], 2), "/".join(f(r["e2e_ms"][k]) for k in ("p50", "p99")),
                     f(r.get("mean_accepted_length"), 2)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Output tokens/s against p99 inter-token latency: a line per mode (and concurrency, where the rate
    is swept), a point per concurrency or rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate_sweep = len({r["request_rate"] for r in runs}) > 1
    lines: dict[str, list[dict]] = {}
    for r in runs:
        key = r["mode"] + (f", concurrency {r['concurrency']}" if rate_sweep else "")
        lines.setdefault(key, []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, pts in lines.items():
        pts = [p for p in pts if p["itl_ms"]["p99"] is not None]
        xs, ys = [p["itl_ms"]["p99"] for p in pts], [p["output_tokens_per_s"] for p in pts]
        ax.plot(xs, ys, marker="o", label=key)
        for p, x, y in zip(pts, xs, ys):
            tag = f"r={p['request_rate']:g}" if rate_sweep else f"c={p['concurrency']}"
            ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("p99 inter-token latency (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the command --------------------------------------------------------------------------------
def _list(kind):
    def parse(s: str):
        try:
            vals = [kind(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"a comma list of numbers, got {s!r}") from None
        if not vals or any(not 0 < v < float("inf") for v in vals):
            raise argparse.ArgumentTypeError(f"positive finite values, got {s!r}")
        return vals

    return parse


def _modes(s: str) -> list[str]:
    """``--mode``: a comma list of ``MODES``; ``triton`` stands for ``triton-http`` (the server through HTTP, which
    needs no gRPC package)."""
    modes = ["triton-http" if m.strip() == "triton" else m.strip() for m in s.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"{', '.join(bad) or repr(s)} is not one of {', '.join(MODES)}")
    return modes


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--mode", type=_modes, default=["inprocess"],
                   help=f"{' | '.join(MODES)} (triton: triton-http), or a comma list of them (default inprocess)")
    p.add_argument("--concurrency", type=_list(int), default=[8],
                   help="clients (closed loop) or the most requests in flight (with --request-rate); a comma list "
                        "sweeps (default 8)")
    p.add_argument("--request-rate", type=_list(float), default=None,
                   help="Poisson arrivals of this many requests/s; a comma list sweeps (default: a closed loop)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run (default 64)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (EOS ignored; default 128)")
    p.add_argument("--lengths", default="fixed",
                   help="fixed | uniform (each length from [L/2, 3L/2]) | a JSONL file of "
                        '{"prompt_len", "output_len"} rows (default fixed)')
    p.add_argument("--long-prompt", type=int, default=None, metavar="L",
                   help="in each run, one more request with an L-token prompt (and 8 output tokens), sent once "
                        "--concurrency requests are streaming: their inter-token latency while it is served, "
                        "against just before (long_prompt in the JSON)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seeds the lengths, prompts, arrivals and per-request seeds")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="CPU threads of the engine (in process, and passed to muse-spark triton-repo)")
    p.add_argument("--stub-numpy", default=None, help="passed to muse-spark serve")
    p.add_argument("--out-dir", default=str(results.RESULTS), help="folder for the result JSON")
    p.add_argument("--json", default=None, help="also write the result JSON to this file")
    p.add_argument("--plot", default=None, help="write output tokens/s against p99 inter-token latency (PNG)")


def main(argv: list[str] | None = None, prog: str = "python benchmarks/bench_serving.py") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_engine_arguments(p, argv)
    a.command = " ".join([prog, *argv]).strip()
    for name in ("num_requests", "prompt_len", "output_len"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.backend and not a.pair:
        p.error("--backend applies to --pair (an --engine runs with its own backend)")
    a.request_rate = a.request_rate or [None]

    def log(msg: str) -> None:
        print(f"[bench-serving] {msg}", file=sys.stderr, flush=True)

    if any(not m.startswith("inprocess") for m in a.mode):
        try:
            check_tritonserver()
        except Exception as e:
            print(f"{prog}: error: the triton modes need tritonserver, which cannot run here: {e}", file=sys.stderr)
            return 2
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    lengths = request_lengths(a.lengths, a.num_requests, a.prompt_len, a.output_len, a.seed)
    with tempfile.TemporaryDirectory(prefix="bench-serving-engine-") as tmp:
        if a.pair:
            pair = check_pair(a.pair)
            a.device = default_device(a.device)
            need = window(max([p for p, _ in lengths] + [a.long_prompt or 0]), max(o for _, o in lengths),
                          pair_gamma(pair))
            a.engine = str(build_from_pair(pair, a.work_dir or tmp, backend=a.backend or default_backend(a.device),
                                           device=a.device, max_batch=max(a.concurrency), max_seq=need, log=log,
                                           reuse=a.reuse_engine, kv_cache_dtype=a.kv_cache_dtype))
        return run(a, lengths, log, prog)


def run(a, lengths: list[tuple[int, int]], log, prog: str) -> int:
    manifest = json.loads((Path(a.engine) / "manifest.json").read_text())
    gamma, max_seq = int(manifest["gamma"]), int(manifest["max_seq"])
    too_long = [(p, o) for p, o in lengths if p + o + gamma > max_seq]
    if too_long:
        p, o = max(too_long, key=sum)
        print(f"{prog}: error: a request of prompt {p} + output {o} tokens (+ {gamma} draft slots) does not fit "
              f"the engine's max_seq {max_seq}; shorten the lengths or build the engine with a larger --max-seq",
              file=sys.stderr)
        return 2
    if a.long_prompt is not None and a.long_prompt + LONG_PROMPT_OUTPUT + gamma > max_seq:
        print(f"{prog}: error: --long-prompt {a.long_prompt} (+ {LONG_PROMPT_OUTPUT} output tokens + {gamma} draft "
              f"slots) does not fit the engine's max_seq {max_seq}", file=sys.stderr)
        return 2
    works = make_works(draft_vocabulary(a.engine), lengths, a.seed)
    if a.long_prompt is not None:
        (w,) = make_works(draft_vocabulary(a.engine), [(a.long_prompt, LONG_PROMPT_OUTPUT)], a.seed + 1)
        a.intruder = Work(-1, w.prompt, w.output_len, w.seed)
    log(f"{len(works)} requests, prompts {min(p for p, _ in lengths)}-{max(p for p, _ in lengths)} tokens, outputs "
        f"{min(o for _, o in lengths)}-{max(o for _, o in lengths)} tokens; engine {a.engine} ({manifest['backend']}, "
        f"max_batch {manifest['max_batch']})")
    config = {k: v for k, v in vars(a).items() if k not in ("command", "out_dir", "json", "plot", "intruder")}
    config["engine_backend"], config["gamma"], config["max_batch"] = manifest["backend"], gamma, manifest["max_batch"]
    if a.pair:
        config["pair_summary"] = pair_summary(a.pair)
    device = a.device or manifest.get("device", {}).get("kind", "")
    doc = results.record("bench-serving", config, {"runs": []}, command=[a.command],
                         device=results.cpu_name() if str(device).startswith("cpu") else None)

    def save(runs: list[dict]) -> Path:
        # the same document (date and command) rewritten: one file that grows run by run
        doc["results"]["runs"] = runs
        return results.write(doc, Path(a.out_dir))

    runs = run_modes(a, a.engine, works, log, save)
    print(table(runs), flush=True)
    path = save(runs)
    log(f"wrote {path}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, a.json)
        log(f"wrote {a.json}")
    if a.plot:
        plot(runs, Path(a.plot), f"{doc['device']}: {manifest['backend']} engine, "
                                 f"prompt {a.prompt_len} / output {a.output_len} tokens ({a.lengths})")
        log(f"wrote {a.plot}")
    failed = sum(r["failures"] for r in runs)
    if failed:
        log(f"FAILED: {failed} requests failed (see failure_examples in the JSON)")
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
