"""Helpers for the tests that talk to a real ``muse-spark serve``: start and stop it, its clients.

The server runs the real tritonserver from the nvidia-pytriton wheel on free loopback ports; every
output is compared with the runtime in the test process (``Reference``), which is the specification.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from muse_spark.cli import main as cli_main
from muse_spark.runtime import Generator, SamplingParams, load_engine, load_tokenizer
from muse_spark.serving.server import ServingError, TritonInstall, server_env

MODEL = "muse_spark"
START_TIMEOUT = 180


@contextmanager
def one_torch_thread():
    """The server and this process share the CPU: with torch's default (one thread per
    core) both, OpenMP oversubscription slows every step 10-50x on 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class Reference:
    """The runtime in this process: what the server must return."""

    def __init__(self, engine_dir):
        self.engine = load_engine(engine_dir)
        self.tok = load_tokenizer(self.engine.tokenizer_path)
        self.gen = Generator(self.engine)
        self._lock = threading.Lock()

    def run(self, prompt, **params):
        with self._lock, one_torch_thread():
            return self.gen.generate([list(prompt)], SamplingParams(**params))[0]

    def chunks(self, prompt, **params):
        """The token chunks a stream yields: one per scheduler step."""
        with self._lock, one_torch_thread():
            return list(self.gen.iter_request(self.gen.add(list(prompt), SamplingParams(**params))))

    def text(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)


@dataclass
class Server:
    http: str
    grpc: str
    metrics: str
    proc: subprocess.Popen
    log: Path


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def require_tritonserver() -> None:
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed (extra: serve)")
    try:
        server_env(TritonInstall.find())  # the binary, the stub, libpython, python3 on PATH
    except ServingError as e:
        pytest.skip(f"tritonserver cannot run here: {e}")


def start_server(engine_dir, work: Path, *, python: str = sys.executable, repo_args: tuple = (),
                 serve_args: tuple = (), env: dict | None = None) -> Server:
    """``muse-spark triton-repo`` + ``muse-spark serve`` with ``python``; → the ready server."""
    require_tritonserver()
    repo = work / "repo"
    assert cli_main(["triton-repo", "--engine", str(engine_dir), "--out", str(repo), "--torch-threads", "1",
                     *repo_args]) == 0
    http, grpc, metrics = free_ports(3)
    log = work / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [python, "-m", "muse_spark.cli", "serve", "--repo", str(repo), "--http-port", str(http),
             "--grpc-port", str(grpc), "--metrics-port", str(metrics), *serve_args], stdout=f,
            stderr=subprocess.STDOUT, env=env)
    srv = Server(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics", proc, log)
    wait_ready(srv)
    return srv


def wait_ready(srv: Server, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not is_ready(srv):
        if srv.proc.poll() is not None:
            pytest.fail(f"muse-spark serve exited with {srv.proc.returncode}:\n{tail(srv.log)}")
        if time.monotonic() > deadline:
            srv.proc.kill()
            pytest.fail(f"the server was not ready after {timeout}s:\n{tail(srv.log)}")
        time.sleep(0.5)


def is_ready(srv: Server) -> bool:
    try:
        with urllib.request.urlopen(f"{srv.http}/v2/models/{MODEL}/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_server(srv: Server, timeout: float = 60) -> int:
    """SIGTERM → the exit status (the server must exit within ``timeout``)."""
    srv.proc.send_signal(signal.SIGTERM)
    try:
        return srv.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        pytest.fail(f"muse-spark serve did not exit within {timeout}s of SIGTERM:\n{tail(srv.log)}")


def tail(path: Path, n: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


# ---- clients ----------------------------------------------------------------------------------
def generate(srv: Server, payload: dict, timeout: float = 120) -> tuple[int, dict]:
    """POST /generate → (HTTP status, JSON body)."""
    req = urllib.request.Request(f"{srv.http}/v2/models/{MODEL}/generate", json.dumps(payload).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def generate_stream(srv: Server, payload: dict, stop_after: int | None = None, timeout: float = 120):
    """POST /generate_stream → (HTTP status, the events); closes the connection after ``stop_after`` events."""
    req = urllib.request.Request(f"{srv.http}/v2/models/{MODEL}/generate_stream", json.dumps(payload).encode(),
                                 {"Content-Type": "application/json"})
    events = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                if line.startswith(b"data:"):
                    events.append(json.loads(line[5:]))
                    if stop_after is not None and len(events) >= stop_after:
                        break
            return r.status, events
    except urllib.error.HTTPError as e:
        return e.code, [json.loads(e.read() or b"{}")]


def ids_of(body: dict) -> list[int]:
    ids = body["output_ids"]  # the generate endpoint turns one-element arrays into scalars
    return [ids] if isinstance(ids, int) else list(ids)


def grpc_stream(srv: Server, inputs: dict, cancel_after: int | None = None, timeout: float = 120,
                parameters: dict | None = None):
    """One request over a gRPC stream → list of (output_ids, text, finish_reason) or an error string last."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(srv.grpc)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tensors = []
    for name, value in inputs.items():
        arr = np.asarray(value)
        arr = arr.reshape(1, -1) if arr.ndim <= 1 else arr
        t = grpcclient.InferInput(name, list(arr.shape), "BYTES" if arr.dtype.kind in "OSU" else
                                  np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr.astype(object) if arr.dtype.kind in "SU" else arr)
        tensors.append(t)
    out = []
    try:
        client.async_stream_infer(MODEL, tensors, enable_empty_final_response=True, parameters=parameters)
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                out.append(str(error))
                break
            final = result.get_response().parameters["triton_final_response"].bool_param
            ids = result.as_numpy("output_ids")
            if ids is not None:
                out.append((ids.reshape(-1).tolist(), result.as_numpy("text_output").reshape(-1)[0].decode(),
                            result.as_numpy("finish_reason").reshape(-1)[0].decode()))
            if final:
                break
            if cancel_after is not None and len(out) >= cancel_after:
                break
    finally:
        client.stop_stream(cancel_requests=cancel_after is not None)
        client.close()
    return out


def metrics(srv: Server) -> dict[str, float]:
    with urllib.request.urlopen(srv.metrics, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)\{([^}]*)\} (\S+)$", line)
        if m and f'model="{MODEL}"' in m.group(2):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = m.group(1) + (f":{labels['outcome']}" if "outcome" in labels else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def wait_for(srv: Server, check, what: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(srv)
        if check(m):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"metrics never showed {what}: {m}")
        time.sleep(0.1)


def all_slots_free(m: dict, max_batch: int) -> bool:
    return (m.get("muse_spark_free_slots") == max_batch and m.get("muse_spark_active_requests") == 0
            and m.get("muse_spark_waiting_requests") == 0)


class Collector:
    """A real Sink that keeps what the scheduler hands it (``off_thread``: called on the scheduler's responder
    thread with snapshots; ``outputs`` the request's output as each call saw it, ``threads`` where it ran)."""

    def __init__(self, cancel_after: int | None = None, off_thread: bool = False):
        self.chunks, self.error, self.done, self.cancel_after = [], None, threading.Event(), cancel_after
        self.finish_reason, self.off_thread, self.outputs, self.threads = None, off_thread, [], set()

    def deliver(self, req, new_tokens):
        self.chunks.append(list(new_tokens))
        self.outputs.append(list(req.output))
        self.threads.add(threading.current_thread().name)
        if req.finished:
            self.finish_reason = req.finish_reason
            self.done.set()

    def fail(self, message, kind):
        self.error = (kind, message)
        self.done.set()

    def cancelled(self):
        return self.cancel_after is not None and len(self.chunks) >= self.cancel_after
