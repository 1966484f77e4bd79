"""The C++ embedding on a CUDA engine: the tiny pair built for the GPU with the default plugins (the
Triton kernels), run by the example program (its packages called one after another, no CUDA graph)
and by the Python runtime (its captured steps): the same tokens, greedy and sampled. And the
compute-capability refusal, which only a CUDA build of the library has."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from muse_spark.runtime import load_engine

from conftest import ENGINE_PROMPTS as PROMPTS
from conftest import run_cli
from cxx_utils import cxx, cxx_generate, python_generate, same_as_python

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.xdist_group("cxx")]


@pytest.fixture(scope="module")
def built(agreeing_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("cxx_cuda") / "engine"
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", out, "--backend", "aoti",
                "--device", "cuda", "--max-batch", 3, "--max-seq", 256)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.9, 7)], ids=["greedy", "sampled"])
def test_a_cuda_engine_gives_the_python_runtimes_tokens(cxx_build, built, temperature, seed):
    lines = cxx_generate(cxx_build, built, PROMPTS, max_tokens=30, temperature=temperature, seed=seed)
    reqs = python_generate(load_engine(built), PROMPTS, max_tokens=30, temperature=temperature, seed=seed,
                           ignore_eos=True)
    same_as_python(lines, reqs)


def test_refuses_an_engine_built_for_another_compute_capability(cxx_build, built, tmp_path):
    d = tmp_path / "e"
    shutil.copytree(built, d)
    m = json.loads((d / "manifest.json").read_text())
    m["device"]["compute_capability"] = [8, 0]
    (d / "manifest.json").write_text(json.dumps(m))
    r = cxx(cxx_build, "--engine", d, "--prompt-ids", "1,2")
    assert r.returncode == 2 and "engine was compiled for compute capability 8.0" in r.stderr, r.stderr
