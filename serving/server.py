"""``muse-spark serve``: run the real ``tritonserver`` from the ``nvidia-pytriton`` wheel.

The wheel (extra ``serve``) ships a complete Triton Inference Server:

    site-packages/pytriton/tritonserver/bin/tritonserver
    site-packages/pytriton/tritonserver/backends/python/        libtriton_python.so, utils
    site-packages/pytriton/tritonserver/python_backend_stubs/3.X/triton_python_backend_stub
    site-packages/nvidia_pytriton.libs/                         its shared libraries

What it takes to run a model that imports ``muse_spark`` and torch:

* **The stub.** The python backend runs ``triton_python_backend_stub`` from
  the model directory, else from the backend directory; the wheel keeps one
  per Python version elsewhere. We build a small backend directory per run
  (symlinks: the backend library, its utils, the stub of *this* interpreter's
  version), so the repository stays independent of the Python version.
* **The interpreter.** The stub embeds ``libpython3.X.so`` and finds its
  prefix the way ``python3`` would: it looks ``python3`` up on ``PATH``. Putting
  this interpreter's ``bin`` first on ``PATH`` makes the stub see this venv's
  ``pyvenv.cfg``, hence its site-packages (``.pth`` files included, so an
  editable install works) — no PYTHONPATH juggling. ``libpython`` comes from
  this interpreter's ``LIBDIR`` (it must be built with ``--enable-shared``).
* **Libraries.** ``nvidia_pytriton.libs`` goes on ``LD_LIBRARY_PATH``.

* **numpy.** The stub is built for numpy 1.x; where this environment has
  numpy 2 it runs in an overlay environment with numpy 1.x (``stub_env.py``).

Clients reach HTTP through our front (``front.py``: a request-size bound, since
tritonserver's own HTTP server dies on large bodies; readiness and errors while
the model process restarts); tritonserver's HTTP listens on a private loopback
port. gRPC and metrics are tritonserver's own. tritonserver runs in its own
process group, dies with us (PR_SET_PDEATHSIG) and is supervised
(``supervisor.py``: a graceful drain on SIGINT/SIGTERM/SIGHUP, a restart when a
model process dies).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from muse_spark.options import SERVE_DRAIN_FILE_ENV, SERVE_TP_PORT_ENV
from muse_spark.serving.stub_env import StubEnvError, numpy1_site, write_overlay
from muse_spark.serving.supervisor import Supervisor, free_port, port_in_use


class ServingError(RuntimeError):
    """The server cannot be started here; the message says why and what to do."""


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    python_backend: Path  # backends/python
    stub: Path  # the stub for this interpreter's version
    libs: Path

    @classmethod
    def find(cls) -> "TritonInstall":
        """Locate tritonserver in the nvidia-pytriton wheel (without importing pytriton)."""
        hint = "install the serve extra: pip install 'muse-spark[serve]' (nvidia-pytriton, tritonclient)"
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise ServingError(f"nvidia-pytriton is not installed; {hint}")
        pkg = Path(list(spec.submodule_search_locations)[0])
        root = pkg / "tritonserver"
        binary = root / "bin" / "tritonserver"
        backend = root / "backends" / "python"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
        libs = next((p for p in (pkg.parent / "nvidia_pytriton.libs", root / "external_libs") if p.is_dir()), None)
        if not binary.is_file():
            raise ServingError(f"{binary} is missing: this nvidia-pytriton wheel ships no tritonserver; {hint}")
        if not (backend / "libtriton_python.so").is_file():
            raise ServingError(f"{backend} has no libtriton_python.so: the python backend is missing")
        if not stub.is_file():
            have = sorted(p.name for p in (root / "python_backend_stubs").iterdir()) if (
                root / "python_backend_stubs").is_dir() else []
            raise ServingError(f"nvidia-pytriton has no python backend stub for Python {version} "
                               f"(it has {', '.join(have) or 'none'}); use one of those Python versions")
        if libs is None:
            raise ServingError(f"the tritonserver libraries (nvidia_pytriton.libs) are missing next to {pkg}")
        return cls(binary, backend, stub, libs)


def python_library_dir() -> Path:
    """The directory holding this interpreter's libpython3.X.so, which the stub embeds."""
    name = f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"
    libdir = sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and (Path(libdir) / name).exists():
        return Path(libdir)
    raise ServingError(
        f"this Python ({sys.executable}) has no shared {name}, which Triton's python backend stub embeds; "
        "use a Python built with --enable-shared (distribution packages, pyenv with "
        "PYTHON_CONFIGURE_OPTS=--enable-shared, conda, the python.org builds)")


def prepare_backend_dir(install: TritonInstall, workdir: Path) -> Path:
    """A backend directory whose python backend has this interpreter's stub."""
    py = workdir / "backends" / "python"
    py.mkdir(parents=True)
    for src in sorted(install.python_backend.iterdir()):
        if src.is_file():
            (py / src.name).symlink_to(src)
    (py / "triton_python_backend_stub").symlink_to(install.stub)
    return workdir / "backends"


def server_env(install: TritonInstall, base: dict | None = None, python_bin: Path | None = None) -> dict:
    """tritonserver's environment; ``python_bin`` (default: this interpreter's) is the ``bin`` directory whose
    ``python3`` the stub takes its environment from."""
    env = dict(os.environ if base is None else base)
    libpath = [str(install.libs), str(python_library_dir())]
    if env.get("LD_LIBRARY_PATH"):
        libpath.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libpath)
    # The stub resolves its prefix from `python3` on PATH: make that this interpreter (or its overlay).
    bindir = python_bin or Path(sys.executable).parent
    if not (bindir / "python3").exists():
        raise ServingError(f"{bindir} has no `python3`, which Triton's python stub looks up on PATH to find this "
                           f"environment; run muse-spark with a venv's or distribution's python3")
    env["PATH"] = os.pathsep.join([str(bindir), env.get("PATH", "")])
    env.pop("PYTHONHOME", None)  # would point the stub at another interpreter's stdlib
    return env


def check_repository(repo: Path) -> list[str]:
    """The model names in ``repo``; a clear error for an empty or broken repository."""
    if not repo.is_dir():
        raise ServingError(f"model repository {repo} does not exist (write one with `muse-spark triton-repo`)")
    models = sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file())
    if not models:
        raise ServingError(f"{repo} holds no model (no */config.pbtxt); write one with `muse-spark triton-repo`")
    for name in models:
        text = (repo / name / "config.pbtxt").read_text()
        for engine in _engine_dirs(text):
            if not (Path(engine) / "manifest.json").is_file():
                raise ServingError(f"model {name!r}: its engine directory {engine} is missing or not an engine "
                                   f"(rebuild it, or rewrite the repository with `muse-spark triton-repo`)")
    return models


def _engine_dirs(config_text: str) -> list[str]:
    return _param_values(config_text, "engine_dir")


def _param_values(config_text: str, key: str) -> list[str]:
    """The string values of parameter ``key`` in a config.pbtxt muse-spark wrote."""
    out, lines = [], config_text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f'key: "{key}"' and i + 1 < len(lines):
            value = lines[i + 1].split('string_value: "', 1)
            if len(value) == 2:
                out.append(value[1].split('"', 1)[0])
    return out


def start_tp_ranks(repo: Path, models: list[str], env: dict) -> list[subprocess.Popen]:
    """The ranks 1 … N-1 of a model split over N ranks (``triton-repo --tp N``), started before tritonserver
    loads it (it joins as rank 0 on the port this puts in ``env``); [] where no model is split."""
    split = []
    for name in models:
        text = (repo / name / "config.pbtxt").read_text()
        tp = int((_param_values(text, "tp") or ["1"])[0])
        if tp > 1:
            split.append((name, tp, _engine_dirs(text)[0], (_param_values(text, "device") or [""])[0]))
    if not split:
        return []
    if len(split) > 1:
        raise ServingError(f"models {', '.join(n for n, *_ in split)} are each split over ranks; serve one at a time")
    name, tp, engine_dir, device = split[0]
    if not device:
        device = json.loads((Path(engine_dir) / "manifest.json").read_text()).get("device", {}).get("kind", "cpu")
    port = free_port()
    env[SERVE_TP_PORT_ENV] = str(port)
    _log(f"model {name!r}: target split over {tp} ranks; starting ranks 1-{tp - 1} (rank 0 is the model)")
    return [subprocess.Popen([sys.executable, "-m", "muse_spark.runtime.tensor_parallel", "--engine", engine_dir,
                              "--rank", str(r), "--world", str(tp), "--port", str(port), "--device", device])
            for r in range(1, tp)]


def server_command(install: TritonInstall, repo: Path, backend_dir: Path, *, host: str, http_port: int,
                   grpc_port: int, metrics_port: int, exit_timeout: int = 10, log_verbose: int = 0,
                   extra: list[str] = ()) -> list[str]:
    """tritonserver's command line; its HTTP binds loopback only (clients come through the front)."""
    return [
        str(install.binary),
        f"--model-repository={repo}",
        f"--backend-directory={backend_dir}",
        # Our config.pbtxt is complete; auto-complete would load the model (and torch) twice.
        "--disable-auto-complete-config",
        "--http-address=127.0.0.1", f"--http-port={http_port}",
        f"--grpc-address={host}", f"--grpc-port={grpc_port}",
        f"--metrics-address={host}", f"--metrics-port={metrics_port}",
        f"--exit-timeout-secs={exit_timeout}",
        f"--log-verbose={log_verbose}",
        *extra,
    ]


def _log(msg: str) -> None:
    print(f"muse-spark serve: {msg}", file=sys.stderr, flush=True)


def serve(repo: str | Path, *, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, exit_timeout: float = 10, max_request_bytes: int = 1 << 20,
          stub_numpy: str | None = None, log_verbose: int = 0, extra: list[str] = ()) -> int:
    from muse_spark.serving.front import FrontError, HttpFront  # aiohttp: only when serving
    from muse_spark.serving.protocol import check_generate_json  # imports torch (via the runtime)

    repo = Path(repo).resolve()
    models = check_repository(repo)
    install = TritonInstall.find()
    for name, port in (("HTTP", http_port), ("gRPC", grpc_port), ("metrics", metrics_port)):
        if port_in_use(host, port):
            raise ServingError(f"the {name} port {host}:{port} is in use; choose another with --{name.lower()}-port")
    workdir = Path(tempfile.mkdtemp(prefix="muse-spark-triton-"))
    front, ranks = None, []
    try:
        try:
            numpy_site = numpy1_site(stub_numpy, _log)
        except StubEnvError as e:
            raise ServingError(str(e)) from None
        env = server_env(install, python_bin=write_overlay(workdir, numpy_site) if numpy_site else None)
        drain_file = workdir / "draining"
        env[SERVE_DRAIN_FILE_ENV] = str(drain_file)
        backend_dir = prepare_backend_dir(install, workdir)
        upstream = free_port()
        front = HttpFront(host=host, port=http_port, upstream=f"http://127.0.0.1:{upstream}",
                          max_request_bytes=max_request_bytes, check_body=lambda _path, body: check_generate_json(body),
                          log=_log)
        try:
            front.start()
        except FrontError as e:
            raise ServingError(f"{e}; choose another with --http-port") from None
        ranks = start_tp_ranks(repo, models, env)
        # tritonserver waits for requests in flight this long after the drain's grace period.
        cmd = server_command(install, repo, backend_dir, host=host, http_port=upstream, grpc_port=grpc_port,
                             metrics_port=metrics_port, exit_timeout=int(exit_timeout) + 30,
                             log_verbose=log_verbose, extra=extra)
        _log(f"tritonserver with {', '.join(models)} from {repo}: HTTP {host}:{http_port}, gRPC {host}:{grpc_port}, "
             f"metrics {host}:{metrics_port}" + (f" (stub numpy from {numpy_site})" if numpy_site else ""))
        return Supervisor(cmd, env, front, drain_file=drain_file, grace_s=exit_timeout, log=_log).run()
    finally:
        for rank in ranks:  # (they end when the model closes them; this is the backstop)
            if rank.poll() is None:
                rank.terminate()
            try:
                rank.wait(10)
            except subprocess.TimeoutExpired:
                rank.kill()
        if front is not None:
            front.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# ---- command line ---------------------------------------------------------------------------
def add_serve_command(sub) -> None:
    s = sub.add_parser("serve", help="run Triton Inference Server (from nvidia-pytriton) on a model repository",
                       epilog="arguments after `--` go to tritonserver unchanged")
    s.add_argument("--repo", required=True, help="model repository (from `muse-spark triton-repo`)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--http-port", type=_port, default=8000)
    s.add_argument("--grpc-port", type=_port, default=8001)
    s.add_argument("--metrics-port", type=_port, default=8002)
    s.add_argument("--exit-timeout", type=_seconds, default=10.0,
                   help="on SIGINT/SIGTERM, seconds running requests may go on before they end with finish "
                        "reason 'shutdown' (default 10)")
    s.add_argument("--max-request-bytes", type=_positive, default=1 << 20,
                   help="largest HTTP request body accepted (default 1 MiB); larger ones get HTTP 413")
    s.add_argument("--stub-numpy", default=None, metavar="WHEEL_OR_DIR",
                   help="a numpy 1.x wheel (or a directory holding numpy/) for Triton's python backend stub, "
                        "where this environment has numpy 2 and pip cannot fetch one")
    s.add_argument("--log-verbose", type=int, default=0)
    s.add_argument("tritonserver_args", nargs="*", help=argparse.SUPPRESS)
    s.set_defaults(fn=cmd_serve)


def _port(text: str) -> int:
    port = _int(text, "a port")
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be in [1, 65535], got {port}")
    return port


def _positive(text: str) -> int:
    n = _int(text, "a positive integer")
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def add_kv_pool_arguments(p: argparse.ArgumentParser, fraction: bool = True) -> None:
    """``--kv-cache-tokens``, ``--kv-block-size`` and (``fraction``: where an engine is loaded) the pool as a
    fraction of the memory the loaded engine leaves, and ``--swap-space`` (host memory for preempted requests)."""
    size = p.add_mutually_exclusive_group()
    if fraction:
        size.add_argument("--kv-cache-memory-fraction", type=float, default=None, metavar="F",
                          help="paged KV caches sized to this fraction (0-1] of the memory available once the "
                               "weights are loaded (eager engines; instead of --kv-cache-tokens)")
    size.add_argument("--kv-cache-tokens", type=_positive, default=None, metavar="N",
                      help="paged KV caches: one pool of N token positions that requests take blocks of as they "
                           "grow (an eager engine's when it is loaded, an aoti engine's when it is built; default: a "
                           "window of max_seq positions per slot)")
    p.add_argument("--kv-block-size", type=_positive, default=16, metavar="P",
                   help="tokens per KV block of the pool (a power of two; default 16)")
    if fraction:
        p.add_argument("--swap-space", type=_gib, default=None, metavar="GiB",
                       help="paged KV caches: host memory for the K/V of requests preempted when the pool runs "
                            "short (default 4); a request whose copy would pass it is recomputed when it resumes "
                            "(0: always)")


def kv_pool(a) -> dict:
    """``load_engine``'s paged-cache arguments from ``add_kv_pool_arguments``' options (none: contiguous, and
    the default swap space)."""
    swap = {} if getattr(a, "swap_space", None) is None else {"swap_space": a.swap_space}
    fraction = getattr(a, "kv_cache_memory_fraction", None)  # (argparse keeps it and the tokens apart)
    if fraction is not None:
        return {"kv_memory_fraction": fraction, "kv_block_size": a.kv_block_size, **swap}
    if a.kv_cache_tokens is None:
        return swap
    return {"kv_tokens": a.kv_cache_tokens, "kv_block_size": a.kv_block_size, **swap}


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected GiB >= 0, got {text}")
    return value


def _int(text: str, what: str) -> int:
    if not text.strip().isascii() or not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in [0, 3600], got {text}")
    return value


def cmd_serve(a) -> int:
    try:
        return serve(a.repo, host=a.host, http_port=a.http_port, grpc_port=a.grpc_port,
                     metrics_port=a.metrics_port, exit_timeout=a.exit_timeout,
                     max_request_bytes=a.max_request_bytes, stub_numpy=a.stub_numpy, log_verbose=a.log_verbose,
                     extra=a.tritonserver_args)
    except ServingError as e:
        print(f"muse-spark: error: {e}", file=sys.stderr)
        return 2
