"""``muse-spark serve`` under what a deployment meets: hostile and oversized requests, a full queue, a
model process that dies, shutdown with work in flight — against the real tritonserver.

One server (a random pair, so generation takes many steps; 2 slots, a queue of 2, a 3 s grace period)
serves the tests in file order; the last one stops it with SIGTERM. Outputs are compared with the
runtime in this process (``Reference``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from muse_spark.builder.build import build_engine
from muse_spark.cli import main as cli_main
from muse_spark.runtime import SamplingParams, load_engine
from muse_spark.serving.repo import RepoError, write_repository
from muse_spark.serving.scheduler import Scheduler
from muse_spark.serving.supervisor import stub_pids
from serving_utils import (MODEL, Collector, Reference, all_slots_free, generate, generate_stream, grpc_stream, ids_of,
                           is_ready, metrics, one_torch_thread, require_tritonserver, start_server, stop_server, tail, wait_for,
                           wait_ready)

MAX_BATCH, MAX_SEQ, MAX_QUEUE, GRACE_S = 2, 512, 2, 3
LONG = MAX_SEQ - 40  # max_tokens of a request that holds its slot for many steps


@pytest.fixture(scope="module")
def engine_dir(random_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("reliability") / "engine"
    build_engine(*random_pair, out, max_batch=MAX_BATCH, max_seq=MAX_SEQ, quiet=True)
    return out


@pytest.fixture(scope="module")
def ref(engine_dir):
    return Reference(engine_dir)


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    srv = start_server(engine_dir, tmp_path_factory.mktemp("triton"), repo_args=("--max-queue", str(MAX_QUEUE)),
                       serve_args=("--exit-timeout", str(GRACE_S)))
    yield srv
    if srv.proc.poll() is None:
        stop_server(srv)


def slots_free(m: dict) -> bool:
    return all_slots_free(m, MAX_BATCH)


def tritonserver_pid(srv) -> int:
    """The tritonserver process under ``muse-spark serve``."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat", "rb").read()
                cmd = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == srv.proc.pid and b"tritonserver" in cmd:
                return int(entry)
    raise AssertionError("no tritonserver under muse-spark serve")


def post_raw(srv, body_chunks, total: int, path: str = "generate", chunked: bool = False) -> bytes:
    """An HTTP request written piece by piece on a raw socket (as curl sends a file) → the response head."""
    host, port = srv.http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
        s.sendall(f"POST /v2/models/{MODEL}/{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"{length}\r\n\r\n".encode())
        try:
            for piece in body_chunks:
                s.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece)
            if chunked:
                s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered before reading it all: what we check is its answer
        return s.recv(4096)


# ---- without a server ---------------------------------------------------------------------------
def test_triton_repo_refuses_a_device_that_does_not_exist(engine_dir, tmp_path, capsys):
    with pytest.raises(RepoError, match="--device must be cpu, cuda or cuda:N"):
        write_repository(engine_dir, tmp_path / "repo", device="bogus")
    assert not (tmp_path / "repo").exists()


def test_serve_refuses_bad_and_occupied_ports_before_loading_the_model(engine_dir, tmp_path, capsys):
    require_tritonserver()
    write_repository(engine_dir, tmp_path / "repo")
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--repo", str(tmp_path / "repo"), "--http-port", "83536"])
    assert e.value.code == 2 and "a port must be in [1, 65535], got 83536" in capsys.readouterr().err
    for flag in ("--http-port", "--grpc-port", "--metrics-port"):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            t0 = time.monotonic()
            rc = cli_main(["serve", "--repo", str(tmp_path / "repo"), flag, str(taken.getsockname()[1])])
            err = capsys.readouterr().err
            assert rc == 2 and "is in use" in err, err
            assert time.monotonic() - t0 < 10  # at once, not after a model load


def test_scheduler_drain_ends_waiting_requests_at_once_and_running_ones_after_the_grace(engine_dir, ref):
    with one_torch_thread():
        sched = Scheduler(load_engine(engine_dir), max_queue=64)
        sched.start()
        running = [Collector() for _ in range(MAX_BATCH)]
        for i, sink in enumerate(running):
            sched.submit([i + 1, 7], SamplingParams(max_tokens=LONG, ignore_eos=True), sink)
        deadline = time.monotonic() + 30
        while sched.occupancy.active < MAX_BATCH and time.monotonic() < deadline:
            time.sleep(0.01)
        waiting = Collector()
        sched.submit([3, 3], SamplingParams(max_tokens=4), waiting)
        t0 = time.monotonic()
        sched.drain(0.2)
        assert waiting.done.wait(5) and waiting.finish_reason == "shutdown" and sum(waiting.chunks, []) == []
        for sink in running:
            assert sink.done.wait(30) and sink.finish_reason == "shutdown" and sink.error is None
        assert 0.2 <= time.monotonic() - t0 < 10
        for i, sink in enumerate(running):  # the tokens each got are the runtime's, as far as they go
            got = sum(sink.chunks, [])
            assert 0 < len(got) < LONG
            assert got == ref.run([i + 1, 7], max_tokens=len(got), ignore_eos=True).output
        late = Collector()
        sched.submit([1], SamplingParams(max_tokens=1), late)
        assert late.finish_reason == "shutdown"
        sched.stop()


# ---- one server, in file order ----------------------------------------------------------------------
def test_a_fresh_server_reports_every_slot_free(server):
    m = metrics(server)
    assert m["muse_spark_free_slots"] == MAX_BATCH and m["muse_spark_waiting_requests"] == 0


def test_unknown_request_fields_are_refused_over_http_and_grpc(server):
    status, body = generate(server, {"input_ids": [1, 2], "max_tokens": 3, "top_p": 0.9, "foo": 1})
    assert status == 400 and "unknown request fields foo, top_p" in body["error"], body
    out = grpc_stream(server, {"input_ids": np.array([[1, 2]], np.int32), "max_tokens": np.array([[3]], np.int32)},
                      parameters={"top_p": 0.9})
    assert len(out) == 1 and "unknown request field top_p" in out[0], out


def test_integers_that_do_not_fit_their_type_are_refused_not_wrapped(server, ref):
    for payload, message in [
        ({"input_ids": [4294967297], "max_tokens": 3}, "input_ids value 4294967297 does not fit its type INT32"),
        ({"input_ids": [1], "max_tokens": 4294967300}, "max_tokens value 4294967300 does not fit its type INT32"),
        ({"input_ids": [1], "max_tokens": 3, "seed": 2**64}, f"seed value {2**64} does not fit its type UINT64"),
        ({"input_ids": [[1, -(2**31) - 1]], "max_tokens": 3}, "does not fit its type INT32"),
    ]:
        status, body = generate(server, payload)
        assert status == 400 and message in body["error"], (payload, body)
    status, body = generate(server, {"input_ids": [1], "max_tokens": 3, "seed": 2**64 - 1, "temperature": 1.0})
    assert status == 200 and ids_of(body) == ref.run([1], max_tokens=3, seed=2**64 - 1, temperature=1.0).output


def test_oversized_bodies_get_413_and_the_server_keeps_serving(server, ref):
    big = os.urandom(4 << 20)
    head = post_raw(server, (big[i:i + 16384] for i in range(0, len(big), 16384)), len(big))
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"exceeds the server's limit of 1048576 bytes" in head
    head = post_raw(server, (big[i:i + 65536] for i in range(0, 2 << 20, 65536)), 2 << 20, chunked=True,
                    path="generate_stream")
    assert head.startswith(b"HTTP/1.1 413"), head
    valid = json.dumps({"input_ids": [1] * 400_000, "max_tokens": 1}).encode()  # 1.2 MB of valid JSON
    req = urllib.request.Request(f"{server.http}/v2/models/{MODEL}/generate", valid)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 413
    assert is_ready(server)
    status, body = generate(server, {"input_ids": [5, 6, 7], "max_tokens": 12})
    assert status == 200 and ids_of(body) == ref.run([5, 6, 7], max_tokens=12).output


def hold_slots(server, n: int = MAX_BATCH) -> list[threading.Thread]:
    """``n`` long streams that hold slots (started one by one, each running before the next)."""
    threads = []
    for i in range(n):
        holder = {}
        t = threading.Thread(target=lambda h=holder, i=i: h.update(
            result=generate_stream(server, {"input_ids": [9, i + 1], "max_tokens": LONG, "ignore_eos": True,
                                            "stream": True})))
        t.holder = holder
        t.start()
        threads.append(t)
        wait_for(server, lambda m, k=i + 1: m["muse_spark_active_requests"] >= k, f"{i + 1} running", timeout=60)
    return threads


def test_a_full_queue_answers_503_and_admits_no_more_than_max_queue(server, ref):
    before = wait_for(server, slots_free, "all slots free")
    holders = hold_slots(server)
    payloads = [{"input_ids": [3, k], "max_tokens": 4} for k in range(8)]
    with ThreadPoolExecutor(len(payloads)) as pool:
        results = list(pool.map(lambda p: generate(server, p), payloads))
    refused = [body for status, body in results if status == 503]
    served = [(p, body) for p, (status, body) in zip(payloads, results) if status == 200]
    assert len(refused) == len(payloads) - MAX_QUEUE and len(served) == MAX_QUEUE, results
    assert all(b["error"].startswith("unavailable: the request queue is full") for b in refused)
    for p, body in served:
        assert ids_of(body) == ref.run(p["input_ids"], max_tokens=4).output
    for t in holders:
        t.join(timeout=300)
        status, events = t.holder["result"]
        assert status == 200 and events[-1]["finish_reason"] == "length"
    after = wait_for(server, slots_free, "all slots free")
    assert after["muse_spark_requests_total:rejected"] - before["muse_spark_requests_total:rejected"] == 6


def test_a_dead_model_process_fails_in_flight_requests_and_is_restarted(server, ref):
    wait_for(server, slots_free, "all slots free")
    stream = {}
    http = threading.Thread(target=lambda: stream.update(result=generate_stream(
        server, {"input_ids": [4, 4], "max_tokens": LONG, "ignore_eos": True, "stream": True})))
    grpc = {}
    rpc = threading.Thread(target=lambda: grpc.update(result=grpc_stream(
        server, {"input_ids": np.array([[5, 5]], np.int32), "max_tokens": np.array([[LONG]], np.int32),
                 "ignore_eos": np.array([[True]]), "stream": np.array([[True]])})))
    http.start()
    rpc.start()
    wait_for(server, lambda m: m["muse_spark_active_requests"] == 2, "both running", timeout=60)
    (stub,) = stub_pids(tritonserver_pid(server))
    os.kill(stub, 9)
    t0 = time.monotonic()
    http.join(timeout=30)
    rpc.join(timeout=30)
    assert not http.is_alive() and not rpc.is_alive(), "a request still hangs after its model process died"
    assert time.monotonic() - t0 < 30
    status, events = stream["result"]
    assert status == 200 and "model process" in events[-1].get("error", ""), events[-3:]
    assert isinstance(grpc["result"][-1], str), grpc["result"][-3:]  # an error, not a final response
    assert not is_ready(server)
    status, body = generate(server, {"input_ids": [1, 2], "max_tokens": 3})
    # (a clear 503 either way: the dead model process, or, once the restart has begun, the server not reachable)
    assert status == 503 and ("model process" in body["error"] or "not reachable" in body["error"]), body
    wait_ready(server)
    status, body = generate(server, {"input_ids": [1, 2, 3], "max_tokens": 10})
    assert status == 200 and ids_of(body) == ref.run([1, 2, 3], max_tokens=10).output
    assert "restarting tritonserver" in server.log.read_text(errors="replace")


def test_sigterm_ends_every_request_with_a_final_response_then_exits_cleanly(server, ref):
    wait_for(server, slots_free, "all slots free")
    holders = hold_slots(server)
    results = [{} for _ in range(MAX_QUEUE)]
    waiting = [threading.Thread(target=lambda h=h, k=k: h.update(result=generate(
        server, {"input_ids": [8, k], "max_tokens": 5}))) for k, h in enumerate(results)]
    for t in waiting:
        t.start()
    wait_for(server, lambda m: m["muse_spark_waiting_requests"] == MAX_QUEUE, "two waiting")
    t0 = time.monotonic()
    server.proc.send_signal(15)
    for t in holders + waiting:
        t.join(timeout=GRACE_S + 30)
        assert not t.is_alive(), f"a request got no final response:\n{tail(server.log)}"
    for t in holders:
        status, events = t.holder["result"]
        assert status == 200 and events[-1]["finish_reason"] == "shutdown", events[-2:]
        got = sum((ids_of(e) for e in events), [])
        assert 0 < len(got) < LONG and got == ref.run([9, holders.index(t) + 1], max_tokens=len(got),
                                                      ignore_eos=True).output
    for h in results:
        status, body = h["result"]
        assert status == 200 and body["finish_reason"] == "shutdown" and ids_of(body) == [], body
    rc = server.proc.wait(timeout=GRACE_S + 60)
    assert rc == 0, tail(server.log)
    assert time.monotonic() - t0 < GRACE_S + 60
    assert "successfully unloaded" in server.log.read_text(errors="replace")
