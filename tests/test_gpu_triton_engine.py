"""The aoti engine built with the Triton plugin kernels compiled into its packages, on CUDA.

Skipped without a CUDA device (and Triton). Its own file so that the GPU test run builds this
engine in parallel with tests/test_gpu_engine.py's (``pytest -n … --dist loadfile``).
"""

import json

import pytest
import torch

from muse_spark.runtime import EagerEngine, Generator, SamplingParams

from conftest import ENGINE_PROMPTS as PROMPTS
from conftest import cli_generate_ids, run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_SEQ = 256
cli = run_cli


@pytest.fixture(scope="module")
def eager(agreeing_pair):
    return EagerEngine.from_checkpoints(*agreeing_pair, device="cuda", max_batch=2, max_seq=MAX_SEQ)


def test_engine_with_the_triton_plugin_kernels_equals_eager(agreeing_pair, eager, tmp_path):
    """The product path: the fused Triton kernels compiled into the packages (no fallback allowed),
    built by the CLI and run by another process; greedy and sampled output equal the eager engine's."""
    out = tmp_path / "triton_engine"
    r = cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", out, "--backend", "aoti",
            "--device", "cuda", "--max-batch", 2, "--max-seq", MAX_SEQ, "--plugins", "triton")
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads((out / "manifest.json").read_text())["aoti"]["plugin_impl"] == "triton"
    params = [SamplingParams(max_tokens=24, ignore_eos=True), SamplingParams(max_tokens=24, temperature=0.9, seed=3,
                                                                             ignore_eos=True)]
    for prompt, p in zip(PROMPTS[:2], params):
        ids = cli_generate_ids(out, prompt, 24, temperature=p.temperature, seed=p.seed)
        assert ids == Generator(eager).generate([prompt], [p])[0].output
