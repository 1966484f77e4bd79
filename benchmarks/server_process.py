"""A ``muse-spark serve`` process for the benchmarks that measure through the real Triton server
(``serving.py``, ``bench_serving.py``): the repository written by ``muse-spark triton-repo``, the server
started on free loopback ports, awaited until the model is ready, and stopped with SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MODEL = "muse_spark"


@dataclass(frozen=True)
class ServerEndpoints:
    http: str  # http://127.0.0.1:PORT (the HTTP front of `muse-spark serve`)
    grpc: str  # 127.0.0.1:PORT (tritonserver's gRPC)
    metrics: str  # http://127.0.0.1:PORT/metrics
    model: str
    log: Path

    @property
    def model_url(self) -> str:
        return f"{self.http}/v2/models/{self.model}"


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all bound at once, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def post(url: str, payload: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def check_tritonserver() -> None:
    """Raise ``muse_spark.serving.server.ServingError`` (saying why) where tritonserver cannot run here."""
    from muse_spark.serving.server import TritonInstall, server_env

    server_env(TritonInstall.find())


@contextmanager
def triton_server(engine_dir: str | Path, device: str | None, work: Path, log, *, repo_args: list[str] = (),
                  serve_args: list[str] = (), start_timeout: float = 600):
    """``muse-spark triton-repo`` into ``work/repo`` + ``muse-spark serve`` on free ports → its endpoints,
    once the model is ready; the server gets SIGTERM (and is killed after 120 s) on leaving."""
    repo = Path(work) / "repo"
    cmd = [sys.executable, "-m", "muse_spark.cli", "triton-repo", "--engine", str(engine_dir), "--out", str(repo),
           *(["--device", device] if device else []), *repo_args]
    made = subprocess.run(cmd, capture_output=True, text=True)
    if made.returncode != 0:
        raise RuntimeError(f"muse-spark triton-repo failed ({made.returncode}):\n{made.stderr[-4000:]}")
    log(made.stdout.strip().splitlines()[0] if made.stdout.strip() else f"wrote the model repository {repo}")
    http, grpc, metrics = free_ports(3)
    server_log = Path(work) / "server.log"
    with open(server_log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "muse_spark.cli", "serve", "--repo", str(repo),
                                 "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                 *serve_args], stdout=f, stderr=subprocess.STDOUT)
    ends = ServerEndpoints(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics",
                           MODEL, server_log)
    try:
        t0 = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(f"{ends.model_url}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() - t0 > start_timeout:
                raise RuntimeError(f"the server did not start:\n{server_log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        log(f"server ready in {time.monotonic() - t0:.1f} s")
        yield ends
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
