"""Bad input gets a clear error and loses nothing; engine directories are checked."""

import json
import math
import shutil

import pytest

from muse_spark.builder.build import build_engine
from muse_spark.runtime import EngineError, Generator, RequestError, SamplingParams, load_engine
from muse_spark.runtime.target_only import generate_target_only


@pytest.fixture(scope="module")
def engine_dir(agreeing_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("engines") / "tiny"
    build_engine(*agreeing_pair, out, max_batch=4, max_seq=96, quiet=True)
    return out


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "the prompt is empty"),
        ([1, 259], SamplingParams(), r"prompt token ids \[259\] are outside the vocabulary \[0, 259\)"),
        ([-1], SamplingParams(), "outside the vocabulary"),
        ([1], SamplingParams(max_tokens=0), "max_tokens must be a positive integer, got 0"),
        ([1], SamplingParams(max_tokens=-3), "max_tokens must be a positive integer"),
        ([1], SamplingParams(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
        ([1], SamplingParams(temperature=math.nan), "temperature must be a finite number >= 0, got nan"),
        ([1], SamplingParams(temperature=math.inf), "temperature must be a finite number"),
        ([1], SamplingParams(stop_token_ids=(999,)), r"stop token ids \[999\] are outside the vocabulary"),
        ([1], SamplingParams(stop_sequences=((3, 999),)), r"stop sequences must be at most 16 tuples of 1 … 64"),
        ([1], SamplingParams(stop_sequences=((),)), "stop sequences must be"),
        ([1], SamplingParams(stop_sequences=[(1, 2)]), "stop sequences must be"),
        ([1] * 50, SamplingParams(max_tokens=50),
         r"prompt length 50 \+ max_tokens 50 \(\+ 5 draft slots\) = 105 exceeds the engine's maximum sequence length 96"),
    ],
)
def test_bad_requests_get_clear_errors(engine_dir, prompt, params, message):
    engine = load_engine(engine_dir)
    gen = Generator(engine)
    with pytest.raises(RequestError, match=message):
        gen.add(prompt, params)
    assert not gen.has_work() and len(gen.free_slots) == engine.max_batch


def test_a_failing_request_never_corrupts_the_others(engine_dir):
    engine = load_engine(engine_dir)
    gen = Generator(engine)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    good = [gen.add([1, 2, 3], params), gen.add([50, 60], params)]
    gen.step()
    for bad in ([], [1000], [1] * 95):
        with pytest.raises(RequestError):
            gen.add(bad, params)
    gen.step()
    # A request cancelled mid-flight frees its slot; the others go on.
    victim = gen.add([9, 9, 9], params)
    gen.step()
    gen.cancel(victim)
    assert victim.finish_reason == "cancelled"
    gen.run()
    for r in good:
        assert r.output == generate_target_only(engine, r.prompt, params)
    assert sorted(gen.free_slots) == list(range(engine.max_batch))


def test_more_requests_than_slots_queue(engine_dir):
    engine = load_engine(engine_dir)  # 4 slots
    gen = Generator(engine)
    prompts = [[i + 1, i + 2] for i in range(9)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reqs = gen.generate(prompts, params)
    for r in reqs:
        assert r.output == generate_target_only(engine, r.prompt, params)
    assert len(gen.free_slots) == 4


def test_streaming_yields_what_generate_returns(engine_dir):
    engine = load_engine(engine_dir)
    params = SamplingParams(max_tokens=23, temperature=0.7, seed=3, ignore_eos=True)
    chunks = list(Generator(engine).stream([5, 6, 7], params))
    assert len(chunks) > 1 and len(chunks[0]) == 1  # the first token comes from prefill
    assert sum(chunks, []) == Generator(engine).generate([[5, 6, 7]], params)[0].output


def test_closing_a_stream_early_frees_the_slot(engine_dir):
    engine = load_engine(engine_dir)
    gen = Generator(engine)
    it = gen.stream([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    next(it)
    next(it)
    it.close()
    assert len(gen.free_slots) == engine.max_batch and not gen.has_work()


def test_manifest_records_what_the_design_asks(engine_dir):
    m = json.loads((engine_dir / "manifest.json").read_text())
    for key in ("schema_version", "backend", "device", "versions", "target_config", "draft_config",
                "checkpoint_hashes", "dtype", "gamma", "max_seq", "batch_buckets", "plugins", "tokenizer",
                "tokenizer_config", "files"):
        assert key in m
    assert m["backend"] == "eager" and m["gamma"] == 5 and m["batch_buckets"] == [1, 2, 4]
    assert set(m["files"]) == {"target.safetensors", "draft.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert len(m["checkpoint_hashes"]["target"]) == 64


def test_missing_engine_directory():
    with pytest.raises(EngineError, match="does not exist"):
        load_engine("/nonexistent/engine")


def test_directory_without_manifest(tmp_path):
    with pytest.raises(EngineError, match="manifest.json is missing"):
        load_engine(tmp_path)


def _copy(engine_dir, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(engine_dir, dst)
    return dst


def test_corrupted_weights_are_refused(engine_dir, tmp_path):
    d = _copy(engine_dir, tmp_path)
    data = bytearray((d / "draft.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (d / "draft.safetensors").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="draft.safetensors does not match the manifest's hash"):
        load_engine(d)


def test_missing_engine_file_is_refused(engine_dir, tmp_path):
    d = _copy(engine_dir, tmp_path)
    (d / "target.safetensors").unlink()
    with pytest.raises(EngineError, match="engine file target.safetensors is missing"):
        load_engine(d)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: "{broken", "corrupted manifest"),
        (lambda m: json.dumps({**m, "schema_version": 99}), "schema version 99 is not supported"),
        (lambda m: json.dumps({**m, "backend": "quantum"}), "backend 'quantum' is not supported"),
        (lambda m: json.dumps({**m, "plugins": {**m["plugins"], "markov_sample": 0}}), "plugin markov_sample v0"),
        (lambda m: json.dumps({k: v for k, v in m.items() if k != "gamma"}), "manifest lacks 'gamma'"),
        (lambda m: json.dumps({**m, "format": "other"}), "not a Muse Spark engine manifest"),
    ],
)
def test_bad_manifests_are_refused(engine_dir, tmp_path, edit, message):
    d = _copy(engine_dir, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(edit(m))
    with pytest.raises(EngineError, match=message):
        load_engine(d)


def test_build_refuses_to_overwrite_a_foreign_directory(agreeing_pair, tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an engine directory"):
        build_engine(*agreeing_pair, tmp_path, quiet=True)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_build_limits_are_checked(agreeing_pair, tmp_path):
    with pytest.raises(ValueError, match="exceeds the target's max_position_embeddings"):
        build_engine(*agreeing_pair, tmp_path / "e", max_seq=10**6, quiet=True)
    with pytest.raises(ValueError, match="--max-batch must be >= 1"):
        build_engine(*agreeing_pair, tmp_path / "e", max_batch=0, quiet=True)


def test_a_prefill_failure_fails_that_request_alone(engine_dir, monkeypatch):
    engine = load_engine(engine_dir)
    gen = Generator(engine)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ok = gen.add([1, 2, 3], params)
    gen.step()
    real = engine.prefill_chunks

    def failing(chunks):
        if any(c.prompt == [66, 66] for c in chunks):
            raise RuntimeError("simulated device failure")
        return real(chunks)

    monkeypatch.setattr(engine, "prefill_chunks", failing)
    bad = gen.add([66, 66], params)
    gen.run()
    assert bad.finish_reason == "error" and "simulated device failure" in bad.error
    assert ok.output == generate_target_only(engine, ok.prompt, params)
    assert len(gen.free_slots) == engine.max_batch


def test_tiny_temperatures_are_greedy(engine_dir):
    engine = load_engine(engine_dir)
    tiny = Generator(engine).generate([[4, 5]], SamplingParams(max_tokens=10, temperature=1e-9, seed=3))[0]
    assert tiny.params.temperature == 0.0
    assert tiny.output == generate_target_only(engine, [4, 5], SamplingParams(max_tokens=10))


def test_a_stop_sequence_ends_the_output_across_step_boundaries(engine_dir):
    """The output ends with the first stop sequence it completes (kept, as a stop token is), wherever the
    steps split it, and not before min_tokens tokens are out."""
    engine = load_engine(engine_dir)
    free = Generator(engine).generate([[4, 5, 6]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    steps = [len(s.emitted) for s in free.steps]
    assert max(steps) > 1  # (steps emit several tokens: a sequence can straddle two)
    for end in (3, 9, 17, 26):
        seq = tuple(free.output[end - 3:end])
        first = next(i + 3 for i in range(len(free.output) - 2) if tuple(free.output[i:i + 3]) == seq)
        r = Generator(engine).generate([[4, 5, 6]], SamplingParams(max_tokens=40, ignore_eos=True,
                                                                  stop_sequences=(seq, (258, 257))))[0]
        assert r.output == free.output[:first] and r.finish_reason == "stop"
    late = Generator(engine).generate([[4, 5, 6]], SamplingParams(
        max_tokens=40, ignore_eos=True, min_tokens=12, stop_sequences=(tuple(free.output[3:6]),)))[0]
    assert len(late.output) >= 12 and late.output == free.output[:len(late.output)]
