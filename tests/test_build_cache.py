"""The build cache (builder/package_cache.py): compiled packages kept by what they were compiled from,
taken by a later build of the same job, whatever its weights."""

import json
import os
import zipfile
from pathlib import Path

import pytest

from muse_spark.builder.package_cache import PackageCache, cache_folder, check_package
from muse_spark.options import OptionsError
from muse_spark.runtime import EagerEngine, Generator, SamplingParams, load_engine

from conftest import AOTI_MAX_BATCH, AOTI_MAX_SEQ, AOTI_NARROW_WIDTH, AOTI_PREFILL_BATCH, ENGINE_PROMPTS, run_cli


def a_job(tmp_path, **change) -> dict:
    """A compile job of the shape ``aoti.graph_jobs`` writes (its fields that matter here)."""
    job = {"name": "step_layer_b2", "fn": "layer", "batch": 2, "tokens": 6, "width": None, "device": "cpu",
           "tcfg": {"hidden_size": 64, "num_hidden_layers": 2}, "dcfg": {"block_size": 5}, "max_seq": 128,
           "cache_slots": 3, "cache_dtype": "bfloat16", "impl": "inline", "configs": {"cpp.vec_isa_ok": False},
           "options": {"pdl": True}, "kv_pool": None, "tp": None, "markov_words": 0,
           "weights": [["model.layers.0.mlp.down_proj.weight", [64, 128], "bfloat16"]],
           "out": str(tmp_path / "step_layer_b2.pt2")}
    return {**job, **change}


def write_package(path: Path, payload: bytes = b"code", metadata: bytes = b'{"ok": 1}') -> Path:
    """A zip with a JSON member, as an AOTI package is (``check_package`` reads its JSON members)."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/data/aotinductor/model/_metadata.json", metadata)
        z.writestr("pkg/data/aotinductor/model/model.so", payload)
    return path


def test_the_key_is_what_is_compiled_not_where_it_goes(tmp_path, monkeypatch):
    cache = PackageCache(tmp_path / "cache", "cpu")
    job = a_job(tmp_path)
    key = cache.key(job)
    # where the package goes, its name, the threads it compiles with: not in the key
    assert cache.key(dict(job, out="/elsewhere/x.pt2", name="other", compile_threads=16)) == key
    # everything the graph is traced and compiled from is
    for change in ({"batch": 3}, {"tokens": 3, "width": 2}, {"tcfg": {"hidden_size": 64, "num_hidden_layers": 3}},
                   {"options": {"pdl": False}}, {"configs": {}}, {"kv_pool": [17, 16]}, {"impl": "triton"},
                   {"weights": [["model.layers.0.mlp.down_proj.weight", [64, 256], "bfloat16"]]},
                   {"cache_dtype": "float8_e4m3fn"}, {"tp": {"world": 2, "vocab": True}}):
        assert cache.key(dict(job, **change)) != key, change
    # and so are the sources, the device and the toolchain
    assert set(cache.context) == {"source", "device", "toolchain"}
    other = PackageCache(tmp_path / "cache", "cpu")
    other.context = dict(other.context, source="0" * 64)  # (what an edit to the project's code does)
    assert other.key(job) != key
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")  # (a variable that steers Inductor)
    assert PackageCache(tmp_path / "cache", "cpu").key(job) != key
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # (a folder: the same compile)
    assert PackageCache(tmp_path / "cache", "cpu").key(job) == key
    assert cache.context["device"]["type"] == "cpu" and cache.context["toolchain"]["torch"]


def test_a_stored_package_is_taken_whole_by_another_build(tmp_path):
    cache = PackageCache(tmp_path / "cache", "cpu")
    first = a_job(tmp_path, out=str(write_package(tmp_path / "first.pt2")))
    assert not cache.take(dict(first, out=str(tmp_path / "nothing-yet.pt2")))
    cache.store(first)
    stored = cache.path(first)
    assert stored.read_bytes() == Path(first["out"]).read_bytes()
    assert stored.stat().st_mode & 0o777 == 0o644  # (readable by whoever serves an engine linking it)
    assert not list(cache.root.glob("*.tmp"))
    (tmp_path / "engine").mkdir()
    second = dict(first, out=str(tmp_path / "engine" / "step_layer_b2.pt2"))
    assert cache.take(second)
    assert Path(second["out"]).read_bytes() == Path(first["out"]).read_bytes()
    check_package(second["out"])


def test_a_torn_or_truncated_package_is_dropped_and_compiled_again(tmp_path):
    said = []
    cache = PackageCache(tmp_path / "cache", "cpu", log=said.append)
    job = a_job(tmp_path)
    for bad in (b"not a zip at all", None):
        if bad is None:  # a zip whose JSON member was being rewritten when it was packaged
            write_package(cache.path(job), metadata=b"")
        else:
            cache.path(job).write_bytes(bad)
        assert cache.lookup(job) is None and not cache.take(job)
        assert not cache.path(job).exists()
    assert len(said) == 2 and all("does not read back" in m and "compiling it again" in m for m in said)


def test_the_folder_is_kept_under_its_limit_least_recently_used_first(tmp_path):
    cache = PackageCache(tmp_path / "cache", "cpu", limit_bytes=10**9)
    jobs = []
    for i in range(3):
        job = a_job(tmp_path, batch=i + 1, out=str(write_package(tmp_path / f"p{i}.pt2", payload=os.urandom(4000))))
        cache.store(job)
        os.utime(cache.path(job), (1000 + i, 1000 + i))  # stored one after another
        jobs.append(job)
    size = cache.path(jobs[0]).stat().st_size
    assert cache.lookup(jobs[0]) is not None  # the oldest is used again: now the most recent
    cache.limit_bytes = 2 * size + size // 2
    cache.prune()
    assert [cache.path(j).exists() for j in jobs] == [True, False, True]


def test_a_cache_that_cannot_be_written_is_said_once_and_the_build_goes_on(tmp_path):
    said = []
    cache = PackageCache(tmp_path / "cache", "cpu", log=said.append)
    cache.root.rmdir()
    cache.root.write_text("a file where the folder was")
    for batch in (1, 2):
        cache.store(a_job(tmp_path, batch=batch, out=str(write_package(tmp_path / f"p{batch}.pt2"))))
    assert len(said) == 1 and "cannot store in" in said[0] and "building without it" in said[0]
    assert cache.broken


def test_the_cache_folder_setting(tmp_path, monkeypatch):
    monkeypatch.delenv("MUSE_SPARK_BUILD_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_folder() == tmp_path / "xdg" / "muse-spark" / "packages"
    monkeypatch.setenv("MUSE_SPARK_BUILD_CACHE", str(tmp_path / "env"))
    assert cache_folder() == tmp_path / "env"
    assert cache_folder(str(tmp_path / "flag")) == tmp_path / "flag"  # (build --build-cache over the variable)
    for off in ("off", "OFF", "0", "none"):
        assert cache_folder(off) is None
    monkeypatch.setenv("MUSE_SPARK_BUILD_CACHE", "off")
    assert cache_folder() is None
    monkeypatch.setenv("MUSE_SPARK_BUILD_CACHE_GB", "0.000001")
    assert PackageCache(tmp_path / "small", "cpu").limit_bytes == int(0.000001 * 2**30)
    for bad in ("lots", "-1", "0"):
        monkeypatch.setenv("MUSE_SPARK_BUILD_CACHE_GB", bad)
        with pytest.raises(OptionsError, match=f"MUSE_SPARK_BUILD_CACHE_GB={bad!r}: expected a positive number"):
            PackageCache(tmp_path / "small", "cpu")


def test_a_pair_of_other_weights_takes_every_graph_from_the_cache_and_runs_its_own_weights(aoti_built, build_cache,
                                                                                         tmp_path):
    """The shared engine's build (tests/conftest.py) stored its graphs in the run's cache; a pair of the same
    shapes but other weights, built with the same arguments, compiles nothing, and its engine gives its own
    eager engine's tokens, not the shared pair's: the packages carry no weights."""
    from muse_spark.builder.pair import make_pair

    make_pair(tmp_path / "pair", preset="tiny", acceptance=0.5, seed=7, device="cpu")
    out = tmp_path / "engine"
    r = run_cli("build", "--target", tmp_path / "pair" / "target", "--draft", tmp_path / "pair" / "draft", "--out", out,
                "--backend", "aoti", "--device", "cpu", "--max-batch", AOTI_MAX_BATCH, "--max-seq", AOTI_MAX_SEQ,
                "--verify-widths", AOTI_NARROW_WIDTH, "--prefill-batch", AOTI_PREFILL_BATCH,
                "--build-cache", build_cache, env={"MUSE_SPARK_BUILD_CACHE": "off"})  # (the flag over the variable)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out / "manifest.json").read_text())["aoti"]
    assert m["compile"]["cached"] == sorted(m["graphs"]) and len(m["graphs"]) == 12
    assert f"12 of 12 graphs from the build cache ({build_cache})" in r.stderr and "compiling" not in r.stderr
    shared = aoti_built[0]
    for g in m["graphs"].values():
        assert (out / g["file"]).read_bytes() == (shared / g["file"]).read_bytes()

    params = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in ENGINE_PROMPTS[:3]]
    got = [r.output for r in Generator(load_engine(out)).generate(ENGINE_PROMPTS[:3], params)]
    own = EagerEngine.from_checkpoints(tmp_path / "pair" / "target", tmp_path / "pair" / "draft",
                                       max_batch=AOTI_MAX_BATCH, max_seq=AOTI_MAX_SEQ)
    assert got == [r.output for r in Generator(own).generate(ENGINE_PROMPTS[:3], params)]
    theirs = [r.output for r in Generator(load_engine(shared)).generate(ENGINE_PROMPTS[:3], params)]
    assert got != theirs  # (other weights, other tokens: nothing of the shared pair's came with its packages)
