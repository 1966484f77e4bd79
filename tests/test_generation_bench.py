"""``benchmarks/generation.py`` on the CPU: from a pair to generated tokens/s of speculative decoding and
of the target alone, with identical greedy outputs and the pair's acceptance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from muse_spark.builder.pair import make_pair

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_measures_both_sides_on_a_pair(tmp_path):
    make_pair(tmp_path / "pair", "tiny", acceptance=0.8, seed=0)
    out, md = tmp_path / "results", tmp_path / "table.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generation.py"), "--pair", str(tmp_path / "pair"),
                        "--backend", "eager", "--device", "cpu", "--batches", "1,2", "--max-tokens", "16",
                        "--prompt-len", "8", "--work-dir", str(tmp_path / "work"), "--out-dir", str(out),
                        "--markdown", str(md), "--sampled-acceptance", "4"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "[build] engine written to" in r.stderr  # the build's progress
    (doc,) = [json.loads(p.read_text()) for p in out.glob("*_generation.json")]
    assert doc["benchmark"] == "generation" and doc["config"]["pair"]["acceptance"] == 0.8
    assert doc["config"]["engine"]["backend"] == "eager" and doc["config"]["engine"]["max_batch"] == 2
    res = doc["results"]
    assert res["outputs_identical"] and [row["batch"] for row in res["batches"]] == [1, 2]
    for row in res["batches"]:
        assert row["outputs_identical"]
        for side in ("speculative", "target_only"):
            assert row[side]["tokens_per_s"] > 0 and row[side]["decode_tokens_per_s"] > 0
            assert row[side]["generated_tokens"] == 16 * row["batch"]
        assert row["speculative"]["mean_accepted_per_step"] > 0.5
        assert row["target_only"]["steps"] == 15 and row["speedup"] > 0
    sampled = res["sampled_acceptance"]  # (the pair's acceptance at temperature 1, schedule off)
    assert sampled["temperature"] == 1.0 and sampled["requests"] == 4 and sampled["steps"] > 0
    assert 0 <= sampled["mean_accepted_per_step"] <= 5 and len(sampled["acceptance_per_position"]) == 5
    table = md.read_text()
    assert "| schedule | batch | spec tok/s" in table and table.count("| True |") == 2


def test_schedules_off_and_confidence_side_by_side(tmp_path):
    """`--schedule off,confidence --calibrate`: both policies on the same engine, the cost table measured
    first; confidence verifies fewer drafts a step and the outputs stay the target's. The head's calibration
    is checked on a run by the threshold alone: the measured table's cut depends on the machine's load (a
    budget may verify low-confidence drafts where they are cheap), the threshold's does not."""
    make_pair(tmp_path / "pair", "tiny", acceptance=0.6, seed=0)

    def run(name, *args):
        out = tmp_path / name
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generation.py"), "--pair", str(tmp_path / "pair"),
                            "--backend", "eager", "--device", "cpu", "--batches", "2", "--max-tokens", "16",
                            "--prompt-len", "8", "--work-dir", str(tmp_path / "work"), "--out-dir", str(out),
                            "--confidence-threshold", "0.5", "--sampled-acceptance", "0", *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
        (doc,) = [json.loads(p.read_text()) for p in out.glob("*_generation.json")]
        return doc, {row["schedule"]: row for row in doc["results"]["batches"]}

    doc, rows = run("calibrated", "--schedule", "off,confidence", "--calibrate")
    assert set(rows) == {"off", "confidence"} and all(row["outputs_identical"] for row in rows.values())
    assert rows["off"]["speculative"]["mean_verified_per_step"] == 5
    assert rows["confidence"]["speculative"]["mean_verified_per_step"] < 5
    counts = rows["confidence"]["speculative"]["verified_counts"]  # (request-steps by the drafts they verified)
    assert len(counts) == 6 and sum(counts) > 0
    assert sum(k * c for k, c in enumerate(counts)) / sum(counts) == pytest.approx(
        rows["confidence"]["speculative"]["mean_verified_per_step"])
    assert len(doc["config"]["cost_ms"]["2"]) == 6
    assert "confidence" in rows["confidence"]["speculative"] and "sampled_acceptance" not in doc["results"]
    # the scheduled steps report the head's values: its calibration (the informative head separates)
    doc, rows = run("threshold", "--schedule", "confidence")
    conf = rows["confidence"]["speculative"]["confidence"]
    assert rows["confidence"]["outputs_identical"] and conf["decided_positions"] > 20
    assert conf["auroc"] > 0.9 and conf["mean_when_accepted"] > conf["mean_when_rejected"]


def test_an_fp8_pair_with_an_fp8_kv_cache(tmp_path):
    """A quantized pair (``muse-spark quantize``) built with ``--kv-cache-dtype fp8``: the record names the FP8
    projections and cache, and speculative decoding gives the FP8 target's own greedy tokens. ``--kv-cache-dtype``
    with a built ``--engine`` is refused (its cache was chosen at its build)."""
    from muse_spark.builder.quantize import quantize_checkpoint

    make_pair(tmp_path / "pair", "tiny", acceptance=0.8, seed=0)
    for part in ("target", "draft"):
        quantize_checkpoint(tmp_path / "pair" / part, tmp_path / "fp8" / part)
    out = tmp_path / "results"
    script = [sys.executable, str(ROOT / "benchmarks" / "generation.py")]
    r = subprocess.run(script + ["--pair", str(tmp_path / "fp8"), "--backend", "eager", "--device", "cpu",
                                 "--kv-cache-dtype", "fp8", "--batches", "2", "--max-tokens", "12", "--prompt-len", "8",
                                 "--work-dir", str(tmp_path / "work"), "--out-dir", str(out),
                                 "--sampled-acceptance", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    (doc,) = [json.loads(p.read_text()) for p in out.glob("*_generation.json")]
    engine = doc["config"]["engine"]
    assert engine["kv_cache_dtype"] == "fp8" and "o_proj" in " ".join(engine["fp8_projections"])
    assert doc["results"]["outputs_identical"]
    (built,) = (tmp_path / "work").glob("engine-*-kvfp8")
    r = subprocess.run(script + ["--engine", str(built), "--kv-cache-dtype", "fp8"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--kv-cache-dtype is for --pair" in r.stderr
