"""Prefix caching (runtime/prefix_cache.py): a prompt that starts with a stored prefix skips its
prefill and gets the tokens it gets without the cache; the store stays within its capacity."""

from __future__ import annotations

import pytest

from muse_spark.runtime import EagerEngine, Generator, SamplingParams
from muse_spark.runtime.prefix_cache import PrefixCache

CHUNK = 8
SYSTEM = [32 + (7 * i) % 90 for i in range(40)]  # a shared "system prompt": 5 chunks


@pytest.fixture(scope="module")
def engine(agreeing_pair):
    e = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=3, max_seq=192)
    e.prefill_chunk = CHUNK
    return e


def _prompts():
    return [SYSTEM + [65, 66, 67], SYSTEM + [70], SYSTEM[:20] + [1, 2, 3], SYSTEM + [65, 66, 67]]


PARAMS = [SamplingParams(max_tokens=20, ignore_eos=True), SamplingParams(max_tokens=16, temperature=0.9, seed=3,
                                                                         ignore_eos=True),
          SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=20, temperature=1.0, seed=8,
                                                                         ignore_eos=True)]


def test_hits_skip_the_prefix_and_give_the_same_tokens(engine, monkeypatch):
    plain = [r.output for r in Generator(engine).generate(_prompts(), PARAMS)]
    cache = PrefixCache(engine, capacity_bytes=1 << 30)
    gen = Generator(engine, prefix_cache=cache)
    first = gen.generate(_prompts()[:1], PARAMS[:1])[0]  # stores the system prompt's 5 chunks
    assert cache.stats()["blocks"] == 5 and first.output == plain[0]
    prefilled = []
    real = engine.prefill_chunks
    monkeypatch.setattr(engine, "prefill_chunks", lambda chunks: (prefilled.extend(c.start for c in chunks),
                                                                  real(chunks))[1])
    got = [r.output for r in gen.generate(_prompts()[1:], PARAMS[1:])]
    assert got == plain[1:]
    # the two prompts behind the whole system prompt start prefilling at chunk 5 (token 40), the one that
    # leaves it after 20 tokens at chunk 2 (token 16): each prefills one chunk
    assert sorted(prefilled) == [16, 40, 40]
    s = cache.stats()
    assert s["hits"] == 3 and s["reused_tokens"] == 40 + 16 + 40


def test_the_store_keeps_to_its_capacity_and_evicts_least_recently_used(engine):
    block_bytes = engine.block_bytes(CHUNK)
    cache = PrefixCache(engine, capacity_bytes=3 * block_bytes)
    gen = Generator(engine, prefix_cache=cache)
    gen.generate([SYSTEM + [5]], SamplingParams(max_tokens=4, ignore_eos=True))
    s = cache.stats()
    assert s["blocks"] == 3 and s["bytes"] <= 3 * block_bytes and s["evicted_blocks"] == 2
    # the deepest chunks went first: a request behind the system prompt finds its first three
    assert cache.lookup(SYSTEM + [6]) == 3
    out = gen.generate([SYSTEM + [6]], SamplingParams(max_tokens=8, ignore_eos=True))[0].output
    assert out == Generator(engine).generate([SYSTEM + [6]], SamplingParams(max_tokens=8, ignore_eos=True))[0].output


def test_a_one_token_remainder_is_always_prefilled(engine):
    cache = PrefixCache(engine, capacity_bytes=1 << 30)
    gen = Generator(engine, prefix_cache=cache)
    gen.generate([SYSTEM], SamplingParams(max_tokens=4, ignore_eos=True))  # exactly 5 chunks
    assert cache.lookup(SYSTEM) == 4  # the last chunk is prefilled again, for the first token's logits
    again = gen.generate([SYSTEM], SamplingParams(max_tokens=10, ignore_eos=True))[0].output
    assert again == Generator(engine).generate([SYSTEM], SamplingParams(max_tokens=10, ignore_eos=True))[0].output
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(engine, -1)


def test_the_serving_scheduler_reuses_prefixes(engine):
    """The scheduler thread the servers share (``prefix_cache_bytes``): a request behind a stored system
    prompt gets its plain tokens, and the store records the hit."""
    import threading

    from muse_spark.serving.scheduler import Scheduler

    class Sink:
        def __init__(self):
            self.tokens, self.done = [], threading.Event()

        def deliver(self, req, new):
            self.tokens += new
            if req.finished:
                self.done.set()

        def fail(self, message, kind):
            self.done.set()

        def cancelled(self):
            return False

    sched = Scheduler(engine, prefix_cache_bytes=1 << 30, log=lambda *a: None)
    sched.start()
    try:
        outs = []
        for prompt in (SYSTEM + [65], SYSTEM + [66, 67]):
            sink = Sink()
            sched.submit(prompt, SamplingParams(max_tokens=12, ignore_eos=True), sink)
            assert sink.done.wait(60)
            outs.append(sink.tokens)
    finally:
        sched.stop()
    plain = Generator(engine).generate([SYSTEM + [65], SYSTEM + [66, 67]], SamplingParams(max_tokens=12,
                                                                                          ignore_eos=True))
    assert outs == [r.output for r in plain]
    assert sched.gen.prefix_cache.stats()["hits"] == 1


# ---- prompts shared by requests running at once: prefilled once -------------------------------------
def _alone(engine, prompts, params):
    """Each request by itself, nothing shared: the reference."""
    out = []
    for prompt, p in zip(prompts, params):
        gen = Generator(engine)
        gen.share_prefill = False
        out.append(gen.generate([prompt], [p])[0].output)
    return out


def _spied(engine, monkeypatch):
    """The (slot, start) of every chunk the engine prefills (the real calls, recorded)."""
    seen, real = [], engine.prefill_chunks
    monkeypatch.setattr(engine, "prefill_chunks", lambda chunks: (seen.extend((c.slot, c.start) for c in chunks),
                                                                  real(chunks))[1])
    return seen


def test_samples_of_one_prompt_prefill_it_once(engine, monkeypatch):
    """n samples of a prompt (OpenAI's n, Triton's num_return_sequences): the first prefills every chunk,
    the others copy all but their last chunk from its slot and prefill that one (their first token comes
    from their own seed); each sample's tokens are the ones it gets alone."""
    prompt = SYSTEM + [65, 66, 67]  # 43 tokens: chunks at 0, 8, …, 40
    params = [SamplingParams(max_tokens=14, temperature=4.0, seed=s, ignore_eos=True) for s in range(3)]
    want = _alone(engine, [prompt] * 3, params)
    seen = _spied(engine, monkeypatch)
    gen = Generator(engine)
    assert [r.output for r in gen.generate([prompt] * 3, params)] == want
    assert len(set(map(tuple, want))) == 3  # (three different samples)
    assert gen.shared_prefill_tokens == 2 * 40
    assert sorted(start for _, start in seen) == [0, 8, 16, 24, 32, 40, 40, 40]


def test_requests_with_a_common_start_share_its_chunks_and_a_donor_may_finish_first(engine, monkeypatch):
    """Prompts that share their first chunks but not their ends, one of them done after one token (its
    slot freed while the others still prefill): every request gets its own tokens."""
    prompts = [SYSTEM + [65, 66, 67], SYSTEM[:24] + [1, 2, 3, 4, 5], SYSTEM + [70]]
    params = [SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)]
    want = _alone(engine, prompts, params)
    seen = _spied(engine, monkeypatch)
    gen = Generator(engine)
    assert [r.output for r in gen.generate(prompts, params)] == want
    # the second copies its 3 shared chunks, the third its first 5 (all before its last chunk)
    assert gen.shared_prefill_tokens == 3 * CHUNK + 5 * CHUNK
    assert len(seen) == 6 + 1 + 1
