"""The benchmarks folder on CPU: the committed results follow the one schema (benchmarks/results.py),
benchmarks/render.py gives the current table and plot from them, and `muse-spark bench` finds
benchmarks/step.py or says why it cannot."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

import results  # noqa: E402  (benchmarks/results.py)

KEYS = {"schema", "benchmark", "date", "device", "commit", "versions", "command", "config", "results"}


def test_every_committed_result_is_in_the_schema_and_named_by_it():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        doc = json.loads(path.read_text())
        assert KEYS <= set(doc), path.name
        assert doc["schema"] == results.SCHEMA and doc["command"] and doc["device"], path.name
        date, device, commit, rest = path.stem.split("_", 3)
        assert date == doc["date"][:10] and commit == (doc["commit"] or "nogit"), path.name
        # (a suffix after the benchmark's name: -2, -3 for more runs that day, or a variant, serving-aoti)
        assert rest == doc["benchmark"] or rest.startswith(doc["benchmark"] + "-"), path.name


def test_render_prints_the_current_figures_and_writes_the_plot(tmp_path):
    png = tmp_path / "performance.png"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render.py"), "--png", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"batch", "1", "8", "32"}
    # batch 1: roofline, GEMM floor, the aoti step and its ratios, in turns, eager, torch.compile, the Markov loop
    for cell in ("4.22", "4.58", "**5.23**", "1.24×", "5.205 (1.21×)", "76.55", "6.44", "14.65×", "1.23×", "27.4",
                 "NVIDIA H200"):
        assert f" {cell} " in rows["1"], (cell, rows["1"])
    for b, cells in (("8", ("4.48", "**7.25**", "7.226 (1.59×)", "98.8")),
                     ("32", ("5.37", "**12.38**", "12.403 (2.28×)", "173.0"))):
        assert all(f" {c} " in rows[b] for c in cells), (b, rows[b])
    assert "`python scripts/bench.py --batches 1 --deadline-s 360" in r.stdout  # each run's exact command
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300 and height > 200
    assert width > 1.5 * height  # (the step panel and, beside it, the generation results' panel)


def test_render_keeps_fp8_steps_apart_from_the_bf16_figures():
    """A step of an FP8 pair (FP8 projections, FP8 KV cache) is not a current bf16 figure: ``--precision fp8``
    shows it, the default table does not."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render.py"), "--png", "", "--precision", "fp8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| ")}
    assert all(c in rows["1"] for c in (" 3.45 ", " **5.25** ", " 1.52× ", "2390ae9bf28f"))
    assert " **8.17** " in rows["8"] and "2390ae9" in rows["8"]
    assert " **13.14** " in rows["32"] and "--kv-cache-dtype fp8" in r.stdout
    bf16 = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render.py"), "--png", ""],
                          capture_output=True, text=True, timeout=300)
    assert "dc1e9e0" not in bf16.stdout and "2390ae9" not in bf16.stdout


def test_the_fp8_plot_sets_fp8_beside_bf16_on_one_device(tmp_path):
    """``--precision fp8 --png``: the FP8 figures' device, each precision's steps by batch, and the tokens/s of the
    latest FP8 generation run beside the bf16 run of the same call (the committed H100 runs)."""
    import render

    series = render.fp8_series(results.load(RESULTS, "step"), results.load(RESULTS, "generation"),
                               "NVIDIA H100 80GB HBM3")
    assert dict(series["tokens"]["fp8"])[1] == pytest.approx(726.4) and dict(series["tokens"]["bf16"])[1] == \
        pytest.approx(538.89)
    assert [b for b, *_ in series["step"]["fp8"]] == [1, 8, 32]
    assert round(dict((b, ms) for b, ms, _ in series["step"]["fp8"])[1], 2) == 5.25
    assert render.fp8_series([], [], "NVIDIA H100 80GB HBM3") == {"step": {"bf16": [], "fp8": []}, "tokens": {}}
    png = tmp_path / "fp8.png"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render.py"), "--precision", "fp8", "--png",
                        str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    data = png.read_bytes()
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and width > 1.5 * height


def test_the_generation_plot_has_a_line_per_acceptance_and_schedule_and_the_target_only_one():
    import render

    series = render.generation_series(results.load(RESULTS, "generation"), "NVIDIA H100 80GB HBM3")
    # each acceptance and schedule on that device: the latest committed run's figure at each batch size (the
    # batch 1–64 run of 7dd5c17 replaces the acceptance-0.6 points; the 0.85 line keeps the 44ea3f4 run's)
    assert round(dict(series["acceptance 0.85, fixed γ"])[1], 1) == 604.1
    assert [(b, round(t, 1)) for b, t in series["acceptance 0.6, fixed γ"]] == [(1, 355.0), (8, 1879.4),
                                                                               (32, 4492.3), (64, 5421.7)]
    assert round(dict(series["acceptance 0.6, confidence scheduling"])[64], 1) == 5987.3
    assert [(b, round(t, 1)) for b, t in series["acceptance 0.6, fixed γ, prefill 8 chunks a call"]] == [
        (1, 354.9), (8, 1976.4), (32, 5088.6), (64, 6288.6)]
    assert round(dict(series["acceptance 0.6, confidence scheduling, prefill 8 chunks a call"])[64], 1) == 6984.0
    assert [b for b, _ in series["target-only decoding (the same engine)"]] == [1, 8, 32, 64]


def test_the_committed_plot_is_a_png():
    data = (ROOT / "docs" / "performance.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"


def test_write_rewrites_its_own_run_and_numbers_another(tmp_path):
    """A run saving as it goes keeps one file; another run of the same day, device, commit and
    benchmark gets the next free name; load() gives both, oldest first."""
    doc = results.record("step", {"batches": [1]}, {"sections": {}}, command=["python", "benchmarks/step.py"])
    first = results.write(doc, tmp_path)
    doc["results"] = {"sections": {"eager": {"1": {"median_ms": 1.0}}}}
    assert results.write(doc, tmp_path) == first
    assert json.loads(first.read_text())["results"]["sections"]["eager"]["1"]["median_ms"] == 1.0
    other = dict(doc, command="python benchmarks/step.py --batches 8")
    second = results.write(other, tmp_path)
    assert second.name == first.name.replace("_step.json", "_step-2.json")
    assert [d["_file"] for d in results.load(tmp_path, "step")] == [first.name, second.name]
    assert results.load(tmp_path, "markov") == []


def test_results_of_dropped_code_stay_out_of_the_current_figures(tmp_path):
    """A result marked ``dropped`` (its code tried and removed) is kept on disk but load() leaves it out unless
    asked; the FP8 step render shows the step the engines run now, not the dropped one's."""
    doc = results.record("step", {"batches": [8]}, {"sections": {}}, command=["python", "benchmarks/step.py"])
    kept = results.write(doc, tmp_path)
    gone = results.write(dict(doc, command="python benchmarks/step.py --batches 8", dropped="reverted"), tmp_path)
    assert [d["_file"] for d in results.load(tmp_path, "step")] == [kept.name]
    assert [d["_file"] for d in results.load(tmp_path, "step", dropped=True)] == [kept.name, gone.name]
    assert any(d.get("dropped") for d in results.load(RESULTS, "step", dropped=True))


def test_the_cli_runs_the_step_benchmark_from_the_repository():
    r = subprocess.run([sys.executable, "-m", "muse_spark.cli", "bench", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: muse-spark bench") and "--out-dir" in r.stdout


def test_the_cli_says_so_when_the_package_has_no_repository(tmp_path, monkeypatch, capsys):
    from muse_spark import cli

    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "muse_spark" / "cli.py"))
    assert cli.main(["bench", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "installed without its repository" in err and str(tmp_path / "site-packages" / "benchmarks") in err


@pytest.mark.parametrize("script", ["step.py", "markov.py", "attention.py", "linear.py", "render.py", "serving.py",
                                    "paged_kv.py"])
def test_each_benchmark_answers_help(script):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]


def test_the_paged_kv_benchmark_fits_more_requests_in_the_same_memory_with_the_same_tokens(tmp_path):
    """On the CPU with a tiny pair: in a budget of 4 windows the paged side runs more requests at once than
    the 4 slots the contiguous side has, both sides give the same tokens, and the requests behind a shared
    system prompt map its first chunk's blocks in; one result file in the schema."""
    from muse_spark.builder.pair import make_pair

    make_pair(tmp_path / "pair", preset="tiny", acceptance=0.8, seed=0, device="cpu")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paged_kv.py"), "--pair", str(tmp_path / "pair"),
                        "--device", "cpu", "--requests", "16", "--prompt-len", "4:60", "--max-tokens", "4:40",
                        "--system-prompt", "140", "--shared", "3", "--out-dir", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = (tmp_path / "out").glob("*_paged_kv.json")
    doc = json.loads(path.read_text())
    assert KEYS <= set(doc) and doc["results"]["outputs_identical"] is True
    res, cfg = doc["results"], doc["config"]
    assert cfg["contiguous_slots"] == 4 and res["contiguous"]["workload"]["peak_running"] <= 4
    assert res["paged"]["workload"]["peak_running"] > 4
    assert res["paged"]["shared_prompt"]["cached_prefill_tokens"] == 2 * 128
    assert res["contiguous"]["shared_prompt"]["cached_prefill_tokens"] == 0


def test_the_paged_kv_plot_draws_the_committed_results(tmp_path):
    """``paged_kv.py --render`` draws the latest committed step and workload results: a PNG, and refuses
    a device with none."""
    png = tmp_path / "paged.png"
    run = lambda *extra: subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paged_kv.py"), "--render",  # noqa: E731
                                         "--plot", str(png), *extra], capture_output=True, text=True, timeout=300)
    r = run()
    assert r.returncode == 0, r.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    r = run("--device", "no such GPU")
    assert r.returncode == 1 and "no paged_kv or paged_kv_step results" in r.stderr


def test_the_paged_kv_benchmark_times_the_compiled_step_paged_against_slot_caches(tmp_path):
    """`--backend aoti` on the CPU with a tiny pair: two aoti engines built from it (slot caches, and a pool of
    the same positions; one copy of the weights on the disk), the step timed at batch 2 on each (one bucket an
    engine: each bucket is a build of its own); one result file in the schema with both engines' figures and the
    ratio, a printed table, the same tokens on both; a second run reuses the engines. (The figures' values are
    not checked: a CPU's say nothing.)"""
    import os

    from muse_spark.builder.pair import make_pair

    make_pair(tmp_path / "pair", preset="tiny", acceptance=0.8, seed=0, device="cpu")
    args = [sys.executable, str(ROOT / "benchmarks" / "paged_kv.py"), "--backend", "aoti", "--pair",
            str(tmp_path / "pair"), "--device", "cpu", "--step-batches", "2", "--context", "40", "--steps", "3",
            "--warmup-steps", "1", "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out")]
    r = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = (tmp_path / "out").glob("*_paged_kv_step.json")
    doc = json.loads(path.read_text())
    assert KEYS <= set(doc) and doc["benchmark"] == "paged_kv_step"
    res, cfg = doc["results"], doc["config"]
    assert [row["batch"] for row in res["batches"]] == [2] and res["outputs_identical"] is True
    for row in res["batches"]:
        for side in ("slot", "paged"):
            assert {"median_ms", "mean_ms", "min_ms"} <= set(row[side]) and row[side]["steps"] == 3
            assert row[side]["median_ms"] > 0
        assert row["slot_chained"]["mean_ms"] > 0 and row["paged_chained"]["mean_ms"] > 0
        assert row["outputs_identical"] is True
        assert row["paged_over_slot"] == pytest.approx(row["paged"]["median_ms"] / row["slot"]["median_ms"],
                                                       rel=1e-2, abs=1e-3)
        assert row["paged_over_slot_chained"] == pytest.approx(
            row["paged_chained"]["mean_ms"] / row["slot_chained"]["mean_ms"], rel=1e-2, abs=1e-3)
    assert cfg["kv_pool"] == [17, 16] and cfg["pool_tokens"] == cfg["slot_tokens"] == 2 * cfg["max_seq"] == 256
    assert "paged/slot" in r.stdout and "identical" in r.stdout
    slot, paged = Path(cfg["engines"]["slot"]), Path(cfg["engines"]["paged"])
    assert json.loads((slot / "manifest.json").read_text())["aoti"]["kv_pool"] is None
    assert json.loads((paged / "manifest.json").read_text())["aoti"]["kv_pool"] == [17, 16]
    assert os.path.samefile(slot / "target.safetensors", paged / "target.safetensors")
    r = subprocess.run(args + ["--reuse-engine"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("reusing the engine built before") == 2 and len(list((tmp_path / "out").glob("*.json"))) == 2


def test_a_step_of_fp8_projections_reads_their_bytes_once():
    """The roofline of an FP8 checkpoint (``timing.step_bytes``): its decoder projections one byte an element
    and a float32 scale per output row, everything else as in bf16."""
    import dataclasses

    from presets import preset_configs
    from timing import step_bytes

    from muse_spark.config import QuantizationConfig

    t, d = preset_configs("muse-spark-8b")
    q = QuantizationConfig.from_dict({"quant_method": "fp8"}, "test")
    tq, dq = dataclasses.replace(t, quantization_config=q), dataclasses.replace(d, quantization_config=q)
    bf16, fp8 = step_bytes(t, d, 1, 1024), step_bytes(tq, dq, 1, 1024)
    D = t.hidden_size

    def proj(c):
        return c.num_hidden_layers * (c.qkv_out * D + c.q_size * D + 3 * c.intermediate_size * D)

    rows = sum(c.num_hidden_layers * (c.qkv_out + 2 * D + 2 * c.intermediate_size) for c in (t, d))
    assert bf16["weights"] - fp8["weights"] == proj(t) + proj(d) - 4 * rows
    assert bf16["kv"] == fp8["kv"] and 0.5 < fp8["total"] / bf16["total"] < 0.65
    # an FP8 KV cache: the target's K/V one byte an element, the draft's context K/V and the weights as they were
    kv8 = step_bytes(dataclasses.replace(tq, kv_cache_dtype="fp8"), dq, 8, 1024)
    g = d.block_size
    target_kv = t.num_hidden_layers * 8 * (1024 + g + 1) * 2 * t.num_key_value_heads * t.head_dim
    b8 = step_bytes(tq, dq, 8, 1024)
    assert b8["kv"] - kv8["kv"] == target_kv and kv8["weights"] == b8["weights"]


def test_the_step_benchmark_times_a_step_with_an_fp8_kv_cache(tmp_path):
    """``benchmarks/step.py --kv-cache-dtype fp8`` (CPU, a two-layer preset, aoti skipped): the eager step runs
    over E4M3 target caches and the roofline counts their bytes at one an element."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step.py"), "--preset", "tiny", "--device", "cpu",
                        "--batches", "1", "--context", "32", "--iters", "2", "--skip", "compile,aoti",
                        "--kv-cache-dtype", "fp8", "--out-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = tmp_path.glob("*_step.json")
    doc = json.loads(path.read_text())
    assert doc["results"]["config"]["target"]["kv_cache_dtype"] == "fp8"
    assert doc["results"]["sections"]["eager"]


def test_the_fp8_error_benchmark_reports_the_logit_error(tmp_path):
    """benchmarks/fp8_error.py on a tiny pair (CPU): the FP8 target's logits against the bf16 target's, written
    in the common schema; the figures are small and nonzero (the weights were rounded), and the comparison
    itself is checked on logits it knows."""
    import torch

    import fp8_error

    assert fp8_error.main(["--preset", "tiny", "--prompts", "4", "--prompt-len", "8", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_fp8-error.json")
    doc = json.loads(path.read_text())
    r = doc["results"]
    assert doc["benchmark"] == "fp8-error" and r["positions"] == 32
    assert 0 < r["max_abs_logit_error"] < 0.1 * r["logit_scale"] and 0 <= r["mean_kl_nats"] <= r["max_kl_nats"] < 1e-3
    assert 0.9 <= r["greedy_agreement"] <= 1
    ref = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    same, shifted = fp8_error.compare(ref, ref.clone()), fp8_error.compare(ref, ref + torch.tensor([0.0, 0.0, 5.0]))
    assert same["max_kl_nats"] == 0 and same["greedy_agreement"] == 1
    assert shifted["max_abs_logit_error"] == 5 and shifted["greedy_agreement"] == 0.5 and shifted["mean_kl_nats"] > 0


def test_the_gemm_floor_counts_fp8_projections(tmp_path):
    """``presets.step_matrices`` and ``gemm_floor`` of an FP8 pair: the same GEMMs as the bf16 pair's, the FP8
    projections as the engine multiplies by them (their codes and scales: fewer bytes)."""
    from presets import gemm_floor, step_matrices, weight_bytes

    import torch

    from muse_spark.builder.pair import make_pair
    from muse_spark.builder.quantize import quantize_pair
    from muse_spark.checkpoint import load_pair
    from muse_spark.models.layers import Fp8Weight

    make_pair(tmp_path / "bf16", "tiny", acceptance=0.8, seed=0)
    quantize_pair(tmp_path / "bf16" / "target", tmp_path / "fp8" / "target", draft=tmp_path / "bf16" / "draft",
                  draft_out=tmp_path / "fp8" / "draft", log=lambda s: None)
    bf16, fp8 = load_pair(tmp_path / "bf16" / "target", tmp_path / "bf16" / "draft"), \
        load_pair(tmp_path / "fp8" / "target", tmp_path / "fp8" / "draft")
    a, b = step_matrices(*bf16), step_matrices(*fp8)
    assert [n for n, _, _ in a] == [n for n, _, _ in b] and any(isinstance(w, Fp8Weight) for _, w, _ in b)
    assert sum(weight_bytes(w) for _, w, _ in b) < sum(weight_bytes(w) for _, w, _ in a)
    r = gemm_floor(*fp8, 1, 5, torch.device("cpu"), iters=1)
    assert r["gemms"] == len(b) and r["weight_bytes"] == sum(weight_bytes(w) for _, w, _ in b)
