"""Pairs with a chosen acceptance (``muse-spark make-pair``): they load like any checkpoint, their
measured acceptance tracks the rate asked for, speculative output still equals the target's, and
an informative confidence head separates accepted from rejected drafts while a random one does not."""

from __future__ import annotations

import json

import pytest
import torch

from muse_spark.builder.pair import (PairError, draft_token_ids, expected_accepted, make_pair, make_tokenizer,
                                     random_prompts)
from muse_spark.checkpoint import load_pair
from muse_spark.runtime import EagerEngine, Generator, SamplingParams
from muse_spark.runtime.acceptance import acceptance_stats, auroc, measure_acceptance
from muse_spark.runtime.target_only import generate_target_only


def _engine(pair_dir, batch=64):
    return EagerEngine.from_checkpoints(pair_dir / "target", pair_dir / "draft", max_batch=batch, max_seq=192)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    out = {}
    for p in (0.3, 0.6, 0.9):
        make_pair(root / f"p{p}", "tiny", acceptance=p, seed=1)
        out[p] = root / f"p{p}"
    make_pair(root / "random", "tiny", acceptance=0.6, seed=1, confidence="random")
    out["random"] = root / "random"
    return out


def test_the_pair_is_a_checkpoint_the_loader_reads(pairs):
    d = pairs[0.6]
    for sub in ("target", "draft"):  # (small enough for one file)
        assert (d / sub / "model.safetensors").is_file() and not (d / sub / "model.safetensors.index.json").exists()
    target, draft = load_pair(d / "target", d / "draft")
    assert draft.cfg.block_size == 5 and draft.cfg.enable_confidence_head and draft.cfg.confidence_head_with_markov
    summary = json.loads((d / "pair.json").read_text())
    assert summary["acceptance"] == 0.6 and summary["preset"] == "tiny"
    ids = draft_token_ids(d)
    assert len(ids) == draft.cfg.draft_vocab_size and ids == sorted(ids)


def test_a_large_pair_is_sharded_with_an_index(tmp_path, pairs):
    d = tmp_path / "sharded"
    make_pair(d, "tiny", acceptance=0.6, seed=1, shard_bytes=64 << 10)
    for sub in ("target", "draft"):
        index = json.loads((d / sub / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert shards and all((d / sub / s).is_file() for s in shards)
        assert len(shards) > 1 and all((d / sub / s).is_file() for s in shards)
        assert (d / sub / "tokenizer.json").is_file() and (d / sub / "config.json").is_file()
    # the same weights as the one-file pair of the same seed
    for sub in ("target", "draft"):
        sharded = load_pair(d / "target", d / "draft")[sub == "draft"].state_dict()
        single = load_pair(pairs[0.6] / "target", pairs[0.6] / "draft")[sub == "draft"].state_dict()
        assert all(torch.equal(sharded[k], single[k]) for k in single)
    assert draft_token_ids(d) == draft_token_ids(pairs[0.6])


def test_the_same_seed_gives_the_same_weights(tmp_path):
    a, b = make_pair(tmp_path / "a", "tiny", seed=5), make_pair(tmp_path / "b", "tiny", seed=5)
    assert a["draft_tokens_disagreeing"] == b["draft_tokens_disagreeing"]
    ta, da = load_pair(tmp_path / "a" / "target", tmp_path / "a" / "draft")
    tb, db = load_pair(tmp_path / "b" / "target", tmp_path / "b" / "draft")
    for m1, m2 in ((ta, tb), (da, db)):
        for (n, p1), p2 in zip(m1.state_dict().items(), m2.state_dict().values()):
            assert torch.equal(p1, p2), n


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_measured_greedy_acceptance_tracks_the_rate(pairs, p):
    engine = _engine(pairs[p])
    m = measure_acceptance(engine, random_prompts(draft_token_ids(pairs[p]), 64, 8, seed=0), 48)
    want = expected_accepted(p, engine.gamma)
    assert abs(m["mean_accepted_per_step"] - want) <= 0.1 * want, (m["mean_accepted_per_step"], want)


def test_acceptance_orders_with_the_rate(pairs):
    got = [measure_acceptance(_engine(pairs[p], 16), random_prompts(draft_token_ids(pairs[p]), 16, 8), 32)
           ["mean_accepted_per_step"] for p in (0.3, 0.6, 0.9)]
    assert got[0] < got[1] < got[2]


def test_greedy_speculative_output_equals_target_only_on_every_pair(pairs):
    for key in (0.3, 0.9, "random"):
        engine = _engine(pairs[key], 4)
        prompts = random_prompts(draft_token_ids(pairs[key]), 4, 6, seed=3)
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        for r in Generator(engine).generate(prompts, params):
            assert r.output == generate_target_only(engine, r.prompt, params)


def test_informative_confidence_separates_accepted_from_rejected_and_random_does_not(pairs):
    def calibration(key):
        engine = _engine(pairs[key], 32)
        m = measure_acceptance(engine, random_prompts(draft_token_ids(pairs[key]), 32, 8), 48)
        return m["confidence"]

    good, rnd = calibration(0.6), calibration("random")
    assert good["auroc"] > 0.9 and good["mean_when_accepted"] > good["mean_when_rejected"] + 0.5
    assert abs(rnd["auroc"] - 0.5) < 0.1


def test_sampled_acceptance_is_measured_too(pairs):
    engine = _engine(pairs[0.9], 16)
    m = measure_acceptance(engine, random_prompts(draft_token_ids(pairs[0.9]), 16, 8), 32, temperature=1.0)
    assert m["temperature"] == 1.0 and 0 < m["mean_accepted_per_step"] <= engine.gamma


def test_auroc_is_the_rank_statistic():
    assert auroc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert auroc([0.1], [0.9]) == 0.0
    assert auroc([0.5, 0.5], [0.5]) == 0.5
    assert auroc([], [0.3]) is None


def test_stats_score_only_decided_positions():
    from muse_spark.runtime.generator import Request, StepRecord

    r = Request(0, [1], SamplingParams(), frozenset())
    r.steps = [StepRecord(1, [5, 6, 7], 1, [5, 9], [0.9, 0.2, 0.99]), StepRecord(3, [1, 2, 3], 3, [1, 2, 3, 4],
                                                                                 [0.8, 0.7, 0.6])]
    s = acceptance_stats([r], 3)
    # decided: step 1 positions 0 (accepted) and 1 (rejected); step 2 positions 0–2 (accepted)
    assert s["confidence"]["decided_positions"] == 5
    assert s["confidence"]["mean_when_rejected"] == pytest.approx(0.2)
    assert s["acceptance_per_position"] == [1.0, 0.5, 1.0]
    assert s["mean_accepted_per_step"] == 2.0
    assert "verified_counts" not in s  # (no step reported its width)
    r.steps[0].verified, r.steps[1].verified = 1, 3
    assert acceptance_stats([r], 3)["verified_counts"] == [0, 1, 0, 1]


def test_bad_requests_are_refused_before_writing(tmp_path):
    with pytest.raises(PairError, match="acceptance"):
        make_pair(tmp_path / "x", "tiny", acceptance=1.5)
    with pytest.raises(PairError, match="preset"):
        make_pair(tmp_path / "x", "huge")
    with pytest.raises(PairError, match="confidence"):
        make_pair(tmp_path / "x", "tiny", confidence="sometimes")
    assert not (tmp_path / "x").exists()
    make_pair(tmp_path / "y", "tiny")
    with pytest.raises(PairError, match="exists"):
        make_pair(tmp_path / "y", "tiny")
    make_pair(tmp_path / "y", "tiny", overwrite=True, acceptance=1.0)


def test_full_agreement_accepts_every_draft(tmp_path):
    make_pair(tmp_path / "all", "tiny", acceptance=1.0)
    engine = _engine(tmp_path / "all", 4)
    m = measure_acceptance(engine, random_prompts(draft_token_ids(tmp_path / "all"), 4, 8), 36)
    assert m["mean_accepted_per_step"] == engine.gamma


def test_a_wide_vocabulary_tokenizer_decodes_every_id():
    tok = make_tokenizer(70000)
    assert tok.get_vocab_size() == 70000
    assert tok.decode(tok.encode("hello").ids) == "hello"
    assert tok.decode([300, 69999]) != ""


def test_make_pair_cli_reports_the_measured_acceptance(tmp_path):
    from conftest import run_cli

    r = run_cli("make-pair", tmp_path / "pair", "--acceptance", "0.7", "--prompts", "8", "--max-tokens", "32")
    assert r.returncode == 0, r.stderr
    assert "accepted drafts per step" in r.stdout and "AUROC" in r.stdout
    measured = json.loads((tmp_path / "pair" / "pair.json").read_text())["measured"]
    assert measured["greedy"]["mean_accepted_per_step"] > 0.5
    r = run_cli("make-pair", tmp_path / "pair", "--acceptance", "0.7")
    assert r.returncode == 2 and "exists" in r.stderr
