"""The aoti backend on CPU: AOTInductor packages built by another process, loaded here.

One engine is built for the whole module (an AOTInductor compile of the tiny
pair takes about a minute and a half on two cores), by the CLI in a
subprocess, so every test also checks that a prebuilt engine loads in a process
that did not compile it.
"""

import dataclasses
import json
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from muse_spark.runtime import EagerEngine, EngineError, Generator, SamplingParams, load_engine
from muse_spark.runtime.aoti_engine import AOTIEngine, check_compatibility, machine_info, prefill_groups
from muse_spark.graphs.parts import LAYOUT
from muse_spark.options import KernelOptions

from conftest import ENGINE_PROMPTS as PROMPTS
from conftest import chained_generation, cli_generate_ids, run_cli

from conftest import AOTI_MAX_BATCH as MAX_BATCH, AOTI_MAX_SEQ as MAX_SEQ
# Lengths straddle the prefill chunk (128): one prompt takes two chunks, the last one padded.


cli = run_cli


@pytest.fixture(scope="module")
def built(aoti_built):
    return aoti_built


@pytest.fixture(scope="module")
def engine(built):
    return load_engine(built[0])


@pytest.fixture(scope="module")
def eager(agreeing_pair):
    return EagerEngine.from_checkpoints(*agreeing_pair, max_batch=MAX_BATCH, max_seq=MAX_SEQ)


def copy_engine(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---- build ---------------------------------------------------------------------------------------
def test_build_reports_progress_and_writes_the_manifest(built):
    out, log = built
    files = {"prefill_layer.pt2", "prefill_finish.pt2", "step_draft_b3.pt2", "step_layer_b3.pt2",
             "step_verify_b3.pt2", "step_context_b3.pt2",
             # (the shared engine also verifies 2 drafts per request: conftest.AOTI_NARROW_WIDTH)
             "step_layer_b3_k2.pt2", "step_verify_b3_k2.pt2", "step_context_b3_k2.pt2",
             "step_verify_ctl_b3.pt2",  # (the verification under the sampling controls)
             "prefill_layer_p3.pt2", "prefill_finish_p3.pt2"}  # (three prompt chunks at once: --prefill-batch 3)
    m = json.loads((out / "manifest.json").read_text())
    # each graph compiled, or taken from the run's build cache where an earlier build compiled its job
    cached = m["aoti"]["compile"]["cached"]
    assert all(f"[build] {name} compiled (export" in log or name in cached for name in m["aoti"]["graphs"])
    assert ("[build] compiling 12 graphs" in log) if not cached else (f"{len(cached)} of 12 graphs from" in log)
    assert m["backend"] == "aoti" and m["device"]["kind"] == "cpu"
    a = m["aoti"]
    assert a["layout"] == LAYOUT and a["plugin_impl"] == "inline"  # CPU builds trace the reference plugins
    assert a["attention_kernel"] == "reference"  # the fp32 einsums: no fused attention on CPU
    assert a["linear_kernel"] == "reference"  # F.linear on CPU
    assert a["attention_cache"] is False
    # PDL step graphs: CUDA (sm_90+) engines only
    assert a["pdl_kernels"] == [] and a["pdl_trigger"] is a["pdl_gemm_trigger"] is False
    assert a["rope_table"] is False
    assert a["attention_splits"] is None  # the Triton attention's knob: not on CPU
    assert a["batch_buckets"] == [MAX_BATCH] and a["cache_slots"] == MAX_BATCH + 1
    assert a["markov_workspace_words"] == {str(MAX_BATCH): 0}  # the reference loop keeps no workspace
    assert "markov_workspace" in a["graph_inputs"]["step_draft"]
    assert {g["file"] for g in a["graphs"].values()} == files
    # one layer package for every target layer: it takes one layer's weights
    assert a["graphs"]["step_layer_b3"] == {"file": "step_layer_b3.pt2", "fn": "layer", "batch": 3, "tokens": 6}
    assert a["graphs"]["step_layer_b3_k2"] == {"file": "step_layer_b3_k2.pt2", "fn": "layer", "batch": 3,
                                               "tokens": 3, "width": 2}
    assert a["verify_widths"] == [2, 5] and a["sampling_controls"] == {"logprobs_top": 20}
    assert a["prefill_batch"] == 3 and a["graphs"]["prefill_layer_p3"] == {
        "file": "prefill_layer_p3.pt2", "fn": "layer", "batch": 3, "tokens": a["prefill_chunk"]}
    for name in sorted(files) + ["target.safetensors", "draft.safetensors", "derived.safetensors", "tokenizer.json"]:
        assert len(m["files"][name]) == 64  # sha256 of every engine file
    assert m["versions"]["torch"] == torch.__version__
    assert KernelOptions.from_dict(m["options"]) == KernelOptions.from_env()  # the CLI's environment's


def test_packages_hold_no_python_registered_op_and_no_weights(built):
    """The C++ loader and a fresh process need nothing from Python; weights stay in safetensors."""
    out = built[0]
    for name in ("step_draft_b3", "step_layer_b3", "step_verify_b3", "step_context_b3", "prefill_finish"):
        with zipfile.ZipFile(out / f"{name}.pt2") as z:
            wrapper = [n for n in z.namelist() if n.endswith(".cpp") and "wrapper" in n]
            text = "".join(z.read(n).decode() for n in wrapper)
            assert "muse_spark" not in text and "proxy_executor_call_function" not in text
            assert sum(i.file_size for i in z.infolist()) < 20e6


# ---- output equality with the eager engine -------------------------------------------------------------
def test_loaded_engine_is_aoti_with_one_scratch_slot(engine):
    assert isinstance(engine, AOTIEngine) and engine.backend == "aoti"
    assert engine.target_cache.k[0].shape[0] == MAX_BATCH + 1 and engine.scratch_slot == MAX_BATCH


def test_greedy_output_identical_to_eager(engine, eager):
    # Different max_tokens: the batch shrinks 3 → 2 → 1 inside the one bucket (padding rows).
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 23, 9, 31)]
    got = Generator(engine).generate(PROMPTS, params)
    want = Generator(eager).generate(PROMPTS, params)
    assert [r.output for r in got] == [r.output for r in want]
    assert sum(s.accepted for r in got for s in r.steps) > 0  # multi-token acceptance really happened


def test_sampled_output_identical_to_eager_given_seeds(engine, eager):
    params = [SamplingParams(max_tokens=30, temperature=t, seed=s, ignore_eos=True)
              for t, s in ((0.8, 1), (1.0, 2), (1.3, 2**63 + 5), (0.6, 4))]
    got = Generator(engine).generate(PROMPTS, params)
    want = Generator(eager).generate(PROMPTS, params)
    assert [r.output for r in got] == [r.output for r in want]
    assert [[s.accepted for s in r.steps] for r in got] == [[s.accepted for s in r.steps] for r in want]


def test_layered_parts_compose_to_the_eager_step_and_prefill(agreeing_pair):
    """The parts the builder compiles (draft, one layer reused for every layer, verify, context), run
    uncompiled over the reference modules and composed as the runtime composes them, give the
    eager engine's step and prefill token for token and write the same caches."""
    from muse_spark.graphs.parts import (GraphFn, LayeredPrefill, LayeredStep, SpecPair, embed_and_norm,
                                                part_weight_names, weight_names, weight_tensors)

    a = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=MAX_BATCH, max_seq=MAX_SEQ)
    b = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=MAX_BATCH, max_seq=MAX_SEQ)
    pair = SpecPair(b.target, b.draft)
    names = weight_names(pair)
    weights = weight_tensors(pair, names)

    def part(fn):
        return GraphFn(pair, fn, part_weight_names(names, fn))

    L, aux_ids = b.tcfg.num_hidden_layers, b.target.aux_layer_ids
    step = LayeredStep(names, L, aux_ids, part("step_draft"), part("layer"), part("step_verify"), part("step_context"),
                       b.gamma)
    prefill = LayeredPrefill(names, L, aux_ids, embed_and_norm(b.target), part("layer"), part("prefill_finish"))
    for bad in ((), (L,)):  # the draft context starts after the last aux layer: it must be one of the layers
        with pytest.raises(ValueError, match=r"aux layer ids .*: expected some, each in \[0, "):
            LayeredStep(names, L, bad, part("step_draft"), part("layer"), part("step_verify"), part("step_context"),
                        b.gamma)
    caches_b = (b.target_cache.k, b.target_cache.v, b.draft_cache.k, b.draft_cache.v)
    with torch.inference_mode():
        prompt = [72, 101, 108, 108, 111, 44, 32, 119]
        got = prefill(weights, *caches_b, torch.tensor([prompt]), torch.arange(8)[None], torch.tensor([1]),
                      torch.tensor([7]), torch.tensor([7]), torch.tensor([0.0]))
        assert got.tolist() == a.prefill(prompt, 1, 7, 0.0).tolist()
        for anchor_pos, temp in ((8, 0.0), (14, 0.9)):
            x = (torch.tensor([65]), torch.tensor([anchor_pos]), torch.tensor([1]), torch.tensor([9]),
                 torch.tensor([temp]))
            no_ws = torch.empty(0, dtype=torch.int64)  # CPU: the reference Markov loop keeps no workspace
            assert torch.equal(step(weights, *caches_b, no_ws, *x), a.step(*x, MAX_SEQ))
        # A workspace whose error flag is up (the fused kernel's; the reference loop ignores the
        # words): the step's rows say the drafts are not valid, n = −1.
        flagged = torch.tensor([0, 0, 1, 0, 0, 0], dtype=torch.int64)
        out = step(weights, *caches_b, flagged, *x)
        g = b.gamma
        assert out[:, g].tolist() == [-1] and torch.equal(out[:, :g], a.step(*x, MAX_SEQ)[:, :g])
    for ca, cb in zip((a.target_cache.k, a.target_cache.v, a.draft_cache.k, a.draft_cache.v), caches_b):
        for ta, tb in zip(ca, cb):
            assert torch.equal(ta, tb)  # (the flagged step wrote the positions the eager one did)


@pytest.mark.parametrize("n, width, calls", [
    (0, 8, []), (1, 8, [(0, 1)]), (8, 8, [(0, 8)]), (16, 8, [(0, 8), (8, 16)]),
    # a remainder filling more than half of a call's rows: one padded call; half or less: one chunk a call
    (5, 8, [(0, 5)]), (4, 8, [(0, 1), (1, 2), (2, 3), (3, 4)]), (13, 8, [(0, 8), (8, 13)]),
    (10, 8, [(0, 8), (8, 9), (9, 10)]), (2, 3, [(0, 2)]), (4, 3, [(0, 3), (3, 4)]),
    (3, 1, [(0, 1), (1, 2), (2, 3)]), (5, 2, [(0, 2), (2, 4), (4, 5)])])
def test_prefill_groups_fill_each_batched_call_more_than_half(n, width, calls):
    assert prefill_groups(n, width) == calls


@pytest.mark.parametrize("n, width", [(-1, 4), (3, 0)])
def test_prefill_groups_refuse_a_negative_count_or_an_empty_call(n, width):
    with pytest.raises(ValueError, match="want n ≥ 0 and width ≥ 1"):
        prefill_groups(n, width)


def test_rounds_of_chunks_run_in_the_batched_prefill_with_the_single_chunks_tokens(built):
    """``--prefill-batch 3``: a round of three prompts' chunks is one call of the three-chunk packages, a round
    of two the same call with a padding row (the scratch slot), a single chunk the one-chunk packages. Each
    prompt's first token is the one its chunks give run one at a time (greedy and sampled), each slot holds
    what they write there (within the bf16 rounding of GEMMs over more rows), and no call writes outside its
    chunks' positions but in the scratch slot."""
    from muse_spark.runtime.engine import PrefillChunk

    a, b = load_engine(built[0]), load_engine(built[0])
    assert a.prefill_batch == 3 and a.prefill_batch_fn is not None
    b.prefill_batch_fn = None  # (one chunk a call)
    calls = []
    for name in ("prefill_fn", "prefill_batch_fn"):
        fn = getattr(a, name)
        setattr(a, name, lambda *x, _fn=fn, _name=name, **kw: calls.append(_name) or _fn(*x, **kw))
    g = torch.Generator().manual_seed(3)
    for ca, cb in zip(a.caches, b.caches):
        for ta, tb in zip(ca, cb):
            ta.copy_(torch.randn(ta.shape, generator=g).to(ta.dtype))
            tb.copy_(ta)
    before = [t.clone() for c in a.caches for t in c]
    C = a.prefill_chunk
    long = PROMPTS[1]  # two chunks
    rounds = [[PrefillChunk(PROMPTS[0], 0, 0, 5, 0.0), PrefillChunk(long, 0, 1, 6, 0.9),
               PrefillChunk(PROMPTS[3], 0, 2, 7, 1.2)],
              [PrefillChunk(long, C, 1, 6, 0.9), PrefillChunk(PROMPTS[2], 0, 0, 8, 0.7)],
              [PrefillChunk(PROMPTS[2], 0, 2, 9, 0.0)]]
    with torch.inference_mode():
        for chunks in rounds:
            got = a.prefill_chunks(chunks)
            want = [b.prefill_chunks([c])[0] for c in chunks]
            assert [None if t is None else t.tolist() for t in got] == [None if t is None else t.tolist() for t in want]
            assert [t is None for t in got] == [c.start + C < len(c.prompt) for c in chunks]
    assert calls == ["prefill_batch_fn", "prefill_batch_fn", "prefill_fn"]
    scratch = a.scratch_slot
    for t0, ta, tb in zip(before, [t for c in a.caches for t in c], [t for c in b.caches for t in c]):
        torch.testing.assert_close(ta[:scratch].float(), tb[:scratch].float(), atol=0.05, rtol=0.02)
        for slot in (0, 2):  # (short prompts: one chunk, its padded end at C)
            assert torch.equal(ta[slot, C:], t0[slot, C:])
        assert torch.equal(ta[scratch, C:], t0[scratch, C:]) and torch.equal(tb[scratch], t0[scratch])


def test_step_graph_equals_eager_step_and_writes_only_its_slots(engine, eager):
    """Random caches; one request in the bucket of 3: same packed result, same cache writes,
    and the padding rows touch nothing but the scratch slot."""
    g = torch.Generator().manual_seed(5)
    for t_a, t_e in zip(engine.caches, (eager.target_cache.k, eager.target_cache.v, eager.draft_cache.k,
                                        eager.draft_cache.v)):
        for a, e in zip(t_a, t_e):
            a.copy_(torch.randn(a.shape, generator=g).to(a.dtype))
            e.copy_(a[:MAX_BATCH])
    before = [t.clone() for c in engine.caches for t in c]
    x = (torch.tensor([65]), torch.tensor([57]), torch.tensor([1]), torch.tensor([9]), torch.tensor([0.0]))
    kv_len = 57 + engine.gamma + 1
    assert torch.equal(engine.step(*x, kv_len), eager.step(*x, kv_len))
    after = [t for c in engine.caches for t in c]
    written = slice(57, 57 + engine.gamma + 1)
    for b, a in zip(before, after):
        for slot in (0, 2):  # other requests' slots: untouched
            assert torch.equal(a[slot], b[slot])
        assert torch.equal(a[1, :57], b[1, :57]) and torch.equal(a[1, written.stop:], b[1, written.stop:])
    # the request's own writes are the eager engine's (bf16 rounding of fused kernels aside)
    for a, e in zip(after, [t for c in (eager.target_cache.k, eager.target_cache.v, eager.draft_cache.k,
                                        eager.draft_cache.v) for t in c]):
        torch.testing.assert_close(a[1, written].float(), e[1, written].float(), atol=0.05, rtol=0.02)


def test_step_host_gives_the_steps_rows(engine, eager):
    """The serving loop's form (host values in, lists of ints out, through the runner's host
    twins of its static inputs): the rows ``step`` gives, for a padded bucket and a full one, on
    the aoti engine and the eager engine alike. Inputs of unequal lengths are refused before
    anything is copied."""
    for n in (1, MAX_BATCH):
        lists = ([65 + i for i in range(n)], [40 + 3 * i for i in range(n)], list(range(n)),
                 [7 + i for i in range(n)], [0.0 if i % 2 == 0 else 0.8 for i in range(n)])
        tensors = [torch.tensor(v) for v in lists]
        kv_len = max(lists[1]) + engine.gamma + 1
        want = eager.step(*tensors, kv_len).tolist()
        assert engine.step(*tensors, kv_len).tolist() == want
        assert engine.step_host(*lists, kv_len) == want
        assert eager.step_host(*lists, kv_len) == want
    with pytest.raises(ValueError, match="step input seeds: expected 1 values, got 2"):
        engine.step_host([65], [40], [0], [7, 8], [0.0], 50)
    # a value the int64 rows would truncate (or wrap) is refused, not rounded
    for bad, name in (([65.5], "anchor"), ([2**70], "anchor"), ([2**63], "anchor"), (["3"], "anchor")):
        with pytest.raises(ValueError, match=f"step input {name}: expected integers"):
            engine.step_host(bad, [40], [0], [7], [0.0], 50)
    with pytest.raises(ValueError, match="step input temperature: expected numbers"):
        engine.step_host([65], [40], [0], [7], ["hot"], 50)


def test_runner_fills_its_static_inputs_and_padding_rows_alike_from_tensors_and_host_values():
    """The runner's two ways in (device tensors through ``__call__``, host values through
    ``step_host``) leave the same static inputs: the batch's values in rows [0, n), and padding rows
    pointed at the scratch slot at position 0, greedy (so a padded step writes nothing but the
    scratch slot); rows of a larger earlier batch do not linger."""
    from muse_spark.runtime.cuda_graph import StaticStep

    seen = []

    def fn(weights, *args):  # the compiled step's signature: weights, 4 caches, the Markov words, 5 inputs
        assert args[4].dtype == torch.int64 and args[4].shape == (6,) and not args[4].any()
        seen.append([t.clone() for t in args[5:]])
        return torch.arange(4 * 9).view(4, 9)

    runner = StaticStep(fn, 4, [], ([], [], [], []), scratch_slot=7, device=torch.device("cpu"), markov_words=6)
    full = ([5, 6, 7, 8], [10, 11, 12, 13], [0, 1, 2, 3], [21, 22, 23, 24], [0.5, 1.0, 0.0, 2.0])
    small = ([65, 66], [40, 41], [3, 1], [9, 10], [0.8, 0.0])
    for values in (full, small):
        n = len(values[0])
        assert runner.step_host(*values) == torch.arange(4 * 9).view(4, 9)[:n].tolist()
        by_host = seen[-1]
        runner(*(torch.tensor(v) for v in values))
        assert all(torch.equal(a, b) for a, b in zip(seen[-1], by_host))
    anchor, pos, slots, seeds, temps = by_host  # the small batch after the full one
    assert len(seen) == 4  # no step ran twice: the rows' n (column γ) was never −1
    assert anchor.tolist() == [65, 66, 0, 0] and pos.tolist() == [40, 41, 0, 0]
    assert slots.tolist() == [3, 1, 7, 7] and seeds.tolist() == [9, 10, 0, 0]
    assert temps.tolist() == pytest.approx([0.8, 0.0, 0.0, 0.0])
    # and through __call__ alone: full, small (its padding rows refilled), small again, one row
    for values in (full, small, small, ([3], [4], [2], [5], [1.5])):
        runner(*(torch.tensor(v) for v in values))
        n = len(values[0])
        for got, want, pad in zip(seen[-1], values, runner.padding):
            assert got.tolist() == pytest.approx(list(want) + [pad] * (4 - n))
    assert len(seen) == 8
    with pytest.raises(ValueError, match="does not fit the bucket of 4"):
        runner.step_host([1] * 5, [1] * 5, [1] * 5, [1] * 5, [0.0] * 5)


def test_fresh_process_generates_the_same_tokens(built, engine):
    """A new process (the CLI) loads the engine, generates, and exits cleanly."""
    ids = cli_generate_ids(built[0], [72, 101, 108], 20, temperature=0.9, seed=7)
    here = Generator(engine).generate([[72, 101, 108]], SamplingParams(max_tokens=20, temperature=0.9, seed=7,
                                                                       ignore_eos=True))[0].output
    assert ids == here


def test_loading_puts_libstdcxx_in_the_global_symbol_scope():
    """The premise and the remedy of the loader's libstdc++ step (docs/aoti.md), in a fresh process:
    after ``import torch`` a library dlopen-ed later cannot bind to libstdc++ through the global
    scope; after ``libstdcxx_global()`` it can, and it is the copy torch loaded."""
    code = ("import ctypes, torch\n"
            "from muse_spark.runtime.aoti_engine import libstdcxx_global\n"
            "g = lambda: hasattr(ctypes.CDLL(None), '_ZNSt6locale7classicEv')\n"
            "before = g(); ok = libstdcxx_global()\n"
            "maps = {l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l}\n"
            "print(before, ok, g(), len(maps))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "True", "True", "1"]


# ---- refusals -------------------------------------------------------------------------------------
def test_refuses_a_file_that_does_not_match_its_hash(built, tmp_path):
    d = copy_engine(built[0], tmp_path / "e")
    data = bytearray((d / "step_layer_b3.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "step_layer_b3.pt2").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="step_layer_b3.pt2 does not match the manifest's hash"):
        load_engine(d)


def test_refuses_an_engine_compiled_with_another_torch(built, tmp_path):
    d = copy_engine(built[0], tmp_path / "e")
    m = json.loads((d / "manifest.json").read_text())
    m["versions"]["torch"] = "2.11.0+cu130"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match=r"compiled with torch 2\.11\.0\+cu130, this runtime has torch"):
        load_engine(d)


@pytest.mark.parametrize("layout", [None, "layered"], ids=["one_graph_per_step", "layered_without_fused_norm"])
def test_refuses_an_engine_of_an_older_layout(built, tmp_path, layout):
    """The unrolled step of the first builds, and the layer package before it took and returned
    the normed input ("layered"): another calling convention, refused before anything loads."""
    d = copy_engine(built[0], tmp_path / "e")
    m = json.loads((d / "manifest.json").read_text())
    if layout is None:
        del m["aoti"]["layout"]
    else:
        m["aoti"]["layout"] = layout
    (d / "manifest.json").write_text(json.dumps(m))
    what = "one unrolled graph per step" if layout is None else f"the packages' layout '{layout}', this runtime's is '{LAYOUT}'"
    with pytest.raises(EngineError, match=f"built by another muse-spark \\({what}\\); rebuild it"):
        load_engine(d)


@pytest.mark.parametrize("words", [None, -1, "8", 2.5], ids=["missing", "negative", "string", "float"])
def test_refuses_a_manifest_without_a_valid_markov_workspace_size(built, tmp_path, words):
    """The runtime allocates each bucket's kept Markov workspace from the manifest: an entry it
    cannot use is refused with the bucket named, before any package is loaded."""
    d = copy_engine(built[0], tmp_path / "e")
    m = json.loads((d / "manifest.json").read_text())
    if words is None:
        del m["aoti"]["markov_workspace_words"]
    else:
        m["aoti"]["markov_workspace_words"] = {str(MAX_BATCH): words}
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match=f"markov_workspace_words has no valid entry for batch bucket {MAX_BATCH}"):
        load_engine(d)


@pytest.mark.parametrize("batch", [0, "3", 2.0, 2], ids=["zero", "string", "float", "no_packages"])
def test_refuses_a_manifest_whose_prefill_batch_it_cannot_use(built, tmp_path, batch):
    """A prefill batch that is no positive integer, or whose packages the manifest does not list, is refused
    with the field named (not a lookup error when the packages load)."""
    d = copy_engine(built[0], tmp_path / "e")
    m = json.loads((d / "manifest.json").read_text())
    m["aoti"]["prefill_batch"] = batch
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match=f"the manifest's prefill_batch {batch!r} names no prefill packages it lists"):
        load_engine(d)


def test_refuses_another_compute_capability_or_device_kind(built):
    m = json.loads((built[0] / "manifest.json").read_text())
    cuda_m = dict(m, device={"kind": "cuda", "name": "NVIDIA A100", "compute_capability": [8, 0]})
    h200 = {"kind": "cuda", "name": "NVIDIA H200", "compute_capability": [9, 0], "torch": torch.__version__}
    with pytest.raises(EngineError, match=r"compute capability 8\.0 \(NVIDIA A100\).*NVIDIA H200\) is 9\.0"):
        check_compatibility(cuda_m, h200)
    check_compatibility(dict(m, device={"kind": "cuda", "name": "x", "compute_capability": [9, 0]}), h200)
    with pytest.raises(EngineError, match="compiled for 'cpu' and cannot run on 'cuda'"):
        check_compatibility(m, h200)
    check_compatibility(m, machine_info(torch.device("cpu")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_refuses_a_cuda_engine_without_a_gpu(built, tmp_path):
    d = copy_engine(built[0], tmp_path / "e")
    m = json.loads((d / "manifest.json").read_text())
    m["device"] = {"kind": "cuda", "name": "NVIDIA H200", "compute_capability": [9, 0]}
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="no CUDA device is available"):
        load_engine(d)


def test_refuses_a_dtype_override(built):
    with pytest.raises(EngineError, match="runs in the dtype it was compiled for"):
        load_engine(built[0], dtype="float32")


def test_auto_plugins_fall_back_to_the_references_when_the_triton_kernels_do_not_compile(agreeing_pair, tmp_path,
                                                                                         monkeypatch):
    """CUDA builds try the Triton plugin kernels first; if they fail to compile into a package the
    build says why, rebuilds with the references, and records both in the manifest."""
    import muse_spark.builder.aoti as aoti
    from muse_spark.checkpoint import load_pair

    tried = []

    def fake_compile(jobs, workers=None, log=lambda m: None, cache=None):
        tried.append(jobs[0]["impl"])
        if jobs[0]["impl"] == "triton":
            raise RuntimeError("compiling step_b2 failed: CompilationError: boom\ntraceback …")
        return [{"name": j["name"], "file": f"{j['name']}.pt2", "fn": j["fn"], "batch": j["batch"],
                 "tokens": j["tokens"], "export_s": 0.0, "compile_s": 0.0} for j in jobs]

    monkeypatch.setattr(aoti, "resolve_plugin_impl", lambda requested, device: "triton")
    monkeypatch.setattr(aoti, "compile_graphs", fake_compile)
    logs = []
    target, draft = load_pair(*agreeing_pair)
    section = aoti.build_aoti(target, draft, tmp_path, device="cpu", max_batch=2, max_seq=64, log=logs.append)
    assert tried == ["triton", "inline"]
    assert section["plugin_impl"] == "inline" and "boom" in section["plugin_fallback"]
    assert any("rebuilding with the reference plugins" in line for line in logs)

    def always_fails(jobs, workers=None, log=None, cache=None):
        raise RuntimeError("compiling prefill failed: x")

    monkeypatch.setattr(aoti, "compile_graphs", always_fails)
    with pytest.raises(RuntimeError, match="compiling prefill failed"):  # an explicit choice never falls back
        aoti.build_aoti(target, draft, tmp_path, device="cpu", max_batch=2, max_seq=64, plugins="inline")


def test_runner_runs_a_step_again_when_the_markov_kernel_flags_an_error():
    """The step's rows carry n = −1 where the fused Markov kernel raised its error flag (its
    programs were not all resident): ``step_host`` zeroes the kept workspace and runs the step once
    more (exact: same inputs, same cache positions written); a second failure raises
    ``MarkovKernelError`` (an ``EngineError``: the serving loop fails that batch's requests)."""
    from muse_spark.runtime.cuda_graph import MarkovKernelError, StaticStep

    calls = []
    good = torch.tensor([[5, 6, 1, 9], [7, 8, 2, 3]])  # γ = 2: drafts, n, bonus

    def fn(weights, tk, tv, dk, dv, ws, *inputs):
        calls.append(ws.clone())
        failed = bool(ws[2])
        ws[0] += 1  # the kernel counts its calls; a failing call leaves its flag up
        return torch.where(torch.tensor([False, False, True, False]), -1, good) if failed else good

    runner = StaticStep(fn, 2, [], ([], [], [], []), scratch_slot=3, device=torch.device("cpu"), markov_words=8)
    host = ([1, 2], [10, 11], [0, 1], [4, 5], [0.0, 1.0])
    assert runner.step_host(*host) == good.tolist() and len(calls) == 1
    runner.markov_ws[2] = 1  # the next call fails
    assert runner.step_host(*host) == good.tolist()  # run again on a zeroed workspace
    assert len(calls) == 3 and calls[1][2] == 1 and not calls[2].any()

    def always_failing(weights, tk, tv, dk, dv, ws, *inputs):
        calls.append(None)
        return torch.full((2, 4), -1)

    runner.fn = always_failing
    with pytest.raises(MarkovKernelError, match="failed twice in a row at batch bucket 2"):
        runner.step_host(*host)
    assert len(calls) == 5 and not runner.markov_ws.any()


# ---- chained steps (the Generator launches the next step before it reads this one's rows) ----------
def test_the_generator_chains_steps_and_gives_the_unchained_output(engine, eager, monkeypatch):
    """On an aoti engine the Generator launches each step's successor (inputs advanced on the device)
    before it reads the step's rows; the output is the eager engine's (which never chains), greedy
    and sampled, while the batch shrinks; and chained steps really ran."""
    got, want, chained = chained_generation(engine, eager, monkeypatch)
    assert [r.output for r in got] == [r.output for r in want]
    assert [[s.accepted for s in r.steps] for r in got] == [[s.accepted for s in r.steps] for r in want]
    assert len(chained) > 3 and max(chained) <= MAX_SEQ


def test_a_request_cancelled_while_its_chained_step_runs_leaves_the_others_unchanged(engine):
    """Cancel a request while a chained step holding its row is in flight: its row is ignored, its
    slot freed, and the other request's output is what it is alone (outputs do not depend on batch
    mates); a request admitted into the freed slot afterwards generates what it generates alone."""
    p = SamplingParams(max_tokens=30, ignore_eos=True)
    alone = [Generator(engine).generate([prompt], p)[0].output for prompt in PROMPTS[:3]]
    gen = Generator(engine)
    a, b = gen.add(PROMPTS[0], p), gen.add(PROMPTS[1], p)
    while gen._inflight is None:
        gen.step()
    gen.cancel(b)
    c = gen.add(PROMPTS[2], p)
    while not (a.finished and c.finished):
        gen.step()
    assert b.finish_reason == "cancelled" and a.output == alone[0] and c.output == alone[2]


def test_a_chained_step_advances_the_static_inputs_as_the_host_would():
    """``launch_next``: anchor ← bonus and anchor_pos ← anchor_pos + n + 1 in the request rows, the
    padding rows untouched; its host inputs (for a retry) are the same values. More than two steps
    in flight, or a successor of any but the last step, are refused."""
    from muse_spark.runtime.cuda_graph import StaticStep

    seen = []

    def fn(weights, *args):  # packed rows from the inputs: γ = 2 drafts, n = seed % 3, bonus = anchor + 100
        anchor, pos, slots, seeds, temps = (t.clone() for t in args[5:])
        seen.append((anchor, pos, slots, seeds, temps))
        return torch.stack([anchor + 1, anchor + 2, seeds % 3, anchor + 100], 1)

    runner = StaticStep(fn, 4, [], ([], [], [], []), scratch_slot=7, device=torch.device("cpu"))
    h1 = runner.launch_host([5, 6], [10, 20], [0, 1], [4, 5], [0.0, 0.5])
    h2 = runner.launch_next(h1)
    anchor, pos, slots, seeds, temps = seen[-1]
    assert anchor.tolist() == [105, 106, 0, 0] and pos.tolist() == [12, 23, 0, 0]
    assert slots.tolist() == [0, 1, 7, 7] and seeds.tolist() == [4, 5, 0, 0] and temps.tolist() == [0.0, 0.5, 0, 0]
    assert runner.rows(h1) == [[6, 7, 1, 105], [7, 8, 2, 106]]
    assert h2.host_inputs() == ([105, 106], [12, 23], [0, 1], [4, 5], [0.0, 0.5])
    with pytest.raises(ValueError, match="must be the last one"):
        runner.launch_next(h1)
    h3 = runner.launch_next(h2)
    with pytest.raises(ValueError, match="more than two in flight"):
        runner.rows(h1)
    assert runner.rows(h2) == [[106, 107, 1, 205], [107, 108, 2, 206]] and runner.rows(h3)[0][-1] == 305


def test_an_engine_runs_with_the_options_its_manifest_records(built, tmp_path, monkeypatch):
    """The runtime reads the kernel options back from the manifest: an engine whose manifest records
    options other than the defaults (here written into a copy's manifest, as a build with them would)
    runs with them: no chained steps, no second stream; one whose manifest has none runs with the
    defaults. A key this runtime does not know is refused."""
    for f in dataclasses.fields(KernelOptions):
        monkeypatch.delenv(f.metadata["env"], raising=False)
    d = copy_engine(built[0], tmp_path / "e")
    m = json.loads((d / "manifest.json").read_text())
    opts = KernelOptions(pdl=False, context_stream=False, chained_steps=False)
    (d / "manifest.json").write_text(json.dumps(dict(m, options=opts.to_dict())))
    engine = load_engine(d)
    assert engine.options == opts and not engine.chains
    assert all(runner.fn.side is None for runner in engine.runners.values())
    del m["options"]
    (d / "manifest.json").write_text(json.dumps(m))
    assert load_engine(d).options == KernelOptions()
    (d / "manifest.json").write_text(json.dumps(dict(m, options={"qkv_epilogue": True})))
    with pytest.raises(ValueError, match=r"manifest options: unknown kernel option\(s\) \['qkv_epilogue'\]"):
        load_engine(d)


def test_chained_steps_follow_their_option(engine, monkeypatch):
    """The kernel option ``chained_steps``: on (the default), an engine chains; off, the Generator waits
    for every step (and it gives the same output)."""
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    assert engine.options.chained_steps and engine.chains
    want = Generator(engine).generate(PROMPTS[:2], p)
    monkeypatch.setattr(engine, "options", dataclasses.replace(engine.options, chained_steps=False))
    assert not engine.chains
    gen = Generator(engine)
    got = gen.generate(PROMPTS[:2], p)
    assert [r.output for r in got] == [r.output for r in want] and gen._inflight is None


def test_a_flagged_chained_step_runs_again_from_its_own_inputs():
    """``rows`` of a step whose Markov kernel raised its flag, read after its successor was launched
    (so the static inputs had moved on): the step runs once more on a zeroed workspace from its own
    inputs put back, ``redone`` is set (the Generator drops the successor), and a second failure
    raises ``MarkovKernelError``, as ``step_host`` does."""
    from muse_spark.runtime.cuda_graph import MarkovKernelError, StaticStep

    seen = []

    def fn(weights, tk, tv, dk, dv, ws, anchor, pos, slots, seeds, temps):
        seen.append((anchor[:2].tolist(), pos[:2].tolist(), ws.clone()))
        failed = bool(ws[2])
        ws[0] += 1
        rows = torch.stack([anchor + 1, anchor + 2, seeds % 3, anchor + 100], 1)
        return torch.where(torch.tensor([False, False, True, False]), -1, rows) if failed else rows

    runner = StaticStep(fn, 2, [], ([], [], [], []), scratch_slot=3, device=torch.device("cpu"), markov_words=8)
    runner.markov_ws[2] = 1  # the first step fails
    h1 = runner.launch_host([5, 6], [10, 20], [0, 1], [4, 5], [0.0, 0.5])
    h2 = runner.launch_next(h1)  # from h1's invalid rows
    assert runner.rows(h1) == [[6, 7, 1, 105], [7, 8, 2, 106]] and h1.redone
    assert seen[-1][:2] == ([5, 6], [10, 20]) and not seen[-1][2][1:].any()  # h1's inputs, a zeroed workspace
    assert len(seen) == 3 and not h2.redone
    runner.markov_ws[2] = 1
    runner.fn = lambda *a: torch.full((2, 4), -1)
    h3 = runner.launch_host([5, 6], [10, 20], [0, 1], [4, 5], [0.0, 0.5])
    with pytest.raises(MarkovKernelError, match="failed twice in a row at batch bucket 2"):
        runner.rows(h3)
