"""The Triton model repository and launcher, tested against the real ``tritonserver``.

The module starts ``muse-spark serve`` once (a real tritonserver from the
nvidia-pytriton wheel, on free loopback ports, CPU, a tiny engine) and talks to
it over HTTP (``generate``, ``generate_stream``) and gRPC streaming
(tritonclient). Every output is compared with the runtime run in this process
(``Generator``), which is the specification. Skips when nvidia-pytriton or
tritonclient is not installed.
"""

from __future__ import annotations

import itertools

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from muse_spark.builder.build import build_engine
from muse_spark.cli import main as cli_main
from muse_spark.runtime import RequestError, SamplingParams, load_engine
from muse_spark.serving.protocol import StreamDecoder, parse_request
from muse_spark.serving.repo import RepoError, render_config, write_repository
from muse_spark.serving.scheduler import Scheduler
from muse_spark.serving.server import ServingError, check_repository
from serving_utils import (MODEL, Collector, Reference, all_slots_free, generate, generate_stream, grpc_stream, ids_of,
                           one_torch_thread, start_server, stop_server, tail, wait_for)

MAX_BATCH, MAX_SEQ, GAMMA = 8, 512, 5


def slots_free(m: dict) -> bool:
    return all_slots_free(m, MAX_BATCH)


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_dir(agreeing_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("serving") / "engine"
    build_engine(*agreeing_pair, out, max_batch=MAX_BATCH, max_seq=MAX_SEQ, quiet=True)
    return out


@pytest.fixture(scope="module")
def ref(engine_dir):
    return Reference(engine_dir)


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    srv = start_server(engine_dir, tmp_path_factory.mktemp("triton"))
    yield srv
    # Clean exit on SIGTERM: forwarded to tritonserver, which unloads the model and exits 0.
    rc = stop_server(srv)
    assert rc == 0, f"muse-spark serve exited with {rc}:\n{tail(srv.log)}"
    assert "successfully unloaded" in srv.log.read_text(errors="replace")


# ---- the repository (no server) ---------------------------------------------------------------
def test_repository_layout_and_config(engine_dir, tmp_path):
    model_dir = write_repository(engine_dir, tmp_path / "repo", instances=2)
    assert (model_dir / "1" / "model.py").read_text().startswith('"""The Triton python-backend model')
    cfg = (model_dir / "config.pbtxt").read_text()
    assert 'backend: "python"' in cfg and "decoupled: true" in cfg and "count: 2" in cfg and "KIND_CPU" in cfg
    for name in ("text_input", "input_ids", "max_tokens", "temperature", "seed", "random_seed", "stream",
                 "end_id", "stop_ids", "text_output", "output_ids", "accepted_draft_tokens",
                 "acceptance_per_position"):
        assert f'name: "{name}"' in cfg
    assert f'string_value: "{Path(engine_dir).resolve().as_posix()}"' in cfg
    # the sampling controls and log-probabilities: optional inputs, and their output
    for name in ("runtime_top_k", "runtime_top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "min_tokens", "min_length", "return_log_probs"):
        assert f'name: "{name}"' in cfg
        assert "optional: true" in cfg[cfg.index(f'name: "{name}"'):].split("}", 1)[0]
    assert 'name: "output_log_probs"' in cfg
    assert check_repository(tmp_path / "repo") == [MODEL]
    paged = write_repository(engine_dir, tmp_path / "paged", kv_pool={"kv_tokens": 4096, "kv_block_size": 32,
                                                                      "swap_space": 0.5})
    cfg = (paged / "config.pbtxt").read_text()
    assert 'key: "kv_cache_tokens"' in cfg and 'string_value: "4096"' in cfg and 'string_value: "32"' in cfg
    assert 'key: "swap_space"\n  value: { string_value: "0.5" }' in cfg
    swap_only = write_repository(engine_dir, tmp_path / "swap", kv_pool={"swap_space": 1})
    cfg = (swap_only / "config.pbtxt").read_text()
    assert 'key: "swap_space"' in cfg and "kv_cache_tokens" not in cfg and "kv_block_size" not in cfg


def test_repository_refuses_bad_arguments(engine_dir, tmp_path):
    foreign = tmp_path / "repo" / MODEL
    foreign.mkdir(parents=True)
    (foreign / "config.pbtxt").write_text('name: "mine"\n')
    with pytest.raises(RepoError, match="not written by muse-spark"):
        write_repository(engine_dir, tmp_path / "repo")
    with pytest.raises(RepoError, match="instances"):
        write_repository(engine_dir, tmp_path / "other", instances=0)
    with pytest.raises(RepoError, match="model name"):
        write_repository(engine_dir, tmp_path / "other", model_name="a b")
    assert cli_main(["triton-repo", "--engine", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2


def test_serve_refuses_a_missing_or_broken_repository(tmp_path, capsys):
    assert cli_main(["serve", "--repo", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "repo" / MODEL).mkdir(parents=True)
    (tmp_path / "repo" / MODEL / "config.pbtxt").write_text(render_config(MODEL, tmp_path / "gone"))
    with pytest.raises(ServingError, match="engine directory .* is missing"):
        check_repository(tmp_path / "repo")


def test_sampling_inputs_map_to_the_runtimes_params():
    def parse(**inputs):
        arrays = {"input_ids": np.array([[1, 2, 3]], np.int32), "max_tokens": np.array([[8]], np.int32)}
        for name, value in inputs.items():
            arrays[name] = np.array([[value]], dtype={bool: np.bool_, int: np.int32, float: np.float32}[type(value)])
        return parse_request(arrays.get, None).params

    p = parse(runtime_top_k=5, runtime_top_p=0.75, min_p=0.125, repetition_penalty=1.25, presence_penalty=0.5,
              frequency_penalty=-0.25, min_length=3, return_log_probs=True)
    assert (p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_tokens,
            p.logprobs) == (5, 0.75, 0.125, 1.25, 0.5, -0.25, 3, 0)
    assert parse(min_tokens=2).min_tokens == 2 and parse(min_tokens=2, min_length=2).min_tokens == 2
    assert parse(return_log_probs=False).logprobs is None and not parse().controls()
    with pytest.raises(RequestError, match="min_tokens .2. and min_length .3. disagree"):
        parse(min_tokens=2, min_length=3)
    with pytest.raises(RequestError, match="runtime_top_k must be an integer"):
        parse(runtime_top_k=1.5)


def test_an_engine_without_sampling_controls_fails_the_request_alone(engine_dir, ref):
    """An engine that samples with temperature and seed only (the compiled ones) refuses a request with
    controls through the scheduler's error path; the next request is served."""
    engine = load_engine(engine_dir)
    engine.controls = False  # (as the compiled engines declare)
    with one_torch_thread():
        sched = Scheduler(engine, max_queue=8)
        sched.start()
        try:
            refused, served = Collector(), Collector()
            sched.submit([1, 2, 3], SamplingParams(max_tokens=4, top_k=1, temperature=1.0), refused)
            sched.submit([1, 2, 3], SamplingParams(max_tokens=4), served)
            assert refused.done.wait(60) and served.done.wait(60)
        finally:
            sched.stop()
    assert refused.error[0] == "invalid" and "run on the eager engine" in refused.error[1]
    assert served.error is None and sum(served.chunks, []) == ref.run([1, 2, 3], max_tokens=4).output


def test_stream_decoder_holds_back_split_characters(ref):
    text = "héllo wörld ✓ — 🚀 done"
    ids = ref.tok.encode(text).ids
    dec, pieces = StreamDecoder(ref.tok), []
    for n in range(1, len(ids) + 1):
        pieces.append(dec.push(ids[:n], final=n == len(ids)))
    assert "".join(pieces) == text == ref.text(ids)
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("off_thread", [False, True], ids=["scheduler_thread", "responder_thread"])
def test_scheduler_batches_requests_in_flight_and_frees_every_slot(engine_dir, ref, off_thread):
    with one_torch_thread():
        _scheduler_batches_requests(engine_dir, ref, off_thread)


def _scheduler_batches_requests(engine_dir, ref, off_thread):
    """Requests in flight, one refused and one cancelled, with sinks called on the scheduler thread or (the
    Triton model's) on the responder thread, where each call sees the request as it was at its step."""
    sched = Scheduler(load_engine(engine_dir), max_queue=64)
    sched.start()
    jobs = [([i + 1, 2 * i + 3], dict(max_tokens=5 + 3 * i, ignore_eos=True)) for i in range(12)]  # > 8 slots
    sinks = [Collector(off_thread=off_thread) for _ in jobs]
    for (prompt, params), sink in zip(jobs, sinks):
        sched.submit(prompt, SamplingParams(**params), sink)
    bad = Collector(off_thread=off_thread)
    sched.submit([1, 2], SamplingParams(max_tokens=0), bad)
    cancelled = Collector(cancel_after=2, off_thread=off_thread)
    sched.submit([9, 9], SamplingParams(max_tokens=400, ignore_eos=True), cancelled)
    for sink in [*sinks, bad, cancelled]:
        assert sink.done.wait(60)
    for (prompt, params), sink in zip(jobs, sinks):
        assert sink.error is None and sink.chunks == ref.chunks(prompt, **params)
        assert sink.threads == {"muse-spark-responder" if off_thread else "muse-spark-scheduler"}
        # each call's snapshot: the output up to that call's tokens, not what the request reached later
        assert [len(o) for o in sink.outputs] == list(itertools.accumulate(len(c) for c in sink.chunks))
    assert bad.error[0] == "invalid" and "max_tokens" in bad.error[1]
    assert cancelled.error[0] == "cancelled" and len(cancelled.chunks) < 400
    time.sleep(0.2)
    assert sched.occupancy.free_slots == MAX_BATCH and sched.occupancy.active == 0
    assert sched.counters.outcomes == {"completed": 12, "rejected": 1, "cancelled": 1, "failed": 0}
    sched.stop()


def test_a_client_that_goes_away_is_seen_from_the_responder_thread(engine_dir):
    """An off-thread sink's ``cancelled()`` is asked on the responder thread (not between steps); its request
    is then cancelled and its slot freed, and the other request runs on."""
    with one_torch_thread():
        sched = Scheduler(load_engine(engine_dir), max_queue=8)
        sched.start()
        try:
            leaving, staying = Collector(cancel_after=3, off_thread=True), Collector(off_thread=True)
            asked = []
            leaving_cancelled = leaving.cancelled
            leaving.cancelled = lambda: asked.append(threading.current_thread().name) or leaving_cancelled()
            sched.submit([5, 6], SamplingParams(max_tokens=300, ignore_eos=True), leaving)
            sched.submit([1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True), staying)
            assert leaving.done.wait(60) and staying.done.wait(60)
            assert leaving.error[0] == "cancelled" and "was cancelled" in leaving.error[1]
            assert set(asked) == {"muse-spark-responder"} and staying.error is None
            assert len(sum(staying.chunks, [])) == 40 and len(sum(leaving.chunks, [])) < 300
        finally:
            sched.stop()


class _BrokenSink(Collector):
    """A Triton-like sink (responder thread) whose client goes away: its second response cannot be sent."""

    def deliver(self, req, new_tokens):
        if len(self.chunks) == 1:
            raise ConnectionError("the client went away")
        super().deliver(req, new_tokens)


def test_a_response_that_cannot_be_sent_cancels_its_request_and_frees_its_slot(engine_dir, ref):
    with one_torch_thread():
        sched = Scheduler(load_engine(engine_dir), max_queue=8)
        sched.start()
        try:
            broken, other = _BrokenSink(off_thread=True), Collector(off_thread=True)
            sched.submit([5, 6], SamplingParams(max_tokens=200, ignore_eos=True), broken)
            sched.submit([1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True), other)
            assert broken.done.wait(60) and other.done.wait(60)
            assert broken.error[0] == "cancelled" and "could not be sent" in broken.error[1]
            assert len(broken.chunks) == 1 and other.error is None
            assert sum(other.chunks, []) == ref.run([1, 2, 3], max_tokens=12, ignore_eos=True).output
            deadline = time.monotonic() + 10
            while sched.occupancy.free_slots != MAX_BATCH and time.monotonic() < deadline:
                time.sleep(0.02)
            assert sched.occupancy.free_slots == MAX_BATCH
            assert sched.counters.outcomes["cancelled"] == 1 and sched.counters.outcomes["completed"] == 1
        finally:
            sched.stop()


def test_scheduler_refuses_past_its_queue_and_ends_everything_on_stop(engine_dir):
    sched = Scheduler(load_engine(engine_dir), max_queue=2)  # not started: requests stay queued
    queued = [Collector() for _ in range(2)]
    for sink in queued:
        sched.submit([1, 2, 3], SamplingParams(max_tokens=4), sink)
    refused = Collector()
    sched.submit([1, 2, 3], SamplingParams(max_tokens=4), refused)
    assert refused.error[0] == "unavailable" and "queue is full" in refused.error[1]
    sched.stop()
    # Each queued request gets one final response, finish reason shutdown, no tokens; so does a late one.
    late = Collector()
    sched.submit([1], SamplingParams(max_tokens=1), late)
    for sink in [*queued, late]:
        assert sink.error is None and sink.finish_reason == "shutdown" and sink.chunks == [[]]
    assert sched.counters.outcomes == {"completed": 0, "rejected": 1, "cancelled": 3, "failed": 0}


# ---- the server ---------------------------------------------------------------------------------
def test_generate_is_exactly_the_greedy_runtime_output(server, ref):
    want = ref.run([1, 2, 3], max_tokens=40, ignore_eos=True)
    status, body = generate(server, {"input_ids": [1, 2, 3], "max_tokens": 40, "ignore_eos": True})
    assert status == 200, body
    assert ids_of(body) == want.output
    assert body["text_output"] == ref.text(want.output)
    assert body["finish_reason"] == "length"
    stats = want.stats(GAMMA)
    assert body["num_steps"] == stats["steps"] and body["accepted_draft_tokens"] == stats["accepted_draft_tokens"]
    assert body["accepted_draft_tokens"] > 0  # the agreeing pair really accepts drafts
    assert len(body["acceptance_per_position"]) == GAMMA

    text = "Speculative decoding, served."
    prompt = ref.tok.encode(text).ids
    want = ref.run(prompt, max_tokens=30)
    # The request shape of tensorrtllm_backend's examples (empty bad_words / stop_words).
    status, body = generate(server, {"text_input": text, "max_tokens": 30, "bad_words": "", "stop_words": ""})
    assert status == 200, body
    assert ids_of(body) == want.output and body["text_output"] == ref.text(want.output)


def test_end_id_and_stop_ids_end_generation(server, ref):
    free_run = ref.run([4, 5, 6], max_tokens=40, ignore_eos=True).output
    end, stop = free_run[12], free_run[6]
    for extra, stops in (({"end_id": end}, (end,)), ({"stop_ids": [stop], "ignore_eos": True}, (stop,))):
        want = ref.run([4, 5, 6], max_tokens=40, stop_token_ids=stops, ignore_eos=True)
        status, body = generate(server, {"input_ids": [4, 5, 6], "max_tokens": 40, **extra})
        assert status == 200, body
        assert ids_of(body) == want.output and ids_of(body)[-1] in stops
        assert body["finish_reason"] == "stop"


def test_num_return_sequences_and_stop_words_of_several_tokens(server, ref):
    """num_return_sequences: one response stream per sample (seed, seed + 1, …), told apart by
    sequence_index, the final flag on the last; a stop word of several tokens ends the output with
    its tokens (tensorrtllm_backend's matching, on the output's tokens)."""
    base = {"input_ids": [1, 2, 3], "max_tokens": 16, "ignore_eos": True, "temperature": 1.5, "seed": 5}
    for stream in (False, True):
        status, events = generate_stream(server, {**base, "num_return_sequences": 3, "stream": stream})
        assert status == 200, events
        by_seq: dict[int, list] = {}
        for e in events:
            by_seq.setdefault(e["sequence_index"], []).append(e)
        assert sorted(by_seq) == [0, 1, 2]
        for i, evs in by_seq.items():
            want = ref.chunks([1, 2, 3], max_tokens=16, ignore_eos=True, temperature=1.5, seed=5 + i)
            assert [ids_of(e) for e in evs] == (want if stream else [sum(want, [])])
            assert evs[-1]["finish_reason"] == "length"
    free = ref.run([4, 5, 6], max_tokens=40, ignore_eos=True).output
    word = seq = None
    for i in range(4, 30):  # a word of several tokens out of the output
        text = ref.text(free[i:i + 3])
        ids = tuple(ref.tok.encode(text, add_special_tokens=False).ids)
        if text.strip() and len(ids) > 1:
            word, seq = text, ids
            break
    assert word is not None
    want = ref.run([4, 5, 6], max_tokens=40, ignore_eos=True, stop_sequences=(seq,))
    assert want.finish_reason == "stop" and tuple(want.output[-len(seq):]) == seq
    status, body = generate(server, {"input_ids": [4, 5, 6], "max_tokens": 40, "ignore_eos": True,
                                     "stop_words": [word, "zzzz never"]})
    assert status == 200, body
    assert ids_of(body) == want.output and body["finish_reason"] == "stop"
    for bad in (0, 9):
        status, body = generate(server, {**base, "num_return_sequences": bad})
        assert status == 400 and "num_return_sequences must be an integer in [1, 8]" in body["error"], body


def test_generate_stream_yields_each_step_and_concatenates_to_the_result(server, ref):
    payload = {"input_ids": [7, 8, 9, 10], "max_tokens": 60, "stream": True, "ignore_eos": True}
    status, events = generate_stream(server, payload)
    assert status == 200, events
    chunks = [ids_of(e) for e in events]
    assert chunks == ref.chunks([7, 8, 9, 10], max_tokens=60, ignore_eos=True)  # one event per runtime step
    assert len(chunks) > 3
    assert [e["finish_reason"] for e in events] == [""] * (len(events) - 1) + ["length"]
    _, whole = generate(server, {**payload, "stream": False})
    assert sum(chunks, []) == ids_of(whole)
    assert "".join(e["text_output"] for e in events) == whole["text_output"]


def test_sampling_controls_and_log_probs(server, ref):
    base = {"input_ids": [1, 2, 3], "max_tokens": 30, "ignore_eos": True}
    # runtime_top_k 1 keeps the most likely token alone: at temperature 1 the output is the greedy one
    greedy = ref.run([1, 2, 3], max_tokens=30, ignore_eos=True).output
    status, body = generate(server, {**base, "temperature": 1.0, "seed": 11, "runtime_top_k": 1})
    assert status == 200, body
    assert ids_of(body) == greedy
    # the other controls reach the runtime (values exact in fp32)
    controls = dict(top_p=0.75, min_p=0.0625, repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=0.25,
                    min_tokens=4)
    want = ref.run([1, 2, 3], max_tokens=30, ignore_eos=True, temperature=2.0, seed=11, **controls).output
    status, body = generate(server, {**base, "temperature": 2.0, "seed": 11, "runtime_top_p": 0.75, "min_p": 0.0625,
                                     "repetition_penalty": 1.25, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                                     "min_length": 4})
    assert status == 200 and ids_of(body) == want
    # return_log_probs: one log-probability per output token, the runtime's
    req = ref.run([1, 2, 3], max_tokens=30, ignore_eos=True, logprobs=0)
    status, body = generate(server, {**base, "return_log_probs": True})
    assert status == 200 and ids_of(body) == req.output
    lps = body["output_log_probs"]
    assert len(lps) == 30 and all(abs(a - b) < 1e-4 for a, (b, _) in zip(lps, req.logprobs))
    assert "output_log_probs" not in generate(server, base)[1]
    # streamed: each response carries its new tokens' log-probabilities
    status, events = generate_stream(server, {**base, "return_log_probs": True, "stream": True})
    assert status == 200 and len(events) > 3
    per_event = [e["output_log_probs"] if isinstance(e["output_log_probs"], list) else [e["output_log_probs"]]
                 for e in events]
    assert [len(x) for x in per_event] == [len(ids_of(e)) for e in events]
    assert all(abs(a - b) < 1e-4 for a, b in zip(sum(per_event, []), lps)) and len(sum(per_event, [])) == 30
    # bad values: the runtime's checks
    for extra, says in (({"runtime_top_p": 1.5}, "top_p must be a number in [0.0, 1.0]"),
                        ({"runtime_top_k": -1}, "top_k must be an integer in"),
                        ({"min_tokens": 2, "min_length": 3}, "disagree")):
        status, body = generate(server, {**base, **extra})
        assert status == 400 and says in body["error"], (extra, body)


def test_grpc_streaming_with_tritonclient(server, ref):
    prompt = ref.tok.encode("gRPC streams").ids
    out = grpc_stream(server, {"text_input": np.array([["gRPC streams"]], dtype=object),
                               "max_tokens": np.array([[25]], np.int32), "stream": np.array([[True]]),
                               "temperature": np.array([[0.9]], np.float32), "seed": np.array([[1234]], np.uint64)})
    assert all(isinstance(o, tuple) for o in out), out
    want = ref.chunks(prompt, max_tokens=25, temperature=0.9, seed=1234)
    assert [ids for ids, _, _ in out] == want
    assert "".join(text for _, text, _ in out) == ref.text(sum(want, []))


def test_sixteen_concurrent_requests_with_different_parameters(server, ref):
    rng = random.Random(0)
    jobs = []
    for i in range(20):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
        params = dict(max_tokens=rng.randint(1, 48), temperature=rng.choice([0.0, 0.0, 0.7, 1.3]),
                      seed=rng.randrange(2**63), ignore_eos=rng.random() < 0.5)
        jobs.append((prompt, params, i % 3 == 0))

    def run(job):
        prompt, params, stream = job
        payload = {"input_ids": prompt, **params, "stream": stream}
        if stream:
            status, events = generate_stream(server, payload)
            return status, sum((ids_of(e) for e in events), []), "".join(e["text_output"] for e in events)
        status, body = generate(server, payload)
        return status, ids_of(body), body["text_output"]

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (prompt, params, stream), (status, ids, text) in zip(jobs, results):
        want = ref.run(prompt, **params).output
        assert status == 200
        assert ids == want, (prompt, params, stream)
        assert text == ref.text(want)
    wait_for(server, slots_free, "all slots free")


BAD_REQUESTS = [
    ({"max_tokens": 5}, "no prompt"),
    ({"input_ids": [1, 2, 400], "max_tokens": 5}, "outside the vocabulary"),
    ({"input_ids": [1, 2, 3], "max_tokens": -3}, "max_tokens must be a positive integer"),
    ({"input_ids": [1, 2, 3]}, "max_tokens is required"),
    ({"input_ids": [5] * (MAX_SEQ - 10), "max_tokens": 20}, "exceeds the engine's maximum sequence length"),
    ({"input_ids": [1], "text_input": "x", "max_tokens": 5}, "not both"),
    ({"input_ids": [1, 2], "max_tokens": 5, "temperature": -1.0}, "temperature"),
    ({"input_ids": [1, 2], "max_tokens": 5, "bad_words": "nope"}, "bad_words"),
    ({"input_ids": [1, 2], "max_tokens": "ten"}, "parse"),  # wrong datatype (JSON string for INT32)
]


def test_bad_requests_get_errors_while_the_server_keeps_serving(server, ref):
    long_payload = {"input_ids": [3, 1, 4, 1, 5], "max_tokens": 300, "ignore_eos": True, "stream": True}
    holder = {}
    t = threading.Thread(target=lambda: holder.update(result=generate_stream(server, long_payload)))
    t.start()
    for payload, message in BAD_REQUESTS:
        status, body = generate(server, payload)
        assert status >= 400 and message in body.get("error", ""), (payload, status, body)
    # Wrong datatype over gRPC: Triton itself refuses it, before the model.
    out = grpc_stream(server, {"input_ids": np.array([[1, 2]], np.int32), "max_tokens": np.array([[5.0]], np.float32)})
    assert len(out) == 1 and isinstance(out[0], str) and "max_tokens" in out[0] and "FP32" in out[0]
    t.join(timeout=120)
    status, events = holder["result"]
    assert status == 200 and sum((ids_of(e) for e in events), []) == ref.run(
        [3, 1, 4, 1, 5], max_tokens=300, ignore_eos=True).output
    wait_for(server, slots_free, "all slots free")


def test_a_cancelled_stream_frees_its_slot(server):
    before = wait_for(server, slots_free, "all slots free")
    long = {"input_ids": [2, 7, 1, 8], "max_tokens": MAX_SEQ - 20, "ignore_eos": True, "stream": True}
    # HTTP: the client reads two events and hangs up.
    status, events = generate_stream(server, long, stop_after=2)
    assert status == 200 and len(events) == 2
    # gRPC: stop_stream(cancel_requests=True) after two responses.
    out = grpc_stream(server, {"input_ids": np.array([[2, 7, 1, 8]], np.int32),
                               "max_tokens": np.array([[MAX_SEQ - 20]], np.int32),
                               "ignore_eos": np.array([[True]]), "stream": np.array([[True]])}, cancel_after=2)
    assert len(out) == 2
    after = wait_for(server, lambda m: slots_free(m) and m["muse_spark_requests_total:cancelled"]
                     >= before["muse_spark_requests_total:cancelled"] + 2, "two cancellations and free slots")
    assert after["muse_spark_requests_total:completed"] == before["muse_spark_requests_total:completed"]


def test_metrics_count_the_requests(server):
    key = "nv_inference_request_success"
    before = wait_for(server, slots_free, "all slots free")
    for n in (3, 4):
        assert generate(server, {"input_ids": [n], "max_tokens": n})[0] == 200
    assert generate(server, {"input_ids": [300], "max_tokens": 2})[0] == 400
    expected = {key: 3, "muse_spark_requests_total:completed": 2, "muse_spark_requests_total:rejected": 1,
                "muse_spark_generated_tokens_total": 7}
    # Metrics are published after the responses go out (one update at a time): wait for all of them.
    after = wait_for(server, lambda m: all(m[k] >= before[k] + n for k, n in expected.items()), "the three requests")
    assert {k: after[k] - before[k] for k in expected} == expected
    assert after["muse_spark_steps_total"] > before["muse_spark_steps_total"]
    # every step sends γ = 5 drafts to the target (the schedule 'off')
    steps = after["muse_spark_steps_total"] - before["muse_spark_steps_total"]
    assert after["muse_spark_verified_draft_tokens_total"] - before["muse_spark_verified_draft_tokens_total"] == 5 * steps


def test_load_loop_ends_without_failure_or_leaked_slot(server, ref):
    prompts = [[i, i + 1, (7 * i) % 256] for i in range(10)]
    full = {tuple(p): ref.run(p, max_tokens=24).output for p in prompts}
    rng = random.Random(1)
    jobs = [(rng.choice(prompts), rng.randint(1, 24), rng.random() < 0.5) for _ in range(200)]

    def run(job):
        prompt, n, stream = job
        payload = {"input_ids": prompt, "max_tokens": n, "stream": stream}
        if stream:
            status, events = generate_stream(server, payload)
            return status, sum((ids_of(e) for e in events if "output_ids" in e), [])
        status, body = generate(server, payload)
        return status, ids_of(body) if status == 200 else body

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    elapsed = time.perf_counter() - t0
    bad = [(job, res) for job, res in zip(jobs, results) if res[0] != 200 or res[1] != full[tuple(job[0])][:job[1]]]
    assert not bad, f"{len(bad)} of 200 requests failed, e.g. {bad[:3]}"
    m = wait_for(server, slots_free, "all slots free after the load loop")
    assert m["muse_spark_requests_total:failed"] == 0
    print(f"load loop: 200 requests at concurrency 16 in {elapsed:.1f}s")


def test_a_snapshot_sees_the_request_as_it_was_without_copying_it():
    """``snapshot``: the output, steps and log-probabilities as they were (``Prefix`` views of the lists the
    scheduler goes on appending to), slices and indices within that length, equal to the lists it saw."""
    from muse_spark.runtime.generator import Request, StepRecord
    from muse_spark.serving.scheduler import Prefix, snapshot

    req = Request(1, [1, 2], SamplingParams(), frozenset(), output=[5, 6, 7])
    req.add_step(StepRecord(2, [5, 6, 9], 2, [5, 6, 7]), 3)
    view = snapshot(req)
    req.output.extend([8, 9])
    req.add_step(StepRecord(5, [8, 1, 1], 1, [8, 9]), 3)
    assert view.output == [5, 6, 7] and len(view.output) == 3 and list(view.output) == [5, 6, 7]
    assert view.output[1:] == [6, 7] and view.output[-1] == 7 and view.output[::-1] == [7, 6, 5]
    with pytest.raises(IndexError):
        view.output[3]
    assert len(view.steps) == 1 and view.stats(3)["steps"] == 1 and req.stats(3)["steps"] == 2
    assert Prefix([1, 2, 3], 2) == [1, 2] and Prefix([1, 2, 3], 2) != [1, 2, 3]
