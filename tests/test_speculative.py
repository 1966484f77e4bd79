"""Lossless speculative decoding: greedy exactness, sampled distributions, and bookkeeping."""

import numpy as np
import pytest
import torch

from muse_spark.checkpoint import load_pair
from muse_spark.runtime import EagerEngine, Generator, SamplingParams
from muse_spark.plugins.acceptance import reference as sampling
from muse_spark.runtime.target_only import generate_target_only
from muse_spark.plugins.acceptance.reference import target_probs

from conftest import small_engine
from stat_utils import chi2_pvalue

PROMPTS = [[1, 2, 3], [72, 101, 108, 108, 111], [200], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7, 7]]


def greedy(max_tokens=24):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("which", ["random_engine", "agreeing_engine"])
def test_greedy_speculative_equals_greedy_target_only(which, request):
    engine = request.getfixturevalue(which)
    reqs = Generator(engine).generate(PROMPTS, greedy())
    for r in reqs:
        assert r.output == generate_target_only(engine, r.prompt, greedy()), r.prompt
    if which == "agreeing_engine":  # multi-token acceptance really happened
        assert np.mean([s.accepted for r in reqs for s in r.steps]) > 2.0


def test_mixed_batch_with_joins_and_leaves(agreeing_engine):
    """Requests of different lengths and parameters share steps, join late and leave early;
    greedy rows still equal target-only, sampled rows equal their solo runs."""
    gen = Generator(agreeing_engine)
    a = gen.add(PROMPTS[0], greedy(30))
    b = gen.add(PROMPTS[1], SamplingParams(max_tokens=7, temperature=0.8, seed=11, ignore_eos=True))
    gen.step()
    gen.step()
    c = gen.add(PROMPTS[3], greedy(12))
    d = gen.add(PROMPTS[4], SamplingParams(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True))
    gen.run()
    for r in (a, c):
        assert r.output == generate_target_only(agreeing_engine, r.prompt, r.params)
    for r in (b, d):
        solo = Generator(agreeing_engine).generate([r.prompt], r.params)[0]
        assert solo.output == r.output
    assert sorted(gen.free_slots) == list(range(agreeing_engine.max_batch))


def test_same_seed_same_output_whatever_the_batch(random_engine):
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    solo = Generator(random_engine).generate([PROMPTS[1]], p)[0].output
    others = [SamplingParams(max_tokens=n, temperature=t, seed=s, ignore_eos=True)
              for n, t, s in ((5, 0.7, 1), (25, 1.5, 2), (9, 0.0, 3))]
    batch = Generator(random_engine).generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]],
                                              [others[0], others[1], p, others[2]])
    assert batch[2].output == solo
    diff = Generator(random_engine).generate([PROMPTS[1]], SamplingParams(**{**p.__dict__, "seed": 4321}))[0]
    assert diff.output != solo


def test_max_tokens_is_exact(agreeing_engine):
    for n in (1, 2, 5, 6, 7, 13):
        r = Generator(agreeing_engine).generate([PROMPTS[0]], greedy(n))[0]
        assert len(r.output) == n and r.finish_reason == "length"


def test_stop_token_inside_an_accepted_block_truncates_exactly(agreeing_engine):
    full = Generator(agreeing_engine).generate([PROMPTS[1]], greedy(40))[0]
    block = next(s for s in full.steps if s.accepted >= 3)
    stop = block.emitted[1]  # a token accepted mid-block
    cut = full.output.index(stop)
    r = Generator(agreeing_engine).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=40, stop_token_ids=(stop,), ignore_eos=True))[0]
    assert r.output == full.output[: cut + 1]
    assert r.finish_reason == "stop"


def test_eos_stops_unless_ignored(random_engine):
    eos = random_engine.tcfg.eos_token_id[0]
    r = Generator(random_engine).generate([PROMPTS[0]], SamplingParams(max_tokens=30, stop_token_ids=()))[0]
    assert eos not in r.output[:-1]
    if eos in r.output:
        assert r.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_step_proposals_equal_a_from_scratch_draft(random_pair, temperature):
    """Each step's draft tokens equal the draft recomputed from scratch (full target
    forward over the accepted sequence → fresh context cache → block → Markov loop)."""
    target, draft = load_pair(*random_pair, dtype="float32")
    engine = EagerEngine(target, draft, max_batch=2, max_seq=128, device="cpu")
    params = SamplingParams(max_tokens=30, temperature=temperature, seed=77, ignore_eos=True)
    r = Generator(engine).generate([PROMPTS[3]], params)[0]
    seq = r.prompt + r.output
    for s in r.steps:
        p = s.position
        tcache, dcache = target.allocate_cache(1, 128), draft.allocate_cache(1, 128)
        slot = torch.tensor([0])
        _, aux = target(torch.tensor([seq[:p]]), torch.arange(p)[None], slot, tcache, p)
        draft.store_context(aux, torch.arange(p)[None], slot, dcache)
        ids, _, _ = draft.propose(torch.tensor([seq[p]]), torch.tensor([p]), slot, dcache, p,
                                  torch.tensor([r.params.seed]), torch.tensor([temperature]))
        assert ids[0].tolist() == s.draft_ids, p


def test_step_records_are_consistent(agreeing_engine):
    r = Generator(agreeing_engine).generate([PROMPTS[0]], greedy(30))[0]
    flat = [r.output[0]] + [t for s in r.steps for t in s.emitted]
    assert flat == r.output
    pos = len(r.prompt)
    for s in r.steps:
        assert s.position == pos
        assert s.emitted[: s.accepted] == s.draft_ids[: min(s.accepted, len(s.emitted))]
        pos += s.accepted + 1
    st = r.stats(agreeing_engine.gamma)
    assert st["steps"] == len(r.steps) and st["accepted_draft_tokens"] == sum(s.accepted for s in r.steps)
    assert len(st["acceptance_per_position"]) == agreeing_engine.gamma


# ---- statistical losslessness ----------------------------------------------------------------
ROWS, REPS, T = 500, 40, 1.0  # 20,000 samples


def _target_dist(engine, seq):
    """Exact target-only next-token distribution after ``seq`` (scratch slot 0)."""
    tgt = engine.target
    cache = tgt.allocate_cache(1, engine.max_seq)
    h, _ = tgt(torch.tensor([seq]), torch.arange(len(seq))[None], torch.tensor([0]), cache, len(seq))
    return target_probs(tgt.logits(h[:, -1:]), torch.tensor([T]))[0, 0].double().numpy()


def _two_token_samples(engine, prompt, anchor):
    """(e1, e2): the first two tokens emitted after ``anchor`` by speculative steps,
    from the same cached state, with fresh seeds per repetition."""
    p = len(prompt)
    slots = torch.arange(1, ROWS + 1)
    for s in slots.tolist():
        engine.prefill(prompt, s, 0, T)
    out = []
    temps = torch.full((ROWS,), T)
    for rep in range(REPS):
        seeds = torch.arange(ROWS) + rep * ROWS + 1
        packed = engine.step(torch.full((ROWS,), anchor), torch.full((ROWS,), p), slots, seeds, temps,
                             p + engine.gamma + 1)
        g = engine.gamma
        n, bonus = packed[:, g], packed[:, g + 1]
        e1 = torch.where(n >= 1, packed[:, 0], bonus)
        e2 = torch.where(n >= 2, packed[:, 1], torch.where(n == 1, bonus, -1))
        need = (n == 0).nonzero().flatten()
        if need.numel():  # their second token comes from a second step at p+1
            sub = engine.step(e1[need], torch.full((need.numel(),), p + 1), slots[need], seeds[need] + 10**6,
                              temps[need], p + g + 2)
            e2[need] = torch.where(sub[:, g] >= 1, sub[:, 0], sub[:, g + 1])
        out.append(torch.stack([e1, e2], 1))
    return torch.cat(out).numpy()


def _lossless_pvalues(engine):
    prompt, anchor = [3, 1, 4, 1, 5], 9
    samples = _two_token_samples(engine, prompt, anchor)
    V = engine.tcfg.vocab_size
    pvals = [chi2_pvalue(np.bincount(samples[:, 0], minlength=V), _target_dist(engine, prompt + [anchor]))]
    # Second token, conditioned on the two most frequent first tokens.
    for e1 in np.argsort(-np.bincount(samples[:, 0], minlength=V))[:2]:
        sel = samples[samples[:, 0] == e1, 1]
        pvals.append(chi2_pvalue(np.bincount(sel, minlength=V), _target_dist(engine, prompt + [anchor, int(e1)])))
    return pvals


@pytest.fixture(scope="module")
def stat_engine():
    # vocab 12, draft vocab 7, γ = 3; the draft is a different random model, so
    # acceptance is partial and every branch (accept, reject+residual, bonus) runs.
    return small_engine(seed=21, max_batch=ROWS + 1, max_seq=32, vocab=12, draft_vocab=7, gamma=3)


def test_sampled_output_matches_target_only_distribution(stat_engine):
    pvals = _lossless_pvalues(stat_engine)
    assert min(pvals) > 1e-3, pvals


def test_a_broken_acceptance_rule_fails_the_same_test(stat_engine, monkeypatch):
    # Bug: at a rejection, sample the bonus from p instead of normalize(max(p − q, 0)).
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)
    pvals = _lossless_pvalues(stat_engine)
    assert min(pvals) < 1e-3, pvals


@pytest.mark.parametrize("chunk", [4, 16])
def test_two_stage_argmax_is_argmax(chunk):
    """``sampling.argmax_last`` (the compiled step's two-stage argmax) returns ``argmax``'s index:
    the first index of the maximum, with ties inside a chunk and across chunks, ±0, −inf rows and
    NaN (which counts as the maximum), and falls back to ``argmax`` on lengths it cannot split."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (6, 5, 64), generator=g).float()  # many ties
    x[0, 0] = float("-inf")
    x[0, 1] = 0.0
    x[0, 1, 37] = -0.0
    x[0, 2, 20] = float("nan")
    x[0, 2, 50] = float("nan")
    x[0, 3, 63] = float("inf")
    x[0, 3, 5] = float("inf")
    x[1] = torch.randn(5, 64, generator=g)
    assert torch.equal(sampling.argmax_last(x, chunk), x.argmax(-1))
    for n in (chunk, 3 * chunk + 1):  # one chunk, not a multiple: plain argmax
        assert torch.equal(sampling.argmax_last(x[..., :n], chunk), x[..., :n].argmax(-1))
    bf = x.bfloat16()
    assert torch.equal(sampling.argmax_last(bf, chunk), bf.argmax(-1))


def test_step_totals_give_the_statistics_of_the_steps_they_count():
    """``Request.stats`` from its running totals (``add_step``) equals the figures summed over the steps here,
    and a request whose steps were appended by hand (no totals) gets the same."""
    import random

    from muse_spark.runtime.generator import Request, StepRecord

    rng, gamma = random.Random(3), 5
    counted = Request(1, [1], SamplingParams(), frozenset())
    by_hand = Request(2, [1], SamplingParams(), frozenset())
    steps = []
    for i in range(40):
        n = rng.randrange(gamma + 1)
        steps.append(StepRecord(i, [0] * gamma, n, [0] * (n + 1),
                                [rng.random() for _ in range(gamma)] if i % 3 else None, rng.choice([None, 2, gamma])))
        counted.add_step(steps[-1], gamma)
        by_hand.steps.append(steps[-1])
    yes = [s.confidence[k] for s in steps if s.confidence for k in range(min(s.accepted + 1, gamma)) if k < s.accepted]
    no = [s.confidence[s.accepted] for s in steps if s.confidence and s.accepted < gamma]
    for st in (counted.stats(gamma), by_hand.stats(gamma)):
        assert st["steps"] == 40 and st["accepted_draft_tokens"] == sum(s.accepted for s in steps)
        assert st["mean_emitted_per_step"] == pytest.approx(sum(len(s.emitted) for s in steps) / 40)
        assert st["mean_verified_per_step"] == pytest.approx(
            sum(gamma if s.verified is None else s.verified for s in steps) / 40)
        assert st["acceptance_per_position"] == pytest.approx(
            [sum(s.accepted > k for s in steps) / 40 for k in range(gamma)])
        assert st["confidence"]["decided_positions"] == len(yes) + len(no)
        assert st["confidence"]["mean_when_accepted"] == pytest.approx(sum(yes) / len(yes))
        assert st["confidence"]["mean_when_rejected"] == pytest.approx(sum(no) / len(no))
    assert counted.totals.n == 40 and by_hand.totals.n == 0
    assert Request(3, [1], SamplingParams(), frozenset()).stats(gamma)["acceptance_per_position"] == [0.0] * gamma
