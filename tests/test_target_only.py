"""Batched target-only decoding (``TargetOnlyDecoder``): every request's tokens equal the one-prompt
reference (``generate_target_only``) and, greedy, the speculative output; on CUDA from captured graphs."""

from __future__ import annotations

import pytest
import torch

from muse_spark.builder.pair import draft_token_ids, make_pair, random_prompts
from muse_spark.runtime import EagerEngine, Generator, RequestError, SamplingParams
from muse_spark.runtime.target_only import TargetOnlyDecoder, generate_target_only


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    make_pair(out, "tiny", acceptance=0.8, seed=3)
    return out


def _engine(pair, device="cpu", max_batch=4):
    return EagerEngine.from_checkpoints(pair / "target", pair / "draft", device=device, max_batch=max_batch,
                                        max_seq=128)


def _prompts(pair, n=5):
    # drawn from the draft vocabulary, and one whole-vocabulary prompt of one token (chunking: 5 > max_batch 4)
    return random_prompts(draft_token_ids(pair), n - 1, 7, seed=2) + [[200]]


def test_greedy_batch_equals_target_only_and_speculative(pair):
    engine, prompts = _engine(pair), _prompts(pair)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    dec = TargetOnlyDecoder(engine)
    reqs = dec.generate(prompts, params)
    spec = Generator(engine).generate(prompts, params)
    for r, s in zip(reqs, spec):
        assert r.finished and r.finish_reason == "length" and len(r.output) == 24
        assert r.output == generate_target_only(engine, r.prompt, params) == s.output
    assert not dec.graphs and len(dec.step_times) == 2 * 23  # (two batches, 23 steps each after the prefill)


def test_sampled_batch_equals_target_only_with_the_same_seeds(pair):
    engine, prompts = _engine(pair), _prompts(pair, 4)
    params = [SamplingParams(max_tokens=20, temperature=t, seed=s, ignore_eos=True)
              for t, s in ((1.0, 7), (0.7, 8), (0.0, 0), (1.3, 2**63 + 5))]
    for r, p in zip(TargetOnlyDecoder(engine).generate(prompts, params), params):
        assert r.output == generate_target_only(engine, r.prompt, p)


def test_mixed_max_tokens_and_a_stop_token(pair):
    engine, prompts = _engine(pair), _prompts(pair, 4)
    free = TargetOnlyDecoder(engine).generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free[1].output[9]  # request 1 stops at its 10th token (or at an earlier one of the same id)
    params = [SamplingParams(max_tokens=n, stop_token_ids=(stop,) if i == 1 else (), ignore_eos=True)
              for i, n in enumerate((3, 30, 17, 1))]
    reqs = TargetOnlyDecoder(engine).generate(prompts, params)
    for r, p in zip(reqs, params):
        assert r.output == generate_target_only(engine, r.prompt, p)
    assert [len(r.output) for r in reqs] == [3, free[1].output.index(stop) + 1, 17, 1]
    assert [r.finish_reason for r in reqs] == ["length", "stop", "length", "length"]


def test_the_whole_window_gives_the_tokens_of_the_window_up_to_the_position(pair):
    """What lets one CUDA graph serve every position: keys past a row's position are masked, exactly."""
    engine, prompts = _engine(pair), _prompts(pair, 4)
    for slot, p in enumerate(prompts):
        engine.prefill(p, slot, 0, 0.0)
    tok, pos, slots = torch.tensor([5, 6, 7, 8]), torch.tensor([len(p) for p in prompts]), torch.arange(4)
    with torch.inference_mode():
        h_short, _ = engine.target(tok[:, None], pos[:, None], slots, engine.target_cache, int(pos.max()) + 1)
        h_full, _ = engine.target(tok[:, None], pos[:, None], slots, engine.target_cache, engine.max_seq)
    assert torch.equal(h_short, h_full)


def test_a_bad_request_runs_nothing(pair):
    engine = _engine(pair)
    dec = TargetOnlyDecoder(engine)
    with pytest.raises(RequestError, match="prompt 1 of 2: .*outside the vocabulary"):
        dec.generate([[1, 2], [1, 10**6]], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="exceeds the engine's maximum sequence length"):
        dec.generate([[1, 2]], SamplingParams(max_tokens=500))
    assert not dec.step_times


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_target_only_tokens(pair):
    engine, prompts = _engine(pair, "cuda"), _prompts(pair)
    dec = TargetOnlyDecoder(engine)
    params = [SamplingParams(max_tokens=n, temperature=t, seed=i, ignore_eos=True)
              for i, (n, t) in enumerate(((24, 0.0), (9, 0.0), (24, 1.0), (16, 0.8), (24, 0.0)))]
    reqs = dec.generate(prompts, params)
    for r, p in zip(reqs, params):
        assert r.output == generate_target_only(engine, r.prompt, p)
    assert sorted(dec.graphs) == [1, 2, 3, 4]  # 4 → 3 → 2 as requests finish; the last batch of one
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    again = dec.generate(prompts, greedy)  # the captured graphs, replayed for new requests
    for r, s in zip(again, Generator(engine).generate(prompts, greedy)):
        assert r.output == s.output == generate_target_only(engine, r.prompt, greedy)
