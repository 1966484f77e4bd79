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

The server binds 127.0.0.1 unless ``--host`` says otherwise, runs in its own
process group (so a terminal's Ctrl-C reaches it once, through us), dies with
us (PR_SET_PDEATHSIG), and gets SIGINT/SIGTERM/SIGHUP forwarded; our exit
status is its exit status.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path


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


def server_env(install: TritonInstall, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    libpath = [str(install.libs), str(python_library_dir())]
    if env.get("LD_LIBRARY_PATH"):
        libpath.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libpath)
    # The stub resolves its prefix from `python3` on PATH: make that this interpreter.
    bindir = Path(sys.executable).parent
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
    out, lines = [], config_text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == 'key: "engine_dir"' and i + 1 < len(lines):
            value = lines[i + 1].split('string_value: "', 1)
            if len(value) == 2:
                out.append(value[1].split('"', 1)[0])
    return out


def server_command(install: TritonInstall, repo: Path, backend_dir: Path, *, host: str, http_port: int,
                   grpc_port: int, metrics_port: int, exit_timeout: int = 10, log_verbose: int = 0,
                   extra: list[str] = ()) -> list[str]:
    return [
        str(install.binary),
        f"--model-repository={repo}",
        f"--backend-directory={backend_dir}",
        # Our config.pbtxt is complete; auto-complete would load the model (and torch) twice.
        "--disable-auto-complete-config",
        f"--http-address={host}", f"--http-port={http_port}",
        f"--grpc-address={host}", f"--grpc-port={grpc_port}",
        f"--metrics-address={host}", f"--metrics-port={metrics_port}",
        f"--exit-timeout-secs={exit_timeout}",
        f"--log-verbose={log_verbose}",
        *extra,
    ]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def run(cmd: list[str], env: dict) -> int:
    """Run tritonserver in the foreground, forwarding signals; → its exit status (128+N if killed by N)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in forwarded}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # only if a handler was replaced under us; keep waiting
                continue
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return 128 - rc if rc < 0 else rc


def serve(repo: str | Path, *, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, exit_timeout: int = 10, log_verbose: int = 0, extra: list[str] = ()) -> int:
    repo = Path(repo).resolve()
    models = check_repository(repo)
    install = TritonInstall.find()
    env = server_env(install)
    workdir = Path(tempfile.mkdtemp(prefix="muse-spark-triton-"))
    try:
        backend_dir = prepare_backend_dir(install, workdir)
        cmd = server_command(install, repo, backend_dir, host=host, http_port=http_port, grpc_port=grpc_port,
                             metrics_port=metrics_port, exit_timeout=exit_timeout, log_verbose=log_verbose,
                             extra=extra)
        print(f"muse-spark serve: tritonserver with {', '.join(models)} from {repo}: "
              f"HTTP {host}:{http_port}, gRPC {host}:{grpc_port}, metrics {host}:{metrics_port}",
              file=sys.stderr, flush=True)
        return run(cmd, env)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---- command line ---------------------------------------------------------------------------
def add_serve_command(sub) -> None:
    s = sub.add_parser("serve", help="run Triton Inference Server (from nvidia-pytriton) on a model repository",
                       epilog="arguments after `--` go to tritonserver unchanged")
    s.add_argument("--repo", required=True, help="model repository (from `muse-spark triton-repo`)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--exit-timeout", type=int, default=10, help="seconds to let in-flight requests finish on exit")
    s.add_argument("--log-verbose", type=int, default=0)
    s.add_argument("tritonserver_args", nargs="*", help=argparse.SUPPRESS)
    s.set_defaults(fn=cmd_serve)


def cmd_serve(a) -> int:
    try:
        return serve(a.repo, host=a.host, http_port=a.http_port, grpc_port=a.grpc_port,
                     metrics_port=a.metrics_port, exit_timeout=a.exit_timeout, log_verbose=a.log_verbose,
                     extra=a.tritonserver_args)
    except ServingError as e:
        print(f"muse-spark: error: {e}", file=sys.stderr)
        return 2
