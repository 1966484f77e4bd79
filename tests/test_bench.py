"""The step benchmark (benchmarks/step.py, also `muse-spark bench`) on CPU at the tiny preset: its
sections, its result file in the common schema (benchmarks/results.py) and its report. Speed is
never asserted here; the figures come from the GPU runs in benchmarks/results/ (docs/performance.md)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import emitted_tokens, first_differing_columns, render_markdown  # noqa: E402  (benchmarks/)

from muse_spark.options import KernelOptions  # noqa: E402

# The current H200 runs (benchmarks/results/): batch 1 with eager and torch.compile, and batch 8 / 32
# with one split a program beside the default.
B1 = ROOT / "benchmarks" / "results" / "2026-12-05_nvidia-h200_de79651d7ad6_step.json"
B8_32 = ROOT / "benchmarks" / "results" / "2026-12-05_nvidia-h200_de79651d7ad6_step-2.json"


def result_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*_step*.json"))


def test_tiny_bench_runs_and_writes_a_result_in_the_schema_and_markdown(tmp_path):
    """`muse-spark bench` runs benchmarks/step.py: one result file in the common schema (date, device,
    commit, versions, the exact command, the options as config, the run's figures as results)."""
    out, md = tmp_path / "results", tmp_path / "b.md"
    args = ["--preset", "tiny", "--device", "cpu", "--batches", "1,2", "--context", "16", "--iters", "2",
            "--skip", "compile,aoti", "--out-dir", str(out), "--markdown", str(md)]
    subprocess.run([sys.executable, "-m", "muse_spark.cli", "bench", *args], check=True, cwd=tmp_path,
                   capture_output=True, text=True, timeout=300)
    (path,) = result_files(out)
    doc = json.loads(path.read_text())
    assert {"schema", "benchmark", "date", "device", "commit", "versions", "command", "config", "results"} <= set(doc)
    assert doc["benchmark"] == "step" and doc["device"].startswith("cpu") and doc["versions"]["torch"]
    assert doc["command"] == "muse-spark bench " + " ".join(args)
    assert doc["config"]["preset"] == "tiny" and doc["config"]["batches"] == [1, 2]
    assert path.name == f"{doc['date'][:10]}_{path.name.split('_')[1]}_{doc['commit'] or 'nogit'}_step.json"
    res = doc["results"]
    sec = res["sections"]
    assert res["command"] == doc["command"]
    assert set(sec["eager"]) == {"1", "2"} and all(v["median_ms"] > 0 for v in sec["eager"].values())
    assert sec["copy_bandwidth"]["GBps"] > 0
    for b in ("1", "2"):  # roofline = bytes / measured bandwidth
        want = sec["bytes_per_step"][b]["total"] / sec["copy_bandwidth"]["GBps"] / 1e6
        assert abs(sec["roofline_ms"][b] - want) < 1e-9
    assert set(sec["tokens_per_s"]["eager"]["1"]) == {"1.0", "3.7", "6.17"}
    assert "reference (eager ops)" in sec["markov"]["1"]
    for b in ("1", "2"):  # the weight GEMMs alone: every linear layer of both models but the Markov head's
        floor = sec["gemm_floor"][b]
        assert floor["median_ms"] > 0 and floor["gemms"] == 4 * 3 + 1 + 4 * 1 + 2  # 3 + 1 layers, lm_heads, fc
        assert floor["weight_bytes"] <= sec["bytes_per_step"][b]["weights"]
    text = md.read_text()
    assert "| 1 |" in text and "| 2 |" in text and res["command"] in text
    host = res["env"]["host"]  # what the host code ran on, to group runs by (no driver on CPU)
    assert host["kernel"] == platform.release() and host["cpus"] == os.cpu_count() and "driver" not in host
    assert 1 <= host["cpus_allowed"] <= host["cpus"]
    assert f"* Host: kernel {host['kernel']}, {host['cpu_model']}, {host['cpus_allowed']} of {host['cpus']} CPUs" in text
    assert res["config"]["aoti_order"] == "descending" and "captured and timed largest first" in text

    # The lines a GPU run adds when the aoti step and eager differ, or a recompile is skipped.
    sec["aoti_matches_eager"] = {"1": True, "2": False}
    sec["aoti_emits_as_eager"] = {"1": True, "2": True}
    sec["aoti_eager_differences"] = {"2": {"rows": 1, "entries": 3, "of_rows": 2, "of_entries": 12,
                                           "first_columns": {"draft[2]": 1}}}
    sec["torch_compile"] = {"skipped": "batches [2]: too late"}
    text = render_markdown(res)
    assert "B=1: True, B=2: False" in text
    assert "Emitted tokens (accepted drafts + bonus) equal to the eager step's: B=1: True, B=2: True." in text
    assert "At B=2, 1 of 2 rows differ (3 of 12 step-output entries); first differing column per row: " \
           "draft[2] (1)." in text
    assert "torch.compile not measured for batches [2]: too late." in text


def test_differing_columns_name_where_a_step_diverged():
    want = torch.tensor([[5, 6, 7, 2, 9], [1, 2, 3, 3, 4], [1, 2, 3, 1, 8]])
    got = want.clone()
    got[0, 1] = 0  # a draft token: the draft diverged (later columns may follow)
    got[0, 3] = 0
    got[2, 4] = 0  # same drafts, another bonus
    assert first_differing_columns(got, want) == {"draft[1]": 1, "bonus": 1}
    assert first_differing_columns(want, want) == {}


def test_emitted_tokens_are_the_accepted_drafts_and_the_bonus():
    packed = torch.tensor([[5, 6, 7, 2, 9], [1, 2, 3, 0, 4], [1, 2, 3, 3, 8]])  # γ = 3
    assert emitted_tokens(packed) == [[5, 6, 9], [4], [1, 2, 3, 8]]
    other = packed.clone()
    other[1, 1] = 0  # a draft past the accepted ones: emitted tokens unchanged
    assert emitted_tokens(other) == emitted_tokens(packed)
    other[0, 0] = 0  # an accepted draft
    assert emitted_tokens(other) != emitted_tokens(packed)


def test_batches_option_takes_a_comma_separated_list():
    import argparse

    from timing import batch_list

    assert batch_list("1,8,32") == [1, 8, 32] and batch_list("4") == [4]
    for bad in ("1 8", "1,x", "0", "", "2,-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated positive batch sizes"):
            batch_list(bad)


def test_slower_in_graph_ranks_kernels_by_their_growth():
    from timing import slower_in_graph

    plain = {"all": {"gemm": [4, 2.0], "norm": [8, 0.1], "gone": [1, 0.5]}}
    replay = {"all": {"gemm": [4, 2.05], "norm": [8, 0.4], "new": [2, 0.2]}}
    rows = slower_in_graph(plain, replay, top=2)
    assert rows == [["norm", 8, 0.1, 0.4], ["new", 2, 0.0, 0.2]]


def test_device_gaps_sums_the_holes_between_events_per_pair_and_per_call():
    """Two calls of a three-kernel step (us): the holes between a kernel's end and the next
    one's start, per call, ranked by (previous, next) pair; overlapping events count no hole."""
    from timing import device_gaps

    spans = [["gemm", 0, 10], ["norm", 12, 13], ["attn", 13, 20],  # holes 2, 0
             ["gemm", 24, 34], ["norm", 40, 41], ["attn", 40.5, 45]]  # hole 4 after call 1; 6, then overlap
    got = device_gaps(list(reversed(spans)), calls=2, top=2)
    assert got["idle_ms"] == pytest.approx((2 + 0 + 4 + 6 + 0) / 2 / 1e3)
    assert got["gaps"] == [{"after": "gemm", "before": "norm", "count": 1.0, "ms": pytest.approx(0.004)},
                           {"after": "attn", "before": "gemm", "count": 0.5, "ms": pytest.approx(0.002)}]


def test_the_interleaved_replays_and_the_idle_time_render():
    """The step graphs timed in turns, each replay's idle time and the host's time to issue a
    step, in the markdown."""
    result = json.loads(B1.read_text())["results"]  # a run's other fields
    sec = result["sections"]
    sec["aoti_interleaved_replay"] = {"1": {"aoti": 5.6, "aoti no_rope_table": 5.46}}
    sec["aoti_host_issue_us"] = {"1": {"step": 61.4, "replay": 18.2},  # (a run before the copies-then-launch split)
                                 "8": {"step": 230.6, "replay": 29.0, "fill_replay": 180.4, "fill_sync_replay": 62.5},
                                 "32": {"step": 298.9, "replay": 50.1, "fill_replay": 185.3, "fill_sync_replay": 261.0,
                                        "fill_sync": 91.2}}
    sec["aoti_fill_replay"] = {"8": {"then": {"median_ms": 5.4127}, "after_sync": {"median_ms": 5.3004}}}
    sec["aoti_context_stream"] = {"1": {"equals": True, "side_replay": {"median_ms": 5.25}, "serial_replay": {
        "median_ms": 5.31}, "host_issue_us": {"side_fill_replay": 185.3, "serial_fill_replay": 61.0}}}
    sec["aoti_runner_profile"] = {"1": {"kernel_ms": 5.41, "idle_ms": 0.25, "gaps": [], "calls": 3,
                                        "beyond_replay": {"Memcpy DtoD (Device -> Device)": [5.0, 0.0061]}}}
    sec["aoti_replay_profile"] = {"1": {"idle_ms": 0.121}}
    sec["variants"] = {"no_rope_table": {"options": {"rope_table": False}, "compiled": [],
                                      "aoti_replay_profile": {"1": {"idle_ms": 0.25}}}}
    text = render_markdown(result)
    assert ("Step graphs replayed in turns, batch 1 (median of the rounds' medians): `aoti` 5.600 ms, "
            "`aoti no_rope_table` 5.460 ms (0.975×).") in text
    assert ("The runner's step, batch 1 (torch.profiler, 3 calls back to back): 5.410 ms of device events and "
            "0.250 ms idle a call; events beyond the bare replay's: `Memcpy DtoD (Device -> Device)` ×5 6.1 µs.") \
        in text
    assert ("Host time to issue (median, the device idle at the call): B=1: the runner's step 61 µs, "
            "the replay alone 18 µs, B=8: the runner's step 231 µs, the replay alone 29 µs, the input copies then "
            "the replay 180 µs (after waiting for the copies 62 µs), B=32: the runner's step 299 µs, the replay "
            "alone 50 µs, the input copies then the replay 185 µs (after waiting for the copies 261 µs; the copies "
            "and that wait alone 91 µs).") in text
    assert ("Draft context on a second stream (the default on CUDA), batch 1: replay 5.250 ms; in line on one "
            "stream 5.310 ms (greedy step equal: True); the host's time to issue the input copies and the launch: "
            "185 µs, in line 61 µs.") in text
    assert ("The input copies and the replay as the device sees them, batch 8 (CUDA events): launched right after "
            "the copies 5.413 ms, after the host waited for them 5.300 ms.") in text
    assert "Device idle between the events of a replay (torch.profiler): `aoti` B=1 0.121 ms, " \
           "`aoti no_rope_table` B=1 0.250 ms." in text
    assert "* Kernel options" not in text  # a run from before the options were recorded
    result["config"]["options"] = dict(KernelOptions().to_dict(), attention="sdpa", rope_table=False)
    assert "* Kernel options: `attention=sdpa`, `rope_table=False` (the others the defaults)." in render_markdown(result)
    assert "### Variant `no_rope_table` (rope_table=False), beside the default aoti step" in text


def test_the_variants_are_compiled_and_timed_beside_the_default(tmp_path):
    """``--pdl both``: the variant's own set of step packages compiled under its kernel options (pdl off: PDL is
    the default) in the workers (its own folder), checked against the eager step under the same options and
    timed after the default; its table in the markdown. (On CPU every variant takes the reference kernels and no
    graph: this checks the plumbing, which every variant shares, with one of them — each variant's options are
    checked below; the GPU runs give the figures.)"""
    out, md, work = tmp_path / "results", tmp_path / "b.md", tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step.py"), "--preset", "tiny", "--device", "cpu",
           "--batches", "1", "--context", "16", "--iters", "2", "--skip", "compile",
           "--pdl", "both", "--work-dir", str(work),
           "--out-dir", str(out), "--markdown", str(md)]
    # the run's options: the defaults (the test run's build cache kept)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUSE_SPARK_") or k == "MUSE_SPARK_BUILD_CACHE"}
    subprocess.run(cmd, check=True, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    (path,) = result_files(out)
    res = json.loads(path.read_text())["results"]
    sec = res["sections"]
    assert res["config"]["options"] == KernelOptions().to_dict()  # the run's, recorded
    assert "aoti_errors" not in sec and "aoti_error" not in sec, (sec.get("aoti_errors"), sec.get("aoti_error"))
    assert sec["aoti"]["1"]["median_ms"] > 0 and sec["aoti_matches_eager"]["1"] is True  # the default's own
    assert sec["aoti_chained"]["1"]["steps"] == 8 and sec["aoti_chained"]["1"]["median_ms"] > 0  # the Generator's form
    text = md.read_text()
    assert "aoti steps chained as the Generator runs them" in text and "* Kernel options: the defaults." in text
    assert sorted(sec["variants"]) == ["no_pdl"]  # (only the one asked for)
    for name, field, value in (("no_pdl", "pdl", False),):
        sub = sec["variants"][name]
        assert sub["options"] == {field: value}
        assert sorted(sub["compiled"]) == ["step_context_b1", "step_draft_b1", "step_layer_b1", "step_verify_b1"], \
            (name, sub.get("aoti_errors"))
        assert {p.name for p in (work / name).glob("*.pt2")} == {f"{n}.pt2" for n in sub["compiled"]}
        assert "1" in sub.get("aoti", {}), (name, sub.get("aoti_error"), sub.get("aoti_errors"))
        assert sub["aoti"]["1"]["median_ms"] > 0 and sub["aoti_matches_eager"]["1"] is True
        assert "aoti_pdl" not in sub  # graph edges: CUDA only
        assert f"### Variant `{name}` ({field}={value}), beside the default aoti step" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 | ") and line.endswith("| True |")]
    assert len(rows) == 1 and all(len(row.split("|")) == 10 for row in rows)

    # Run again into another folder: every package, the default's and the variant's, from the build cache
    again = [c if c != str(work) else str(tmp_path / "again") for c in cmd]
    again[again.index(str(out))] = str(tmp_path / "results-again")
    subprocess.run(again, check=True, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    (path,) = result_files(tmp_path / "results-again")
    sec = json.loads(path.read_text())["results"]["sections"]
    assert sec["aoti_cached"] == ["step_context_b1", "step_draft_b1", "step_layer_b1", "step_verify_b1"]
    assert sec["aoti_matches_eager"]["1"] is True and sec["variants"]["no_pdl"]["aoti_matches_eager"]["1"] is True


def test_every_variant_has_its_option_and_changes_kernel_options():
    """Each bench variant (VARIANTS) is asked for by a ``--<option> both`` the parser knows (its name, or
    VARIANT_OPTION's), off by default, and changes KernelOptions fields to values they take, each away
    from the default (a variant equal to the default would time the default twice)."""
    import argparse
    import dataclasses

    import step as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    defaults = p.parse_args([])
    fields = {f.name for f in dataclasses.fields(KernelOptions)}
    for name, overrides in bench.VARIANTS.items():
        option = bench.VARIANT_OPTION.get(name, name)
        assert getattr(defaults, option) == "off", name
        flag = "--" + option.replace("_", "-")
        assert getattr(p.parse_args([flag, "both"]), option) == "both", name
        assert overrides and set(overrides) <= fields, (name, overrides)
        opts = bench.variant_options(name)  # KernelOptions refuses a value its field does not take
        assert opts.changed() == overrides, (name, overrides)
        assert KernelOptions.from_dict(opts.to_dict()) == opts  # what a compile job carries
    assert bench.VARIANTS["attention_one_split"] == {"attention_splits": 1}
    base = KernelOptions(attention="sdpa")  # a variant keeps the run's other options
    assert bench.variant_options("no_pdl", base) == KernelOptions(attention="sdpa", pdl=False)


def test_a_jobs_options_reach_the_worker_and_leave_the_environment_alone(tmp_path, monkeypatch):
    """A compile job carries its kernel options as a dict (``job["options"]``); the worker traces under
    them (``current_options`` inside the job, in the options' own Inductor cache) and no ``MUSE_SPARK_*``
    variable is read or set: the job's options are not the environment's, and after the job (the next
    one a worker takes, or a failed one) the environment and the options are as before. A job that
    still names ``env`` is refused."""
    from muse_spark.builder import aoti
    from muse_spark.options import current_options

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("MUSE_SPARK_ATTENTION_CACHE", "1")  # not the job's: a job never reads the environment
    before = dict(os.environ)
    ours = {k: v for k, v in before.items() if k.startswith("MUSE_SPARK_")}  # (the run's: its build cache, this one)
    seen = []

    def fake_compile(job):
        seen.append((current_options(), {k: v for k, v in os.environ.items() if k.startswith("MUSE_SPARK_")},
                     os.environ["TORCHINDUCTOR_CACHE_DIR"]))
        if job.get("fail"):
            raise RuntimeError("a failed compile")
        return {"name": job["name"]}

    monkeypatch.setattr(aoti, "_compile_job", fake_compile)
    opts = KernelOptions(attention_cache=False, pdl=False, attention_splits=1)
    assert aoti.compile_job({"name": "step_layer_b1", "options": opts.to_dict()}) == {"name": "step_layer_b1"}
    assert seen[-1] == (opts, ours, aoti.variant_cache_dir(opts)) and ours["MUSE_SPARK_ATTENTION_CACHE"] == "1"
    assert dict(os.environ) == before and current_options() == KernelOptions()
    aoti.compile_job({"name": "step_draft_b1"})  # the next job, without options: the defaults, Inductor's cache
    assert seen[-1] == (KernelOptions(), ours, str(tmp_path / "inductor"))
    with pytest.raises(RuntimeError, match="a failed compile"):
        aoti.compile_job({"name": "step_verify_b1", "options": opts.to_dict(), "fail": True})
    assert seen[-1][0] == opts and dict(os.environ) == before and current_options() == KernelOptions()
    with pytest.raises(RuntimeError, match=r"job\['options'\]"):
        aoti.compile_job({"name": "step_verify_b1", "env": {"MUSE_SPARK_PDL": "0"}})


def test_a_variant_compiles_in_its_own_inductor_cache_and_a_torn_package_is_refused(tmp_path, monkeypatch):
    """Variants whose options change nothing in a graph (PDL on CPU) generate the default's very
    code; compiled at once in one Inductor cache, AOTI packaged a ``_metadata.json`` another worker
    was rewriting (an empty JSON: the package failed to load, in CI). Each set of options compiles
    in a folder of its own (the defaults in Inductor's own), and a package with a JSON member that
    does not parse is refused at build time, naming the member."""
    import zipfile

    from muse_spark.builder.aoti import check_package, variant_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert variant_cache_dir(KernelOptions()) is None
    dirs = {variant_cache_dir(KernelOptions(**o)) for o in ({"pdl": False}, {"pdl_trigger": False},
                                                            {"rope_table": False}, {"attention_splits": 1})}
    assert len(dirs) == 4 and all(os.path.dirname(d) == str(tmp_path / "inductor") for d in dirs)
    assert variant_cache_dir(KernelOptions(pdl=False)) == variant_cache_dir(KernelOptions(pdl=False))  # reused
    good, torn = tmp_path / "good.pt2", tmp_path / "torn.pt2"
    for path, meta in ((good, b'{"AOTI_DEVICE_KEY": "cpu"}'), (torn, b"")):
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("model/data/aotinductor/model/c1_metadata.json", meta)
            z.writestr("model/data/aotinductor/model/c1.wrapper.so", b"\0")
    check_package(good)
    with pytest.raises(RuntimeError, match="c1_metadata.json is not valid JSON"):
        check_package(torn)


def test_the_h200_splits_run_renders_with_its_pdl_lines_and_a_clear_markov_flag_is_no_failure():
    """The current batch-8/32 H200 run renders: the variant's table and its PDL edge/port lines; the Markov
    kernel's error flag 0 is not listed as a failure, a set flag is."""
    result = json.loads(B8_32.read_text())["results"]
    text = render_markdown(result)
    assert "### Variant `attention_one_split` (MUSE_SPARK_ATTENTION_SPLITS=1), beside the default aoti step" in text
    assert "* B=32: 153 edges programmatic (graph of 397 kernels). Replay: programmatic port 14.339 ms" in text
    assert "Failures in this run" not in text
    result["sections"]["aoti_markov_error_flag"] = {"8": 1}
    assert "* `aoti_markov_error_flag`: {'8': 1}" in render_markdown(result)


def test_the_step_in_turns_is_rendered_against_the_copy_timed_in_the_same_rounds():
    """The current batch-1 H200 run renders its graphs timed in turns and, with the copy timed in the same
    rounds (``in_turns``), that roofline and the default graph's ratio to it."""
    result = json.loads(B1.read_text())["results"]
    text = render_markdown(result)
    assert ("Step graphs replayed in turns, batch 1 (median of the rounds' medians): `aoti` 5.205 ms, "
            "`aoti serial_context` 5.269 ms (1.012×).") in text
    assert ("The copy timed in the same rounds: 4157 GB/s, so a roofline of 4.29 ms and the default step graph "
            "at **1.214×** it") in text
    del result["sections"]["in_turns"]
    assert "The copy timed in the same rounds" not in render_markdown(result)


def test_interleaved_replays_time_the_copy_in_the_same_rounds_and_give_the_ratio():
    """``Bench.interleaved_replays`` times every kept step graph and the roofline's copy in each round:
    ``aoti_interleaved_replay`` holds each graph's median, ``in_turns`` the copy's GB/s, the
    roofline from the step's bytes, and the default graph's ratio to it; the graphs are released.
    (On CPU with plain callables standing for the graphs' replays: the GPU run gives the figures.)"""
    import types

    import torch

    from step import Bench

    bench = Bench.__new__(Bench)
    bench.device, bench.a, logged = torch.device("cpu"), types.SimpleNamespace(iters=2), []
    bench.log = logged.append
    x = torch.randn(1 << 16)

    def graph(reps):
        return types.SimpleNamespace(graph=types.SimpleNamespace(replay=lambda: [x.sum() for _ in range(reps)]))

    bench.replays = {1: {"aoti": graph(1), "aoti no_pdl": graph(3)}}
    sec = {"bytes_per_step": {1: {"total": 4_000_000}}}
    bench.interleaved_replays(sec, rounds=3, copy_gib=1 / 1024)
    got, turns = sec["aoti_interleaved_replay"][1], sec["in_turns"][1]
    assert set(got) == {"aoti", "aoti no_pdl"} and all(ms > 0 for ms in got.values())
    assert turns["copy_GBps"] > 0
    assert turns["roofline_ms"] == pytest.approx(4_000_000 / turns["copy_GBps"] / 1e6)
    assert turns["aoti_replay_over_roofline"] == pytest.approx(got["aoti"] / turns["roofline_ms"])
    assert bench.replays == {} and "copy in the same rounds" in logged[-1]


def test_the_step_benchmark_times_a_made_pair(tmp_path):
    """`--pair DIR` times that checkpoint pair (a make-pair folder) instead of the preset's random weights."""
    from muse_spark.builder.pair import make_pair

    make_pair(tmp_path / "pair", "tiny", acceptance=0.8)
    out = tmp_path / "results"
    subprocess.run([sys.executable, "-m", "muse_spark.cli", "bench", "--pair", str(tmp_path / "pair"), "--device",
                    "cpu", "--batches", "1", "--context", "16", "--iters", "2", "--skip", "compile,aoti",
                    "--out-dir", str(out)], check=True, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    (path,) = result_files(out)
    doc = json.loads(path.read_text())
    assert doc["config"]["pair"] == str(tmp_path / "pair")
    assert doc["results"]["config"]["target"]["vocab_size"] == 259 and doc["results"]["config"]["gamma"] == 5
    assert doc["results"]["sections"]["eager"]["1"]["median_ms"] > 0
