"""Paged KV caches (runtime/kv_blocks.py) on the eager engine: the caches as pools of blocks addressed
through per-slot block tables, requests admitted while blocks are free, the newest preempted when the
running ones outgrow the pool. Every output equals the contiguous caches' token for token. The pair is the
random one: its tokens depend on the whole context (the agreeing pair's hardly look past the last token),
so a request that read another's keys would show it."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch

from muse_spark.engine_format import EngineError
from muse_spark.plugins.attention.reference import CacheKV, KeyBounds, PagedKV, cache_rows
from muse_spark.runtime import Generator, SamplingParams, load_engine
from muse_spark.runtime.engine import EagerEngine
from muse_spark.runtime.kv_blocks import BlockPoolError, BlockTables

from conftest import run_cli

MAX_SEQ = 128


def _engine(pair, kv_tokens=None, block=16, max_batch=4, max_seq=MAX_SEQ, **kw):
    if kv_tokens is not None:
        kw.update(kv_tokens=kv_tokens, kv_block_size=block)
    return EagerEngine.from_checkpoints(*pair, max_batch=max_batch, max_seq=max_seq, **kw)


def _workload(n, seed, max_prompt=60, max_tokens=(10, 50)):
    rng = random.Random(seed)
    prompts = [[rng.randrange(30, 250) for _ in range(rng.randrange(2, max_prompt))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(*max_tokens), temperature=rng.choice([0.0, 0.9]), seed=i,
                             ignore_eos=True) for i in range(n)]
    return prompts, params


def poison_freed_blocks(engine) -> None:
    """Fill each block with NaN as it goes back to the pool, and a registered block as the pool takes it for
    another request: a request that read a block it does not hold (or lost a position when preempted)
    would emit other tokens."""
    kv, release, take = engine.kv, engine.kv.release, engine.kv._take

    def poison(ids):
        with torch.inference_mode():
            for cache in engine._all_caches():
                cache[ids] = float("nan")

    def poisoned_release(slot):
        poison([b for b in kv.owned[slot] if kv.refs[b] == 1 and b not in kv.key_of])
        release(slot)

    def poisoned_take():
        b = take()
        poison([b])
        return b

    kv.release, kv._take = poisoned_release, poisoned_take


@pytest.fixture(scope="module")
def pair(random_pair):
    return random_pair


@pytest.fixture(scope="module")
def contiguous(pair):
    return _engine(pair)


def test_the_paged_provider_writes_and_reads_what_the_slot_caches_do():
    """Keys and values written through block tables (scattered, out-of-order blocks) read back as the
    slot-indexed caches' rows, position for position."""
    g = torch.Generator().manual_seed(0)
    B, S, T, KV, Dh, P = 3, 5, 40, 2, 16, 8
    slot_k, slot_v = torch.zeros(B, 64, KV, Dh), torch.zeros(B, 64, KV, Dh)
    pool_k, pool_v = torch.zeros(30, P, KV, Dh), torch.zeros(30, P, KV, Dh)
    table = (torch.randperm(29, generator=g)[: B * 8] + 1).view(B, 8)  # (no block in two tables)
    for start in (0, 9, 35):  # three writes, as prefill then steps
        pos = torch.arange(start, start + S)[None].repeat(B, 1)
        k, v = torch.randn(B, S, KV, Dh, generator=g), torch.randn(B, S, KV, Dh, generator=g)
        mask = KeyBounds(pos, T)
        want = CacheKV(slot_k, slot_v, torch.arange(B), pos, mask)(k, v)
        got = PagedKV(pool_k, pool_v, table, pos, mask)(k, v)
    keys, values = cache_rows(got[0], got[1], mask, got[3])  # (what the attention reads: the gathered blocks)
    assert torch.equal(keys, slot_k[:, :T]) and torch.equal(values, slot_v[:, :T]) and got[2] is mask
    assert got[3] is table and want[3] is not None


def test_a_paged_engine_gives_the_contiguous_tokens_greedy_and_sampled(pair, contiguous):
    prompts, params = _workload(6, seed=1)
    want = [r.output for r in Generator(contiguous).generate(prompts, params)]
    paged = _engine(pair, kv_tokens=4 * MAX_SEQ)
    poison_freed_blocks(paged)
    gen = Generator(paged)
    assert [r.output for r in gen.generate(prompts, params)] == want
    assert gen.preemptions == 0 and len(paged.kv.free) == paged.kv.blocks - 1  # every block back
    paged.kv.check()


def test_a_pool_too_small_for_all_preempts_the_newest_and_loses_no_token(pair, contiguous):
    """160 positions for 4 slots of requests up to ~110: the pool runs short mid-generation, the newest
    request is preempted (its K/V copied out, its blocks freed) and resumes with the same tokens."""
    prompts, params = _workload(8, seed=0)
    want = [r.output for r in Generator(contiguous).generate(prompts, params)]
    paged = _engine(pair, kv_tokens=160)
    poison_freed_blocks(paged)
    gen = Generator(paged)
    reqs = gen.generate(prompts, params)
    assert [r.output for r in reqs] == want
    assert gen.preemptions > 0 and any(r.preempted for r in reqs)
    assert all(r.finish_reason == "length" for r in reqs)
    paged.kv.check()
    assert len(paged.kv.free) == paged.kv.blocks - 1


def swapped_out_bytes(gen) -> int:
    """The host bytes the copies of the generator's swapped-out requests hold, counted from the copies."""
    return sum(t.numel() * t.element_size() for r in gen.waiting if r.swapped is not None for t in r.swapped)


@pytest.mark.parametrize("swap_tokens", [0, MAX_SEQ], ids=["no_swap_space", "one_window_of_swap_space"])
def test_past_the_swap_space_a_preempted_request_is_recomputed_with_the_same_tokens(pair, contiguous, swap_tokens):
    """A swap space of nothing, or of one window's K/V: a running request whose copy would pass it is
    preempted by recompute (its blocks freed, its prompt and emitted tokens prefilled again when it resumes),
    the others are swapped out; greedy and seeded, every output is the contiguous engine's, the copies never
    hold more than the swap space (counted from the copies, after every step), and the pool and the host
    memory are empty at the end."""
    prompts, params = _workload(10, seed=3)
    want = [r.output for r in Generator(contiguous).generate(prompts, params)]
    probe = _engine(pair, kv_tokens=160)
    bound = probe.block_bytes(swap_tokens)
    paged = _engine(pair, kv_tokens=160, swap_space=bound / 2**30)
    assert paged.swap_space_bytes == bound
    poison_freed_blocks(paged)
    gen = Generator(paged)
    reqs = [gen.add(p, sp) for p, sp in zip(prompts, params)]
    while gen.has_work():
        gen.step()
        assert gen.swapped_bytes == swapped_out_bytes(gen) <= bound
    assert [r.output for r in reqs] == want
    assert gen.recomputations > 0 and gen.swapped_bytes_peak <= bound
    if swap_tokens:
        assert gen.swapped_bytes_peak > 0 and gen.recomputations < gen.preemptions  # (both kinds ran)
    else:
        assert gen.recomputations == gen.preemptions
    assert gen.swapped_bytes == 0 and all(r.swapped is None and not r.recompute for r in reqs)
    paged.kv.check()
    assert len(paged.kv.free) == paged.kv.blocks - 1


def test_the_swap_space_is_checked():
    from muse_spark.runtime.kv_blocks import SWAP_SPACE_GIB, swap_space_bytes

    assert SWAP_SPACE_GIB == 4 and swap_space_bytes(4) == 4 * 2**30 and swap_space_bytes(0) == 0
    for bad in (-1, float("nan"), float("inf"), "4", True):
        with pytest.raises(EngineError, match="swap space must be a finite number of GiB >= 0"):
            swap_space_bytes(bad)


@pytest.mark.parametrize("swap_space", [None, 0], ids=["swapped", "recomputed"])
def test_arrivals_and_cancellations_between_steps_keep_tokens_and_blocks(pair, contiguous, swap_space):
    prompts, params = _workload(6, seed=2)
    want = [r.output for r in Generator(contiguous).generate(prompts, params)]
    paged = _engine(pair, kv_tokens=192, **({} if swap_space is None else {"swap_space": swap_space}))
    poison_freed_blocks(paged)
    gen = Generator(paged)
    reqs = [gen.add(prompts[0], params[0]), gen.add(prompts[1], params[1])]
    victim = gen.add([40, 41, 42], SamplingParams(max_tokens=90, ignore_eos=True))
    for i in range(2, 6):
        gen.step()
        gen.step()
        reqs.append(gen.add(prompts[i], params[i]))
        if i == 3:
            gen.cancel(victim)  # (holding blocks, maybe swapped out: either way they come back)
    gen.run()
    assert [r.output for r in reqs] == want
    assert victim.finish_reason == "cancelled" and victim.swapped is None
    assert gen.swapped_bytes == 0 and gen.preemptions > 0 and (gen.recomputations > 0) == (swap_space == 0)
    paged.kv.check()
    assert len(paged.kv.free) == paged.kv.blocks - 1


def test_a_thousand_requests_with_random_lengths_and_cancels_leave_the_pool_full(pair):
    # (a swap space of a quarter window: some preempted requests swapped out, others recomputed)
    paged = _engine(pair, kv_tokens=256 + 16, max_batch=8, max_seq=256,
                    swap_space=_engine(pair, max_batch=1).block_bytes(64) / 2**30)
    gen = Generator(paged)
    rng = random.Random(7)
    system = [rng.randrange(30, 250) for _ in range(128)]  # (a fifth of the prompts start with it)
    live = []
    for i in range(1000):
        tail = [rng.randrange(30, 250) for _ in range(rng.randrange(1, 40))]
        live.append(gen.add(system + tail[:8] if rng.random() < 0.2 else tail,
                            SamplingParams(max_tokens=rng.randrange(1, 12), temperature=rng.choice([0.0, 1.0]),
                                           seed=i, ignore_eos=True)))
        if rng.random() < 0.3:
            gen.step()
        if rng.random() < 0.1:
            gen.cancel(rng.choice(live))
    gen.run()
    assert all(r.finished for r in live) and gen.preemptions > 0 and gen.cached_prefill_tokens > 0
    assert 0 < gen.recomputations < gen.preemptions and gen.swapped_bytes == 0
    assert 0 < gen.swapped_bytes_peak <= paged.swap_space_bytes
    kv = paged.kv
    kv.check()
    assert len(kv.free) + len(kv.unused) == kv.blocks - 1 and not any(kv.refs) and not kv.table.any()


def test_prompt_blocks_are_shared_by_reference_and_keep_the_tokens(pair):
    """A system prompt longer than a prefill chunk: its first chunk's blocks, once a request has prefilled
    them, are mapped into the tables of requests admitted later (while it runs, and after it ended), which
    prefill only after them; every output is the contiguous engine's."""
    system = list(range(40, 180))  # 140 tokens: the first chunk (128 = 8 blocks of 16) is shareable
    prompts = [system + [200 + i] for i in range(4)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True)]
    want = [r.output for r in Generator(_engine(pair, max_seq=256)).generate(prompts, params)]
    paged = _engine(pair, kv_tokens=2 * 256, max_seq=256)
    poison_freed_blocks(paged)
    gen = Generator(paged)
    first = gen.add(prompts[0], params[0])
    while not first.finished:
        gen.step()
    assert gen.cached_prefill_tokens == 0
    second = gen.add(prompts[1], params[1])  # (after the first ended: its blocks kept, unused)
    gen.step()
    third = gen.add(prompts[2], params[2])  # (while the second runs: the same blocks, two references)
    gen.step()
    kv = paged.kv
    assert kv.owned[second.slot][:8] == kv.owned[third.slot][:8] and all(kv.refs[b] == 2 for b in kv.owned[third.slot][:8])
    assert kv.owned[second.slot][8:9] != kv.owned[third.slot][8:9]  # (past the chunk: each its own)
    fourth = gen.add(prompts[3], params[3])
    gen.run()
    assert [r.output for r in (first, second, third, fourth)] == want
    assert gen.cached_prefill_tokens == 3 * 128
    kv.check()
    assert len(kv.free) + len(kv.unused) == kv.blocks - 1 and len(kv.unused) == 8


def test_unused_prompt_blocks_give_way_when_the_pool_needs_them(pair):
    """A pool just large enough for one max_seq request: the registered blocks of earlier prompts are
    reused for new requests (least recently used first), and the tokens stay the contiguous engine's."""
    rng = random.Random(3)
    prompts = [[rng.randrange(30, 250) for _ in range(rng.randrange(130, 160))] for _ in range(4)]
    prompts.append(prompts[0][:129] + [7])  # shares the first's chunk, if its blocks survived
    params = [SamplingParams(max_tokens=20, ignore_eos=True)] * 5
    want = [r.output for r in Generator(_engine(pair, max_seq=256)).generate(prompts, params)]
    paged = _engine(pair, kv_tokens=256, max_seq=256, max_batch=2)
    poison_freed_blocks(paged)
    gen = Generator(paged)
    assert [r.output for r in gen.generate(prompts, params)] == want
    paged.kv.check()
    assert gen.cached_prefill_tokens == 0  # (the first prompt's blocks were reused by the time the last came)


def test_bad_pools_are_refused_with_clear_errors(pair):
    with pytest.raises(BlockPoolError, match="power of two"):
        BlockTables(10, 12, 2, 64, "cpu")
    with pytest.raises(BlockPoolError, match=r"cannot hold one request of max_seq 128 tokens .* at least 128"):
        _engine(pair, kv_tokens=100)
    assert issubclass(BlockPoolError, EngineError)


def test_the_cli_generates_the_same_ids_paged_and_an_aoti_engine_refuses_a_pool(pair, tmp_path):
    out = tmp_path / "engine"
    r = run_cli("build", "--target", pair[0], "--draft", pair[1], "--out", out, "--max-batch", 2,
                "--max-seq", MAX_SEQ)
    assert r.returncode == 0, r.stderr
    ids = []
    for extra in ((), ("--kv-cache-tokens", 200, "--kv-block-size", 8),
                  ("--kv-cache-tokens", 200, "--kv-block-size", 8, "--swap-space", 0.5)):
        r = run_cli("generate", "--engine", out, "--prompt-ids", "65,66,67", "--max-tokens", 30, "--ignore-eos",
                    "--json", *extra)
        assert r.returncode == 0, r.stderr
        ids.append(json.loads(r.stdout.strip().splitlines()[-1])["output_ids"])
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 30
    r = run_cli("generate", "--engine", out, "--prompt-ids", "65", "--kv-cache-tokens", 200, "--swap-space", -1)
    assert r.returncode == 2 and "expected GiB >= 0, got -1" in r.stderr
    assert load_engine(out, kv_tokens=200, kv_block_size=8, swap_space=0.5).swap_space_bytes == 2**29
    assert load_engine(out).swap_space_bytes == 4 * 2**30  # (the default, vLLM's --swap-space)
    assert "KV: paged, a pool of 200 positions in blocks of 8" in load_engine(
        out, kv_tokens=200, kv_block_size=8).kv_description()
    fake = tmp_path / "aoti"
    shutil.copytree(out, fake)
    m = json.loads((fake / "manifest.json").read_text())
    (fake / "manifest.json").write_text(json.dumps(dict(m, backend="aoti")))
    with pytest.raises(EngineError, match="KV caches are laid out when it is built"):
        load_engine(fake, kv_tokens=256)


def _aoti_build_args(pair) -> tuple:
    return "build", "--target", pair[0], "--draft", pair[1], "--max-batch", 3, "--max-seq", 256


@pytest.fixture(scope="module")
def aoti_paged(agreeing_pair, tmp_path_factory):
    """A CPU aoti engine of the agreeing pair built with a pool of 256 positions in blocks of 16 (max_batch 3,
    max_seq 256: one request's window) and a prefill of two chunks a call (through the block tables too) → its
    directory."""
    out = tmp_path_factory.mktemp("aoti-paged") / "engine"
    r = run_cli(*_aoti_build_args(agreeing_pair), "--out", out, "--backend", "aoti", "--kv-cache-tokens", 256,
                "--kv-block-size", 16, "--prefill-batch", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_an_aoti_engine_built_with_a_pool_runs_paged_with_the_eager_tokens(agreeing_pair, aoti_paged, tmp_path):
    """`build --backend aoti --kv-cache-tokens`: the compiled parts address pools of blocks through the
    slots' block tables (gathered inside the step), so the engine admits, grows, preempts and resumes as the
    eager one does; with freed blocks poisoned, every token is the contiguous eager engine's. A pool too
    small for one request, or one asked of an eager build, is refused at build time."""
    out, args = aoti_paged, _aoti_build_args(agreeing_pair)
    assert json.loads((out / "manifest.json").read_text())["aoti"]["kv_pool"] == [17, 16]
    engine = load_engine(out)
    assert engine.kv is not None and "a pool of 256 positions in blocks of 16" in engine.kv_description()
    assert engine.prefill_batch == 2 and engine.prefill_batch_fn.table is engine.kv.table
    batched = []
    fn = engine.prefill_batch_fn
    engine.prefill_batch_fn = lambda *x, **kw: batched.append(1) or fn(*x, **kw)
    poison_freed_blocks(engine)
    prompts, params = _workload(6, seed=0, max_tokens=(60, 120))
    want = [r.output for r in Generator(_engine(agreeing_pair, max_batch=3, max_seq=256)).generate(prompts, params)]
    gen = Generator(engine)
    assert [r.output for r in gen.generate(prompts, params)] == want
    assert gen.preemptions > 0 and batched  # (rounds of two or three chunks ran in the two-chunk packages)
    engine.kv.check()
    r = run_cli(*args, "--out", tmp_path / "small", "--backend", "aoti", "--kv-cache-tokens", 200)
    assert r.returncode == 2 and "cannot hold one request of max_seq 256 tokens" in r.stderr
    r = run_cli(*args, "--out", tmp_path / "eager", "--kv-cache-tokens", 400)
    assert r.returncode == 2 and "applies to --backend aoti" in r.stderr


def test_an_aoti_engine_past_its_swap_space_recomputes_with_the_eager_tokens(agreeing_pair, aoti_paged):
    """`load_engine(…, swap_space=0)` on the compiled paged engine: every running request preempted is
    recomputed (its prompt and emitted tokens through the compiled prefill) and gets its sampling controls
    back when it resumes; with freed blocks poisoned, the tokens are the contiguous eager engine's, greedy,
    seeded and under controls, and nothing stays in the pool or in host memory."""
    import dataclasses

    engine = load_engine(aoti_paged, swap_space=0)
    assert engine.swap_space_bytes == 0
    poison_freed_blocks(engine)
    prompts, params = _workload(6, seed=4, max_tokens=(60, 120))
    params = [dataclasses.replace(p, repetition_penalty=1.3, top_k=20) if i % 3 == 1 else p
              for i, p in enumerate(params)]
    want = [r.output for r in Generator(_engine(agreeing_pair, max_batch=3, max_seq=256)).generate(prompts, params)]
    gen = Generator(engine)
    assert [r.output for r in gen.generate(prompts, params)] == want
    assert gen.recomputations == gen.preemptions > 0 and gen.swapped_bytes_peak == 0
    engine.kv.check()
    assert len(engine.kv.free) + len(engine.kv.unused) == engine.kv.blocks - 1


BAD_SHAPE = r"aoti.kv_pool must be \[blocks, block size\], two positive integers \(null: a window per slot\), got "


@pytest.mark.parametrize("pool, message", [
    ("17x16", BAD_SHAPE + '"17x16"'),
    ([17], BAD_SHAPE + r"\[17\]"),
    ([17, 16, 1], BAD_SHAPE + r"\[17, 16, 1\]"),
    ({"blocks": 17, "block_size": 16}, BAD_SHAPE + r'\{"blocks": 17, "block_size": 16\}'),
    ([17.0, 16], BAD_SHAPE + r"\[17.0, 16\]"),
    ([True, 16], BAD_SHAPE + r"\[true, 16\]"),
    ([17, 0], BAD_SHAPE + r"\[17, 0\]"),
    ([-17, 16], BAD_SHAPE + r"\[-17, 16\]"),
    ([17, 12], r"aoti.kv_pool \[17, 12\]: KV block size must be a power of two, got 12"),
    ([16, 16], r"aoti.kv_pool \[16, 16\]: a KV pool of 16 blocks of 16 tokens \(15 usable: block 0 is kept empty\) "
               r"cannot hold one request of max_seq 256 tokens \(16 blocks\): give it at least 256 tokens"),
    ([1, 256], r"aoti.kv_pool \[1, 256\]: a KV pool of 1 blocks of 256 tokens \(0 usable"),
], ids=["string", "one_number", "three_numbers", "object", "float", "bool", "zero_block_size", "negative",
        "block_size_not_a_power_of_two", "blocks_too_few_for_max_seq", "only_block_0"])
def test_a_malformed_pool_in_an_aoti_manifest_is_refused_with_the_reason(aoti_paged, tmp_path, pool, message):
    """The manifest is not hashed: an edited `aoti.kv_pool` is checked as the build checks a pool (the same
    check), and refused before anything loads, with the manifest entry and the reason."""
    d = tmp_path / "engine"
    shutil.copytree(aoti_paged, d)
    m = json.loads((d / "manifest.json").read_text())
    m["aoti"]["kv_pool"] = pool
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match=f"^{re.escape(str(d))}: manifest " + message):
        load_engine(d)


def test_a_pool_sized_by_a_memory_fraction(pair, tmp_path):
    """`--kv-cache-memory-fraction F`: the pool holds the positions F of the memory left after the weights
    takes (whole blocks, block 0 aside); a fraction outside (0, 1] or too small for one request is refused,
    and the pool is given one way only."""
    from muse_spark.engine_format import cache_bytes, device_memory

    out = tmp_path / "engine"
    r = run_cli("build", "--target", pair[0], "--draft", pair[1], "--out", out, "--max-batch", 2, "--max-seq", MAX_SEQ)
    assert r.returncode == 0, r.stderr
    engine = load_engine(out, kv_memory_fraction=1e-4, kv_block_size=16)
    per = cache_bytes(engine.tcfg, engine.dcfg, 1, 1, engine.target.dtype)
    assert engine.kv is not None and engine.kv.capacity_tokens >= MAX_SEQ
    assert engine.kv.capacity_tokens <= 1e-4 * device_memory("cpu", available=True) / per
    with pytest.raises(EngineError, match=r"must be in \(0, 1\]"):
        load_engine(out, kv_memory_fraction=1.5)
    with pytest.raises(EngineError, match="not one request of max_seq 128"):
        load_engine(out, kv_memory_fraction=1e-12)
    r = run_cli("generate", "--engine", out, "--prompt-ids", "65,66", "--kv-cache-tokens", 200,
                "--kv-cache-memory-fraction", 0.1)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = run_cli("generate", "--engine", out, "--prompt-ids", "65,66,67", "--max-tokens", 8, "--ignore-eos",
                "--kv-cache-memory-fraction", 1e-4, "--json")
    assert r.returncode == 0, r.stderr
