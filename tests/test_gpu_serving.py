"""The Triton server on the GPU: ``muse-spark serve`` with a CUDA engine gives the in-process runtime's
tokens, with many requests in flight, and its throughput is measured beside the in-process one.

Runs ``benchmarks/serving.py`` (which fails when any server output differs from the in-process output)
on a tiny CUDA engine of each backend. Where the environment has numpy 2 and no package index, set
``STUB_NUMPY`` to a numpy 1.x wheel for Triton's python backend stub (``scripts/device_wheels.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from muse_spark.builder.build import build_engine
from muse_spark.serving.server import ServingError, TritonInstall, server_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("backend", ["eager", "aoti"])
def test_server_on_the_gpu_matches_the_runtime_and_reports_its_throughput(backend, agreeing_pair, tmp_path):
    try:
        server_env(TritonInstall.find())
    except ServingError as e:
        pytest.skip(f"tritonserver cannot run here: {e}")
    engine = tmp_path / f"engine-{backend}"
    build_engine(*agreeing_pair, engine, backend=backend, device="cuda", max_batch=8, max_seq=512, quiet=True)
    out = Path(os.environ.get("OUT", tmp_path)) / f"serving-{backend}"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--engine", str(engine), "--concurrency", "8",
           "--requests", "64", "--max-tokens", "64", "--out", str(out)]
    if os.environ.get("STUB_NUMPY"):
        cmd += ["--stub-numpy", os.environ["STUB_NUMPY"]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    (result,) = [json.loads(p.read_text()) for p in sorted(out.glob("*_serving.json"))[-1:]]
    r = result["results"]
    assert r["outputs_identical"] and r["server"]["requests"] == 64
    print(f"{backend}: in process {r['in_process']['tokens_per_s']} tok/s, server {r['server']['tokens_per_s']} "
          f"tok/s ({r['server_over_in_process_tokens_per_s']}x)")
