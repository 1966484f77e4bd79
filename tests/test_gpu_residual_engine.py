"""An aoti engine built with ``MUSE_SPARK_LINEAR_RESIDUAL=1`` (the o and down projections' launches do
the gated residual after them), on CUDA. Skipped without a CUDA device. Its own xdist group, so that
the GPU test run builds this engine beside the others (``pytest -n … --dist loadgroup``)."""

import json

import pytest
import torch

from muse_spark.runtime import EagerEngine, Generator, load_engine

from conftest import ENGINE_PROMPTS as PROMPTS
from test_gpu_triton_engine import MAX_SEQ, PARAMS, assert_cli_equals_eager, build

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.xdist_group("residual_engine")]


def test_a_linear_residual_engine_equals_eager_under_the_same_switch(agreeing_pair, tmp_path, monkeypatch):
    """Recorded in the manifest; greedy and sampled output equal the eager engine's under the same
    switch, in this process (each bucket's step graph replayed) and in a fresh one; every layer's
    words are zero after."""
    out = build(agreeing_pair, tmp_path / "engine", env={"MUSE_SPARK_LINEAR_RESIDUAL": "1"})
    assert json.loads((out / "manifest.json").read_text())["aoti"]["linear_residual"] is True
    monkeypatch.setenv("MUSE_SPARK_LINEAR_RESIDUAL", "1")  # the eager engine decides per call
    eager = EagerEngine.from_checkpoints(*agreeing_pair, device="cuda", max_batch=2, max_seq=MAX_SEQ)
    engine = load_engine(out)
    want = [r.output for r in Generator(eager).generate(PROMPTS[:2], PARAMS)]
    assert [r.output for r in Generator(engine).generate(PROMPTS[:2], PARAMS)] == want
    layers = engine.target.model.layers
    assert all(t.tolist() == [0, 0] for layer in layers for t in (layer.sync_attn, layer.sync_ffn))
    assert_cli_equals_eager(out, eager)
