"""The kernel options (muse_spark/options.py): parsing and refusals, the scoped setter, the manifest
round trip, and an engine built with options other than the defaults running with them."""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import re
import threading
from pathlib import Path

import pytest
import torch

from muse_spark.options import (ATTENTION_KERNELS, LINEAR_KERNELS, SCOPES, SERVE_DRAIN_FILE_ENV, KernelOptions,
                                OptionsError, current_options, engine_options, use_options)

from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
SWITCHES = ["attention_cache", "rope_table", "accept_kernels", "pdl", "pdl_trigger", "pdl_gemm_trigger",
            "context_stream", "chained_steps"]


def env_of(name: str) -> str:
    return KernelOptions.__dataclass_fields__[name].metadata["env"]


# ---- the fields ----------------------------------------------------------------------------------
def test_every_option_has_a_type_a_default_a_variable_a_scope_and_a_doc():
    rows = KernelOptions.describe()
    assert [r["name"] for r in rows] == ["attention", "linear", "attention_cache", "rope_table",
                                         "attention_splits",
                                         "accept_kernels", "pdl", "pdl_trigger", "pdl_gemm_trigger",
                                         "context_stream", "chained_steps"]
    assert len({r["env"] for r in rows}) == len(rows)
    for r in rows:
        assert r["env"] == "MUSE_SPARK_" + r["name"].upper(), r
        assert r["scope"] in SCOPES and len(r["doc"]) > 80 and "session" not in r["doc"], r
        assert r["type"] in ("str", "bool", "int") and type(r["default"]).__name__ == r["type"], r
    assert {r["name"] for r in rows if r["scope"] == "run"} == {"context_stream", "chained_steps"}
    defaults = KernelOptions()
    assert (defaults.attention, defaults.linear, defaults.attention_splits) == ("triton", "triton", 0)
    assert all(getattr(defaults, name) is True for name in SWITCHES)  # every switch on by default
    assert SERVE_DRAIN_FILE_ENV == "MUSE_SPARK_SERVE_DRAIN_FILE"


def test_options_are_frozen_and_refuse_values_of_the_wrong_kind():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().pdl = False
    for bad in (dict(attention="flash"), dict(linear="TRITON"), dict(pdl=1), dict(rope_table="0"),
                dict(attention_splits=-1), dict(attention_splits=True), dict(attention_splits=1.0)):
        with pytest.raises(OptionsError, match=f"kernel option {next(iter(bad))}="):
            KernelOptions(**bad)
    assert issubclass(OptionsError, ValueError)


# ---- the environment -----------------------------------------------------------------------------
def test_from_env_without_variables_gives_the_defaults():
    assert KernelOptions.from_env({}) == KernelOptions()
    assert KernelOptions.from_env({"MUSE_SPARK_SERVE_DRAIN_FILE": "/x", "OTHER": "1"}) == KernelOptions()


@pytest.mark.parametrize("name", SWITCHES)
def test_a_switch_is_on_with_1_off_with_0_and_refuses_anything_else(name):
    var = env_of(name)
    assert getattr(KernelOptions.from_env({var: "1"}), name) is True
    assert getattr(KernelOptions.from_env({var: " 0 "}), name) is False
    assert KernelOptions.from_env({var: "0"}).changed() == {name: False}
    for bad in ("on", "true", "2", ""):
        with pytest.raises(OptionsError, match=f"{var}='{bad.strip()}': expected 0 or 1"):
            KernelOptions.from_env({var: bad})


@pytest.mark.parametrize("name, choices", [("attention", ATTENTION_KERNELS), ("linear", LINEAR_KERNELS)])
def test_a_kernel_choice_is_taken_in_any_case_and_refuses_other_names(name, choices):
    var = env_of(name)
    for choice in choices:
        assert getattr(KernelOptions.from_env({var: f" {choice.upper()} "}), name) == choice
    with pytest.raises(OptionsError, match=re.escape(f"{var}='flash': expected one of {list(choices)}")):
        KernelOptions.from_env({var: "flash"})


def test_the_attention_splits_are_a_count_and_refuse_anything_else():
    assert KernelOptions.from_env({"MUSE_SPARK_ATTENTION_SPLITS": "0"}).attention_splits == 0  # the launcher's
    assert KernelOptions.from_env({"MUSE_SPARK_ATTENTION_SPLITS": " 3 "}).attention_splits == 3
    for bad in ("auto", "-1", "1.5", ""):
        with pytest.raises(OptionsError, match="MUSE_SPARK_ATTENTION_SPLITS=.*expected 0 .*or a count ≥ 1"):
            KernelOptions.from_env({"MUSE_SPARK_ATTENTION_SPLITS": bad})


def test_from_env_keeps_the_base_where_unset_and_reads_only_the_scope_asked_for():
    base = KernelOptions(attention="sdpa", pdl=False)
    env = {"MUSE_SPARK_CHAINED_STEPS": "0", "MUSE_SPARK_ROPE_TABLE": "0"}
    assert KernelOptions.from_env(env, base=base).changed() == {"attention": "sdpa", "pdl": False,
                                                               "rope_table": False, "chained_steps": False}
    assert KernelOptions.from_env(env, base=base, scope="run").changed() == {"attention": "sdpa", "pdl": False,
                                                                            "chained_steps": False}
    assert KernelOptions.from_env(env, scope="build").changed() == {"rope_table": False}
    with pytest.raises(ValueError, match="unknown option scope"):
        KernelOptions.from_env(env, scope="compile")


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("MUSE_SPARK_PDL_TRIGGER", "0")
    assert KernelOptions.from_env().changed() == {"pdl_trigger": False}


# ---- dicts and manifests ---------------------------------------------------------------------------
def test_the_manifest_round_trip_gives_the_same_options():
    opts = KernelOptions(attention="sdpa", linear="cublas", attention_cache=False, rope_table=False,
                         attention_splits=5, accept_kernels=False, pdl=False, pdl_trigger=False,
                         pdl_gemm_trigger=False, context_stream=False, chained_steps=False)
    manifest = json.loads(json.dumps({"options": opts.to_dict()}))
    assert KernelOptions.from_manifest(manifest) == opts
    assert KernelOptions.from_dict(opts.to_dict()) == opts
    assert KernelOptions.from_manifest({}) == KernelOptions()  # built before the options were recorded
    assert KernelOptions.from_dict({"pdl": False}) == KernelOptions(pdl=False)  # missing keys: the defaults


def test_a_manifest_with_options_this_runtime_does_not_know_is_refused():
    with pytest.raises(OptionsError, match=r"engines/x: manifest options: unknown kernel option\(s\) \['host_graph'\]"):
        KernelOptions.from_manifest({"options": {"host_graph": True}}, "engines/x")
    with pytest.raises(OptionsError, match="manifest options: kernel option pdl='yes'"):
        KernelOptions.from_manifest({"options": {"pdl": "yes"}})
    with pytest.raises(OptionsError, match="expected a dict of kernel options, got list"):
        KernelOptions.from_manifest({"options": []})


def test_an_engine_runs_its_build_options_and_takes_its_run_options_from_the_caller_or_the_environment(caplog):
    built = KernelOptions(attention="sdpa", rope_table=False, chained_steps=False)
    manifest = {"options": built.to_dict()}
    assert engine_options(manifest, environ={}) == built
    assert engine_options({}, environ={}) == KernelOptions()
    # the run-scope options from the environment where it sets them
    got = engine_options(manifest, environ={"MUSE_SPARK_CHAINED_STEPS": "1", "MUSE_SPARK_CONTEXT_STREAM": "0"})
    assert got == dataclasses.replace(built, chained_steps=True, context_stream=False)
    # build-scope variables cannot change an engine: ignored, said once in the log
    with caplog.at_level(logging.WARNING, logger="muse_spark.options"):
        got = engine_options(manifest, environ={"MUSE_SPARK_ATTENTION": "triton", "MUSE_SPARK_ROPE_TABLE": "0"},
                             where="engines/x")
    assert got == built
    assert "engines/x: ignoring MUSE_SPARK_ATTENTION from the environment" in caplog.text
    assert "ROPE_TABLE" not in caplog.text  # (the value it was built with)
    with pytest.raises(OptionsError, match="MUSE_SPARK_CHAINED_STEPS='x'"):
        engine_options(manifest, environ={"MUSE_SPARK_CHAINED_STEPS": "x"})
    # an explicit options object: its run-scope fields; the build-scope ones stay the manifest's
    assert engine_options(manifest, KernelOptions(attention="triton", chained_steps=True), environ={}) == \
        dataclasses.replace(built, chained_steps=True)


# ---- the scoped setter ----------------------------------------------------------------------------
def test_use_options_sets_the_current_options_for_its_block_only():
    assert current_options() == KernelOptions()
    a, b = KernelOptions(pdl=False), KernelOptions(attention="sdpa")
    with use_options(a) as got:
        assert got is a and current_options() is a
        with use_options(b):
            assert current_options() is b
        assert current_options() is a
        seen = []
        t = threading.Thread(target=lambda: seen.append(current_options()))
        t.start()
        t.join()
        assert seen == [KernelOptions()]  # another thread starts with the defaults
    assert current_options() == KernelOptions()
    with pytest.raises(RuntimeError), use_options(a):
        raise RuntimeError
    assert current_options() == KernelOptions()
    with pytest.raises(TypeError, match="takes a KernelOptions"):
        with use_options({"pdl": False}):
            pass


def test_the_options_are_a_trace_time_constant_under_torch_compile():
    """dynamo cannot trace a ContextVar: ``current_options`` is a constant of the trace, so a model read
    under ``torch.compile(fullgraph=True)`` (the migraphx step, the bench's torch.compile) compiles."""
    def f(x):
        return x + 1 if current_options().attention_splits == 7 else x - 1

    with use_options(KernelOptions(attention_splits=7)):
        assert torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(2)).tolist() == [1.0, 1.0]


# ---- engines --------------------------------------------------------------------------------------
def clean_environment(monkeypatch):
    for f in dataclasses.fields(KernelOptions):
        monkeypatch.delenv(f.metadata["env"], raising=False)


def test_an_engine_built_with_other_options_records_them_and_loads_them_back(agreeing_pair, tmp_path, monkeypatch):
    from muse_spark.builder.build import build_engine
    from muse_spark.runtime import Generator, SamplingParams, load_engine

    clean_environment(monkeypatch)
    opts = KernelOptions(attention="sdpa", rope_table=False, attention_splits=2, chained_steps=False)
    m = build_engine(*agreeing_pair, tmp_path / "e", backend="eager", max_batch=2, max_seq=64, quiet=True,
                     options=opts)
    assert m["options"] == opts.to_dict()
    assert json.loads((tmp_path / "e" / "manifest.json").read_text())["options"] == opts.to_dict()
    engine = load_engine(tmp_path / "e")
    assert engine.options == opts
    assert engine.full_draft_window is False  # (CPU: the reference attention whatever the options)
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    assert len(Generator(engine).generate([[1, 2, 3]], p)[0].output) == 6
    monkeypatch.setenv("MUSE_SPARK_CHAINED_STEPS", "1")  # a run-scope variable at load time
    assert load_engine(tmp_path / "e").options == dataclasses.replace(opts, chained_steps=True)
    assert load_engine(tmp_path / "e", options=KernelOptions(context_stream=False)).options == \
        dataclasses.replace(opts, context_stream=False, chained_steps=True)


def test_the_eager_engine_runs_its_calls_under_its_options(agreeing_pair, monkeypatch):
    """Each eager call (prefill, step, target-only step) runs under ``use_options(engine.options)``,
    whichever thread makes it; outside them the current options are the caller's."""
    from muse_spark.models import layers
    from muse_spark.runtime import EagerEngine, Generator, SamplingParams

    opts = KernelOptions(attention="sdpa", pdl=False)
    engine = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=2, max_seq=64, options=opts)
    seen = []
    attend = layers.attend
    monkeypatch.setattr(layers, "attend", lambda *a, **kw: seen.append(current_options()) or attend(*a, **kw))
    out = []
    t = threading.Thread(target=lambda: out.append(Generator(engine).generate([[1, 2, 3]], SamplingParams(
        max_tokens=4, ignore_eos=True))))
    t.start()
    t.join()
    assert out and seen and all(o is opts for o in seen)
    assert current_options() == KernelOptions()


def test_from_checkpoints_takes_the_environments_options_unless_given(agreeing_pair, monkeypatch):
    from muse_spark.runtime import EagerEngine

    clean_environment(monkeypatch)
    monkeypatch.setenv("MUSE_SPARK_ATTENTION", "sdpa")
    assert EagerEngine.from_checkpoints(*agreeing_pair, max_batch=1, max_seq=32).options == \
        KernelOptions(attention="sdpa")
    assert EagerEngine.from_checkpoints(*agreeing_pair, max_batch=1, max_seq=32,
                                        options=KernelOptions()).options == KernelOptions()


def test_the_cli_build_takes_the_options_from_the_environment_and_refuses_a_bad_value(agreeing_pair, tmp_path):
    out = tmp_path / "e"
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", out, "--max-batch", 2,
                "--max-seq", 64, env={"MUSE_SPARK_ROPE_TABLE": "0", "MUSE_SPARK_CHAINED_STEPS": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert KernelOptions.from_dict(json.loads((out / "manifest.json").read_text())["options"]).changed() == \
        {"rope_table": False, "chained_steps": False}
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", tmp_path / "f",
                env={"MUSE_SPARK_PDL": "yes"})
    assert r.returncode == 2 and "MUSE_SPARK_PDL='yes': expected 0 or 1" in r.stderr
    assert not (tmp_path / "f").exists()


# ---- the builder's compile jobs -----------------------------------------------------------------------
def test_compile_jobs_carry_their_options_and_a_variant_compiles_in_its_own_cache_folder():
    from muse_spark.builder.aoti import graph_jobs, job_options, variant_cache_dir
    from muse_spark.graphs.parts import SpecPair, weight_specs
    from conftest import small_engine

    e = small_engine()
    wspecs = weight_specs(SpecPair(e.target, e.draft))
    opts = KernelOptions(pdl=False, attention_splits=3)
    kw = dict(device="cpu", max_seq=64, cache_slots=3, buckets=[2], prefill_chunk=16, impl="inline",
              cache_dtype="float32", configs={}, out_dir=Path("/tmp/x"))
    jobs = graph_jobs(e.tcfg, e.dcfg, wspecs, options=opts, **kw)
    assert jobs and all(job_options(j) == opts for j in jobs)
    assert all(job_options(j) == KernelOptions() for j in graph_jobs(e.tcfg, e.dcfg, wspecs, **kw))
    assert variant_cache_dir(KernelOptions()) is None
    assert Path(variant_cache_dir(opts)).name == "variant-attention_splits=3-pdl=False"
    with pytest.raises(ValueError, match=r"kernel options go in job\['options'\]"):
        job_options(dict(jobs[0], env={"MUSE_SPARK_PDL": "0"}))
    with pytest.raises(OptionsError, match="compile job 'prefill_layer': unknown kernel option"):
        job_options(dict(jobs[0], name="prefill_layer", options={"qkv_epilogue": True}))


# ---- where the variables are read --------------------------------------------------------------------
def test_only_the_options_module_names_the_variables_and_it_imports_no_upper_layer():
    found = [str(p.relative_to(ROOT)) for folder in ("muse_spark", "builder", "plugins", "runtime")
             for p in sorted((ROOT / folder).rglob("*.py")) if "MUSE_SPARK_" in p.read_text()]
    assert found == ["muse_spark/options.py"]
    tree = ast.parse((ROOT / "muse_spark" / "options.py").read_text())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert not any(m and m.startswith("muse_spark") for m in imported), imported
