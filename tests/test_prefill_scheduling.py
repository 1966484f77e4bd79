"""Prefill that does not stall decoding: the Generator prefills prompts chunk by chunk, several
requests' chunks in one engine call, one round of at most ``prefill_budget`` tokens per iteration
between speculative steps, with the tokens of the old one-prompt-at-a-time admission."""

from __future__ import annotations

import pytest

from muse_spark.runtime import EagerEngine, Generator, SamplingParams
from muse_spark.runtime.target_only import generate_target_only

CHUNK = 8


@pytest.fixture(scope="module")
def engine(agreeing_pair):
    e = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=4, max_seq=256)
    e.prefill_chunk = CHUNK  # small chunks: a 100-token prompt is 13 of them
    return e


def _calls(engine, monkeypatch):
    """Record the chunks of every ``prefill_chunks`` call (the real one runs)."""
    calls, real = [], engine.prefill_chunks

    def spy(chunks):
        calls.append([(len(c.prompt), c.start, c.slot) for c in chunks])
        return real(chunks)

    monkeypatch.setattr(engine, "prefill_chunks", spy)
    return calls


def test_a_long_prompt_arriving_mid_stream_never_freezes_the_running_stream(engine, monkeypatch):
    gen = Generator(engine, prefill_budget=CHUNK)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    running = gen.add([65, 66, 67], params)
    gen.step()
    gen.step()
    long_prompt = [40 + i % 50 for i in range(100)]
    late = gen.add(long_prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    calls = _calls(engine, monkeypatch)
    while not late.output:  # the long prompt's 13 chunks, one a call
        before = len(running.output)
        gen.step()
        assert len(running.output) > before or running.finished  # a step every call
    assert len(calls) == 13 and all(len(c) == 1 for c in calls)
    gen.run()
    assert running.output == generate_target_only(engine, running.prompt, params)
    assert late.output == generate_target_only(engine, late.prompt, late.params)
    assert sorted(gen.free_slots) == list(range(engine.max_batch))


def test_a_burst_is_prefilled_in_shared_rounds_within_the_budget(engine, monkeypatch):
    gen = Generator(engine, prefill_budget=3 * CHUNK)
    prompts = [[70 + i] * (5 + 6 * i) for i in range(4)]  # 5, 11, 17, 23 tokens: 1, 2, 3, 3 chunks
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True) for i in range(4)]
    calls = _calls(engine, monkeypatch)
    reqs = gen.generate(prompts, params)
    assert len(calls[0]) == 3  # the first round: three requests' chunks in one call
    for call in calls:
        tokens = sum(min(CHUNK, length - start) for length, start, _ in call)
        assert tokens <= 3 * CHUNK or len(call) == 1
    for r, p, sp in zip(reqs, prompts, params):  # the tokens each gets alone, old admission included
        assert r.output == Generator(engine, prefill_budget=10**6).generate([p], sp)[0].output


def test_batched_chunks_equal_one_at_a_time(engine):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7], [1] * 30]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    together = Generator(engine, prefill_budget=10**6).generate(prompts, params)
    for r in together:
        assert r.output == generate_target_only(engine, r.prompt, params)


def test_cancelling_a_request_during_its_prefill_frees_its_slot(engine):
    gen = Generator(engine, prefill_budget=CHUNK)
    keep = gen.add([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    gone = gen.add(list(range(1, 90)), SamplingParams(max_tokens=30, ignore_eos=True))
    gen.step()
    gen.step()
    assert gone in gen.prefilling and 0 < gone.prefilled < len(gone.prompt)
    gen.cancel(gone)
    assert gone.finish_reason == "cancelled" and gone.output == [] and gone not in gen.prefilling
    gen.run()
    assert keep.output == generate_target_only(engine, keep.prompt, keep.params)
    assert sorted(gen.free_slots) == list(range(engine.max_batch)) and not gen.has_work()


def test_no_request_starves_and_each_finishes_once(engine):
    gen = Generator(engine, prefill_budget=CHUNK)
    reqs = [gen.add([10 + i] * (1 + 13 * i), SamplingParams(max_tokens=5 + i, ignore_eos=True)) for i in range(7)]
    ends = {}
    steps = 0
    while gen.has_work():
        gen.step()
        steps += 1
        for r in reqs:
            if r.finished:
                ends.setdefault(r.id, steps)
        assert steps < 500
    assert len(ends) == 7 and all(r.finish_reason == "length" for r in reqs)
    assert [len(r.output) for r in reqs] == [5 + i for i in range(7)]
