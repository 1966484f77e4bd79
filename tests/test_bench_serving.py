"""``muse-spark bench-serving`` (benchmarks/bench_serving.py) on the CPU with the tiny pair: its statistics
on synthetic timestamps, the request stream, and small runs in process and through the real Triton
server, checked through the result JSON. Speed is never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from muse_spark.builder.build import build_engine
from muse_spark.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serving as bs  # noqa: E402  (benchmarks/)


@pytest.fixture(scope="module")
def engine_dir(agreeing_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-serving") / "engine"
    build_engine(*agreeing_pair, out, backend="eager", device="cpu", max_batch=4, max_seq=256, quiet=True)
    return out


def bench(*args) -> int:
    return cli_main(["bench-serving", *map(str, args)])


def load_doc(out_dir: Path) -> dict:
    (path,) = sorted(out_dir.glob("*_bench-serving*.json"))
    return json.loads(path.read_text())


def check_runs(doc: dict, lengths: list[tuple[int, int]] | None = None) -> None:
    """Every request completed with exactly one final response and its output length; sane figures."""
    for run in doc["results"]["runs"]:
        assert run["failures"] == 0 and run["completed"] == run["num_requests"], run["failure_examples"]
        assert run["output_tokens_per_s"] > 0 and run["request_throughput"] > 0
        assert run["output_tokens"] == sum(r["output_len"] for r in run["requests"])
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            s = run[key]
            assert s["p50"] is not None and 0 <= s["p50"] <= s["p90"] <= s["p99"], (key, s)
        assert run["mean_accepted_length"] >= 1
        for i, r in enumerate(run["requests"]):
            assert r["final_responses"] == 1 and r["error"] is None, r
            assert r["tokens"] == r["output_len"] and r["finish_reason"] == "length", r
            assert 0 <= r["ttft_ms"] <= r["e2e_ms"], r
            assert r["steps"] >= (r["output_len"] > 1) and r["accepted_draft_tokens"] >= 0  # (prefill: no step)
            if lengths is not None:
                assert (r["prompt_len"], r["output_len"]) == lengths[i]


# ---- statistics ---------------------------------------------------------------------------------
def test_percentiles_are_numpys_and_empty_gives_none():
    s = bs.percentiles(range(1, 101))
    assert s == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01, "mean": 50.5})
    assert bs.percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_modes_are_checked_and_triton_means_http():
    import argparse

    assert bs._modes("inprocess, triton") == ["inprocess", "triton-http"]
    with pytest.raises(argparse.ArgumentTypeError, match="triton-udp is not one of"):
        bs._modes("inprocess,triton-udp")


def test_inter_token_latency_divides_each_gap_by_the_tokens_of_the_later_chunk():
    # the prefill token at 10 ms, then steps of 1, 4, (an empty final response), 2 tokens
    chunks = [(0.010, 1), (0.020, 1), (0.040, 4), (0.041, 0), (0.050, 2)]
    assert bs.inter_token_latencies(chunks) == pytest.approx([0.010] + [0.005] * 4 + [0.005] * 2)
    assert bs.inter_token_latencies([(0.5, 3)]) == []  # the first chunk's tokens: TTFT, no ITL
    o = bs.Outcome(0, prompt_len=4, output_len=8, sent=0.0, chunks=chunks)
    o.finish(0.052, reason="length")
    assert bs.ttft(o) == pytest.approx(0.010)
    assert bs.tpot(bs.ttft(o), o.end - o.sent, o.tokens) == pytest.approx((0.052 - 0.010) / 7)
    assert bs.tpot(0.01, 0.01, 1) is None
    run = bs.summarize([o], duration=0.052)
    assert run["itl_ms"]["p50"] == pytest.approx(5.0) and run["ttft_ms"]["p99"] == pytest.approx(10.0)
    assert run["output_tokens_per_s"] == pytest.approx(8 / 0.052, rel=1e-4) and run["failures"] == 0


def test_failures_error_missing_or_repeated_final_and_short_output():
    def outcome(tokens, finals=1, error=None):
        o = bs.Outcome(0, 4, 4, sent=0.0, chunks=[(0.01, tokens)] if tokens else [])
        for _ in range(finals):
            o.finish(0.02, reason="length")
        o.error = error
        return o

    cases = [outcome(4), outcome(4, error="internal: boom"), outcome(4, finals=0), outcome(4, finals=2), outcome(3)]
    assert [o.failure() is None for o in cases] == [True, False, False, False, False]
    run = bs.summarize(cases, duration=1.0)
    assert run["completed"] == 1 and run["failures"] == 4 and run["request_throughput"] == 1.0
    assert "internal: boom" in run["failure_examples"]


def test_poisson_arrivals_are_seeded_start_at_zero_and_have_the_rate():
    a = bs.poisson_arrivals(20000, rate=50.0, seed=3)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    np.testing.assert_array_equal(a, bs.poisson_arrivals(20000, rate=50.0, seed=3))
    assert not np.array_equal(a, bs.poisson_arrivals(20000, rate=50.0, seed=4))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: sd = mean
    with pytest.raises(ValueError):
        bs.poisson_arrivals(3, rate=0.0)


def test_request_lengths_fixed_uniform_and_file(tmp_path):
    assert bs.request_lengths("fixed", 3, 16, 8) == [(16, 8)] * 3
    u = bs.request_lengths("uniform", 500, 16, 8, seed=1)
    assert u == bs.request_lengths("uniform", 500, 16, 8, seed=1)
    assert {p for p, _ in u} == set(range(8, 25)) and {o for _, o in u} == set(range(4, 13))
    f = tmp_path / "lengths.jsonl"
    f.write_text('{"prompt_len": 5, "output_len": 3}\n\n{"prompt_len": 7, "output_len": 2}\n')
    assert bs.request_lengths(str(f), 3, 16, 8) == [(5, 3), (7, 2), (5, 3)]
    f.write_text('{"prompt_len": 5}\n')
    with pytest.raises(SystemExit, match="line 1"):
        bs.request_lengths(str(f), 3, 16, 8)


def test_prompts_come_from_the_draft_vocabulary(engine_dir, agreeing_pair):
    from muse_spark.builder.pair import draft_token_ids

    vocab = bs.draft_vocabulary(engine_dir)
    assert vocab == draft_token_ids(Path(agreeing_pair[1]).parent)
    works = bs.make_works(vocab, [(12, 4)] * 5, seed=0)
    assert all(len(w.prompt) == 12 and set(w.prompt) <= set(vocab) for w in works)
    assert len({w.seed for w in works}) == 5 and works == bs.make_works(vocab, [(12, 4)] * 5, seed=0)


# ---- runs -----------------------------------------------------------------------------------------
def test_inprocess_run_through_the_cli_writes_the_json_and_the_plot(engine_dir, tmp_path, capsys):
    out, copy, png = tmp_path / "results", tmp_path / "copy.json", tmp_path / "plot.png"
    args = ["--engine", engine_dir, "--mode", "inprocess", "--concurrency", "1,2", "--num-requests", 6,
            "--prompt-len", 16, "--output-len", 16, "--out-dir", out, "--json", copy, "--plot", png,
            "--torch-threads", 1]
    assert bench(*args) == 0
    captured = capsys.readouterr()
    doc = load_doc(out)
    assert json.loads(copy.read_text()) == doc
    assert doc["benchmark"] == "bench-serving" and doc["device"].startswith("cpu")
    assert doc["command"] == "muse-spark bench-serving " + " ".join(map(str, args))
    assert doc["config"]["concurrency"] == [1, 2] and doc["config"]["request_rate"] == [None]
    runs = doc["results"]["runs"]
    assert [(r["mode"], r["concurrency"], r["request_rate"]) for r in runs] == [("inprocess", 1, None),
                                                                                ("inprocess", 2, None)]
    check_runs(doc, [(16, 16)] * 6)
    assert "6/6 requests done" in captured.err  # progress
    assert "TTFT p50/p90/p99 ms" in captured.out and captured.out.count("inprocess") == 2  # the table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_target_only_baseline_and_a_long_prompt_into_running_streams(engine_dir, tmp_path):
    """inprocess-target-only: the same requests decoded by the target alone (one token a step, no draft
    accepted); --long-prompt: one long prompt sent into the running streams, its figures beside the run's
    (no timing is asserted: the figures are there and consistent)."""
    out = tmp_path / "results"
    assert bench("--engine", engine_dir, "--mode", "inprocess,inprocess-target-only", "--concurrency", 3,
                 "--num-requests", 6, "--prompt-len", 8, "--output-len", 20, "--long-prompt", 150,
                 "--out-dir", out, "--torch-threads", 1) == 0
    doc = load_doc(out)
    check_runs(doc, [(8, 20)] * 6)
    spec, base = doc["results"]["runs"]
    assert (spec["mode"], base["mode"]) == ("inprocess", "inprocess-target-only")
    assert base["mean_accepted_length"] == 1.0 and spec["mean_accepted_length"] > 1.0
    assert all(r["steps"] == r["output_len"] - 1 for r in base["requests"])  # one token per step after prefill
    for run in (spec, base):
        lp = run["long_prompt"]
        assert lp["prompt_len"] == 150 and lp["sent"] and lp["ttft_ms"] <= lp["served_ms"]
        assert lp["itl_during_ms"]["p50"] is not None and lp["itl_during_ms"]["p50"] <= lp["itl_during_ms"]["p99"]
    assert bench("--engine", engine_dir, "--num-requests", 2, "--long-prompt", 250, "--out-dir", tmp_path / "x") == 2


def test_poisson_run_with_lengths_from_a_file(engine_dir, tmp_path):
    lengths = tmp_path / "lengths.jsonl"
    rows = [(9, 5), (20, 12), (3, 1)]
    lengths.write_text("".join(json.dumps({"prompt_len": p, "output_len": o}) + "\n" for p, o in rows))
    out = tmp_path / "results"
    assert bench("--engine", engine_dir, "--concurrency", 2, "--request-rate", 200, "--num-requests", 6,
                 "--lengths", lengths, "--prompt-len", 1, "--output-len", 1, "--out-dir", out) == 0
    doc = load_doc(out)
    (run,) = doc["results"]["runs"]
    assert run["request_rate"] == 200 and run["client_wait_ms"]["p50"] >= 0
    check_runs(doc, (rows * 2)[:6])


def test_a_request_longer_than_the_engine_is_refused_before_any_run(engine_dir, tmp_path, capsys):
    assert bench("--engine", engine_dir, "--num-requests", 2, "--prompt-len", 200, "--output-len", 100,
                 "--out-dir", tmp_path) == 2
    assert "does not fit the engine's max_seq 256" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_triton_http_and_grpc_runs(engine_dir, tmp_path, capsys):
    from serving_utils import require_tritonserver

    require_tritonserver()  # skips, saying why, where tritonserver cannot run
    out = tmp_path / "results"
    assert bench("--engine", engine_dir, "--mode", "triton-http,triton-grpc", "--concurrency", 2, "--num-requests", 6,
                 "--prompt-len", 16, "--output-len", 16, "--out-dir", out, "--torch-threads", 1) == 0
    doc = load_doc(out)
    assert [r["mode"] for r in doc["results"]["runs"]] == ["triton-http", "triton-grpc"]
    check_runs(doc, [(16, 16)] * 6)
    err = capsys.readouterr().err
    assert "server ready" in err and "triton-grpc concurrency 2: 6/6 requests done" in err


def test_the_script_answers_help():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--request-rate" in r.stdout, r.stderr[-2000:]
