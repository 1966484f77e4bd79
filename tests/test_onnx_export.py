"""The ``tensorrt`` backend's input, up to the boundary that runs here: the engine's parts exported as
ONNX graphs with ``muse_spark`` plugin nodes (``builder.onnx_export``), run on CPU with
``onnx.reference`` and onnxruntime (``graphs.onnx_parts``) and composed as the runtime composes the
AOTI packages, give the eager engine's steps and prefill and write the same caches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from muse_spark.builder.tiny import make_tiny  # noqa: E402
from muse_spark.runtime.engine import EagerEngine  # noqa: E402

MAX_SEQ, SLOTS, CHUNK = 48, 2, 8


@pytest.fixture(scope="module", params=["vanilla", "gated", "rnn"])
def fp32_pair(request, tmp_path_factory):
    # float32: onnx.reference computes in numpy, whose bfloat16 matmuls round otherwise than torch's.
    # Every Markov head type: the gated and rnn heads give MarkovSample its head weight and bias inputs.
    out = tmp_path_factory.mktemp(f"fp32-{request.param}")
    make_tiny(out, kind="agreeing", seed=0, dtype="float32", head_type=request.param)
    return out / "target", out / "draft"


@pytest.fixture(scope="module")
def exported(fp32_pair, tmp_path_factory):
    from muse_spark.builder.onnx_export import export_onnx

    e = EagerEngine.from_checkpoints(*fp32_pair, max_batch=SLOTS, max_seq=MAX_SEQ)
    out = tmp_path_factory.mktemp("onnx")
    lines = []
    section = export_onnx(e.target, e.draft, out, max_batch=1, max_seq=MAX_SEQ, buckets=[1], prefill_chunk=CHUNK,
                          cache_slots=SLOTS, log=lines.append)
    return out, section, lines


def test_every_part_is_exported_with_its_plugin_nodes(exported):
    import onnx

    out, section, lines = exported
    assert sorted(section["graphs"]) == ["prefill_finish", "prefill_layer", "step_context_b1", "step_draft_b1",
                                         "step_layer_b1", "step_verify_b1"]
    assert len(lines) == 6 and all(line.startswith("onnx [") for line in lines)
    nodes = {}
    for name, g in section["graphs"].items():
        model = onnx.load(str(out / g["file"]))
        nodes[name] = {(n.domain, n.op_type) for n in model.graph.node}
        for n in model.graph.node:  # TensorRT's ONNX parser finds a plugin by name and namespace
            if n.domain == "muse_spark":
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                assert attrs["plugin_namespace"] == b"muse_spark" and len(n.input) == {"GatedResidualAdd": 5,
                                                                                      "MarkovSample": 11}[n.op_type]
        onnx.checker.check_model(model)  # (the plugin schemas are registered by the export)
        # weights are graph inputs, not initializers: an 8B target is not copied into every graph
        assert not any(i.dims and len(i.raw_data) > 1 << 16 for i in model.graph.initializer)
        assert g["outputs"] >= g["mutated"]
    assert ("muse_spark", "GatedResidualAdd") in nodes["step_layer_b1"]
    assert ("muse_spark", "MarkovSample") in nodes["step_draft_b1"]


@pytest.mark.parametrize("runtime", ["reference", "onnxruntime"])
def test_onnx_parts_compose_to_the_eager_step_and_prefill(fp32_pair, exported, runtime):
    """On onnx.reference, and on onnxruntime (a production runtime, with its own type and shape
    checks) with the plugin nodes as onnxruntime-extensions Python ops."""
    if runtime == "onnxruntime":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxruntime_extensions")
    from muse_spark.runtime.aoti_engine import load_prefill, load_step
    from muse_spark.graphs.parts import SpecPair, weight_names, weight_tensors
    from muse_spark.graphs.onnx_parts import OnnxPart

    out, section, _ = exported
    a = EagerEngine.from_checkpoints(*fp32_pair, max_batch=SLOTS, max_seq=MAX_SEQ)
    b = EagerEngine.from_checkpoints(*fp32_pair, max_batch=SLOTS, max_seq=MAX_SEQ)
    pair = SpecPair(b.target, b.draft)
    weights = weight_tensors(pair, weight_names(pair))

    def part(name):
        g = section["graphs"][name]
        return OnnxPart(out / g["file"], g["fn"], runtime)

    # (the runtime's own composition of an aoti engine's parts, each part an ONNX graph here)
    step = load_step(out, section["graphs"], 1, b.target, b.draft, "cpu", loader=part)
    prefill = load_prefill(out, section["graphs"], b.target, b.draft, "cpu", loader=part)
    caches_b = (b.target_cache.k, b.target_cache.v, b.draft_cache.k, b.draft_cache.v)
    no_ws = torch.empty(0, dtype=torch.int64)  # the reference Markov loop keeps no workspace
    accepted = 0
    with torch.inference_mode():
        prompt = [72, 101, 108, 108, 111, 44, 32, 119]
        got = prefill(weights, *caches_b, torch.tensor([prompt]), torch.arange(CHUNK)[None], torch.tensor([1]),
                      torch.tensor([7]), torch.tensor([7]), torch.tensor([0.0]))
        assert got.tolist() == a.prefill(prompt, 1, 7, 0.0).tolist()
        anchor, pos = int(got[0]), len(prompt)
        for temp, seed in ((0.0, 9), (0.0, 9), (0.9, 2**63 + 3), (1.3, 11)):
            x = (torch.tensor([anchor]), torch.tensor([pos]), torch.tensor([1]), torch.tensor([seed - 2**64 if seed >= 2**63 else seed]),  # (int64 rows)
                 torch.tensor([temp]))
            want = a.step(*x, MAX_SEQ)
            assert torch.equal(step(weights, *caches_b, no_ws, *x), want)
            n = int(want[0, b.gamma])
            accepted += n
            anchor, pos = int(want[0, b.gamma + 1]), pos + n + 1
    assert accepted > 0  # drafts were accepted: the Markov loop's and the verification's outputs were used
    for ca, cb in zip((a.target_cache.k, a.target_cache.v, a.draft_cache.k, a.draft_cache.v), caches_b):
        for ta, tb in zip(ca, cb):
            # (numpy's float32 matmuls sum in another order than torch's: within an ulp or two, not bits)
            torch.testing.assert_close(tb, ta, rtol=1e-5, atol=1e-5)
