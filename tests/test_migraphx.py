"""The ``migraphx`` backend (the ROCm fallback), up to the boundary this workplace can run.

No AMD GPU and no MIGraphX here: the build, the load, the plain eager fallback and its reason are
tested as they are; the compiled step is tested through ``torch.compile`` with the backend swapped
for torch's own ``"eager"`` one (the same whole-step graph capture over the static key window, run by
torch instead of MIGraphX): its tokens must equal the eager engine's, greedy and sampled, as requests
of different batch sizes join and leave.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from muse_spark.runtime import EagerEngine, EngineError, Generator, SamplingParams, load_engine
from muse_spark.runtime.migraphx_engine import MIGraphXEngine, migraphx_unavailable

from conftest import ENGINE_PROMPTS as PROMPTS
from conftest import run_cli

MAX_BATCH, MAX_SEQ = 3, 256


@pytest.fixture(scope="module")
def built(agreeing_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("migraphx") / "engine"
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", out, "--backend",
                "migraphx", "--device", "cpu", "--max-batch", MAX_BATCH, "--max-seq", MAX_SEQ)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def eager(agreeing_pair):
    return EagerEngine.from_checkpoints(*agreeing_pair, max_batch=MAX_BATCH, max_seq=MAX_SEQ)


PARAMS = [SamplingParams(max_tokens=n, temperature=t, seed=s, ignore_eos=True)
          for n, t, s in ((40, 0.0, 0), (23, 0.9, 3), (9, 0.0, 0), (31, 1.2, 5))]


def outputs(engine) -> list[list[int]]:
    """Four requests on three slots (batch sizes 3, then 2 and 3 again as they leave and join), greedy and
    sampled rows, a prompt of two chunks."""
    return [r.output for r in Generator(engine).generate(PROMPTS, PARAMS)]


def test_the_build_writes_an_engine_of_its_own_backend(built):
    m = json.loads((built / "manifest.json").read_text())
    assert m["backend"] == "migraphx" and set(m["files"]) == {"target.safetensors", "draft.safetensors",
                                                             "tokenizer.json", "tokenizer_config.json"}


def test_without_migraphx_it_runs_the_eager_path_and_says_why(built, eager, caplog):
    with caplog.at_level(logging.WARNING, logger="muse_spark.runtime.migraphx_engine"):
        engine = load_engine(built)
    assert isinstance(engine, MIGraphXEngine) and engine.compiled is None
    assert engine.fallback == "MIGraphX compiles for ROCm GPUs, this engine runs on a cpu device"
    assert "the speculative step runs the plain eager path" in caplog.text
    assert outputs(engine) == outputs(eager)


def test_the_compiled_step_gives_the_eager_engines_tokens(built, eager):
    """The whole step captured by dynamo (fullgraph: no graph break) over the static window."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine = MIGraphXEngine.from_dir(built, compile_backend="eager")
    assert engine.compiled is not None and engine.fallback is None
    assert outputs(engine) == outputs(eager)
    # the steps ran compiled: one graph per batch size the requests made (3, then fewer as they finished)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2


def test_the_graph_the_backend_gets_holds_aten_ops_only(built, eager):
    """What MIGraphX would be handed: one whole-step graph per batch size, of aten ops (the plugins'
    reference functions traced through, no Python-registered muse_spark op), computing the eager tokens."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    engine = MIGraphXEngine.from_dir(built, compile_backend=backend)
    assert outputs(engine) == outputs(eager)
    assert len(graphs) >= 2
    for targets in graphs:
        assert targets and not [t for t in targets if "muse_spark" in t]
        assert any(t.startswith("aten.") or "built-in" in t or "torch" in t for t in targets)


def test_reasons_it_cannot_compile_here():
    assert "ROCm GPUs" in migraphx_unavailable(torch.device("cpu"))
    if torch.version.hip is None:
        assert "a CUDA (not ROCm) build of torch" in migraphx_unavailable(torch.device("cuda"))


def test_other_backends_engines_are_refused_by_name(built):
    with pytest.raises(EngineError, match="this is a 'migraphx' engine; EagerEngine loads 'eager' engines"):
        EagerEngine.from_dir(built)
