"""The aoti engine built with the Triton plugin kernels compiled into its packages, on CUDA.

Skipped without a CUDA device (and Triton). Each engine it builds is an xdist group of its own,
so that the GPU test run builds them in parallel with each other and with tests/test_gpu_engine.py's
(``pytest -n … --dist loadgroup``).
"""

import json

import pytest
import torch

from muse_spark.runtime import EagerEngine, Generator, SamplingParams, load_engine

from conftest import ENGINE_PROMPTS as PROMPTS
from conftest import cli_generate_ids, run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_SEQ = 256
cli = run_cli
# greedy, and sampled with a seed: what each engine's output is compared with the eager engine's on
PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)]


def build(agreeing_pair, out, env: dict | None = None, extra: tuple = ()):
    """The pair built by the CLI as a 2-bucket CUDA engine with the Triton plugins (``env``: the
    kernel switches of the build; ``extra``: more build arguments) → ``out``."""
    r = cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", out, "--backend", "aoti",
            "--device", "cuda", "--max-batch", 2, "--max-seq", MAX_SEQ, "--plugins", "triton", *extra, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def assert_cli_equals_eager(out, eager) -> None:
    """The engine at ``out``, run by the CLI in a fresh process, emits the eager engine's tokens for
    the first two prompts, greedy and sampled (``PARAMS``)."""
    for prompt, p in zip(PROMPTS[:2], PARAMS):
        assert cli_generate_ids(out, prompt, 24, temperature=p.temperature, seed=p.seed) == \
            Generator(eager).generate([prompt], [p])[0].output


@pytest.fixture(scope="module")
def eager(agreeing_pair):
    return EagerEngine.from_checkpoints(*agreeing_pair, device="cuda", max_batch=2, max_seq=MAX_SEQ)


@pytest.fixture(scope="module")
def built(agreeing_pair, tmp_path_factory):
    # (with a prefill of two chunks a call: two prompts prefill in one call of its packages)
    return build(agreeing_pair, tmp_path_factory.mktemp("triton_engine") / "engine", extra=("--prefill-batch", 2))


# Each engine this file builds is a group of its own (scripts/gpu_check.sh runs --dist loadgroup): the
# builds run on different workers at once.
@pytest.mark.xdist_group("triton_engine")
def test_engine_with_the_triton_plugin_kernels_equals_eager(built, eager):
    """The product path: the fused Triton kernels compiled into the packages (no fallback allowed),
    built by the CLI and run by another process; greedy and sampled output equal the eager engine's.
    The RoPE table (the qkv GEMM's launch writes it), the fused attention (it norms q/k, writes
    the caches and attends, reading the table) and PDL (the plugin kernels wait first, the small
    ones trigger their dependents first, the GEMMs after their weight stream; the step graphs' edges
    into them programmatic) and the draft context on a second stream are on by default."""
    from muse_spark.plugins.pdl import PDL_KERNELS

    a = json.loads((built / "manifest.json").read_text())["aoti"]
    assert a["plugin_impl"] == "triton" and a["rope_table"] is True and a["attention_cache"] is True
    assert a["pdl_kernels"] == list(PDL_KERNELS) and a["pdl_trigger"] is True and a["pdl_gemm_trigger"] is True
    assert a["prefill_batch"] == 2 and "prefill_layer_p2" in a["graphs"]
    engine = load_engine(built)
    for runner in engine.runners.values():
        assert 0 < runner.programmatic_edges < runner.graph_kernels, (runner.programmatic_edges, runner.graph_kernels)
        assert isinstance(runner.fn.side, torch.cuda.Stream)
    batched = []
    fn = engine.prefill_batch_fn
    engine.prefill_batch_fn = lambda *x, **kw: batched.append(1) or fn(*x, **kw)
    want = [r.output for r in Generator(eager).generate(PROMPTS[:2], PARAMS)]
    assert [r.output for r in Generator(engine).generate(PROMPTS[:2], PARAMS)] == want
    assert batched  # (the two prompts' chunks in one call of the two-chunk packages)
    assert_cli_equals_eager(built, eager)


@pytest.mark.xdist_group("triton_engine")
def test_the_markov_workspace_is_kept_per_bucket_and_a_flagged_step_runs_again(built, eager):
    """Each bucket's runner keeps the Markov kernel's workspace (zeroed once, at load): every step
    counts its call on it, none zeroes it, and no program gives up. A step whose kernel raised
    its error flag reports n = −1 and ``step_host`` runs it again on a zeroed workspace: the rows
    are the ones a clean step gives."""
    m = json.loads((built / "manifest.json").read_text())["aoti"]
    engine = load_engine(built)
    assert set(engine.runners) == {1, 2}
    for b, runner in engine.runners.items():
        assert m["markov_workspace_words"][str(b)] == runner.markov_ws.numel() > 0
        assert int(runner.markov_ws[0]) > 0 and int(runner.markov_ws[2]) == 0  # warm-up calls counted, no flag
    params = [SamplingParams(max_tokens=16, ignore_eos=True), SamplingParams(max_tokens=16, temperature=0.8, seed=5,
                                                                             ignore_eos=True)]
    want = [r.output for r in Generator(eager).generate(PROMPTS[:2], params)]
    assert [r.output for r in Generator(engine).generate(PROMPTS[:2], params)] == want
    runner = engine.runners[2]
    counted = int(runner.markov_ws[0])
    host = ([65, 66], [40, 41], [0, 1], [9, 10], [0.0, 0.7])
    kv_len = 41 + engine.gamma + 1
    clean = engine.step_host(*host, kv_len)
    assert int(runner.markov_ws[0]) > counted and int(runner.markov_ws[2]) == 0
    assert all(row[engine.gamma] >= 0 for row in clean)
    with torch.inference_mode():  # (the engine's tensors are inference tensors)
        runner.markov_ws[2] = 1  # as a program that gave up would leave it
    assert engine.step_host(*host, kv_len) == clean  # the flagged step was run again
    assert int(runner.markov_ws[2]) == 0
    with torch.inference_mode():
        runner.markov_ws[2] = 1
    flagged = engine.step(*(torch.tensor(v, device="cuda") for v in host), kv_len)  # the device form reports it
    assert flagged[:, engine.gamma].tolist() == [-1, -1]
    runner.reset_markov()
    assert engine.step_host(*host, kv_len) == clean


@pytest.fixture(scope="module")
def built_pdl(agreeing_pair, tmp_path_factory):
    return build(agreeing_pair, tmp_path_factory.mktemp("triton_engine_pdl") / "engine",
                 env={"MUSE_SPARK_PDL_TRIGGER": "0", "MUSE_SPARK_PDL_GEMM_TRIGGER": "0"})


@pytest.mark.xdist_group("triton_engine_pdl")
def test_a_pdl_engine_whose_kernels_only_wait_equals_eager(built_pdl, eager):
    """Built with ``MUSE_SPARK_PDL_TRIGGER=0 MUSE_SPARK_PDL_GEMM_TRIGGER=0`` (PDL on, the default, but no
    kernel triggers its dependents: they launch as its programs exit): the manifest names the kernels
    compiled with the wait first, each bucket's step graph has the edges into them programmatic (not
    into its other kernels), and greedy and sampled output equal the eager engine's (built with the
    defaults), in this process and in a fresh one."""
    from muse_spark.plugins.pdl import PDL_KERNELS

    manifest = json.loads((built_pdl / "manifest.json").read_text())
    m = manifest["aoti"]
    assert m["pdl_kernels"] == list(PDL_KERNELS) and m["pdl_trigger"] is m["pdl_gemm_trigger"] is False
    assert manifest["options"]["pdl_trigger"] is manifest["options"]["pdl_gemm_trigger"] is False
    engine = load_engine(built_pdl)
    assert engine.options.pdl and not engine.options.pdl_trigger and not engine.options.pdl_gemm_trigger
    assert set(engine.runners) == {1, 2}
    for runner in engine.runners.values():
        assert 0 < runner.programmatic_edges < runner.graph_kernels, (runner.programmatic_edges, runner.graph_kernels)
        assert isinstance(runner.fn.side, torch.cuda.Stream)
    want = [r.output for r in Generator(eager).generate(PROMPTS[:2], PARAMS)]
    assert [r.output for r in Generator(engine).generate(PROMPTS[:2], PARAMS)] == want
    assert_cli_equals_eager(built_pdl, eager)


@pytest.mark.xdist_group("triton_engine_old_path")
def test_an_engine_without_the_rope_table_the_fused_attention_and_pdl_equals_eager(agreeing_pair, eager, tmp_path):
    """Built with ``MUSE_SPARK_ROPE_TABLE=0 MUSE_SPARK_ATTENTION_CACHE=0 MUSE_SPARK_PDL=0`` (the q/k norm
    kernel computes the angles and writes the caches, then the attention, kernels without the PDL
    wait on plain graph edges): recorded in the manifest, no
    programmatic edge, and greedy and sampled output equal the eager engine's (built with the
    defaults: the same bits), in this process and in a fresh one."""
    out = build(agreeing_pair, tmp_path / "engine",
                env={"MUSE_SPARK_ROPE_TABLE": "0", "MUSE_SPARK_ATTENTION_CACHE": "0", "MUSE_SPARK_PDL": "0"})
    a = json.loads((out / "manifest.json").read_text())["aoti"]
    assert a["rope_table"] is False and a["attention_cache"] is False
    assert a["pdl_kernels"] == [] and a["pdl_trigger"] is False
    engine = load_engine(out)
    assert engine.options.changed() == {"rope_table": False, "attention_cache": False, "pdl": False}
    assert all(runner.programmatic_edges == 0 for runner in engine.runners.values())
    want = [r.output for r in Generator(eager).generate(PROMPTS[:2], PARAMS)]
    assert [r.output for r in Generator(engine).generate(PROMPTS[:2], PARAMS)] == want
    assert_cli_equals_eager(out, eager)


@pytest.mark.xdist_group("triton_engine_widths")
def test_confidence_scheduled_steps_at_narrower_widths_equal_eager(agreeing_pair, eager, tmp_path, monkeypatch):
    """An engine built with a narrower verification width (``--verify-widths 2``): each bucket's step
    halves are captured graphs of their own (the draft, then the verification at width 2 or γ); a
    step verifying K drafts emits the eager engine's tokens for K, greedy and sampled; confidence
    scheduling keeps greedy output, in process and from the CLI in a fresh one. Then the sampling
    controls on the same engine's controlled step graphs."""
    from muse_spark.schedule import Schedule

    out = build(agreeing_pair, tmp_path / "engine", extra=("--verify-widths", 2))
    engine = load_engine(out)
    assert engine.verify_widths == [2, 5]
    assert all(sorted(r.halves, key=str) == [2, 5, "ctl", "draft"] for r in engine.runners.values())
    try:
        for K in (2, 5):
            for e in (engine, eager):
                e.set_schedule(Schedule("fixed", length=K))
            want = [r.output for r in Generator(eager).generate(PROMPTS[:2], PARAMS)]
            assert [r.output for r in Generator(engine).generate(PROMPTS[:2], PARAMS)] == want, K
        engine.set_schedule(Schedule("confidence", threshold=0.5))
        reqs = Generator(engine).generate(PROMPTS[:2], [PARAMS[0]] * 2)
        assert {s.verified for r in reqs for s in r.steps} <= {2, 5}
        engine.set_schedule(Schedule())
        eager.set_schedule(Schedule())
        assert [r.output for r in reqs] == [r.output for r in Generator(eager).generate(PROMPTS[:2], [PARAMS[0]] * 2)]
        # Batch 1's flat cost row runs its plain steps, batch 2's steep row plans; both chain (a chained scheduled
        # step plans from an earlier step's confidences, on the GPU while this one's are on their way), and each
        # gives the eager engine's greedy tokens.
        g = engine.gamma
        launched = []
        step_next = engine.step_next
        monkeypatch.setattr(engine, "step_next", lambda *a, **kw: launched.append(a[0].n) or step_next(*a, **kw))
        engine.set_schedule(Schedule("confidence", threshold=0.5,
                                     cost_ms={"1": [10.0] * (g + 1), "2": [5.0 + k for k in range(g + 1)]}))
        assert engine.runners[1].planner is None and engine.runners[2].planner is not None and engine.chains
        one = Generator(engine).generate(PROMPTS[:1], [PARAMS[0]])
        short = [PROMPTS[0], PROMPTS[2]]  # (both prefilled in one round: their first steps run together, at batch 2)
        two = Generator(engine).generate(short, [PARAMS[0]] * 2)
        engine.set_schedule(Schedule())
        assert set(launched) == {1, 2}  # (both batch sizes chained)
        assert all(s.verified is None for s in one[0].steps)
        # (the request that finishes first ran every step beside the other, at batch 2: each planned; the other's
        # last steps, alone, run batch 1's plain step, but for the first of them where it was chained at batch 2
        # before the other's end was read)
        first, last = sorted(two, key=lambda r: len(r.steps))
        assert all(s.verified in (2, 5) and len(s.confidence) == g for s in first.steps)
        assert all(s.verified in (2, 5) and len(s.confidence) == g for s in last.steps[: len(first.steps)])
        tail = last.steps[len(first.steps):]
        assert all(s.verified in (2, 5) and len(s.confidence) == g for s in tail[:1] if s.verified is not None)
        assert all(s.verified is None and s.confidence is None for s in tail[1:])
        assert [r.output for r in one] == [reqs[0].output]
        assert [r.output for r in two] == [r.output for r in Generator(eager).generate(short, [PARAMS[0]] * 2)]
    finally:
        engine.set_schedule(Schedule())
        eager.set_schedule(Schedule())
    r = cli("generate", "--engine", out, "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-tokens", 24,
            "--ignore-eos", "--json", "--schedule", "confidence", "--confidence-threshold", 0.5)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["output_ids"] == cli_generate_ids(out, PROMPTS[0], 24)
    assert all(s["verified"] in (2, 5) and len(s["confidence"]) == 5 for s in got["steps"])
    # The sampling controls on the same engine: the controlled step's own captured graph, reading and
    # advancing the slots' state on the device, emits the eager engine's tokens and log-probabilities.
    controlled = [SamplingParams(max_tokens=24, temperature=1.1, seed=3, top_k=5, repetition_penalty=1.3,
                                 logprobs=2, ignore_eos=True),
                  SamplingParams(max_tokens=24, temperature=0.9, seed=4, top_p=0.8, frequency_penalty=0.4,
                                 min_tokens=8, ignore_eos=True)]
    assert all("ctl" in r.halves for r in engine.runners.values())
    got = Generator(engine).generate(PROMPTS[:2], controlled)
    want = Generator(eager).generate(PROMPTS[:2], controlled)
    assert [r.output for r in got] == [r.output for r in want]
    assert [lp for lp, _ in got[0].logprobs] == pytest.approx([lp for lp, _ in want[0].logprobs], abs=1e-3)


@pytest.mark.xdist_group("triton_engine_paged")
def test_a_paged_engine_with_the_triton_plugins_equals_eager(agreeing_pair, eager, tmp_path):
    """Built with a pool (``--kv-cache-tokens``): the packages' Triton kernels write and read the caches
    through the slots' block tables, gathered inside the captured step graphs (the tables change between
    replays; no recapture); with freed blocks poisoned and requests preempted, greedy and sampled tokens
    equal the eager engine's (slot caches)."""
    from test_paged_kv import _workload, poison_freed_blocks

    out = build(agreeing_pair, tmp_path / "engine", extra=("--kv-cache-tokens", 272, "--kv-block-size", 16))
    engine = load_engine(out)
    assert engine.kv is not None and engine.cuda_graphs
    poison_freed_blocks(engine)
    prompts, params = _workload(6, seed=0, max_tokens=(60, 120))
    want = [r.output for r in Generator(eager).generate(prompts, params)]
    gen = Generator(engine)
    assert [r.output for r in gen.generate(prompts, params)] == want
    assert gen.preemptions > 0
    engine.kv.check()


@pytest.mark.xdist_group("triton_engine_fp8")
def test_an_fp8_engine_with_the_triton_plugins_equals_the_eager_fp8_engine(tmp_path):
    """The FP8 (per-channel E4M3) tiny pair built by the CLI into an aoti engine with the Triton plugins: the
    step packages' projections run the W8A16 kernel (``linear_fp8_triton``, its FP8 weights and scales graph
    inputs), and the CUDA-graph steps give the eager FP8 engine's tokens, greedy and sampled."""
    from muse_spark.builder.pair import draft_token_ids, make_pair, random_prompts
    from muse_spark.builder.quantize import quantize_pair

    make_pair(tmp_path / "bf16", "tiny", acceptance=0.8, seed=0)
    quantize_pair(tmp_path / "bf16" / "target", tmp_path / "fp8" / "target", draft=tmp_path / "bf16" / "draft",
                  draft_out=tmp_path / "fp8" / "draft", log=lambda s: None)
    out = build((tmp_path / "fp8" / "target", tmp_path / "fp8" / "draft"), tmp_path / "engine")
    engine = load_engine(out)
    assert engine.cuda_graphs
    eager = EagerEngine.from_checkpoints(tmp_path / "fp8" / "target", tmp_path / "fp8" / "draft", device="cuda",
                                         max_batch=2, max_seq=MAX_SEQ)
    prompts = random_prompts(draft_token_ids(tmp_path / "bf16"), 2, 7, seed=2)
    want = [r.output for r in Generator(eager).generate(prompts, PARAMS)]
    assert [r.output for r in Generator(engine).generate(prompts, PARAMS)] == want
