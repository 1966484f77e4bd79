"""The ``tensorrt`` backend on a GPU with TensorRT (≥ 10.9, ``tensorrt.plugin``): a tiny engine
built by the CLI gives the eager engine's tokens, greedy and sampled. Not run in this workplace:
TensorRT does not install here (its wheels come from NVIDIA's index), nor on the device machine."""

from __future__ import annotations

import pytest
import torch

from conftest import ENGINE_PROMPTS as PROMPTS
from conftest import run_cli

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("tensorrt", reason="needs TensorRT's Python package (NVIDIA's index; not installable here)")
pytest.importorskip("tensorrt.plugin", reason="needs TensorRT >= 10.9 (tensorrt.plugin)")

from muse_spark.runtime import EagerEngine, Generator, SamplingParams, load_engine  # noqa: E402


@pytest.fixture(scope="module")
def engines(agreeing_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("trt") / "engine"
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", out, "--backend",
                "tensorrt", "--device", "cuda", "--max-batch", "4", "--max-seq", "128")
    assert r.returncode == 0, r.stderr[-4000:]
    eager = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=4, max_seq=128, device="cuda")
    return load_engine(out), eager


@pytest.mark.parametrize("sampled", [False, True])
def test_tensorrt_engine_gives_the_eager_tokens(engines, sampled):
    engine, eager = engines
    params = [SamplingParams(max_tokens=24, temperature=0.8 if sampled else 0.0, seed=7 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    got = Generator(engine).generate(PROMPTS, params)
    want = Generator(eager).generate(PROMPTS, params)
    assert [r.output for r in got] == [r.output for r in want]
