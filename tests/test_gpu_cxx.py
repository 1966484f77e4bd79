"""The C++ embedding on a CUDA engine: the tiny pair built for the GPU with the default plugins (the
Triton kernels), run by the example program (each bucket's step captured in CUDA graphs and chained,
or its packages called one after another with --no-cuda-graphs) and by the Python runtime (its
captured steps): the same tokens, greedy and sampled, with requests joining, waiting for a slot and
cancelled between steps, and with a schedule's planned halves. And the compute-capability refusal,
which only a CUDA build of the library has."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch

from muse_spark.runtime import load_engine

from conftest import ENGINE_PROMPTS as PROMPTS
from conftest import run_cli
from cxx_utils import cxx, cxx_generate, finals, python_generate, same_as_python

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.xdist_group("cxx")]


@pytest.fixture(scope="module")
def built(agreeing_pair, tmp_path_factory):
    """The tiny pair's CUDA engine, with a narrower verification width (2) beside γ for the planned schedule."""
    out = tmp_path_factory.mktemp("cxx_cuda") / "engine"
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", out, "--backend", "aoti",
                "--device", "cuda", "--max-batch", 3, "--max-seq", 256, "--verify-widths", 2)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graphs", "no_cuda_graphs"])
@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.9, 7)], ids=["greedy", "sampled"])
def test_a_cuda_engine_gives_the_python_runtimes_tokens(cxx_build, built, temperature, seed, graphs):
    lines = cxx_generate(cxx_build, built, PROMPTS, max_tokens=30, temperature=temperature, seed=seed,
                         extra=() if graphs else ("--no-cuda-graphs",))
    reqs = python_generate(load_engine(built), PROMPTS, max_tokens=30, temperature=temperature, seed=seed,
                           ignore_eos=True)
    same_as_python(lines, reqs)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_requests_joining_waiting_and_cancelled_between_chained_graph_steps(cxx_build, built, temperature):
    """Four requests over three slots through the C++ Generator with CUDA graphs and chained steps: two
    join later (one waits for a slot while chained steps run), one is cancelled mid-run. A request's tokens
    do not depend on its batch mates or on when it was stepped (per-request seeds), so every request that
    ran to the end has the Python runtime's tokens and steps, the cancelled one a prefix of them, and each
    request's streamed tokens are its output."""
    args = ["--arrivals", "0,0,2,3", "--cancel", "1@5"]
    lines = cxx_generate(cxx_build, built, PROMPTS, max_tokens=40, temperature=temperature, seed=11, stream=True,
                         extra=args)
    reqs = python_generate(load_engine(built), PROMPTS, max_tokens=40, temperature=temperature, seed=11,
                           ignore_eos=True)
    out = finals(lines)
    assert [x["finish_reason"] for x in out] == ["length", "cancelled", "length", "length"]
    for i in (0, 2, 3):
        assert out[i]["output_ids"] == reqs[i].output and out[i]["steps"] == len(reqs[i].steps)
    assert 0 < len(out[1]["output_ids"]) < 40 and out[1]["output_ids"] == reqs[1].output[: len(out[1]["output_ids"])]
    for x in out:
        assert sum((c["tokens"] for c in lines if "tokens" in c and c["request"] == x["request"]), []) == x["output_ids"]


def test_a_planned_schedule_replays_the_draft_and_verification_graphs(cxx_build, built, tmp_path):
    """A schedule in the manifest (fixed, at the narrowest compiled width): each step replays the draft
    half's graph, then the verification graph at that width; the tokens and steps are the Python
    runtime's under the same schedule."""
    m = json.loads((built / "manifest.json").read_text())
    widths = sorted(m["aoti"].get("verify_widths") or [m["gamma"]])
    if len(widths) < 2:
        pytest.skip("the engine was built without narrower verification widths")
    d = tmp_path / "e"
    shutil.copytree(built, d)
    m["schedule"] = {"mode": "fixed", "length": widths[0]}
    (d / "manifest.json").write_text(json.dumps(m))
    for temperature, seed in ((0.0, 0), (0.9, 7)):
        lines = cxx_generate(cxx_build, d, PROMPTS, max_tokens=30, temperature=temperature, seed=seed)
        reqs = python_generate(load_engine(d), PROMPTS, max_tokens=30, temperature=temperature, seed=seed,
                               ignore_eos=True)
        same_as_python(lines, reqs)
        assert {s.verified for r in reqs for s in r.steps} == {widths[0]}


def test_refuses_an_engine_built_for_another_compute_capability(cxx_build, built, tmp_path):
    d = tmp_path / "e"
    shutil.copytree(built, d)
    m = json.loads((d / "manifest.json").read_text())
    m["device"]["compute_capability"] = [8, 0]
    (d / "manifest.json").write_text(json.dumps(m))
    r = cxx(cxx_build, "--engine", d, "--prompt-ids", "1,2")
    assert r.returncode == 2 and "engine was compiled for compute capability 8.0" in r.stderr, r.stderr


def test_the_benchmark_replays_graphs_with_the_manifests_programmatic_edges(cxx_build, built):
    """muse_spark_bench on the CUDA engine: its steps are CUDA graphs, and where the engine was built with
    PDL (the manifest's pdl_kernels) the captures made edges into those kernels programmatic, as the
    Python runtime's do."""
    m = json.loads((built / "manifest.json").read_text())
    r = subprocess.run([str(cxx_build / "muse_spark_bench"), "--engine", str(built), "--batches", "1,3",
                        "--max-tokens", "16", "--prompt-len", "8", "--warmup", "1"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["batch"] for x in rows] == [1, 3] and all(x["cuda_graphs"] for x in rows)
    edges = int(re.search(r"CUDA graphs \((\d+) programmatic edges\)", r.stderr).group(1))
    assert (edges > 0) == bool(m["aoti"].get("pdl_kernels")), r.stderr
