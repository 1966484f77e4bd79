"""The eager engine on a CUDA device (skipped without one)."""

import dataclasses

import pytest
import torch

from muse_spark.options import KernelOptions, use_options
from muse_spark.runtime import EagerEngine, Generator, SamplingParams
from muse_spark.runtime.target_only import generate_target_only

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[1, 2, 3], [72, 101, 108, 108, 111], [200], [40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_greedy_speculative_equals_target_only(agreeing_pair, dtype):
    engine = EagerEngine.from_checkpoints(*agreeing_pair, device="cuda", dtype=dtype, max_batch=4, max_seq=128)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for r in Generator(engine).generate(PROMPTS, params):
        assert r.output == generate_target_only(engine, r.prompt, params)


def test_cuda_sampling_is_batch_independent(random_pair):
    engine = EagerEngine.from_checkpoints(*random_pair, device="cuda", max_batch=4, max_seq=128)
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
    solo = Generator(engine).generate([PROMPTS[1]], p)[0].output
    batch = Generator(engine).generate(PROMPTS, [SamplingParams(max_tokens=9, temperature=0.5, seed=1), p, p, p])
    assert batch[1].output == solo


def test_cuda_step_matches_cpu_step_in_fp32(random_pair):
    """Same weights, same seeds: the CUDA and CPU engines emit the same greedy tokens."""
    outs = []
    for dev in ("cpu", "cuda"):
        engine = EagerEngine.from_checkpoints(*random_pair, device=dev, dtype="float32", max_batch=2, max_seq=128)
        outs.append(Generator(engine).generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0].output)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
def test_cuda_bf16_attention_matches_the_fp32_einsums(kernel):
    """attend() in bf16 on CUDA runs a fused kernel (the kernel option ``attention``): within bf16 tolerance
    of the fp32 einsums, garbage past the lengths (NaN, large keys) ignored, zeros for a query
    with no visible key."""
    from muse_spark.models.layers import attend
    from muse_spark.plugins.attention.reference import attend_reference

    from test_models import attention_case
    from tolerances import TOL

    q, k, v, mask = attention_case(torch.bfloat16, "cuda", T=300)
    with use_options(KernelOptions(attention=kernel)):
        out = attend(q, k, v, mask)
    ref = attend_reference(q.float(), k.float(), v.float(), mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert torch.equal(out[-1, 0], torch.zeros_like(out[-1, 0]))
    torch.testing.assert_close(out.float(), ref, **TOL[torch.bfloat16])


def test_cuda_greedy_speculative_equals_target_only_with_the_triton_attention(agreeing_pair):
    """The eager engine with the Triton attention kernel: still lossless."""
    engine = EagerEngine.from_checkpoints(*agreeing_pair, device="cuda", max_batch=4, max_seq=256,
                                          options=KernelOptions(attention="triton"))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for r in Generator(engine).generate(PROMPTS, params):
        assert r.output == generate_target_only(engine, r.prompt, params)


def answers(monkeypatch, cls, name: str) -> list:
    """The values method ``cls.name`` returns from now on, appended to the list returned."""
    got, original = [], getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda self, *a: got.append(original(self, *a)) or got[-1])
    return got


@pytest.mark.parametrize("attention_cache", [False, True], ids=["norm_kernel", "fused_attention"])
def test_cuda_rope_table_changes_no_token_and_no_cache_bit(random_pair, monkeypatch, attention_cache):
    """The RoPE table (the qkv GEMM's launch writes it for the fused attention, the default, or with
    the kernel option ``attention_cache`` off for the q/k norm kernel; ``rope_table`` off turns it
    off): the same greedy and sampled tokens, and the same KV caches bit for bit, as
    without it; and the layers do take that path (the op is called), by default as when asked for."""
    from muse_spark.models.layers import Attention

    params = [SamplingParams(max_tokens=20, ignore_eos=True), SamplingParams(max_tokens=20, temperature=0.9, seed=4,
                                                                             ignore_eos=True)]
    runs = []
    for table in (False, True, None):
        options = KernelOptions(attention_cache=attention_cache)
        if table is not None:
            options = dataclasses.replace(options, rope_table=table)
        engine = EagerEngine.from_checkpoints(*random_pair, device="cuda", max_batch=2, max_seq=128, options=options)
        with monkeypatch.context() as m:  # each decision of the layers, recorded
            taken, fused = (answers(m, Attention, name) for name in ("takes_rope_table", "attends_from_cache_write"))
            out = [r.output for r in Generator(engine).generate(PROMPTS[:2], params)]
        assert any(fused) == attention_cache
        caches = engine.target_cache.k + engine.target_cache.v
        runs.append((out, [t.clone() for t in caches], any(taken)))
    assert runs[0][0] == runs[1][0] == runs[2][0]
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(runs[0][1], runs[1][1], runs[2][1]))
    assert [r[2] for r in runs] == [False, True, True]


@pytest.mark.parametrize("swap_space", [4, 0], ids=["swapped", "recomputed"])
@pytest.mark.parametrize("attention_cache", [False, True], ids=["norm_kernel", "fused_attention"])
def test_cuda_paged_caches_give_the_slot_caches_tokens_through_the_same_kernels(random_pair, attention_cache,
                                                                                  swap_space):
    """Paged KV caches on CUDA in bf16: the layers run the Triton kernels through the block tables (the
    norm kernel's cache write or the fused attention, then the split-KV attention), and a pool too small
    for all requests preempts some (swapped out, or with no swap space recomputed by a prefill of their
    tokens); every token, greedy and sampled, is the slot caches' one."""
    from test_paged_kv import _workload, poison_freed_blocks

    prompts, params = _workload(8, seed=0)
    options = KernelOptions(attention_cache=attention_cache)  # (an engine runs its own options, not the caller's)
    with use_options(options):
        slot = EagerEngine.from_checkpoints(*random_pair, device="cuda", max_batch=4, max_seq=128, options=options)
        want = [r.output for r in Generator(slot).generate(prompts, params)]
        paged = EagerEngine.from_checkpoints(*random_pair, device="cuda", max_batch=4, max_seq=128, kv_tokens=160,
                                             swap_space=swap_space, options=options)
        poison_freed_blocks(paged)
        gen = Generator(paged)
        assert [r.output for r in gen.generate(prompts, params)] == want
    assert gen.preemptions > 0 and (gen.recomputations == gen.preemptions) == (swap_space == 0)
    paged.kv.check()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_cuda_fp8_pair_is_lossless_on_the_skinny_kernel(tmp_path, static):
    """The FP8 (per-channel E4M3) tiny pair on CUDA, with per-token activation scales or static ones calibrated on
    the bf16 pair (``quantize --calibrate``): its projections run the skinny kernel at these row counts (W8A8 on
    FP8 tensor cores, the static scale passed on; else W8A16), and greedy speculative output equals the same
    engine's greedy target-only output."""
    from muse_spark.builder.pair import draft_token_ids, make_pair, random_prompts
    from muse_spark.builder.quantize import quantize_pair
    from muse_spark.models import layers
    from muse_spark.runtime.activation_scales import measure_input_amax

    make_pair(tmp_path / "bf16", "tiny", acceptance=0.8, seed=0)
    calibrate = (lambda: measure_input_amax(tmp_path / "bf16" / "target", tmp_path / "bf16" / "draft",
                                            random_prompts(draft_token_ids(tmp_path / "bf16"), 4, 12, seed=5), 16,
                                            device="cuda", log=lambda s: None)) if static else None
    quantize_pair(tmp_path / "bf16" / "target", tmp_path / "fp8" / "target", draft=tmp_path / "bf16" / "draft",
                  draft_out=tmp_path / "fp8" / "draft", log=lambda s: None, measure_input_amax=calibrate)
    engine = EagerEngine.from_checkpoints(tmp_path / "fp8" / "target", tmp_path / "fp8" / "draft", device="cuda",
                                          max_batch=2, max_seq=128)
    w = layers.proj_weight(engine.target.model.layers[0].self_attn.o_proj)
    assert (w.input_scale is not None) == static
    x = torch.randn(8, w.shape[1], device="cuda").to(torch.bfloat16)
    assert isinstance(w, layers.Fp8Weight) and layers._triton_linear_fits(x, w)
    ops = torch.ops.muse_spark
    fp8_cores = layers.fp8_tensor_cores(x.device)
    with use_options(engine.options):  # (what the engine's layers run at a step's 8 rows)
        want = ops.linear_w8a8_triton(x, w.weight, w.scale, False, w.input_scale) if fp8_cores else \
            ops.linear_fp8_triton(x, w.weight, w.scale, False)
        assert torch.equal(layers.linear(x, w), want)
    prompts = random_prompts(draft_token_ids(tmp_path / "bf16"), 2, 7, seed=2)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for r in Generator(engine).generate(prompts, params):
        assert r.output == generate_target_only(engine, r.prompt, params)
    if fp8_cores:  # the compiled engines' layers: the residual kernel quantizes the gate/up product's rows itself
        _the_residual_kernel_quantizes_the_ffn_rows_with_the_same_bits(engine)


def _the_residual_kernel_quantizes_the_ffn_rows_with_the_same_bits(engine):
    """The target's 8-row forward through the Triton plugins (``plugin_impl("triton")``, as the aoti packages run
    it): every layer folds the gate/up product's row quantization into its residual kernel
    (``_folds_w8a8_rows``), and the hidden states and aux streams are those of the same forward with a quantizing
    kernel of its own, bit for bit."""
    from unittest import mock

    from muse_spark.models import layers
    from muse_spark.models.target import KVCache
    from muse_spark.plugins.dispatch import plugin_impl

    t = engine.target
    tokens = torch.arange(3, 11, device="cuda")[None]
    positions = torch.arange(8, device="cuda")[None]
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    c = t.cfg

    def forward(fold: bool):
        cache = KVCache.allocate(c.num_hidden_layers, 1, 64, c.num_key_value_heads, c.head_dim, t.dtype, "cuda")
        folds = []

        def spy(stream, w):
            folds.append(fold and real(stream, w))
            return folds[-1]

        with torch.inference_mode(), plugin_impl("triton"), use_options(engine.options), \
                mock.patch.object(layers, "_folds_w8a8_rows", spy):
            return t(tokens, positions, slots, cache, 64), folds

    real = layers._folds_w8a8_rows
    (h, aux), folds = forward(True)
    (h0, aux0), unfolded = forward(False)
    assert folds == [True] * c.num_hidden_layers and unfolded == [False] * c.num_hidden_layers
    assert torch.equal(h, h0) and torch.equal(aux, aux0)


@pytest.mark.parametrize("attention_cache", [False, True], ids=["norm_kernel", "fused_attention"])
def test_cuda_fp8_kv_cache_is_lossless_and_paged_pools_give_its_tokens(random_pair, attention_cache):
    """The target's KV cache in E4M3 on CUDA: the norm kernel (or the fused attention) quantizes the new keys and
    values as it writes them, the split-KV Triton attention dequantizes each tile as it loads it (slot rows
    and, paged, block tables); greedy speculative output equals the engine's greedy target-only output, and a
    pool too small for all requests (preempting, freed blocks poisoned) gives the slot caches' tokens, greedy
    and sampled."""
    _fp8_kv_cache_case(random_pair, KernelOptions(attention_cache=attention_cache))


def _fp8_kv_cache_case(random_pair, options):
    from test_paged_kv import _workload, poison_freed_blocks

    engine = EagerEngine.from_checkpoints(*random_pair, device="cuda", max_batch=4, max_seq=128,
                                          kv_cache_dtype="fp8", options=options)
    assert engine.target_cache.k[0].dtype == torch.float8_e4m3fn
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for r in Generator(engine).generate(PROMPTS, params):
        assert r.output == generate_target_only(engine, r.prompt, params)
    prompts, mixed = _workload(8, seed=0)
    want = [r.output for r in Generator(engine).generate(prompts, mixed)]
    paged = EagerEngine.from_checkpoints(*random_pair, device="cuda", max_batch=4, max_seq=128, kv_tokens=160,
                                         kv_cache_dtype="fp8", options=options)
    poison_freed_blocks(paged)
    gen = Generator(paged)
    assert [r.output for r in gen.generate(prompts, mixed)] == want and gen.preemptions > 0
    paged.kv.check()
