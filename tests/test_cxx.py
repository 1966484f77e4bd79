"""The C++ embedding (cxx/): built with CMake against this torch, run on the aoti engine the CLI built.

Its tokens must be the Python runtime's over the same engine, token for token (greedy, and sampled
given the same seeds), with in-flight batching (more requests than slots, a prompt of two chunks),
streaming, stop ids, a bad request that fails alone, and the manifest's confidence schedule; it must
refuse what the Python runtime refuses, with the same reasons (where Python checks the manifest, the
same message); and its benchmark program must run on the CPU engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from muse_spark.builder.embedder import DERIVED_FILE, EMBEDDING_VERSION, embedding_section
from muse_spark.config import MuseSpark1xConfig
from muse_spark.engine_format import EngineError
from muse_spark.runtime import Generator, RequestError, SamplingParams, load_engine
from muse_spark.graphs.parts import LAYOUT, torch_dtype
from muse_spark.runtime.engine import build_modules

from conftest import AOTI_MAX_BATCH, AOTI_MAX_SEQ, ENGINE_PROMPTS, random_state_dict, small_configs
from cxx_utils import cxx, cxx_generate, finals, info, python_generate, same_as_python

ROOT = Path(__file__).resolve().parents[1]
# One request more than the engine's slots (the last joins when one leaves); one of two prompt chunks.
PROMPTS = ENGINE_PROMPTS
assert len(PROMPTS) > AOTI_MAX_BATCH and max(map(len, PROMPTS)) > 128


@pytest.fixture(scope="module")
def engine(aoti_built):
    return load_engine(aoti_built[0])


# ---- the build ------------------------------------------------------------------------------------
def test_the_library_names_the_layout_and_torch_of_this_runtime(cxx_build):
    got = info(cxx_build)
    assert got == {"package_layout": LAYOUT, "embedding_version": EMBEDDING_VERSION, "torch": torch.__version__,
                   "checks_hashes": got["checks_hashes"]}
    if not got["checks_hashes"]:
        pytest.skip("this machine has no OpenSSL libcrypto to build the hash check with (the tokens are tested)")


def test_a_build_without_openssl_opens_engines_only_unchecked(cxx_build, aoti_built, tmp_path_factory):
    """Without libcrypto the library still builds; it refuses to open an engine with its hashes unchecked
    unless told to (--no-verify), and then gives the same tokens."""
    from cxx_utils import build_cxx

    bare = build_cxx(tmp_path_factory, "-DCMAKE_DISABLE_FIND_PACKAGE_OpenSSL=ON")
    assert info(bare)["checks_hashes"] is False
    r = cxx(bare, "--engine", aoti_built[0], "--prompt-ids", "1,2,3")
    assert r.returncode == 2 and "cannot check the engine files' hashes" in r.stderr and "--no-verify" in r.stderr
    assert (finals(cxx_generate(bare, aoti_built[0], PROMPTS[:2], max_tokens=12))
            == finals(cxx_generate(cxx_build, aoti_built[0], PROMPTS[:2], max_tokens=12)))


# ---- the same tokens as the Python runtime ----------------------------------------------------------
@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.9, 7), (1.3, 2**64 - 5)],
                         ids=["greedy", "sampled", "sampled_seed_past_int64"])
def test_tokens_equal_the_python_runtime(cxx_build, aoti_built, engine, temperature, seed):
    """Four requests on three slots (the last joins when one leaves), one prompt of two chunks."""
    lines = cxx_generate(cxx_build, aoti_built[0], PROMPTS, max_tokens=30, temperature=temperature, seed=seed)
    reqs = python_generate(engine, PROMPTS, max_tokens=30, temperature=temperature, seed=seed, ignore_eos=True)
    same_as_python(lines, reqs)
    assert all(len(r.output) == 30 for r in reqs)
    assert sum(len(r.steps) for r in reqs) > len(reqs)  # speculative steps ran (not the prefill alone)


def test_the_confidence_head_comes_out_per_step(cxx_build, aoti_built, agreeing_engine):
    """The draft package's confidence head values, γ per speculative step: the eager engine's for the same
    steps (greedy: the same tokens and drafts), within the compute dtype's tolerance."""
    from tolerances import TOL

    lines = finals(cxx_generate(cxx_build, aoti_built[0], PROMPTS[:2], max_tokens=24))
    reqs = Generator(agreeing_engine).generate(PROMPTS[:2], SamplingParams(max_tokens=24, ignore_eos=True))
    tol = TOL[agreeing_engine.target.dtype]
    for line, r in zip(lines, reqs):
        assert line["output_ids"] == r.output and len(line["confidence"]) == line["steps"] == len(r.steps) > 1
        for mine, step in zip(line["confidence"], r.steps):
            assert len(mine) == 5 and mine == pytest.approx(step.confidence, rel=tol["rtol"], abs=tol["atol"])


def test_stop_ids_and_eos_end_requests_as_in_python(cxx_build, aoti_built, engine):
    ref = python_generate(engine, PROMPTS, max_tokens=40, ignore_eos=True)
    stop = ref[0].output[5]  # a token request 0 emits mid-way: it stops there
    lines = cxx_generate(cxx_build, aoti_built[0], PROMPTS, max_tokens=40, stop=[stop], ignore_eos=False)
    reqs = python_generate(engine, PROMPTS, max_tokens=40, stop_token_ids=(stop,))
    same_as_python(lines, reqs)
    assert reqs[0].finish_reason == "stop" and reqs[0].output[-1] == stop and len(reqs[0].output) <= 6


def test_streamed_chunks_add_up_to_each_output(cxx_build, aoti_built):
    lines = cxx_generate(cxx_build, aoti_built[0], PROMPTS, max_tokens=20, temperature=0.8, seed=3, stream=True)
    chunks = [x for x in lines if "tokens" in x]
    for x in finals(lines):
        mine = [c["tokens"] for c in chunks if c["request"] == x["request"]]
        assert len(mine[0]) == 1  # the prefill's token streams at once
        assert sum(mine, []) == x["output_ids"]
        assert len(mine) == x["steps"] + 1


def test_a_bad_request_fails_alone(cxx_build, aoti_built, engine):
    """An out-of-vocabulary prompt and one too long for the engine: each finishes with Python's reason;
    the requests around them get the tokens they get without them."""
    vocab = engine.tcfg.vocab_size
    too_long = [5] * (engine.max_seq - 10)
    good = [PROMPTS[0], PROMPTS[2]]
    lines = finals(cxx_generate(cxx_build, aoti_built[0], [good[0], [1, vocab + 3], too_long, good[1]],
                                max_tokens=20))
    alone = finals(cxx_generate(cxx_build, aoti_built[0], good, max_tokens=20))
    assert [lines[0], lines[3]] == [dict(alone[0], request=0), dict(alone[1], request=3)]
    gen = Generator(engine)
    for line, prompt in ((lines[1], [1, vocab + 3]), (lines[2], too_long)):
        with pytest.raises(RequestError) as e:
            gen.validate(prompt, SamplingParams(max_tokens=20))
        assert line["finish_reason"] == "error" and line["output_ids"] == []
        assert line["error"] == f"RequestError: {e.value}"


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_requests_arriving_and_cancelled_over_time_as_in_python(cxx_build, aoti_built, engine, monkeypatch,
                                                                temperature):
    """The Generator API: requests join at later scheduler iterations (one waits for a slot), one is
    cancelled mid-run, one before it was admitted; the Python Generator driven the same way (unchained,
    as the C++ one steps) gives the same tokens, finish reasons and steps."""
    arrivals, cancels = [0, 0, 3, 5], [(1, 4), (3, 5)]
    args = ["--arrivals", ",".join(map(str, arrivals))]
    for i, k in cancels:
        args += ["--cancel", f"{i}@{k}"]
    lines = cxx_generate(cxx_build, aoti_built[0], PROMPTS, max_tokens=30, temperature=temperature, seed=11,
                         stream=True, extra=args)
    monkeypatch.setattr(engine, "options", dataclasses.replace(engine.options, chained_steps=False))
    gen, reqs, k = Generator(engine), [None] * len(PROMPTS), 0
    params = SamplingParams(max_tokens=30, temperature=temperature, seed=11, ignore_eos=True)
    while k <= max(arrivals + [c[1] for c in cancels]) or gen.has_work():
        for i, p in enumerate(PROMPTS):
            if arrivals[i] == k:
                reqs[i] = gen.add(p, params)
        for i, when in cancels:
            if when == k:
                gen.cancel(reqs[i])
        if gen.has_work():
            gen.step()
        k += 1
    same_as_python(lines, reqs)
    assert [r.finish_reason for r in reqs] == ["length", "cancelled", "length", "cancelled"]
    assert 0 < len(reqs[1].output) < 30 and reqs[3].output == []
    for x in finals(lines):
        assert sum((c["tokens"] for c in lines if "tokens" in c and c["request"] == x["request"]), []) == x["output_ids"]


def test_bad_arguments_get_the_usage(cxx_build, aoti_built):
    for args in (["--engine", aoti_built[0]], ["--engine", aoti_built[0], "--prompt-ids", "1,x"], ["--bogus"],
                 ["--engine", aoti_built[0], "--prompt-ids", "1", "--arrivals", "0,1"],
                 ["--engine", aoti_built[0], "--prompt-ids", "1", "--cancel", "3@1"]):
        r = cxx(cxx_build, *args)
        assert r.returncode == 64 and "usage: muse_spark_generate" in r.stderr


# ---- refusals -------------------------------------------------------------------------------------
def edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(m, dst)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _flip(d: Path, name: str) -> None:
    data = bytearray((d / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / name).write_bytes(bytes(data))


REFUSALS = {
    "another_torch": (lambda m, d: m["versions"].update(torch="2.11.0+cu130"),
                      r"compiled with torch 2\.11\.0\+cu130, this runtime has torch"),
    "a_changed_package": (lambda m, d: _flip(d, "step_layer_b3.pt2"),
                          r"step_layer_b3\.pt2 does not match the manifest's hash"),
    "changed_derived_weights": (lambda m, d: _flip(d, DERIVED_FILE),
                                r"derived\.safetensors does not match the manifest's hash"),
    "a_missing_file": (lambda m, d: (d / "step_verify_b3.pt2").unlink(), r"engine file step_verify_b3\.pt2 is missing"),
    "an_older_layout": (lambda m, d: m["aoti"].update(layout="layered-4"),
                        r"built by another muse-spark \(the packages' layout 'layered-4'"),
    "no_embedding_section": (lambda m, d: m.pop("embedding"), r"lacks its 'embedding' section"),
    "a_tensor_parallel_engine": (lambda m, d: m.update(tensor_parallel={"world": 2, "target_files": []}),
                                 r"split for 2 tensor-parallel ranks \(built with --tp\): the C\+\+ embedding runs"),
    "an_eager_engine": (lambda m, d: m.update(backend="eager"), r"backend 'eager' is not an aoti engine"),
    "a_cuda_engine": (lambda m, d: m["device"].update(kind="cuda", compute_capability=[9, 0]),
                      r"compiled for 'cuda' and cannot run on 'cpu'|no CUDA device is available"),
    "another_schema": (lambda m, d: m.update(schema_version=2), r"schema version 2 is not supported"),
    "a_malformed_section": (lambda m, d: m["embedding"].pop("weight_sources"), r"the manifest is malformed"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refuses_an_engine_it_cannot_run(cxx_build, aoti_built, tmp_path, case):
    edit, why = REFUSALS[case]
    checked = info(cxx_build)["checks_hashes"]
    if "hash" in why and not checked:
        pytest.skip("this build has no hash check (no OpenSSL libcrypto here)")
    d = edited(aoti_built[0], tmp_path / "e", edit)
    r = cxx(cxx_build, "--engine", d, "--prompt-ids", "1,2,3", *([] if checked else ["--no-verify"]))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and re.search(why, r.stderr), r.stderr


def test_refuses_more_slots_than_the_engine_has_and_a_manifest_that_is_not_one(cxx_build, aoti_built, tmp_path):
    r = cxx(cxx_build, "--engine", aoti_built[0], "--prompt-ids", "1", "--max-batch", AOTI_MAX_BATCH + 1)
    assert r.returncode == 2 and f"max_batch {AOTI_MAX_BATCH + 1} must be in [1, {AOTI_MAX_BATCH}]" in r.stderr
    (tmp_path / "manifest.json").write_text("[1, 2]")
    r = cxx(cxx_build, "--engine", tmp_path, "--prompt-ids", "1")
    assert r.returncode == 2 and f"{tmp_path}/manifest.json: not a Muse Spark engine manifest" in r.stderr, r.stderr
    (tmp_path / "manifest.json").write_text("{not json")
    r = cxx(cxx_build, "--engine", tmp_path, "--prompt-ids", "1")
    assert r.returncode == 2 and "manifest.json is not valid JSON" in r.stderr, r.stderr


def _replace_with_a_folder(d: Path, name: str) -> None:
    (d / name).unlink()
    (d / name).mkdir()


def _link_outside(m: dict, d: Path) -> None:
    os.symlink(d.parent, d / "out")  # (a link inside the directory to the folder that holds it)
    m["files"]["out/x.safetensors"] = "0" * 64


# Manifest fields the Python runtime's load_engine checks (engine_format.read_manifest, KernelOptions,
# check_plugins, AOTIEngine: its layout, Markov workspaces and schedule), each altered alone: the library
# refuses them with the very message Python raises.
PYTHON_REFUSALS = {
    "an_unknown_kernel_option": lambda m, d: m["options"].update(bogus=1),
    "a_kernel_choice_it_does_not_have": lambda m, d: m["options"].update(attention="flash"),
    "a_kernel_switch_not_a_bool": lambda m, d: m["options"].update(pdl=1),
    "a_negative_attention_split_count": lambda m, d: m["options"].update(attention_splits=-1),
    "kernel_options_not_a_dict": lambda m, d: m.update(options=[1]),
    "another_plugin_version": lambda m, d: m["plugins"].update(markov_sample=m["plugins"]["markov_sample"] + 1),
    "a_plugin_this_runtime_lacks": lambda m, d: m["plugins"].update(new_kernel=1),
    "an_unknown_schedule": lambda m, d: m.update(schedule={"mode": "sometimes"}),
    "a_schedule_threshold_past_1": lambda m, d: m.update(schedule={"mode": "confidence", "threshold": 1.5}),
    "a_fixed_schedule_of_an_uncompiled_width": lambda m, d: m.update(schedule={"mode": "fixed", "length": 3}),
    "a_schedule_without_narrower_widths": lambda m, d: (m.update(schedule={"mode": "confidence"}),
                                                        m["aoti"].update(verify_widths=[m["gamma"]])),
    "a_schedule_cost_table_with_a_zero": lambda m, d: m.update(schedule={"mode": "confidence", "cost_ms": {"3": [0]}}),
    "a_schedule_not_an_object": lambda m, d: m.update(schedule=[1]),
    "a_negative_fixed_length": lambda m, d: m.update(schedule={"mode": "fixed", "length": -1}),
    "no_markov_workspace_for_a_bucket": lambda m, d: m["aoti"]["markov_workspace_words"].pop("3"),
    "a_negative_markov_workspace": lambda m, d: m["aoti"]["markov_workspace_words"].update({"3": -1}),
    "no_layout": lambda m, d: m["aoti"].pop("layout"),
    "another_layout": lambda m, d: m["aoti"].update(layout="layered-4"),
    "a_file_up_the_tree": lambda m, d: m["files"].update({"../x.safetensors": "0" * 64}),
    "an_absolute_file": lambda m, d: m["files"].update({"/etc/passwd": "0" * 64}),
    "a_file_through_a_link_outside": _link_outside,
    "an_unhashed_tokenizer": lambda m, d: m.update(tokenizer="other.json"),
    "no_dtype": lambda m, d: m.pop("dtype"),
    "max_seq_not_an_integer": lambda m, d: m.update(max_seq=str(m["max_seq"])),
    "gamma_not_the_drafts_block_size": lambda m, d: m.update(gamma=m["gamma"] - 1),
    "max_batch_0": lambda m, d: m.update(max_batch=0),
    "max_seq_below_gamma_plus_2": lambda m, d: m.update(max_seq=3),
    "max_seq_past_the_targets_positions": lambda m, d: m.update(
        max_seq=m["target_config"]["max_position_embeddings"] + 1),
    "a_file_that_is_a_folder": lambda m, d: _replace_with_a_folder(d, "tokenizer_config.json"),
    "another_schema": lambda m, d: m.update(schema_version=2),
    "another_format": lambda m, d: m.update(format="onnx-model"),
}


@pytest.mark.parametrize("case", sorted(PYTHON_REFUSALS))
def test_refuses_what_the_python_runtime_refuses_with_its_message(cxx_build, aoti_built, tmp_path, case):
    d = edited(aoti_built[0], tmp_path / "e", PYTHON_REFUSALS[case])
    with pytest.raises((EngineError, ValueError)) as python:  # (OptionsError and the schedule's: ValueError)
        load_engine(d)
    r = cxx(cxx_build, "--engine", d, "--prompt-ids", "1,2,3", *([] if info(cxx_build)["checks_hashes"] else
                                                                 ["--no-verify"]))
    assert r.returncode == 2 and r.stderr == f"error: {python.value}\n", (str(python.value), r.stderr)


def test_refuses_a_confidence_schedule_for_a_draft_without_the_head(cxx_build, aoti_built, tmp_path):
    """AOTIEngine.set_schedule's refusal (the Python runtime meets this draft's config with its weights
    first: they hold a head the config does not have)."""
    d = edited(aoti_built[0], tmp_path / "e", lambda m, d: (m["draft_config"].update(enable_confidence_head=False),
                                                            m.update(schedule={"mode": "confidence"})))
    r = cxx(cxx_build, "--engine", d, "--prompt-ids", "1,2,3", *([] if info(cxx_build)["checks_hashes"] else
                                                                 ["--no-verify"]))
    assert r.returncode == 2 and r.stderr == (
        "error: schedule 'confidence' needs a draft with a confidence head (enable_confidence_head in its "
        "config.json); this draft has none\n"), r.stderr


SCHEDULES = {
    "fixed_2": {"mode": "fixed", "length": 2},
    "confidence": {"mode": "confidence", "threshold": 0.5},
    "confidence_cut_by_a_cost_table": {"mode": "confidence", "threshold": 0.05,
                                       "cost_ms": {"3": [5.0, 6.0, 7.0, 8.0, 9.0, 10.0]}},
    "confidence_with_a_flat_cost_table": {"mode": "confidence",
                                          "cost_ms": {"3": [10.0, 10.1, 10.1, 10.2, 10.2, 10.25]}},
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_manifests_schedule_is_followed_as_in_python(cxx_build, aoti_built, tmp_path, name):
    """An engine whose manifest holds a schedule (``muse-spark calibrate`` writes one): the library plans each
    step's verification width from that step's confidences, as AOTIEngine does for the steps the Python
    Generator does not chain (its chained steps plan from an earlier step's), and runs the narrower packages, so
    the tokens, steps and accepted drafts are those of Python's unchained steps, greedy and sampled; the fixed and
    cost-cut schedules do verify fewer."""
    d = edited(aoti_built[0], tmp_path / "e", lambda m, d: m.update(schedule=SCHEDULES[name]))
    scheduled = load_engine(d)
    scheduled.options = dataclasses.replace(scheduled.options, chained_steps=False)  # (each step's own plan)
    for temperature, seed in ((0.0, 0), (0.9, 7)):
        lines = cxx_generate(cxx_build, d, PROMPTS, max_tokens=30, temperature=temperature, seed=seed)
        reqs = python_generate(scheduled, PROMPTS, max_tokens=30, temperature=temperature, seed=seed, ignore_eos=True)
        same_as_python(lines, reqs)
        verified = [s.verified for r in reqs for s in r.steps]
        if name == "fixed_2":
            assert set(verified) == {2}
        elif name == "confidence_cut_by_a_cost_table":
            assert 2 in verified
        elif name == "confidence_with_a_flat_cost_table":
            assert set(verified) == {None}  # (the plain step: its width cannot pay for planning)


# ---- the benchmark program ----------------------------------------------------------------------------
def bench(build: Path, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    extra = [] if info(build)["checks_hashes"] else ["--no-verify"]
    return subprocess.run([str(build / "muse_spark_bench"), *map(str, args), *extra], capture_output=True,
                          text=True, timeout=timeout)


def test_the_benchmark_runs_on_the_cpu_engine(cxx_build, aoti_built, engine, tmp_path):
    """One JSON line per batch size the engine holds (a larger one is skipped, saying so), the same list in
    --json; its steps are those the Python runtime takes to generate N tokens from the benchmark's prompt
    (the rows are alike: every request takes every step), its tokens B·N. No timing is checked but > 0."""
    n, length, out = 24, 20, tmp_path / "bench.json"
    r = bench(cxx_build, "--engine", aoti_built[0], "--batches", f"1,{AOTI_MAX_BATCH},{AOTI_MAX_BATCH + 5}",
              "--max-tokens", n, "--prompt-len", length, "--warmup", 1, "--threads", 1, "--json", out)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"batch {AOTI_MAX_BATCH + 5} exceeds the engine's max_batch {AOTI_MAX_BATCH}: skipped" in r.stderr
    assert "did not all finish" not in r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert json.loads(out.read_text()) == lines and [x["batch"] for x in lines] == [1, AOTI_MAX_BATCH]
    prompt = [(7 + 31 * j) % engine.tcfg.vocab_size for j in range(length)]
    (ref,) = python_generate(engine, [prompt], max_tokens=n, ignore_eos=True)
    accepted = sum(s.accepted for s in ref.steps)
    for x in lines:
        assert {"batch", "step_ms_median", "step_ms_mean", "tokens_per_s", "steps", "accepted_per_step"} <= set(x)
        assert x["tokens_per_s"] > 0 and x["step_ms_median"] > 0 and x["step_ms_mean"] > 0
        assert x["steps"] == len(ref.steps) > 1 and x["tokens"] == x["batch"] * n
        assert x["accepted_per_step"] == pytest.approx(accepted / len(ref.steps), abs=1e-4)
    # (those steps are what N tokens take: the prefill's one, then each step's accepted drafts and bonus)
    emitted = [1 + sum(s.accepted + 1 for s in ref.steps[:k]) for k in range(len(ref.steps) + 1)]
    assert emitted[-2] < n <= emitted[-1]


def test_the_benchmark_refuses_bad_arguments(cxx_build, aoti_built, tmp_path):
    for args in (["--batches", "1,0"], ["--max-tokens", "0"], ["--warmup", "x"], ["--bogus"],
                 ["--prompt-len", AOTI_MAX_SEQ, "--max-tokens", 8]):
        r = bench(cxx_build, "--engine", aoti_built[0], *args)
        assert r.returncode == 64 and "usage: muse_spark_bench" in r.stderr, (args, r.stderr)
    r = bench(cxx_build, "--engine", tmp_path)
    assert r.returncode == 2 and "manifest.json is missing" in r.stderr


def test_refuses_a_directory_without_an_engine(cxx_build, tmp_path):
    r = cxx(cxx_build, "--engine", tmp_path / "nothing", "--prompt-ids", "1")
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = cxx(cxx_build, "--engine", tmp_path, "--prompt-ids", "1")
    assert r.returncode == 2 and "manifest.json is missing" in r.stderr


# ---- the manifest's embedding section (no C++) --------------------------------------------------
def test_the_embedding_section_names_what_the_python_runtime_feeds(aoti_built, engine):
    """Each weight source, read and cast, is the tensor the Python engine feeds its packages; the parts'
    weight indices are its LayeredStep's; the caches are its caches."""
    d = aoti_built[0]
    m = json.loads((d / "manifest.json").read_text())
    emb = m["embedding"]
    files = {name: load_file(str(d / name)) for name in {s[0] for s in emb["weight_sources"]}}
    assert set(files) == {"target.safetensors", "draft.safetensors", DERIVED_FILE}
    for (name, shape, dtype), (file, key), mine in zip(m["aoti"]["weights"], emb["weight_sources"], engine.weights,
                                                     strict=True):
        t = files[file][key].to(torch_dtype(dtype))
        assert list(t.shape) == shape and torch.equal(t, mine), name
    derived = set(files[DERIVED_FILE])
    assert derived and all(n.endswith(("g_attn", "g_ffn")) for n in derived)
    step = next(iter(engine.runners.values())).fn
    assert emb["head_weights"] == step.head_idx and emb["layer_weights"] == step.layer_idx
    assert emb["aux_layer_ids"] == sorted(step.aux_layer_ids)
    for which, k in (("target", engine.target_cache.k), ("draft", engine.draft_cache.k)):
        c = emb["caches"][which]
        assert c["layers"] == len(k) and c["shape"] == list(k[0].shape) and c["dtype"] == str(k[0].dtype)[6:]
    names = [w[0] for w in m["aoti"]["weights"]]
    pe = emb["prefill_embed"]
    assert names[pe["embedding"]] == "target.model.embed_tokens.weight"
    assert names[pe["norm"]] == "target.model.layers.0.self_attn.pre_qkv_proj_norm.weight"
    assert pe["eps"] == engine.tcfg.rms_norm_eps and pe["zero_centered"] == engine.tcfg.norm_zero_centered_gamma


def test_the_embedding_section_with_tied_embeddings_and_unweighted_norms(tmp_path):
    """No lm_head of its own (tied: the head reads the embedding, one source) and norms without weights
    (prefill_embed's norm is null); the residual gates' derived values are the modules'."""
    tcfg, dcfg = small_configs()
    tcfg = MuseSpark1xConfig.from_dict({**tcfg.to_dict(), "tie_word_embeddings": True, "norm_affine": False,
                                        "residual_multiplier": 0.75})
    dcfg = type(dcfg).from_dict({**dcfg.to_dict(), "norm_affine": False})
    target, draft = build_modules(tcfg, dcfg, random_state_dict(tcfg, 0), random_state_dict(dcfg, 1), tcfg.dtype,
                                  "cpu")
    emb = embedding_section(target, draft, tmp_path, cache_slots=3, max_seq=32)
    assert emb["prefill_embed"]["norm"] is None
    sources = [tuple(s) for s in emb["weight_sources"]]
    assert ("target.safetensors", "lm_head.weight") not in sources
    assert sources.count(("target.safetensors", "model.embed_tokens.weight")) == 1
    derived = load_file(str(tmp_path / DERIVED_FILE))
    layer = target.model.layers[1]
    assert torch.equal(derived["target.model.layers.1.g_attn"], layer.g_attn)
    assert torch.equal(derived["target.model.layers.1.g_attn"], 0.75 * layer.attn_residual_gate.float())
    assert emb["caches"]["target"] == {"layers": 3, "shape": [3, 32, 1, 8], "dtype": "float32"}


def test_the_cxx_step_benchmark_puts_the_library_beside_the_python_runtime(cxx_build, aoti_built, tmp_path):
    """benchmarks/cxx_step.py on the CPU engine: muse_spark_bench (with and without CUDA graphs: on a CPU
    engine both call the packages) and the Python runtime's Generator on the same workload, one row per
    batch size with the three runners' figures and the ratios; it exits 0 only where the C++ and Python
    runs took the same steps and accepted the same drafts. No timing is checked but > 0."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cxx_step

    rc = cxx_step.main(["--engine", str(aoti_built[0]), "--cxx-build", str(cxx_build), "--batches", f"1,{AOTI_MAX_BATCH}",
                        "--max-tokens", "12", "--prompt-len", "8", "--warmup", "1", "--threads", "1",
                        "--out-dir", str(tmp_path)])
    assert rc == 0
    (f,) = tmp_path.glob("*_cxx-step.json")
    doc = json.loads(f.read_text())
    assert doc["benchmark"] == "cxx-step" and doc["command"].startswith("python benchmarks/cxx_step.py")
    rows = doc["results"]["rows"]
    assert [r["batch"] for r in rows] == [1, AOTI_MAX_BATCH]
    for r in rows:
        for k in cxx_step.RUNNERS:
            assert r[k]["tokens"] == r["batch"] * 12 and r[k]["tokens_per_s"] > 0 and r[k]["steps"] > 1
        assert r["cxx"]["cuda_graphs"] is False and r["step_ratio"] > 0 and r["tokens_per_s_ratio"] > 0


def test_a_project_embeds_the_installed_library_with_find_package(cxx_build, aoti_built, engine, tmp_path):
    """`cmake --install` of the build, then cxx/examples/minimal (find_package(muse_spark_embed), one
    executable, docs/cxx.md) configured against the installed package and torch, built and run on the CPU
    engine: its greedy tokens are the Python runtime's."""
    from cxx_utils import _tool

    if not info(cxx_build)["checks_hashes"]:
        pytest.skip("this build cannot check engine hashes (no OpenSSL): the minimal program opens engines checked")
    cmake, prefix, build = _tool("cmake"), tmp_path / "prefix", tmp_path / "minimal"
    for cmd in ([cmake, "--install", cxx_build, "--prefix", prefix],
                [cmake, "-S", ROOT / "cxx" / "examples" / "minimal", "-B", build,
                 f"-DCMAKE_PREFIX_PATH={prefix};{torch.utils.cmake_prefix_path}"],
                [cmake, "--build", build, "-j", "2"]):
        r = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-3000:])
    r = subprocess.run([str(build / "minimal"), str(aoti_built[0]), "12"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (want,) = python_generate(engine, [[1, 2, 3, 4]], max_tokens=12, ignore_eos=True)
    assert [int(t) for t in r.stdout.split()] == want.output
