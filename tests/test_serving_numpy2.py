"""Serving from an environment with numpy 2, as today's torch environments have it.

Triton's python-backend stub in nvidia-pytriton is built for numpy 1.x and, under numpy 2, corrupts
every tensor (``serving/stub_env.py``). The test makes an environment with numpy 2 over this one (a
venv whose own numpy 2 comes first, then this environment's packages) and checks that
``muse-spark serve`` from it answers exactly what the runtime computes — ids, text, streaming — and
that a stub left with numpy 2 (tritonserver started by hand) refuses to load rather than serve wrong
tokens. Needs PyPI (numpy 2 for the environment, numpy 1.x for the stub).
"""

from __future__ import annotations

import os
import site
import subprocess
import time
import venv
from pathlib import Path

import pytest

from muse_spark.builder.build import build_engine
from muse_spark.serving.repo import write_repository
from muse_spark.serving.server import TritonInstall, prepare_backend_dir, server_command, server_env
from muse_spark.serving.supervisor import free_port
from serving_utils import (Reference, generate, generate_stream, ids_of, require_tritonserver, start_server,
                           stop_server, tail)

NUMPY2 = "numpy==2.3.5"


@pytest.fixture(scope="module")
def numpy2_python(tmp_path_factory) -> Path:
    require_tritonserver()
    env = tmp_path_factory.mktemp("numpy2") / "venv"
    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "--only-binary=:all:", NUMPY2],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"pip install {NUMPY2} failed (this test needs PyPI):\n{done.stderr[-2000:]}")
    sp = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                      text=True).strip())
    (sp / "zz-base-environment.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))
    version = subprocess.check_output([str(py), "-c", "import numpy, muse_spark, torch; print(numpy.__version__)"],
                                      text=True).strip()
    assert version.startswith("2."), version
    return py


@pytest.fixture(scope="module")
def engine_dir(agreeing_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("numpy2-serving") / "engine"
    build_engine(*agreeing_pair, out, max_batch=4, max_seq=256, quiet=True)
    return out


def test_serve_from_a_numpy2_environment_gives_the_runtime_output(numpy2_python, engine_dir, tmp_path):
    ref = Reference(engine_dir)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    srv = start_server(engine_dir, tmp_path, python=str(numpy2_python), env=env)
    try:
        assert "stub numpy from" in srv.log.read_text(errors="replace")
        want = ref.run([1, 2, 3], max_tokens=20, ignore_eos=True)
        status, body = generate(srv, {"input_ids": [1, 2, 3], "max_tokens": 20, "ignore_eos": True})
        assert status == 200, body
        assert ids_of(body) == want.output and body["text_output"] == ref.text(want.output)
        assert len(body["acceptance_per_position"]) == ref.engine.gamma
        text = "numpy two, served"
        want = ref.run(ref.tok.encode(text).ids, max_tokens=16, temperature=0.8, seed=3)
        status, events = generate_stream(srv, {"text_input": text, "max_tokens": 16, "temperature": 0.8, "seed": 3,
                                               "stream": True})
        assert status == 200, events
        assert sum((ids_of(e) for e in events), []) == want.output
        assert "".join(e["text_output"] for e in events) == ref.text(want.output)
    finally:
        rc = stop_server(srv)
    assert rc == 0, tail(srv.log)


def test_a_stub_left_with_numpy2_refuses_to_load(numpy2_python, engine_dir, tmp_path):
    """tritonserver started by hand in the numpy-2 environment: the model refuses, naming the cause."""
    repo = tmp_path / "repo"
    write_repository(engine_dir, repo, torch_threads=1)
    install = TritonInstall.find()
    env = server_env(install, python_bin=numpy2_python.parent)
    cmd = server_command(install, repo, prepare_backend_dir(install, tmp_path / "work"), host="127.0.0.1",
                         http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-3000:]
    assert "corrupts every tensor" in log and "muse-spark serve" in log, log[-3000:]
    assert time.monotonic() - t0 < 180
