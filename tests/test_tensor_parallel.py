"""Tensor parallelism on CPU (gloo): the target split across 2 and 4 ranks gives the single-process
engine's tokens, greedy and seeded, with in-flight batching; a rank that dies ends the group with an
error in bounded time; splits the model cannot take are refused."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from conftest import run_cli
from muse_spark.checkpoint import load_pair
from muse_spark.runtime import EagerEngine, Generator, SamplingParams
from muse_spark.runtime import tensor_parallel as tp

PROMPTS = [[65, 66, 67], [70, 71], [40 + i % 20 for i in range(30)], [5]]
PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True),
          SamplingParams(max_tokens=20, temperature=0.8, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=16, ignore_eos=True),
          SamplingParams(max_tokens=28, temperature=1.0, seed=9, ignore_eos=True)]


@pytest.fixture(scope="module")
def single(agreeing_pair):
    engine = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=2, max_seq=128)
    return [r.output for r in Generator(engine).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("world", [2, 4])
def test_split_target_gives_the_single_process_tokens(agreeing_pair, single, world):
    # max_batch 2 for 4 requests: requests join and leave between steps on every rank alike
    out = tp.generate(*agreeing_pair, PROMPTS, PARAMS, world, max_batch=2, max_seq=128)
    assert [o["output"] for o in out] == single


def test_the_shards_hold_the_whole_layer(agreeing_pair):
    """The slices put back together are the layer's weights: q/k/v/gate rows by heads (K/V heads
    replicated where there are fewer than ranks), o_proj and down_proj by columns, gate/up by rows."""
    target, _ = load_pair(*agreeing_pair)
    cfg, sd = target.cfg, target.state_dict()
    name = "model.layers.1.feed_forward.down_proj.weight"
    for world in (2, 4):
        parts = [tp.shard_state_dict(sd, cfg, r, world) for r in range(world)]
        assert torch.equal(torch.cat([p[name] for p in parts], 1), sd[name])
        assert torch.equal(torch.cat([p["model.layers.0.self_attn.o_proj.weight"] for p in parts], 1),
                           sd["model.layers.0.self_attn.o_proj.weight"])
        shard_cfg = tp.shard_config(cfg, world)
        qkv = parts[world - 1]["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv.shape[0] == shard_cfg.qkv_out
        assert torch.equal(parts[0]["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
        # the untied lm_head by vocabulary rows (each rank's logits slice, gathered), the embedding whole
        # (259 ids: ⌈259 / world⌉ rows a rank, the last rank's slice ending in zero rows)
        rows = -(-cfg.vocab_size // world)
        assert tp.vocab_split(cfg, world) and all(p["lm_head.weight"].shape[0] == rows for p in parts)
        head = torch.cat([p["lm_head.weight"] for p in parts])
        assert torch.equal(head[: cfg.vocab_size], sd["lm_head.weight"]) and not head[cfg.vocab_size:].any()
    import dataclasses

    assert not tp.vocab_split(dataclasses.replace(cfg, tie_word_embeddings=True), 2)  # (the head is the embedding)


@pytest.fixture(scope="module")
def fp8_pair(agreeing_pair, tmp_path_factory):
    from muse_spark.builder.quantize import quantize_pair

    out = tmp_path_factory.mktemp("fp8_tp")
    quantize_pair(agreeing_pair[0], out / "target", draft=agreeing_pair[1], draft_out=out / "draft", log=lambda s: None)
    return out / "target", out / "draft"


def test_fp8_shards_keep_each_rows_scale(fp8_pair):
    """An FP8 target's slices: the E4M3 weights split as the bf16 ones, each per-channel scale with the rows
    it scales (the row-parallel projections keep all of theirs), so the dequantized slices put back together
    are the dequantized layer."""
    target, _ = load_pair(*fp8_pair)
    cfg, sd = target.cfg, target.state_dict()
    pre = "model.layers.0."
    for world in (2, 4):
        parts = [tp.shard_state_dict(sd, cfg, r, world) for r in range(world)]
        for proj, dim in (("feed_forward.down_proj", 1), ("self_attn.o_proj", 1), ("feed_forward.gate_up_proj", 0)):
            w, s = f"{pre}{proj}.weight", f"{pre}{proj}.weight_scale"
            assert all(p[w].dtype == torch.float8_e4m3fn for p in parts)
            deq = [p[w].float() * p[s] for p in parts]
            if dim == 1:
                assert all(torch.equal(p[s], sd[s]) for p in parts)
                assert torch.equal(torch.cat(deq, 1), sd[w].float() * sd[s])
            else:  # gate rows then up rows on each rank
                inter = cfg.intermediate_size // world
                gate = torch.cat([d[:inter] for d in deq]), torch.cat([d[inter:] for d in deq])
                assert torch.equal(torch.cat(gate), sd[w].float() * sd[s])
        qkv = parts[0][f"{pre}self_attn.qkv_proj.weight_scale"]
        assert qkv.shape == (tp.shard_config(cfg, world).qkv_out, 1)


@pytest.mark.parametrize("world", [2, 4])
def test_an_fp8_target_split_over_ranks_gives_the_single_process_tokens(fp8_pair, world):
    """FP8 checkpoints over ranks: greedy and seeded tokens equal the single-process FP8 engine's (the row-parallel
    partial products on the dequantized weight, summed in FP32 and rounded once)."""
    engine = EagerEngine.from_checkpoints(*fp8_pair, max_batch=2, max_seq=128)
    want = [r.output for r in Generator(engine).generate(PROMPTS, PARAMS)]
    out = tp.generate(*fp8_pair, PROMPTS, PARAMS, world, max_batch=2, max_seq=128)
    assert [o["output"] for o in out] == want


def test_splits_the_model_cannot_take_are_refused(agreeing_pair):
    target, _ = load_pair(*agreeing_pair)
    for world, says in ((3, "attention heads"), (0, "at least 1")):
        with pytest.raises(tp.TensorParallelError, match=says):
            tp.check_split(target.cfg, world)
    r = run_cli("generate", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--prompt-ids", "1", "--tp", 3)
    assert r.returncode == 2 and "do not split over 3 ranks" in r.stderr


def test_a_rank_that_dies_ends_the_group_with_an_error(agreeing_pair):
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="exit|terminated|3"):
        tp.generate(*agreeing_pair, PROMPTS[:1], PARAMS[:1], 2, max_batch=1, max_seq=128, fail_rank=1, timeout_s=20)
    assert time.perf_counter() - t0 < 60


def test_generate_tp_prints_the_tokens_of_one_process(agreeing_pair):
    import json

    args = ["generate", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--prompt-ids", "72,101",
            "--max-tokens", 16, "--json"]
    one = json.loads(run_cli(*args).stdout.strip().splitlines()[-1])
    r = run_cli(*args, "--tp", 2)
    assert r.returncode == 0, r.stderr
    two = json.loads(r.stdout.strip().splitlines()[-1])
    assert two["output_ids"] == one["output_ids"] and two["tp"] == 2


class _Collect:
    """A scheduler sink that keeps a request's tokens and says when it is done."""

    def __init__(self):
        self.tokens, self.done, self.error = [], threading.Event(), None

    def deliver(self, req, new_tokens):
        self.tokens.extend(new_tokens)
        if req.finished:
            self.done.set()

    def fail(self, message, kind):
        self.error = message
        self.done.set()

    def cancelled(self):
        return False


def _serve_lead(leader, prompts, params):
    """Rank 0: the serving scheduler thread over the leader engine, requests submitted from threads."""
    from muse_spark.serving.scheduler import Scheduler

    sched = Scheduler(leader, log=lambda *a: None)
    sched.start()
    sinks = [_Collect() for _ in prompts]
    threads = [threading.Thread(target=sched.submit, args=(p, sp, s)) for p, sp, s in zip(prompts, params, sinks)]
    for t in threads:
        t.start()
    for s in sinks:
        assert s.done.wait(120)
    sched.stop()
    return [s.tokens for s in sinks]


def test_the_serving_scheduler_drives_a_rank_set(agreeing_pair, single):
    """Rank 0's scheduler thread, requests arriving from several threads and batched in flight: the
    other ranks follow its engine calls and every request gets its single-process tokens."""
    out = tp.launch(2, tp.lead_or_follow, str(agreeing_pair[0]), str(agreeing_pair[1]),
                    functools.partial(_serve_lead, prompts=PROMPTS, params=PARAMS), "cpu", 2, 128)
    assert out == single


def test_the_openai_server_over_a_rank_set(agreeing_pair, tmp_path):
    """`serve-openai --tp 2`: rank 0 serves, rank 1 follows; the official client gets the single-process
    greedy text, and SIGTERM drains and ends the whole set."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    import openai

    from muse_spark.builder.build import build_engine
    from muse_spark.runtime import load_engine, load_tokenizer

    engine_dir = tmp_path / "engine"
    build_engine(*agreeing_pair, engine_dir, backend="eager", device="cpu", max_batch=2, max_seq=128, quiet=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "muse_spark.cli", "serve-openai", "--engine", str(engine_dir),
                             "--port", str(port), "--tp", "2", "--served-model-name", "tiny", "--log-level",
                             "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        got = client.completions.create(model="tiny", prompt=[72, 101, 108], max_tokens=20, temperature=0)
        engine = load_engine(engine_dir)
        want = Generator(engine).generate([[72, 101, 108]], SamplingParams(max_tokens=20))[0].output
        assert got.choices[0].text == load_tokenizer(engine.tokenizer_path).decode(want)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    r = run_cli("serve-openai", "--engine", engine_dir, "--tp", 3, "--port", port)
    assert r.returncode == 2 and "do not split over 3 ranks" in r.stderr


def test_controls_and_a_confidence_schedule_over_ranks(agreeing_pair):
    """Sampling controls and confidence-scheduled verification run on a rank set as on one process."""
    from muse_spark.schedule import Schedule

    params = [SamplingParams(max_tokens=20, repetition_penalty=1.5, top_k=4, temperature=0.9, seed=2,
                             ignore_eos=True, logprobs=1)]
    engine = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=1, max_seq=128)
    want = Generator(engine).generate(PROMPTS[:1], params)[0].output
    out = tp.generate(*agreeing_pair, PROMPTS[:1], params, 2, max_batch=1, max_seq=128)
    assert out[0]["output"] == want
    engine.set_schedule(Schedule("confidence", 0.5))
    want = Generator(engine).generate(PROMPTS[:1], params)[0].output
    out = tp.launch(2, tp.lead_or_follow, str(agreeing_pair[0]), str(agreeing_pair[1]),
                    functools.partial(_scheduled_lead, prompts=PROMPTS[:1], params=params), "cpu", 1, 128)
    assert out == [want]


def test_samples_of_one_prompt_share_its_prefill_over_ranks(agreeing_pair):
    """Requests running at once hand each other their prompt's prefilled chunks on every rank (the leader
    broadcasts the copy): the tokens of one process, the shared tokens counted."""
    prompt = [40 + (7 * i) % 50 for i in range(140)]  # (two chunks of 128: the first is shared)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
    engine = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=3, max_seq=256)
    want = [r.output for r in Generator(engine).generate([prompt] * 3, params)]
    out = tp.launch(2, tp.lead_or_follow, str(agreeing_pair[0]), str(agreeing_pair[1]),
                    functools.partial(_sharing_lead, prompts=[prompt] * 3, params=params), "cpu", 3, 256)
    assert out[0] == want and out[1] == 2 * 128


def test_the_prefix_cache_over_ranks(agreeing_pair):
    """Stored prompt blocks on a rank set: the leader's store broadcasts each store, load and eviction, so
    every rank keeps its slice of the same blocks; a prompt behind a stored prefix gets one process's tokens."""
    system = [40 + (7 * i) % 50 for i in range(130)]
    prompts = [system + [65, 66], system + [70]]
    params = [SamplingParams(max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=10, temperature=0.9, seed=3,
                                                                             ignore_eos=True)]
    engine = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=1, max_seq=256)
    want = [Generator(engine).generate([p], [sp])[0].output for p, sp in zip(prompts, params)]
    out = tp.launch(2, tp.lead_or_follow, str(agreeing_pair[0]), str(agreeing_pair[1]),
                    functools.partial(_cached_lead, prompts=prompts, params=params), "cpu", 1, 256)
    assert out[0] == want and out[1]["hits"] == 1 and out[1]["reused_tokens"] == 128


def _cached_lead(leader, prompts, params):
    from muse_spark.runtime.prefix_cache import PrefixCache

    cache = PrefixCache(leader, capacity_bytes=1 << 30)
    gen = Generator(leader, prefix_cache=cache)
    return [gen.generate([p], [sp])[0].output for p, sp in zip(prompts, params)], cache.stats()


def _sharing_lead(leader, prompts, params):
    gen = Generator(leader)
    return [r.output for r in gen.generate(prompts, params)], gen.shared_prefill_tokens


def test_the_triton_server_over_a_rank_set(agreeing_pair, tmp_path):
    """`triton-repo --tp 2` + `muse-spark serve`: the model joins as rank 0, serve starts rank 1; the real
    tritonserver answers with one process's tokens, and stopping the server ends both ranks."""
    from muse_spark.builder.build import build_engine
    from serving_utils import generate, generate_stream, ids_of, start_server, stop_server

    engine_dir = tmp_path / "engine"
    build_engine(*agreeing_pair, engine_dir, max_batch=2, max_seq=128, quiet=True)
    single = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=2, max_seq=128)
    want = [r.output for r in Generator(single).generate(PROMPTS[:2], PARAMS[:2])]
    from muse_spark.serving.repo import RepoError, write_repository

    for kw, says in ((dict(tp=3), "do not split over 3 ranks"), (dict(tp=2, instances=2), "one model instance")):
        with pytest.raises(RepoError, match=says):
            write_repository(engine_dir, tmp_path / "bad", **kw)
    srv = start_server(engine_dir, tmp_path, repo_args=("--tp", "2"))
    try:
        status, body = generate(srv, {"input_ids": PROMPTS[0], "max_tokens": 24, "ignore_eos": True})
        assert status == 200 and ids_of(body) == want[0], body
        status, events = generate_stream(srv, {"input_ids": PROMPTS[1], "max_tokens": 20, "temperature": 0.8,
                                               "seed": 4, "ignore_eos": True, "stream": True})
        assert status == 200 and sum((ids_of(e) for e in events), []) == want[1]
        assert "target split over 2 ranks" in srv.log.read_text()
    finally:
        assert stop_server(srv) == 0, srv.log.read_text()[-3000:]


def _scheduled_lead(leader, prompts, params):
    from muse_spark.schedule import Schedule

    leader.set_schedule(Schedule("confidence", 0.5))  # (rank 0's schedule: the followers get its cut per step)
    return [r.output for r in Generator(leader).generate(prompts, params)]


def test_the_tensor_parallel_benchmark_writes_its_figures(agreeing_pair, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    pair = Path(agreeing_pair[0]).parent
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "tensor_parallel.py"), "--pair", str(pair), "--tp",
                        "1,2", "--batches", "1,2", "--context", "8", "--max-tokens", "8", "--iters", "1", "--device",
                        "cpu", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = tmp_path.glob("*_tensor-parallel.json")
    runs = json.loads(path.read_text())["results"]["tp"]
    assert set(runs) == {"1", "2"}
    for world, run in runs.items():
        for row in run["batches"].values():
            assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["roofline_ms"] > 0
            assert (row["allreduce_ms"] > 0) == (world == "2")
            assert row["chained_steps"] is False  # (the eager engine waits for each step)
    # a rank reads less at tp 2: its half of the split matrices
    assert runs["2"]["batches"]["1"]["rank_bytes"] < runs["1"]["batches"]["1"]["rank_bytes"]


def test_an_engine_built_for_ranks_loads_each_ranks_slice_only(agreeing_pair, single, tmp_path):
    """`build --tp 2`: one target weight file per rank (rank r reads its own); `generate --engine` runs it over
    its ranks, and refuses another count; the single-device loader says what the engine needs."""
    import json

    from muse_spark.engine_format import EngineError
    from muse_spark.runtime import load_engine

    engine = tmp_path / "engine"
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", engine, "--tp", 2,
                "--max-batch", 2, "--max-seq", 128)
    assert r.returncode == 0, r.stderr
    m = json.loads((engine / "manifest.json").read_text())
    assert m["tensor_parallel"] == {"world": 2, "target_files": ["target.tp0.safetensors", "target.tp1.safetensors"]}
    assert not (engine / "target.safetensors").exists()
    from safetensors import safe_open

    with safe_open(str(engine / "target.tp1.safetensors"), "pt") as f:  # (rank 1's vocabulary slice of the head)
        assert f.get_slice("lm_head.weight").get_shape()[0] == -(-load_pair(*agreeing_pair)[0].cfg.vocab_size // 2)
    assert set(m["files"]) >= {"target.tp0.safetensors", "target.tp1.safetensors", "draft.safetensors"}
    with pytest.raises(EngineError, match="split for 2 tensor-parallel ranks"):
        load_engine(engine)
    out = tp.launch(2, tp.lead_or_follow, str(engine), None,
                    functools.partial(tp.generate_lead, prompts=PROMPTS, params=PARAMS), "cpu")
    assert [o["output"] for o in out] == single
    bad = run_cli("generate", "--engine", engine, "--prompt-ids", "1", "--tp", 4)
    assert bad.returncode == 2 and "split for 2 ranks, not 4" in bad.stderr
    # without --tp, generate runs the engine over the ranks it was built for
    r = run_cli("generate", "--engine", engine, "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-tokens", 24,
                "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tp"] == 2 and got["output_ids"] == single[0]
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", tmp_path / "x",
                "--tp", 3)
    assert r.returncode == 2 and "do not split over 3 ranks" in r.stderr and not (tmp_path / "x").exists()


def test_an_engine_built_for_ranks_is_served_over_them_by_default(agreeing_pair, tmp_path):
    """Without --tp, serve-openai and triton-repo take the ranks an engine was built for (``built_world``); an
    explicit single rank is refused with the count to give."""
    import socket

    from muse_spark.engine_format import built_world
    from muse_spark.serving.repo import RepoError, write_repository

    engine = tmp_path / "engine"
    assert run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", engine, "--tp", 2,
                   "--max-batch", 2, "--max-seq", 128).returncode == 0
    assert built_world(engine) == 2 and built_world(tmp_path / "missing") == 1
    model = write_repository(engine, tmp_path / "repo")
    assert 'key: "tp"\n  value: { string_value: "2" }' in (model / "config.pbtxt").read_text()
    with pytest.raises(RepoError, match="split for 2 ranks: give --tp 2"):
        write_repository(engine, tmp_path / "repo1", tp=1)
    # serve-openai launches 2 ranks for it: on CUDA, which this check's machine lacks, the rank set says so
    if not torch.cuda.is_available():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        r = run_cli("serve-openai", "--engine", engine, "--port", port, "--device", "cuda")
        assert r.returncode == 2 and "--tp 2 needs 2 GPUs" in r.stderr, r.stderr[-2000:]


@pytest.fixture(scope="module")
def aoti_tp2(agreeing_pair, tmp_path_factory):
    """`build --backend aoti --tp 2` of the tiny pair (CPU) → (the engine directory, the build's result)."""
    engine = tmp_path_factory.mktemp("engines") / "tp2"
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", engine, "--tp", 2,
                "--backend", "aoti", "--device", "cpu", "--max-batch", 2, "--max-seq", 128)
    return engine, r


def test_an_aoti_engine_built_for_ranks_runs_its_packages_on_every_rank(agreeing_pair, single, aoti_tp2, tmp_path):
    """`build --backend aoti --tp 2`: one set of packages compiled from a rank's slice (its collectives traced
    on the default group), a weight file per rank, no C++ embedding section. Its two ranks give the single
    process's tokens, greedy and seeded with in-flight batching, and a request's sampling controls (set on
    every rank's slot state); `generate` runs it over its ranks. An aoti engine compiled for one device is
    refused a rank count, and a split engine is refused a paged pool."""
    import json

    engine, r = aoti_tp2
    assert r.returncode == 0, r.stderr[-4000:]
    m = json.loads((engine / "manifest.json").read_text())
    assert m["backend"] == "aoti" and m["tensor_parallel"]["world"] == 2 and "embedding" not in m
    assert "target.safetensors" not in m["files"] and "step_layer_b2.pt2" in m["files"]
    controlled = SamplingParams(max_tokens=20, repetition_penalty=1.5, top_k=4, temperature=0.9, seed=2,
                                ignore_eos=True)
    want = single + [r.output for r in Generator(EagerEngine.from_checkpoints(*agreeing_pair, max_batch=1,
                                                                                max_seq=128)).generate(
        PROMPTS[:1], [controlled])]
    out = tp.launch(2, tp.lead_or_follow, str(engine), None,
                    functools.partial(tp.generate_lead, prompts=PROMPTS + PROMPTS[:1], params=PARAMS + [controlled]),
                    "cpu")
    assert [o["output"] for o in out] == want
    r = run_cli("generate", "--engine", engine, "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-tokens", 24,
                "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tp"] == 2 and got["output_ids"] == single[0]
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", tmp_path / "x", "--tp", 2,
                "--backend", "aoti", "--device", "cpu", "--max-batch", 2, "--max-seq", 128, "--kv-cache-tokens", 256)
    assert r.returncode == 2 and "keeps a cache window per slot" in r.stderr and not (tmp_path / "x").exists()


def test_a_compiled_engine_for_one_device_is_refused_ranks(aoti_built):
    """An aoti engine compiled for one device has the whole layers' shapes: `generate --tp 2` says to build
    one for the ranks (before any rank starts)."""
    r = run_cli("generate", "--engine", aoti_built[0], "--prompt-ids", "1,2", "--tp", 2)
    assert r.returncode == 2 and "compiled for one device" in r.stderr and "--backend aoti --tp 2" in r.stderr


def test_the_benchmark_runs_compiled_ranks_and_one_rank_through_the_leader(agreeing_pair, aoti_tp2, aoti_built,
                                                                           tmp_path):
    """`benchmarks/tensor_parallel.py --backend aoti`: the aoti engine for 2 ranks, and at 1 rank a plain aoti
    engine run through the same leader on one rank (the path a single GPU takes)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    work = tmp_path / "engines"
    work.mkdir()
    (work / "tp1").symlink_to(aoti_built[0])
    (work / "tp2").symlink_to(aoti_tp2[0])
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "tensor_parallel.py"), "--pair",
                        str(Path(agreeing_pair[0]).parent), "--tp", "1,2", "--batches", "1,2", "--context", "8",
                        "--max-tokens", "8", "--iters", "1", "--device", "cpu", "--backend", "aoti", "--work-dir",
                        str(work), "--reuse-engine", "--out-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = tmp_path.glob("*_tensor-parallel.json")
    doc = json.loads(path.read_text())
    assert doc["config"]["backend"] == "aoti"
    runs = doc["results"]["tp"]
    for world, run in runs.items():
        for row in run["batches"].values():
            assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["mean_accepted_per_step"] > 0
            assert (row["allreduce_ms"] > 0) == (world == "2")
            assert row["chained_steps"] == (world == "1")  # (one rank chains as the plain engine does)
    assert runs["2"]["batches"]["1"]["rank_bytes"] < runs["1"]["batches"]["1"]["rank_bytes"]
