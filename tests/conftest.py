"""Shared fixtures: tiny checkpoint pairs and engines, built once per test run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from muse_spark.builder.tiny import make_tiny
from muse_spark.config import MuseSpark1xConfig, MuseSparkDSparkConfig
from muse_spark.checkpoint import expected_shapes
from muse_spark.runtime.engine import EagerEngine, build_modules

# The test models are tiny: one intra-op thread beats two (thread hand-off costs
# more than the work), and the serving tests run a server beside the test process.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def agreeing_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("agreeing")
    make_tiny(out, kind="agreeing", seed=0)
    return out / "target", out / "draft"


@pytest.fixture(scope="session")
def random_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("random")
    make_tiny(out, kind="random", seed=1)
    return out / "target", out / "draft"


# The CPU aoti engine the aoti and C++ embedding tests share (built once, by the CLI in another process),
# with one verification width narrower than γ (confidence-scheduled steps; tests/test_schedule.py) and a
# prefill for up to three chunks at once (a round of two runs with one padding row).
AOTI_MAX_BATCH, AOTI_MAX_SEQ, AOTI_NARROW_WIDTH, AOTI_PREFILL_BATCH = 3, 256, 2, 3


def once_per_run(tmp_path_factory, name: str, make):
    """``make()``'s result (JSON: paths as strings) made once in a test run, however many pytest-xdist workers
    it has (scripts/test.sh runs two): the first worker to ask makes it under a file lock in the workers'
    common temporary folder, the others wait for it and take the recorded result. Without workers: ``make()``."""
    import fcntl
    import json
    import os

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make()
    root = tmp_path_factory.getbasetemp().parent
    record = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes, a failed make() too)
        if record.exists():
            return json.loads(record.read_text())
        result = make()
        record.write_text(json.dumps(result))
        return result


@pytest.fixture(scope="session", autouse=True)
def build_cache(tmp_path_factory):
    """One build cache (builder/package_cache.py) for the whole run, shared by its workers and the CLI
    processes the tests start: a graph compiled by one test's build is taken by every later build of
    the same job, and nothing of another run (or of the user's own cache) is taken."""
    import os
    from pathlib import Path

    root = tmp_path_factory.getbasetemp()
    folder = Path(root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "build-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MUSE_SPARK_BUILD_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="session")
def aoti_built(agreeing_pair, tmp_path_factory):
    """→ (the engine directory, the build's stderr). An AOTInductor compile of the tiny pair takes about
    three minutes on two cores; lengths of ENGINE_PROMPTS straddle its prefill chunk (128). (Every worker's
    agreeing pair is the same tiny pair: the engine of one serves all.)"""
    from pathlib import Path

    def make():
        out = tmp_path_factory.mktemp("aoti") / "engine"
        r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", out, "--backend",
                    "aoti", "--device", "cpu", "--max-batch", AOTI_MAX_BATCH, "--max-seq", AOTI_MAX_SEQ,
                    "--verify-widths", AOTI_NARROW_WIDTH, "--prefill-batch", AOTI_PREFILL_BATCH)
        assert r.returncode == 0, r.stderr[-4000:]
        return str(out), r.stderr

    out, stderr = once_per_run(tmp_path_factory, "aoti_built", make)
    return Path(out), stderr


@pytest.fixture(scope="session")
def cxx_build(tmp_path_factory):
    """The C++ embedding (cxx/), built once with CMake against this torch → its build directory."""
    from pathlib import Path

    from cxx_utils import build_cxx

    return Path(once_per_run(tmp_path_factory, "cxx_build", lambda: str(build_cxx(tmp_path_factory))))


@pytest.fixture(scope="session")
def agreeing_engine(agreeing_pair):
    return EagerEngine.from_checkpoints(*agreeing_pair, max_batch=8, max_seq=256)


@pytest.fixture(scope="session")
def random_engine(random_pair):
    return EagerEngine.from_checkpoints(*random_pair, max_batch=8, max_seq=256)


def small_configs(vocab=12, draft_vocab=7, gamma=3, rank=4, head_type="vanilla", dtype="float32", **draft_kw):
    """Very small configs (tiny vocabularies make statistical tests cheap)."""
    common = dict(vocab_size=vocab, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                  intermediate_size=24, torch_dtype=dtype, attn_output_gate=True, output_soft_cap_temp=8.0,
                  eos_token_id=[vocab - 1], max_position_embeddings=512)
    t = MuseSpark1xConfig.from_dict(dict(common, num_hidden_layers=3))
    d = MuseSparkDSparkConfig.from_dict(dict(
        common, num_hidden_layers=2, draft_vocab_size=draft_vocab, target_hidden_size=16, target_layer_ids=[0, 1],
        mask_token_id=0, block_size=gamma, markov_rank=rank, markov_head_type=head_type, **draft_kw))
    return t, d


def random_state_dict(cfg, seed: int, scale: float = 0.5) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in expected_shapes(cfg).items():
        if name == "draft_id_to_target_id":
            ids = torch.sort(torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size]).values
            sd[name] = ids - torch.arange(cfg.draft_vocab_size)
        elif name.endswith("residual_gate"):
            sd[name] = 0.5 + torch.rand(shape, generator=g)
        elif name.endswith("norm.weight"):
            sd[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            sd[name] = scale * torch.randn(shape, generator=g)
    return sd


def small_engine(seed=0, max_batch=8, max_seq=64, **cfg_kw) -> EagerEngine:
    tcfg, dcfg = small_configs(**cfg_kw)
    target, draft = build_modules(tcfg, dcfg, random_state_dict(tcfg, seed), random_state_dict(dcfg, seed + 1),
                                  tcfg.dtype, "cpu")
    return EagerEngine(target, draft, max_batch=max_batch, max_seq=max_seq, device="cpu")


# Prompts for engine-equality tests: a long one (chunked prefill), a one-token one, batch mates.
ENGINE_PROMPTS = [[1, 2, 3], [72, 101, 108, 108, 111] * 30, [200], [40, 41, 42, 43, 44, 45, 46, 47]]


def run_cli(*args, timeout: int = 900, cwd=None, env: dict | None = None):
    """Run ``muse-spark ARGS…`` in a fresh process, as a user would (``env``: added to the environment)."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "muse_spark.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=None if env is None else {**os.environ, **env})


def cli_generate_ids(engine, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    """``muse-spark generate --json`` in a fresh process (ignoring EOS) → its output ids."""
    import json

    args = ["generate", "--engine", engine, "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", max_tokens,
            "--ignore-eos", "--json"]
    if temperature:
        args += ["--temperature", temperature, "--seed", seed]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["output_ids"]


def chained_generation(engine, eager, monkeypatch, prompts=ENGINE_PROMPTS):
    """Generate ``prompts`` (greedy and sampled rows, batch shrinking as they finish) on ``engine``
    with chained steps forced on (the kernel option ``chained_steps``, the default), counting its
    ``step_next`` calls, and on ``eager`` (which never chains). → (engine's requests, eager's requests, kv_len of each chained launch)."""
    from muse_spark.runtime import Generator, SamplingParams

    chained = []
    step_next = engine.step_next

    def counting(prev, kv_len):
        chained.append(kv_len)
        return step_next(prev, kv_len)

    monkeypatch.setattr(engine, "step_next", counting)
    monkeypatch.setattr(engine, "options", dataclasses.replace(engine.options, chained_steps=True))
    assert engine.chains
    params = [SamplingParams(max_tokens=n, temperature=t, seed=s, ignore_eos=True)
              for n, t, s in ((40, 0.0, 0), (23, 0.9, 3), (9, 0.0, 0), (31, 1.2, 5))][: len(prompts)]
    return Generator(engine).generate(prompts, params), Generator(eager).generate(prompts, params), chained


def clone(src, dst, edit=None, config_edit=None):
    """A copy of checkpoint folder ``src`` at ``dst``, its one-file weights passed through ``edit(tensors)``
    and its config through ``config_edit(dict)`` (each in place), for tests of what the loader refuses."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit is not None:
        t = load_file(str(dst / "model.safetensors"))
        edit(t)
        save_file(t, str(dst / "model.safetensors"))
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst

