"""The C++ embedding's test helpers: build it with CMake (a session fixture, in conftest.py), run its example."""

from __future__ import annotations

# (python_generate and same_as_python compare with the Python runtime's Generator)

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from muse_spark.runtime import Generator, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str | None:
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def build_cxx(tmp_path_factory, *cmake_args: str) -> Path:
    """cmake configure + build of cxx/ into a fresh directory (as scripts/build_cxx.sh does) → that directory.
    Skips, saying why, where the tools or the libraries it needs are missing."""
    cmake = _tool("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed (pip install -e .[cxx])")
    if _tool("c++") is None and _tool("g++") is None:
        pytest.skip("no C++ compiler (c++/g++) on this machine")
    out = tmp_path_factory.mktemp("cxx")
    for cmd in ([cmake, "-S", ROOT / "cxx", "-B", out, f"-DPython3_EXECUTABLE={sys.executable}", *cmake_args],
                [cmake, "--build", out, "-j", str(os.cpu_count() or 2)]):
        r = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=900)
        if r.returncode and "the nlohmann-json package" in r.stdout + r.stderr:
            pytest.skip("the C++ embedding cannot be built here: the nlohmann-json package is not installed "
                        "(pip install -e .[cxx])")
        assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert (out / "muse_spark_generate").is_file() and (out / "libmuse_spark_embed.so").is_file()
    return out


def cxx(build: Path, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(build / "muse_spark_generate"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@functools.cache
def info(build: Path) -> dict:
    """The build's ``--info``: the layout, embedding version and torch it accepts, whether it checks hashes."""
    r = cxx(build, "--info")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def cxx_generate(build, engine_dir, prompts, *, max_tokens=24, temperature=0.0, seed=0, stop=(), ignore_eos=True,
                 stream=False, extra=()) -> list[dict]:
    """Run the example program (one torch thread, as this process) → its JSON lines."""
    args = ["--engine", engine_dir, "--max-tokens", max_tokens, "--temperature", temperature, "--seed", seed,
            "--threads", 1, *extra]
    if not info(build)["checks_hashes"]:  # (a build without OpenSSL opens engines only unchecked)
        args.append("--no-verify")
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    if stop:
        args += ["--stop-ids", ",".join(map(str, stop))]
    if ignore_eos:
        args.append("--ignore-eos")
    if stream:
        args.append("--stream")
    r = cxx(build, *args)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


def finals(lines: list[dict]) -> list[dict]:
    return [x for x in lines if "output_ids" in x]


def python_generate(engine, prompts, **kw) -> list:
    return Generator(engine).generate(prompts, SamplingParams(**kw))


def gives_the_eager_tokens(cxx_build, engine_dir, engine, direct, prompts, max_tokens: int = 24) -> None:
    """An aoti engine (loaded from ``engine_dir`` as ``engine``) gives the eager engine ``direct``'s tokens,
    greedy and sampled, from the Python runtime and from the C++ library."""
    from muse_spark.runtime import Generator, SamplingParams

    for temperature, seed in ((0.0, 0), (0.9, 3)):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)
        want = Generator(direct).generate(prompts, params)
        assert [r.output for r in Generator(engine).generate(prompts, params)] == [r.output for r in want]
        same_as_python(cxx_generate(cxx_build, engine_dir, prompts, max_tokens=max_tokens, temperature=temperature,
                                    seed=seed), want)


def same_as_python(lines: list[dict], reqs: list) -> None:
    out = finals(lines)
    assert [x["output_ids"] for x in out] == [r.output for r in reqs]
    assert [x["finish_reason"] for x in out] == [r.finish_reason for r in reqs]
    assert [x["steps"] for x in out] == [len(r.steps) for r in reqs]
    assert [x["accepted_draft_tokens"] for x in out] == [sum(s.accepted for s in r.steps) for r in reqs]


