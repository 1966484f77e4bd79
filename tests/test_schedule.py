"""Confidence-scheduled verification (``muse_spark.schedule``): a step verifies a prefix of each
request's drafts chosen from the draft's confidence, and the output stays exactly the target's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import AOTI_NARROW_WIDTH, small_engine
from muse_spark.builder.pair import draft_token_ids, make_pair, random_prompts
from muse_spark.plugins.acceptance import reference as acceptance
from muse_spark.runtime import EagerEngine, Generator, SamplingParams
from muse_spark.runtime.acceptance import acceptance_stats
from muse_spark.runtime.target_only import generate_target_only
from muse_spark.schedule import Schedule, best_cut, plan, verify_counts
from muse_spark.engine_format import EngineError

import test_speculative as spec


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("sched") / "pair"
    make_pair(d, "tiny", acceptance=0.6, seed=2)
    return d


def _engine(pair, schedule=None, batch=8):
    return EagerEngine.from_checkpoints(pair / "target", pair / "draft", max_batch=batch, max_seq=160,
                                        schedule=schedule)


def test_verify_counts_follow_the_cumulative_confidence():
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.1], [0.2, 0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0]])
    assert verify_counts(conf, 0.5).tolist() == [3, 0, 4]  # 0.9, 0.81, 0.729 ≥ 0.5; 0.0729 < 0.5
    assert verify_counts(conf, 0.0).tolist() == [4, 4, 4]
    verify, K = plan(conf, Schedule("confidence", 0.5), 3, 4)
    assert verify.tolist() == [3, 0, 4] and K == 4


def test_the_cost_table_cuts_where_tokens_per_ms_peak():
    conf = torch.tensor([[0.9, 0.5, 0.5, 0.5]] * 4)  # cumulative 0.9, 0.45, 0.225, 0.11
    counts = verify_counts(conf, 0.0)
    flat = [1.0] * 5  # verification free: verify everything
    assert best_cut(conf, counts, flat) == 4
    steep = [1.0, 1.2, 2.0, 3.0, 4.0]  # expected tokens 4, 7.6, 9.4, 10.3, 10.75 over these costs
    assert best_cut(conf, counts, steep) == 1
    s = Schedule("confidence", 0.0, cost_ms={"4": steep, "32": flat})
    assert plan(conf, s, 4, 4)[1] == 1 and s.cost_row(3) == steep and s.cost_row(64) == flat
    assert plan(conf, s.replace(budget=False), 4, 4)[1] == 4
    verify, K = plan(None, Schedule("fixed", length=2), 4, 4)
    assert verify.tolist() == [2] * 4 and K == 2


def test_bad_policies_are_refused_with_the_reason(pair):
    with pytest.raises(ValueError, match="unknown schedule"):
        Schedule("sometimes")
    with pytest.raises(ValueError, match="threshold"):
        Schedule("confidence", 1.5)
    with pytest.raises(ValueError, match="cost table"):
        Schedule("confidence", cost_ms={"8": [0.0]})
    no_head = small_engine(seed=3)
    with pytest.raises(EngineError, match="confidence head"):
        no_head.set_schedule(Schedule("confidence"))


@pytest.mark.parametrize("threshold", [0.1, 0.5, 0.9])
def test_greedy_output_is_the_targets_whatever_the_threshold(pair, threshold):
    engine = _engine(pair, Schedule("confidence", threshold))
    prompts = random_prompts(draft_token_ids(pair), 6, 8, seed=1)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reqs = Generator(engine).generate(prompts, params)
    for r in reqs:
        assert r.output == generate_target_only(engine, r.prompt, params)
        assert all(s.verified is not None and 0 <= s.accepted <= s.verified <= engine.gamma for s in r.steps)


def test_off_is_todays_step_token_for_token(pair):
    prompts = random_prompts(draft_token_ids(pair), 4, 8, seed=4)
    params = [SamplingParams(max_tokens=32, temperature=0.9, seed=i, ignore_eos=True) for i in range(4)]
    off = Generator(_engine(pair, Schedule())).generate(prompts, params)
    default = Generator(_engine(pair)).generate(prompts, params)
    assert [r.output for r in off] == [r.output for r in default]
    assert all(s.verified is None for r in off for s in r.steps)
    assert off[0].stats(5)["mean_verified_per_step"] == 5


def test_an_informative_head_verifies_what_will_be_accepted(pair):
    """On a pair whose confidence head knows which drafts the target accepts, the schedule sends about
    as many drafts as are accepted (far fewer target rows) and accepts as many tokens per step."""
    prompts = random_prompts(draft_token_ids(pair), 8, 8, seed=5)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    full = acceptance_stats(Generator(_engine(pair)).generate(prompts, params), 5)
    sched = acceptance_stats(Generator(_engine(pair, Schedule("confidence", 0.5))).generate(prompts, params), 5)
    assert sched["mean_accepted_per_step"] == pytest.approx(full["mean_accepted_per_step"], abs=0.05)
    assert sched["mean_verified_per_step"] <= sched["mean_accepted_per_step"] + 0.5 < 5


def test_seeded_tokens_do_not_depend_on_batch_mates_without_a_budget(pair):
    engine = _engine(pair, Schedule("confidence", 0.4))
    prompts = random_prompts(draft_token_ids(pair), 5, 8, seed=6)
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=10 + i, ignore_eos=True) for i in range(5)]
    together = Generator(engine).generate(prompts, params)
    for r, p, sp in zip(together, prompts, params):
        assert r.output == Generator(engine).generate([p], sp)[0].output


def test_with_a_budget_the_batch_shares_one_cut(pair):
    """The cost table's cut K is one per step: every request verifies at most K (stated coupling)."""
    steep = [1.0, 1.1, 5.0, 9.0, 13.0, 17.0]
    engine = _engine(pair, Schedule("confidence", 0.05, cost_ms={"8": steep}))
    prompts = random_prompts(draft_token_ids(pair), 8, 8, seed=7)
    reqs = Generator(engine).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert max(s.verified for r in reqs for s in r.steps) <= 1
    for r in reqs[:3]:  # greedy: still the target's tokens
        assert r.output == generate_target_only(engine, r.prompt, r.params)


# ---- statistical losslessness with scheduling on (test_speculative's two-token test) ----------------
@pytest.fixture(scope="module")
def sched_stat_engine():
    engine = small_engine(seed=21, max_batch=spec.ROWS + 1, max_seq=32, vocab=12, draft_vocab=7, gamma=3,
                          enable_confidence_head=True, confidence_head_with_markov=True)
    # A head that reads the previous token's Markov features alone, so that the confidence and with it
    # the cut vary with the sampled drafts (this seed: cuts after 1, 2 and 3 drafts, a step of 64 rows).
    head = engine.draft.model.confidence_head
    w = torch.zeros(head.proj.weight.shape)
    w[0, 16:] = torch.randn(4, generator=torch.Generator().manual_seed(0)) * 4
    with torch.no_grad():
        head.proj.weight.copy_(w)
        head.proj.bias.fill_(1.5)
    engine.set_schedule(Schedule("confidence", 0.5))
    return engine


def test_scheduling_cuts_often_on_the_statistical_engine(sched_stat_engine):
    e = sched_stat_engine
    p = 5
    e.prefill([3, 1, 4, 1, 5], 1, 0, 1.0)
    e.step(torch.full((64,), 9), torch.full((64,), p), torch.ones(64, dtype=torch.int64), torch.arange(64),
           torch.ones(64), p + e.gamma + 1)
    counts = np.bincount(e.take_step_info()["verified"], minlength=e.gamma + 1)
    assert (counts > 0).sum() >= 3, counts  # several cut points, so every branch of the rule runs


def test_sampled_output_with_scheduling_matches_the_target(sched_stat_engine):
    pvals = spec._lossless_pvalues(sched_stat_engine)
    assert min(pvals) > 1e-3, pvals


def test_a_wrong_bonus_at_the_cut_fails_the_same_test(sched_stat_engine, monkeypatch):
    # Bug: at the cut, take the bonus from the residual max(p − q, 0) as if the next draft had been rejected.
    monkeypatch.setattr(acceptance, "at_the_cut", lambda q_n, n, verify: q_n)
    pvals = spec._lossless_pvalues(sched_stat_engine)
    assert min(pvals) < 1e-3, pvals


# ---- the commands ------------------------------------------------------------------------------------
def test_calibrate_records_the_cost_table_and_generate_follows_the_schedule(pair, tmp_path):
    import json

    from conftest import run_cli

    engine = tmp_path / "engine"
    assert run_cli("build", "--target", pair / "target", "--draft", pair / "draft", "--out", engine,
                   "--max-batch", 2, "--max-seq", 128).returncode == 0
    r = run_cli("calibrate", "--engine", engine, "--batches", "1,2", "--iters", 1, "--confidence-threshold", 0.5)
    assert r.returncode == 0, r.stderr
    sched = json.loads((engine / "manifest.json").read_text())["schedule"]
    assert sched["mode"] == "confidence" and sched["threshold"] == 0.5
    assert set(sched["cost_ms"]) == {"1", "2"} and all(len(v) == 6 and min(v) > 0 for v in sched["cost_ms"].values())

    def gen(*extra):
        r = run_cli("generate", "--engine", engine, "--prompt-ids", "65,66,67", "--max-tokens", 30, "--ignore-eos",
                    "--json", *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    on, off = gen(), gen("--schedule", "off")
    assert on["output_ids"] == off["output_ids"]
    assert all(s["verified"] == 5 for s in off["steps"])
    assert all(s["accepted"] <= s["verified"] <= 5 and len(s["confidence"]) == 5 for s in on["steps"])
    assert on["stats"]["mean_verified_per_step"] < 5
    bad = run_cli("generate", "--engine", engine, "--prompt-ids", "1", "--confidence-threshold", 2)
    assert bad.returncode == 2 and "threshold" in bad.stderr


# ---- the compiled engine: steps at the widths it was built with -----------------------------------
@pytest.fixture(scope="module")
def aoti_engine(aoti_built):
    from muse_spark.runtime import load_engine

    return load_engine(aoti_built[0])


def _outputs(engine, schedule, prompts, temperature, max_tokens=24):
    engine.set_schedule(schedule)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7 + i, ignore_eos=True)
              for i in range(len(prompts))]
    return [r.output for r in Generator(engine).generate(prompts, params)]


@pytest.mark.parametrize("length", [AOTI_NARROW_WIDTH, 5])
def test_an_aoti_engine_verifying_k_drafts_equals_eager_token_for_token(aoti_engine, agreeing_engine, length):
    """A step at a compiled width K verifies the anchor and the first K drafts of every row: the same
    tokens as the eager engine told to verify K, greedy and sampled, in a batch of three."""
    assert aoti_engine.verify_widths == [AOTI_NARROW_WIDTH, 5]
    prompts = [[65, 66, 67, 68], [70, 71], [80, 81, 82, 83, 84]]
    try:
        for temperature in (0.0, 1.0):
            fixed = Schedule("fixed", length=length)
            got = _outputs(aoti_engine, fixed, prompts, temperature)
            assert got == _outputs(agreeing_engine, fixed, prompts, temperature)
            if length == 5:  # (all γ: today's step)
                assert got == _outputs(aoti_engine, Schedule(), prompts, temperature)
    finally:
        aoti_engine.set_schedule(Schedule())
        agreeing_engine.set_schedule(Schedule())


def test_confidence_scheduling_on_aoti_keeps_greedy_output_and_verifies_fewer(aoti_engine, monkeypatch):
    """Scheduled steps chain (each planned from an earlier step's confidences); the Generator's steps that do not
    (the batch's last ones) plan from their own. Greedy output is the unscheduled engine's."""
    prompts = [[65, 66, 67, 68], [70, 71]]
    launched = []
    step_next = aoti_engine.step_next
    monkeypatch.setattr(aoti_engine, "step_next", lambda *a, **kw: launched.append(a[0].n) or step_next(*a, **kw))
    try:
        aoti_engine.set_schedule(Schedule("confidence", threshold=0.5))
        assert aoti_engine.chains  # (a chained scheduled step waits for no confidences)
        reqs = Generator(aoti_engine).generate(prompts, [SamplingParams(max_tokens=40, ignore_eos=True)] * 2)
        assert launched  # (the steps were chained)
        off = _outputs(aoti_engine, Schedule(), prompts, 0.0, max_tokens=40)
    finally:
        aoti_engine.set_schedule(Schedule())
    assert [r.output for r in reqs] == off
    steps = [s for r in reqs for s in r.steps]
    assert all(s.verified in (AOTI_NARROW_WIDTH, 5) and s.accepted <= s.verified and len(s.confidence) == 5
               for s in steps)
    assert any(s.verified == AOTI_NARROW_WIDTH for s in steps)  # (the tiny pair's head is often low)
    assert all(0.0 <= c <= 1.0 for s in steps for c in s.confidence)


def test_a_chained_scheduled_step_plans_its_width_from_an_earlier_steps_confidences(aoti_engine, monkeypatch):
    """A chained scheduled step (``StaticStep._lagged``) does not wait for its own confidences: the first runs
    every draft, each later one the width the engine's plan gives for the newest earlier step's confidences on the
    host (on the CPU every launched step is done before the next, so the step before's), and its handle carries
    its own (confidences, width), which the Generator records. A fixed schedule's steps run its width from the
    first. Greedy output is the unscheduled engine's either way."""
    prompt = [65, 66, 67, 68]
    handles = []
    step_rows = aoti_engine.step_rows
    monkeypatch.setattr(aoti_engine, "step_rows", lambda h: handles.append(h) or step_rows(h))
    params = [SamplingParams(max_tokens=40, ignore_eos=True)]
    try:
        aoti_engine.set_schedule(Schedule("confidence", threshold=0.5))
        (req,) = Generator(aoti_engine).generate([prompt], params)
        chained, handles[:] = list(handles), []
        expected = [aoti_engine._plan(prev.plan[0], record=False) for prev in chained[:-1]]
        aoti_engine.set_schedule(Schedule("fixed", length=AOTI_NARROW_WIDTH))
        (fixed,) = Generator(aoti_engine).generate([prompt], params)
        widths = {h.plan[1] for h in handles}
    finally:
        aoti_engine.set_schedule(Schedule())
    assert len(chained) > 2 and all(h.plan is not None and h.plan[0].shape == (1, 5) for h in chained)
    assert chained[0].plan[1] == 5  # (before any plan: every draft)
    assert [h.plan[1] for h in chained[1:]] == expected and set(expected) == {AOTI_NARROW_WIDTH, 5}
    assert [h.serial for h in chained] == list(range(chained[0].serial, chained[0].serial + len(chained)))
    records = [s for s in req.steps if s.verified is not None]
    assert [s.verified for s in records[: len(chained)]] == [h.plan[1] for h in chained]
    assert widths == {AOTI_NARROW_WIDTH}
    off = _outputs(aoti_engine, Schedule(), [prompt], 0.0, max_tokens=40)
    assert [req.output] == off and [fixed.output] == off


def test_a_flat_cost_table_leaves_the_aoti_engine_its_plain_step(aoti_engine):
    """Where the measured step time hardly depends on the drafts verified (batch 1 on a GPU, where
    verification is bandwidth-bound), no cut can pay for the wait for the confidences: that bucket runs
    the plain full-width step; a steep row plans."""
    flat = Schedule("confidence", cost_ms={"3": [10.0, 10.1, 10.1, 10.2, 10.2, 10.25]})
    steep = Schedule("confidence", cost_ms={"3": [5.0, 6.0, 7.0, 8.0, 9.0, 10.0]})
    assert flat.flat(3) and not steep.flat(3) and not Schedule("confidence").flat(3)
    # the rows measured on an H100 (8B shapes), where planning lost to the plain step: flat
    h100 = Schedule("confidence", cost_ms={"8": [8.33, 8.33, 9.36, 9.36, 9.36, 9.49, 9.49, 9.49],
                                           "32": [10.21, 10.21, 11.25, 11.25, 11.25, 12.38, 12.38, 12.38]})
    assert h100.flat(8) and h100.flat(32)
    prompts = [[65, 66, 67, 68], [70, 71]]
    try:
        aoti_engine.set_schedule(flat)
        assert all(r.planner is None for r in aoti_engine.runners.values())
        assert aoti_engine.chains  # (the plain steps chain as without a schedule)
        reqs = Generator(aoti_engine).generate(prompts, [SamplingParams(max_tokens=20, ignore_eos=True)] * 2)
        assert all(s.verified is None for r in reqs for s in r.steps)  # (all γ: no plan ran)
        aoti_engine.set_schedule(steep)
        assert all(r.planner is not None for r in aoti_engine.runners.values()) and aoti_engine.chains
    finally:
        aoti_engine.set_schedule(Schedule())
    assert [r.output for r in reqs] == _outputs(aoti_engine, Schedule(), prompts, 0.0, max_tokens=20)


def test_an_aoti_engine_refuses_widths_it_was_not_built_with(aoti_engine, aoti_built, tmp_path):
    import json
    import shutil

    from muse_spark.runtime import load_engine
    from muse_spark.runtime.calibrate import write_schedule

    with pytest.raises(EngineError, match=r"verify \[2, 5\] drafts per request"):
        aoti_engine.set_schedule(Schedule("fixed", length=3))
    # the same packages, the narrower width left out of the manifest: an engine that verifies all γ only
    full = tmp_path / "engine"
    shutil.copytree(aoti_built[0], full)
    m = json.loads((full / "manifest.json").read_text())
    m["aoti"]["verify_widths"] = [5]
    (full / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="rebuild it with --verify-widths"):
        write_schedule(full, Schedule("confidence"))
    engine = load_engine(full)
    with pytest.raises(EngineError, match="verifies every draft; rebuild it with narrower verification widths"):
        engine.set_schedule(Schedule("confidence"))


def test_calibrate_on_aoti_times_its_widths_and_generate_schedules_by_them(aoti_built, tmp_path):
    import json
    import shutil

    from conftest import run_cli

    engine = tmp_path / "engine"
    shutil.copytree(aoti_built[0], engine)
    r = run_cli("calibrate", "--engine", engine, "--batches", "1,3", "--iters", 1)
    assert r.returncode == 0, r.stderr
    sched = json.loads((engine / "manifest.json").read_text())["schedule"]
    assert sched["mode"] == "confidence" and set(sched["cost_ms"]) == {"1", "3"}
    for row in sched["cost_ms"].values():  # K = 0 … 2 run the width-2 step, 3 … 5 the full one
        assert len(row) == 6 and min(row) > 0 and row[0] == row[1] == row[2] and row[3] == row[4] == row[5]
    # (this machine's rows may be flat, where the engine would run its plain step: a steep table in the
    # manifest, as a GPU's calibration at a large batch gives, makes generate plan by it)
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["schedule"]["cost_ms"] = {k: [5.0] * 3 + [10.0] * 3 for k in sched["cost_ms"]}
    (engine / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli("generate", "--engine", engine, "--prompt-ids", "65,66,67", "--max-tokens", 30, "--ignore-eos",
                "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(s["verified"] in (2, 5) and len(s["confidence"]) == 5 for s in out["steps"])
    off = run_cli("generate", "--engine", engine, "--prompt-ids", "65,66,67", "--max-tokens", 30, "--ignore-eos",
                  "--json", "--schedule", "off")
    assert json.loads(off.stdout.strip().splitlines()[-1])["output_ids"] == out["output_ids"]


def test_verification_widths_are_checked_when_the_build_plans_them():
    from muse_spark.builder.aoti import check_widths, graph_plan_names

    assert check_widths("default", 7) == [1, 4] and check_widths([7, 2, 2], 7) == [2] and check_widths(None, 5) == []
    with pytest.raises(ValueError, match=r"verification widths \[0, 9\]"):
        check_widths([0, 3, 9], 7)
    names = {n: (fn, b, K) for n, fn, b, K in graph_plan_names([1, 4], with_prefill=False, widths=[2])}
    assert names["step_layer_b4_k2"] == ("layer", 4, 2) and names["step_verify_b1_k2"] == ("step_verify", 1, 2)
    assert names["step_draft_b4"] == ("step_draft", 4, None) and "step_draft_b4_k2" not in names
    assert len(names) == 2 * (4 + 3)


def test_a_requests_stats_carry_its_confidence_calibration(pair):
    """The Generator's per-request stats (and so `generate --json`) give the head's mean value where
    drafts were accepted and where they were rejected: far apart for the informative head."""
    r = Generator(_engine(pair)).generate([[65, 66, 67]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    c = r.stats(5)["confidence"]
    assert c["decided_positions"] > 0 and c["mean_when_accepted"] > 0.9 and c["mean_when_rejected"] < 0.1
