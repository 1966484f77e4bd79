"""Sampling controls (top-k, top-p, min-p, penalties, min_tokens, logprobs) on the target's
distribution, exact under speculative decoding (plugins/acceptance/processing.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import test_speculative as spec
from conftest import small_engine
from muse_spark.plugins.acceptance import processing as processing_mod
from muse_spark.plugins.acceptance.processing import Processing, filter_logits, process_logits
from muse_spark.plugins.acceptance.reference import sample_tokens, target_probs
from muse_spark.runtime import EagerEngine, Generator, RequestError, SamplingParams
from muse_spark.runtime.engine import neutral_controls
from stat_utils import chi2_pvalue


def _row(prompt, output, **kw):
    return dict(neutral_controls(prompt), output=list(output), **kw)


# ---- the processing itself ---------------------------------------------------------------------
def test_filters_keep_what_they_promise():
    z = torch.log(torch.tensor([[[0.5, 0.2, 0.15, 0.1, 0.05]]]))
    one = torch.ones(1)

    def kept(**kw):
        args = dict(top_k=torch.zeros(1, dtype=torch.int64), top_p=torch.ones(1), min_p=torch.zeros(1))
        args.update({k: torch.tensor([v]) for k, v in kw.items()})
        return torch.isfinite(filter_logits(z, args["top_k"], args["top_p"], args["min_p"], one))[0, 0].tolist()

    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.7) == [True, True, False, False, False]  # 0.5 + 0.2 reaches 0.7
    assert kept(top_p=0.71) == [True, True, True, False, False]
    assert kept(min_p=0.3) == [True, True, True, False, False]  # ≥ 0.15
    assert kept(top_k=1, top_p=0.01) == [True, False, False, False, False]


@pytest.mark.parametrize("V", [5, 1024, 1025, 3000, 131072])
def test_the_chunked_prefix_sum_is_the_prefix_sum(V):
    """``cumsum_last`` (top-p's prefix sum in chunks Inductor does not split) against float64's ``cumsum``, within
    a few float32 roundings of the total; a chunk's carry left out is caught."""
    p = torch.rand(2, 3, V, generator=torch.Generator().manual_seed(V)).softmax(-1)
    want = torch.cumsum(p.double(), -1)
    got = processing_mod.cumsum_last(p)
    assert got.shape == p.shape and got.dtype == p.dtype
    assert (got.double() - want).abs().max().item() < 1e-6
    if V > processing_mod.SCAN_CHUNK:  # the last element of the second chunk without the first chunk's mass
        assert abs(got[0, 0, -1].item() - 1.0) < 1e-5 and got[0, 0, processing_mod.SCAN_CHUNK].item() > \
            p[0, 0, : processing_mod.SCAN_CHUNK].sum().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_filters_compile_for_cuda_at_a_full_vocabulary():
    """``filter_logits`` under Inductor on CUDA over a 131,072-token vocabulary (an 8B target's; a single prefix sum
    this long became a split scan whose code generation failed) keeps what the eager filters keep."""
    z = torch.randn(2, 8, 131072, device="cuda")
    args = (torch.tensor([0, 50], device="cuda"), torch.tensor([0.9, 1.0], device="cuda"),
            torch.tensor([0.0, 0.05], device="cuda"), torch.tensor([1.0, 0.7], device="cuda"))
    got = torch.compile(filter_logits)(z, *args)
    kept, want = torch.isfinite(got), torch.isfinite(filter_logits(z, *args))
    # (a token whose mass before it is top-p within a rounding may fall either side of the cut)
    assert 0 < want.sum() < want.numel() and (kept != want).sum().item() <= 2


def test_penalties_see_the_drafts_before_each_position():
    V = 6
    z = torch.full((1, 3, V), 2.0)
    proc = Processing.build([_row([1], [2], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)],
                            V, "cpu")
    out = process_logits(z, torch.tensor([[3, 3]]), proc, torch.ones(1))
    # position 0: history prompt [1], output [2]
    assert out[0, 0].tolist() == [2.0, 1.0, 1.0 - 0.75, 2.0, 2.0, 2.0]
    # position 1: t_1 = 3 is output too; position 2: 3 twice
    assert out[0, 1, 3].item() == pytest.approx(1.0 - 0.75)
    assert out[0, 2, 3].item() == pytest.approx(1.0 - 0.5 - 0.5)


def test_min_tokens_holds_the_stop_tokens_back():
    V = 5
    proc = Processing.build([_row([0], [1], min_tokens=3, stop_ids=[4])], V, "cpu")
    out = process_logits(torch.zeros(1, 3, V), torch.tensor([[2, 2]]), proc, torch.ones(1))
    assert [math.isinf(out[0, k, 4].item()) for k in range(3)] == [True, True, False]  # 1, 2 out; then 3


# ---- exactness on the engine ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(agreeing_pair):
    return EagerEngine.from_checkpoints(*agreeing_pair, max_batch=4, max_seq=160)


def _reference(engine, prompt, params: SamplingParams) -> list[int]:
    """Target-only decoding with the controls, from scratch each token (no cache, no speculation)."""
    tgt, out = engine.target, []
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(engine.tcfg.eos_token_id))
    while len(out) < params.max_tokens:
        seq = prompt + out
        cache = tgt.allocate_cache(1, engine.max_seq)
        with torch.inference_mode():
            h, _ = tgt(torch.tensor([seq]), torch.arange(len(seq))[None], torch.tensor([0]), cache, len(seq))
            logits = tgt.logits(h[:, -1])
            row = {k: getattr(params, k) for k in ("top_k", "top_p", "min_p", "repetition_penalty",
                                                    "presence_penalty", "frequency_penalty", "min_tokens")}
            proc = Processing.build([dict(row, prompt=prompt, output=out, stop_ids=sorted(stop))],
                                    engine.tcfg.vocab_size, "cpu")
            temp = torch.tensor([float(params.temperature)])
            z = process_logits(logits[:, None], torch.zeros(1, 0, dtype=torch.int64), proc, temp)[:, 0]
            tok = int(sample_tokens(z, temp, torch.tensor([params.seed]), torch.tensor([len(seq)]))[0])
        out.append(tok)
        if tok in stop:
            break
    return out


@pytest.mark.parametrize("controls", [dict(repetition_penalty=1.5), dict(presence_penalty=1.0, frequency_penalty=0.5),
                                      dict(top_k=3, top_p=0.9, min_p=0.05), dict(min_tokens=20)])
def test_greedy_output_equals_target_only_decoding_with_the_same_controls(engine, controls):
    prompt = [72, 101, 108, 108, 111]
    params = SamplingParams(max_tokens=30, **controls)
    got = Generator(engine).generate([prompt], params)[0]
    assert got.output == _reference(engine, prompt, params)


def test_controlled_and_plain_requests_share_a_batch(engine):
    prompts = [[65, 66], [67, 68, 69], [70]]
    params = [SamplingParams(max_tokens=20, ignore_eos=True), SamplingParams(max_tokens=20, repetition_penalty=2.0,
                                                                           ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=5, top_k=5, ignore_eos=True)]
    together = Generator(engine).generate(prompts, params)
    for r, p, sp in zip(together, prompts, params):
        assert r.output == Generator(engine).generate([p], sp)[0].output
    assert together[0].output == _reference(engine, prompts[0], params[0])
    assert together[1].output == _reference(engine, prompts[1], params[1])


def test_logprobs_are_the_processed_distributions(engine):
    prompt = [72, 105]
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=3, top_k=4, logprobs=3, ignore_eos=True)
    r = Generator(engine).generate([prompt], params)[0]
    assert len(r.logprobs) == len(r.output) == 12
    tgt = engine.target
    for i, (tok, (lp, top)) in enumerate(zip(r.output, r.logprobs)):
        seq = prompt + r.output[:i]
        cache = tgt.allocate_cache(1, engine.max_seq)
        with torch.inference_mode():
            h, _ = tgt(torch.tensor([seq]), torch.arange(len(seq))[None], torch.tensor([0]), cache, len(seq))
            proc = Processing.build([_row(prompt, r.output[:i], top_k=4)], engine.tcfg.vocab_size, "cpu")
            z = process_logits(tgt.logits(h[:, -1])[:, None], torch.zeros(1, 0, dtype=torch.int64), proc,
                               torch.tensor([0.7]))
            want = torch.log_softmax(z[0, 0] / 0.7, -1)
        assert lp == pytest.approx(want[tok].item(), abs=1e-4)
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1]
        assert top[0][1] == pytest.approx(want.max().item(), abs=1e-4)


def test_bad_controls_are_refused_and_compiled_engines_say_why(engine, aoti_built, tmp_path):
    gen = Generator(engine)
    for bad in (dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0), dict(repetition_penalty=0.0),
                dict(presence_penalty=3.0), dict(logprobs=50), dict(min_tokens=99, max_tokens=5)):
        with pytest.raises(RequestError):
            gen.add([1, 2], SamplingParams(**{"max_tokens": 8, **bad}))
    import json
    import shutil

    from muse_spark.runtime import load_engine

    # the same packages, the manifest saying the controls' steps were not built: refused, with the reason
    bare = tmp_path / "engine"
    shutil.copytree(aoti_built[0], bare)
    m = json.loads((bare / "manifest.json").read_text())
    m["aoti"]["sampling_controls"] = None
    (bare / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(RequestError, match="eager engine and on aoti engines built with their steps"):
        Generator(load_engine(bare)).add([1, 2], SamplingParams(top_k=3))


# ---- the compiled engine: the controls' state on the device, per slot ------------------------------
@pytest.fixture(scope="module")
def aoti_engine(aoti_built):
    from muse_spark.runtime import load_engine

    return load_engine(aoti_built[0])


def test_the_aoti_engine_applies_the_controls_as_the_eager_one(aoti_engine, agreeing_engine):
    """The compiled controlled step (``step_verify_ctl``: the controls and token history read from the
    slots' state, advanced in place) emits the eager engine's tokens, greedy and sampled, in a batch
    that mixes controlled and plain requests, with the same log-probabilities (the tolerance table's
    row of the compute dtype); a plain batch afterwards is today's step."""
    from tolerances import TOL

    assert aoti_engine.controls
    prompts = [[65, 66, 67, 68], [70, 71, 72], [80, 81]]
    params = [SamplingParams(max_tokens=30, temperature=1.2, seed=3, top_k=5, repetition_penalty=1.3,
                             ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=25, temperature=0.9, seed=4, top_p=0.8, min_p=0.05, presence_penalty=0.5,
                             frequency_penalty=0.3, ignore_eos=True),
              SamplingParams(max_tokens=28, ignore_eos=True, min_tokens=10)]
    got = Generator(aoti_engine).generate(prompts, params)
    want = Generator(agreeing_engine).generate(prompts, params)
    assert [r.output for r in got] == [r.output for r in want]
    tol = TOL[aoti_engine.target.dtype]  # (the compute dtype's row: the logits are that dtype's GEMMs')
    for (lp, top), (wlp, wtop) in zip(got[0].logprobs, want[0].logprobs):
        assert lp == pytest.approx(wlp, rel=tol["rtol"], abs=tol["atol"]) and [t for t, _ in top] == [t for t, _ in wtop]
        assert [v for _, v in top] == pytest.approx([v for _, v in wtop], rel=tol["rtol"], abs=tol["atol"])
    plain = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
    assert [r.output for r in Generator(aoti_engine).generate(prompts, plain)] == \
        [r.output for r in Generator(agreeing_engine).generate(prompts, plain)]


def test_a_slot_gets_its_new_requests_controls_not_the_last_ones(aoti_engine, agreeing_engine):
    """Requests that follow each other in the same slots, controlled and not, each with the eager
    engine's tokens: the slot's state is its request's (set when its prefill ends), not its predecessor's."""
    gens = Generator(aoti_engine), Generator(agreeing_engine)
    for params in (SamplingParams(max_tokens=16, top_k=1, repetition_penalty=3.0, ignore_eos=True),
                   SamplingParams(max_tokens=16, ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=1.5, seed=9, frequency_penalty=1.5, ignore_eos=True)):
        out = [g.generate([[72, 101, 108]], params)[0].output for g in gens]
        assert out[0] == out[1]


# ---- statistical exactness (test_speculative's two-token test with controls) ------------------------
T = spec.T


def _processed_dist(engine, prompt, output, controls):
    tgt = engine.target
    seq = prompt + output
    cache = tgt.allocate_cache(1, engine.max_seq)
    h, _ = tgt(torch.tensor([seq]), torch.arange(len(seq))[None], torch.tensor([0]), cache, len(seq))
    proc = Processing.build([_row(prompt, output, **controls)], engine.tcfg.vocab_size, "cpu")
    z = process_logits(tgt.logits(h[:, -1:]), torch.zeros(1, 0, dtype=torch.int64), proc, torch.tensor([T]))
    return target_probs(z, torch.tensor([T]))[0, 0].double().numpy()


def _samples(engine, prompt, anchor, controls):
    p, rows = len(prompt), spec.ROWS
    slots = torch.arange(1, rows + 1)
    for s in slots.tolist():
        engine.prefill(prompt, s, 0, T)
    temps = torch.full((rows,), T)
    V, g = engine.tcfg.vocab_size, engine.gamma
    out = []
    for rep in range(spec.REPS):
        seeds = torch.arange(rows) + rep * rows + 1
        proc = Processing.build([_row(prompt, [anchor], **controls)] * rows, V, "cpu")
        packed = engine.step(torch.full((rows,), anchor), torch.full((rows,), p), slots, seeds, temps, p + g + 1, proc)
        n, bonus = packed[:, g], packed[:, g + 1]
        e1 = torch.where(n >= 1, packed[:, 0], bonus)
        e2 = torch.where(n >= 2, packed[:, 1], torch.where(n == 1, bonus, -1))
        need = (n == 0).nonzero().flatten()
        if need.numel():
            sub_proc = Processing.build([_row(prompt, [anchor, int(e1[i])], **controls) for i in need.tolist()], V, "cpu")
            sub = engine.step(e1[need], torch.full((need.numel(),), p + 1), slots[need], seeds[need] + 10**6,
                              temps[need], p + g + 2, sub_proc)
            e2[need] = torch.where(sub[:, g] >= 1, sub[:, 0], sub[:, g + 1])
        out.append(torch.stack([e1, e2], 1))
    return torch.cat(out).numpy()


def _pvalues(engine, controls):
    prompt, anchor = [3, 1, 4, 1, 5], 9
    s = _samples(engine, prompt, anchor, controls)
    V = engine.tcfg.vocab_size
    pv = [chi2_pvalue(np.bincount(s[:, 0], minlength=V), _processed_dist(engine, prompt, [anchor], controls))]
    for e1 in np.argsort(-np.bincount(s[:, 0], minlength=V))[:2]:
        sel = s[s[:, 0] == e1, 1]
        pv.append(chi2_pvalue(np.bincount(sel, minlength=V),
                              _processed_dist(engine, prompt, [anchor, int(e1)], controls)))
    return pv


@pytest.fixture(scope="module")
def stat_engine():
    return small_engine(seed=21, max_batch=spec.ROWS + 1, max_seq=32, vocab=12, draft_vocab=7, gamma=3)


CONTROLS = {"top_k": dict(top_k=4), "top_p": dict(top_p=0.8), "min_p": dict(min_p=0.1),
            "penalty": dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)}


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_sampled_output_has_the_processed_target_distribution(stat_engine, name):
    pv = _pvalues(stat_engine, CONTROLS[name])
    assert min(pv) > 1e-3, pv


def test_penalties_that_forget_the_steps_own_drafts_fail_the_same_test(stat_engine, monkeypatch):
    real = processing_mod.process_logits

    def stale(logits, drafts, proc, temperature):  # bug: every position sees only the history before the step
        return torch.cat([real(logits[:, k : k + 1], drafts[:, :0], proc, temperature) for k in range(logits.shape[1])], 1)

    import muse_spark.runtime.engine as engine_mod

    monkeypatch.setattr(engine_mod, "process_logits", stale)
    pv = _pvalues(stat_engine, dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=4.0))
    assert min(pv) < 1e-3, pv


def test_a_filter_left_out_of_the_step_fails_the_same_test(stat_engine, monkeypatch):
    import muse_spark.runtime.engine as engine_mod

    monkeypatch.setattr(engine_mod, "process_logits", lambda logits, drafts, proc, temperature: logits)
    pv = _pvalues(stat_engine, dict(top_k=2))
    assert min(pv) < 1e-3, pv


def test_generate_takes_the_controls_and_prints_logprobs(agreeing_pair, tmp_path):
    import json

    from conftest import run_cli

    args = ["generate", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--prompt-ids", "72,105",
            "--max-tokens", 10, "--ignore-eos", "--json"]
    r = run_cli(*args, "--temperature", 1.0, "--top-k", 1, "--logprobs", 2)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    greedy = json.loads(run_cli(*args).stdout.strip().splitlines()[-1])
    assert out["output_ids"] == greedy["output_ids"]  # top-k 1: the most likely token at any temperature
    assert [e["token"] for e in out["logprobs"]] == out["output_ids"]
    assert all(e["logprob"] == pytest.approx(0.0, abs=1e-5) and len(e["top"]) == 2 for e in out["logprobs"])
    bad = run_cli(*args, "--repetition-penalty", 0)
    assert bad.returncode == 2 and "repetition_penalty" in bad.stderr


def test_controls_under_a_confidence_schedule_stay_exact(agreeing_pair):
    """Penalties and filters at a cut (fewer verified rows than γ) still give target-only decoding's tokens."""
    from muse_spark.schedule import Schedule

    engine = EagerEngine.from_checkpoints(*agreeing_pair, max_batch=2, max_seq=160,
                                          schedule=Schedule("confidence", 0.5))
    prompt = [72, 101, 108, 108, 111]
    params = SamplingParams(max_tokens=30, repetition_penalty=1.5, top_k=5, presence_penalty=0.5)
    r = Generator(engine).generate([prompt], params)[0]
    assert any(s.verified < engine.gamma for s in r.steps)
    assert r.output == _reference(engine, prompt, params)
