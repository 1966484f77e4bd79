"""The aoti engine on CUDA: per-bucket CUDA graphs, equality with the eager engine, fresh processes.

Skipped without a CUDA device. One engine (buckets 1, 2, 4) is built for the
module by the CLI in a subprocess, so loading it here is a fresh-process load
of packages another process compiled.
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from muse_spark.runtime import EagerEngine, EngineError, Generator, SamplingParams, load_engine

from conftest import ENGINE_PROMPTS as PROMPTS
from conftest import chained_generation, cli_generate_ids, run_cli

# (xdist_group: the GPU run (scripts/gpu_check.sh, --dist loadgroup) keeps the file's tests, which share its
# engines, on one worker, and spreads the ungrouped tests of other files over the rest)
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.xdist_group("engine")]

MAX_BATCH, MAX_SEQ = 4, 256


cli = run_cli


@pytest.fixture(scope="module")
def built(agreeing_pair, tmp_path_factory):
    # Built in another process, with the reference plugins traced in (plugins="inline"): the
    # exactness baseline. The Triton plugin kernels get their own engine (test_gpu_triton_engine.py).
    out = tmp_path_factory.mktemp("aoti_cuda") / "engine"
    code = ("import sys; from muse_spark.builder.build import build_engine; "
            "build_engine(sys.argv[1], sys.argv[2], sys.argv[3], backend='aoti', device='cuda', "
            f"max_batch={MAX_BATCH}, max_seq={MAX_SEQ}, plugins='inline')")
    r = subprocess.run([sys.executable, "-c", code, *map(str, (*agreeing_pair, out))], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    # progress output (2 prefill parts, 5 per bucket: draft, layer, verify, context, controlled verify)
    assert "[build] compiling 17 graphs" in r.stderr
    return out


@pytest.fixture(scope="module")
def engine(built):
    # Load once in a child first: engines are loaded in fresh processes, and torch
    # 2.11.0+cu130's package loader segfaulted on the H200 without the runtime's libstdc++ step
    # (docs/aoti.md); a regression must fail these tests, not take the whole run down.
    code = "import sys; from muse_spark.runtime import load_engine; load_engine(sys.argv[1])"
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, str(built)], capture_output=True,
                       text=True, timeout=600)
    if r.returncode < 0:
        pytest.fail(f"loading the engine in a fresh process died with signal {-r.returncode}:\n{r.stderr[-2500:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return load_engine(built)


@pytest.fixture(scope="module")
def eager(agreeing_pair):
    return EagerEngine.from_checkpoints(*agreeing_pair, device="cuda", max_batch=MAX_BATCH, max_seq=MAX_SEQ)


def test_manifest_records_the_device_and_versions(built):
    m = json.loads((built / "manifest.json").read_text())
    assert m["device"]["kind"] == "cuda"
    assert m["device"]["compute_capability"] == list(torch.cuda.get_device_capability())
    assert m["versions"]["torch"] == torch.__version__ and m["versions"]["triton"]
    assert m["aoti"]["batch_buckets"] == [1, 2, 4]
    assert m["aoti"]["plugin_impl"] == "inline"
    assert m["aoti"]["attention_kernel"] == "triton"  # bf16 on CUDA, the default kernel option
    assert m["aoti"]["linear_kernel"] == "triton"  # the default kernel option


def test_every_bucket_is_a_captured_cuda_graph(engine):
    from muse_spark.runtime.cuda_graph import CUDAGraphStep

    assert sorted(engine.runners) == [1, 2, 4]
    assert all(isinstance(r, CUDAGraphStep) for r in engine.runners.values())


def test_greedy_output_identical_to_eager(engine, eager):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 23, 9, 31)]
    got = Generator(engine).generate(PROMPTS, params)
    want = Generator(eager).generate(PROMPTS, params)
    assert [r.output for r in got] == [r.output for r in want]
    assert sum(s.accepted for r in got for s in r.steps) > 0
    assert sum(r.replays for r in engine.runners.values()) > 0  # the steps were graph replays


def test_sampled_output_identical_to_eager_given_seeds(engine, eager):
    params = [SamplingParams(max_tokens=30, temperature=t, seed=s, ignore_eos=True)
              for t, s in ((0.8, 1), (1.0, 2), (1.3, 3), (0.6, 4))]
    got = Generator(engine).generate(PROMPTS, params)
    want = Generator(eager).generate(PROMPTS, params)
    assert [r.output for r in got] == [r.output for r in want]


def test_a_step_does_not_synchronize_with_the_host(engine):
    dev = engine.device
    x = (torch.tensor([65, 66, 67], device=dev), torch.tensor([10, 20, 30], device=dev),
         torch.tensor([0, 1, 2], device=dev), torch.tensor([1, 2, 3], device=dev),
         torch.tensor([0.0, 1.0, 0.5], device=dev))
    engine.step(*x, 40)  # bucket 4, one padding row
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = engine.step(*x, 40)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (3, engine.gamma + 2) and out.device.type == "cuda"


def test_step_host_gives_the_steps_rows(engine):
    """The serving loop's form on the CUDA graphs: host values through the pinned twins of the
    static inputs, the packed rows back through a pinned buffer; the rows ``step`` gives, for a
    padded bucket, twice in a row (the pinned buffers are reused)."""
    lists = ([65, 66, 67], [10, 20, 30], [0, 1, 2], [1, 2, 3], [0.0, 1.0, 0.5])
    x = [torch.tensor(v, device="cuda") for v in lists]
    for _ in range(2):
        want = engine.step(*x, 40).tolist()
        assert engine.step_host(*lists, 40) == want


def test_replay_refuses_caches_other_than_the_captured_ones(engine):
    x = tuple(torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(4)) + (
        torch.zeros(1, device="cuda"),)
    saved = engine.caches[0][0]
    engine.caches[0][0] = saved.clone()
    try:
        with pytest.raises(AssertionError, match="other than those it was captured with"):
            engine.step(*x, 10)
    finally:
        engine.caches[0][0] = saved


def test_replay_refuses_a_captured_tensor_moved_in_place(engine):
    """A captured KV cache (the very tensor object) given other memory by ``set_``: the runner's
    pointer check, made just after the replay's launch, raises before the step's rows are returned;
    the replay wrote only the captured memory (kept alive by the runner), not the tensor's new
    memory. Back in place, the step runs and gives what it gave before."""
    runner = engine.runners[1]
    x = (torch.tensor([65], device="cuda"), torch.tensor([10], device="cuda"), torch.tensor([0], device="cuda"),
         torch.tensor([1], device="cuda"), torch.tensor([0.0], device="cuda"))
    with torch.inference_mode():
        before = runner(*x)
        t = runner.caches[1][-1]
        storage, offset, size, stride = t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
        moved = torch.full_like(t, 7.0)  # other memory; a write the step makes (slot 0, position 10) would show
        t.set_(moved)
        try:
            with pytest.raises(AssertionError, match="was reallocated.*result is discarded"):
                runner(*x)
            torch.cuda.synchronize()
            assert bool((moved == 7.0).all())
        finally:
            t.set_(storage, offset, size, stride)
        assert torch.equal(runner(*x), before)


def test_the_draft_context_on_a_second_stream_gives_the_in_line_step(engine):
    """The runners run ``step_context`` on a second stream (the kernel option ``context_stream``, the
    default), beside the last target layers and ``step_verify``. The same packages captured with it
    in line on one stream give the same packed rows and write the same draft and target caches,
    replay after replay with new inputs (greedy and sampled; a padded row too)."""
    import copy

    from muse_spark.runtime.cuda_graph import CUDAGraphStep

    runner = engine.runners[4]
    assert isinstance(runner.fn.side, torch.cuda.Stream)
    serial_fn = copy.copy(runner.fn)
    serial_fn.side = None
    serial = CUDAGraphStep(serial_fn, 4, runner.weights, runner.caches, engine.scratch_slot, engine.device,
                           markov_words=runner.markov_ws.numel(), programmatic=engine.pdl_kernels)
    caches = [t for c in runner.caches for t in c]
    with torch.inference_mode():
        for k in range(4):
            x = (torch.tensor([65 + k, 66, 67], device="cuda"), torch.tensor([10 + k, 20 + 2 * k, 30], device="cuda"),
                 torch.tensor([0, 1, 2], device="cuda"), torch.tensor([1, 2 + k, 3], device="cuda"),
                 torch.tensor([0.0, 0.9, 0.5 * k], device="cuda"))
            saved = [t.clone() for t in caches]
            got = runner(*x)
            after_side = [t.clone() for t in caches]
            for t, s in zip(caches, saved):  # the same step again from the same caches, in line
                t.copy_(s)
            want = serial(*x)
            assert torch.equal(got, want)
            assert all(torch.equal(a, b) for a, b in zip(after_side, caches))
    assert serial.replays == 4


def test_chained_steps_on_the_cuda_graphs_give_the_eager_output(engine, eager, monkeypatch):
    """The Generator launches each step's successor on the CUDA graph before it reads the step's rows
    (the inputs advanced on the device, the rows copied into a pinned buffer per step in flight):
    greedy and sampled output equal the eager engine's (which never chains), and chained steps ran."""
    got, want, chained = chained_generation(engine, eager, monkeypatch)  # (chaining forced on, whatever the environment)
    assert [r.output for r in got] == [r.output for r in want]
    assert len(chained) > 3


def test_each_graph_owner_captures_on_a_stream_of_its_own():
    """GraphMemory's capture streams are created for it, not taken from torch's round-robin pool of 32, so
    no two owners (and no owner and torch.cuda.graph's default) share one; a GEMM's graph of the second
    owner replays eager's product after the first owner's graph was destroyed, its pool released and the
    allocator's cache emptied (a graph's destruction drops the cuBLAS workspaces of its capture stream)."""
    import gc

    from muse_spark.runtime.cuda_graph import GraphMemory, capture

    owners = [GraphMemory("cuda") for _ in range(40)]
    assert len({m.stream.cuda_stream for m in owners}) == 40
    default = torch.cuda.graph.default_capture_stream
    assert default is None or default.cuda_stream not in {m.stream.cuda_stream for m in owners}
    g = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    first, _ = capture(lambda: a @ w, owners[0])
    second, out = capture(lambda: a @ w, owners[1])
    first.replay()
    del first, _
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    junk = torch.full((64 << 20,), -7.0, device="cuda")  # (memory the first owner gave back, overwritten)
    out.zero_()
    second.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, a @ w)
    del junk


def test_an_engine_loaded_beside_another_keeps_its_graphs_when_the_other_goes(built, eager):
    """A model reload: a second engine loaded while the first is running, the first then dropped (its
    graphs destroyed, its pool released, the cache emptied): the second's graph replays give the eager
    engine's tokens."""
    import gc

    old = load_engine(built)
    params = [SamplingParams(max_tokens=24, temperature=t, seed=5, ignore_eos=True) for t in (0.0, 0.9)]
    want = [r.output for r in Generator(eager).generate(PROMPTS[:2], params)]
    assert [r.output for r in Generator(old).generate(PROMPTS[:2], params)] == want
    new = load_engine(built)
    del old
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert [r.output for r in Generator(new).generate(PROMPTS[:2], params)] == want
    assert sum(r.replays for r in new.runners.values()) > 0


def test_fresh_process_loads_and_generates_the_same_tokens(built, engine):
    ids = cli_generate_ids(built, [72, 101, 108], 20, temperature=0.9, seed=7)
    here = Generator(engine).generate([[72, 101, 108]], SamplingParams(max_tokens=20, temperature=0.9, seed=7,
                                                                       ignore_eos=True))[0].output
    assert ids == here


def test_refuses_an_engine_for_another_compute_capability(built, tmp_path):
    d = tmp_path / "e"
    shutil.copytree(built, d)
    m = json.loads((d / "manifest.json").read_text())
    m["device"]["compute_capability"] = [8, 0]
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match=r"compiled for compute capability 8\.0"):
        load_engine(d)
