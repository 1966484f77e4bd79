"""The ``tensorrt`` backend where TensorRT does not install (this workplace, CI): the ONNX export
from the command line, and the build's and the runtime's refusals, each with its reason. (The
graphs themselves, run on ``onnx.reference``: ``tests/test_onnx_export.py``; a build and a run
with TensorRT: ``tests/test_gpu_tensorrt.py``.)"""

from __future__ import annotations

import importlib.util
import json

import pytest

from muse_spark.runtime import EngineError, load_engine

from conftest import run_cli

pytest.importorskip("onnxscript")
NO_TENSORRT = importlib.util.find_spec("tensorrt") is None


def test_export_onnx_writes_every_part_and_their_names(agreeing_pair, tmp_path):
    import onnx

    out = tmp_path / "onnx"
    r = run_cli("export-onnx", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", out,
                "--max-batch", "2", "--max-seq", "64")
    assert r.returncode == 0, r.stderr
    section = json.loads((out / "onnx.json").read_text())
    assert sorted(section["graphs"]) == sorted(["prefill_finish", "prefill_layer"] + [
        f"step_{p}_b{b}" for b in (1, 2) for p in ("context", "draft", "layer", "verify")])
    assert "[export-onnx] onnx [10/10]" in r.stderr  # progress, a line a part
    # a GPU's buckets (a TensorRT build's), one scratch slot for padding rows
    assert section["cache_slots"] == 3 and section["scratch_slot"] == 2 and section["batch_buckets"] == [1, 2]
    for g in section["graphs"].values():
        model = onnx.load(str(out / g["file"]))
        assert [i.name for i in model.graph.input] == g["input_names"]
        assert [o.name for o in model.graph.output] == g["output_names"]
    # a folder that holds something is not written into
    r = run_cli("export-onnx", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", out)
    assert r.returncode == 2 and "exists and is not empty" in r.stderr
    # the build's limits (builder.limits.check_max_seq)
    r = run_cli("export-onnx", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", tmp_path / "o2",
                "--max-seq", "3")
    assert r.returncode == 2 and "--max-seq must be at least γ+2" in r.stderr


def test_build_refuses_with_its_reason(agreeing_pair, tmp_path):
    args = ("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", tmp_path / "t",
            "--backend", "tensorrt")
    r = run_cli(*args)
    assert r.returncode == 2 and "--backend tensorrt builds plans for a CUDA GPU: give --device cuda" in r.stderr
    if NO_TENSORRT:
        r = run_cli(*args, "--device", "cuda")
        assert r.returncode == 2 and "needs TensorRT's Python package" in r.stderr and "export-onnx" in r.stderr
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.partial").exists()


def test_runtime_refuses_an_engine_it_cannot_run(agreeing_pair, tmp_path):
    """A manifest naming the tensorrt backend: refused for a CPU build (plans are GPU code), and
    where TensorRT does not import, refused with that reason, before any plan is read."""
    from muse_spark.builder.build import build_engine

    d = tmp_path / "e"
    build_engine(agreeing_pair[0], agreeing_pair[1], d, backend="eager", max_batch=2, max_seq=64, quiet=True)
    m = json.loads((d / "manifest.json").read_text())
    m["backend"], m["tensorrt"] = "tensorrt", {"graphs": {}, "tensorrt_version": "10.9.0"}
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="a tensorrt engine runs on a CUDA GPU; .* built for 'cpu'"):
        load_engine(d)
    del m["tensorrt"]
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="manifest lacks its 'tensorrt' section"):
        load_engine(d)
    if NO_TENSORRT:
        from muse_spark.runtime.tensorrt_engine import TensorRTEngine

        m.update(tensorrt={"graphs": {}}, device={"kind": "cuda", "name": "x", "compute_capability": [9, 0]})
        with pytest.raises(EngineError, match="needs TensorRT's Python package"):
            TensorRTEngine.check_section(m, str(d))


def test_a_presets_graphs_export_without_weights(tmp_path):
    """scripts/export_onnx_preset.py: the graphs of a benchmark preset's shapes, from modules on the
    meta device (the weights are graph inputs: no checkpoint is needed)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "export_onnx_preset.py"
    out = tmp_path / "onnx"
    r = subprocess.run([sys.executable, str(script), "--out", str(out), "--preset", "tiny", "--max-batch", "2",
                        "--max-seq", "64"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    section = json.loads((out / "onnx.json").read_text())
    assert len(section["graphs"]) == 10 and section["batch_buckets"] == [1, 2]
    assert all((out / g["file"]).stat().st_size > 0 for g in section["graphs"].values())
    assert "10 graphs in" in r.stdout
    r = subprocess.run([sys.executable, str(script), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "exists and is not empty" in r.stderr
