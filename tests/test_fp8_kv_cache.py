"""The FP8 KV cache (docs/fp8.md): the target's K/V held as E4M3 codes with a float32 scale per layer and KV
head, written quantized (``x / scale``, saturated) and read dequantized (``code · scale``, rounded once to the
compute dtype) by every path. Speculative decoding stays lossless with respect to the target that reads this
cache: greedy speculative output equals greedy target-only output of the same engine, and the paged pools,
the compiled packages and the C++ library give the eager FP8-cache engine's tokens."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import clone, run_cli
from muse_spark.checkpoint import CheckpointError, load_pair, load_target
from muse_spark.config import MuseSpark1xConfig, load_config
from muse_spark.plugins.attention.reference import FP8_MAX, CacheKV, KeyBounds, dequantize_kv, quantize_kv
from muse_spark.runtime import EagerEngine, Generator, SamplingParams, load_engine
from muse_spark.runtime.target_only import generate_target_only

from test_paged_kv import _workload, poison_freed_blocks

MAX_SEQ = 128
SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _engine(pair, kv_cache_dtype="fp8", **kw):
    kw.setdefault("max_batch", 4)
    return EagerEngine.from_checkpoints(*pair, max_seq=MAX_SEQ, kv_cache_dtype=kv_cache_dtype, **kw)


def _scaled(pair, dst):
    """``pair`` with its target declaring an FP8 KV cache whose scales differ by layer and KV head (0.06-0.5)."""
    kv = load_config(pair[0]).num_key_value_heads
    edit = _scales(lambda i: (torch.arange(kv, dtype=torch.float32) + 1 + i) / (2 * kv + 8))
    return clone(pair[0], dst, edit=edit, config_edit=_scheme(strategy="attn_head")), pair[1]


@pytest.fixture(scope="module")
def scaled_pair(random_pair, tmp_path_factory):
    return _scaled(random_pair, tmp_path_factory.mktemp("scaled") / "target")


@pytest.fixture(scope="module")
def fp8_engine(scaled_pair):
    return _engine(scaled_pair, None)  # (the checkpoint declares it)


# ---- the codes ------------------------------------------------------------------------------------------------
def test_the_codes_are_the_scaled_values_rounded_and_saturated():
    scale = torch.tensor([0.5, 4.0])
    x = torch.tensor([[1.0, -3.3, 1000.0, -1e6], [2.0, 0.01, 448.0 * 4, float("nan")]])[None]  # [1, KV=2, Dh=4]
    q = quantize_kv(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    want = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    back = dequantize_kv(q, scale, torch.float32)
    assert back[0, 0, 2] == FP8_MAX * 0.5 and back[0, 0, 3] == -FP8_MAX * 0.5  # saturated, not NaN
    assert torch.isnan(back[0, 1, 3])  # (NaN stays NaN: garbage is never read, the masks see to it)
    finite = torch.isfinite(x) & (x.abs() / scale[:, None] <= FP8_MAX)
    # E4M3 rounding: within 2^-4 relative, 2^-10 · scale absolute below the normal range
    err = (back - x).abs()[finite]
    bound = (2.0**-4 * x.abs() + 2.0**-10 * scale[:, None].expand_as(x))[finite]
    assert bool((err <= bound).all())


def test_a_cache_of_another_dtype_than_its_writes_needs_its_scales():
    c = torch.zeros(2, 8, 2, 16, dtype=torch.float8_e4m3fn)
    kv = CacheKV(c, c.clone(), torch.tensor([1]), torch.tensor([[0, 1]]), KeyBounds(torch.tensor([[0, 1]]), 8))
    with pytest.raises(ValueError, match="written with its scales"):
        kv(torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16))


# ---- configs and checkpoints ----------------------------------------------------------------------------------
def _scheme(**kw):
    """A quantization_config declaring the FP8 KV cache (its projections left in bf16: ignored_layers)."""
    return lambda cfg: cfg.setdefault("quantization_config", {"quant_method": "fp8", "ignored_layers": ["re:.*"]}
                                      ).update(kv_cache_scheme={**SCHEME, **kw})


def _scales(value, layers=None):
    def edit(t):
        n = layers if layers is not None else len({k.split(".")[2] for k in t if k.startswith("model.layers.")})
        for i in range(n):
            for kind in ("k_scale", "v_scale"):
                t[f"model.layers.{i}.self_attn.{kind}"] = value.clone() if torch.is_tensor(value) else value(i)
    return edit


@pytest.mark.parametrize("scheme, message", [
    (dict(dynamic=True), r"dynamic KV-cache scales are not supported"),
    (dict(symmetric=False), r"asymmetric KV-cache quantization is not supported"),
    (dict(num_bits=4, type="int"), r"only an 8-bit float \(E4M3\) KV cache"),
    (dict(strategy="channel"), r"strategy 'channel' is not supported"),
])
def test_unsupported_kv_cache_schemes_are_refused(random_pair, tmp_path, scheme, message):
    d = clone(random_pair[0], tmp_path / "t", config_edit=_scheme(**scheme))
    with pytest.raises(ValueError, match=message):
        load_config(d)


def test_a_declared_fp8_cache_reads_its_scales_and_refuses_bad_ones(random_pair, tmp_path):
    layers = load_config(random_pair[0]).num_hidden_layers
    kv_heads = load_config(random_pair[0]).num_key_value_heads
    per_head = torch.arange(1, kv_heads + 1, dtype=torch.float32) / 8
    d = clone(random_pair[0], tmp_path / "t", edit=_scales(per_head, layers), config_edit=_scheme(strategy="attn_head"))
    cfg = load_config(d)
    assert cfg.kv_cache_dtype == "fp8" and cfg.quantization_config.kv_cache_scheme["strategy"] == "attn_head"
    assert MuseSpark1xConfig.from_dict(cfg.to_dict()).kv_cache_dtype == "fp8"  # (the manifest's round trip)
    target = load_target(d)
    attn = target.model.layers[1].self_attn
    assert torch.equal(attn.k_scale, per_head) and attn.k_scale.dtype == torch.float32
    # one scale a layer ([] in the checkpoint, bf16 widened exactly) expands over the KV heads
    d2 = clone(random_pair[0], tmp_path / "t2", edit=_scales(lambda i: torch.tensor(0.25 * (i + 1), dtype=torch.bfloat16),
                                                            layers), config_edit=_scheme())
    assert torch.equal(load_target(d2).model.layers[2].self_attn.v_scale, torch.full((kv_heads,), 0.75))
    bad = [
        (_scales(per_head, layers - 1), rf"missing tensor 'model.layers.{layers - 1}.self_attn.k_scale'.*declares"),
        (_scales(torch.ones(kv_heads + 1), layers), r"has shape \[%d\], expected a scale per layer" % (kv_heads + 1)),
        (_scales(-per_head, layers), r"scale\(s\) that are not positive finite numbers"),
        (_scales(per_head.to(torch.int32), layers), r"has dtype int32, expected float32"),
    ]
    for i, (edit, message) in enumerate(bad):
        e = clone(random_pair[0], tmp_path / f"bad{i}", edit=edit, config_edit=_scheme())
        with pytest.raises(CheckpointError, match=message):
            load_target(e)


def test_the_option_asks_for_an_fp8_cache_the_checkpoint_does_not_declare(random_pair, tmp_path):
    """``kv_cache_dtype="fp8"`` on a checkpoint without scales: each scale 1; with scales but no declaration:
    the checkpoint's; "auto" over a declared scheme: a cache of the compute dtype, the scales ignored."""
    target = load_target(random_pair[0], kv_cache_dtype="fp8")
    assert target.cfg.kv_cache_dtype == "fp8" and torch.equal(target.model.layers[0].self_attn.k_scale,
                                                              torch.ones(target.cfg.num_key_value_heads))
    d = clone(random_pair[0], tmp_path / "t", edit=_scales(torch.tensor([0.5])), config_edit=_scheme())
    assert load_target(d, kv_cache_dtype="fp8").model.layers[0].self_attn.v_scale[0] == 0.5
    plain = load_target(d, kv_cache_dtype="auto")
    assert plain.cfg.kv_cache_dtype == "auto" and not hasattr(plain.model.layers[0].self_attn, "k_scale")
    assert plain.allocate_cache(1, 8, "cpu").k[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8'\]"):
        load_target(random_pair[0], kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="the draft's context K/V stay in torch_dtype"):
        clone(random_pair[1], tmp_path / "d", config_edit=lambda c: c.update(kv_cache_dtype="fp8"))
        load_config(tmp_path / "d")


# ---- the eager engine -----------------------------------------------------------------------------------------
def test_the_target_cache_is_fp8_and_half_the_bytes(random_pair, fp8_engine):
    bf16 = _engine(random_pair, "auto")
    assert fp8_engine.target_cache.k[0].dtype == torch.float8_e4m3fn
    assert fp8_engine.draft_cache.k[0].dtype == bf16.draft_cache.k[0].dtype == torch.bfloat16  # (the draft's stays)
    assert 2 * fp8_engine.target_cache.nbytes() == bf16.target_cache.nbytes()
    cfg = fp8_engine.tcfg
    assert cfg.kv_cache_bytes(4, MAX_SEQ) == fp8_engine.target_cache.nbytes()


def test_greedy_speculative_output_equals_greedy_target_only_with_an_fp8_cache(random_pair, fp8_engine):
    """Lossless with respect to the target reading the FP8 cache: greedy speculative output is its greedy
    target-only output (the scaled checkpoint's). Against the bf16 cache the tokens may differ: printed."""
    prompts, _ = _workload(4, seed=5)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reqs = Generator(fp8_engine).generate(prompts, params)
    for r in reqs:
        assert len(r.output) == 40 and r.output == generate_target_only(fp8_engine, r.prompt, params)
    same = sum(a == b for r, q in zip(reqs, Generator(_engine(random_pair, "auto")).generate(prompts, params))
               for a, b in zip(r.output, q.output))
    print(f"\nFP8 cache against the bf16 cache: {same} of {40 * len(prompts)} greedy tokens the same")


def test_paged_fp8_pools_give_the_slot_caches_tokens_through_preemption_and_swap(scaled_pair, fp8_engine):
    """Pools of E4M3 blocks, too few for the workload (the newest preempted: swapped out as codes, or
    recomputed), freed blocks poisoned with NaN codes: every output is the FP8 slot caches' engine's."""
    prompts, params = _workload(8, seed=0)
    want = [r.output for r in Generator(fp8_engine).generate(prompts, params)]
    for swap in (None, 0):
        paged = _engine(scaled_pair, None, kv_tokens=160, kv_block_size=16,
                        **({} if swap is None else {"swap_space": swap}))
        assert paged.target_cache.k[0].dtype == torch.float8_e4m3fn
        poison_freed_blocks(paged)
        gen = Generator(paged)
        assert [r.output for r in gen.generate(prompts, params)] == want
        assert gen.preemptions > 0
        paged.kv.check()
        assert len(paged.kv.free) == paged.kv.blocks - 1


def test_shared_prompt_blocks_of_an_fp8_pool_keep_the_tokens(random_pair):
    system = list(range(40, 180))
    prompts = [system + [200 + i] for i in range(3)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    slots = EagerEngine.from_checkpoints(*random_pair, max_batch=4, max_seq=256, kv_cache_dtype="fp8")
    want = [r.output for r in Generator(slots).generate(prompts, params)]
    paged = EagerEngine.from_checkpoints(*random_pair, max_batch=4, max_seq=256, kv_cache_dtype="fp8",
                                         kv_tokens=512, kv_block_size=16)
    gen = Generator(paged)
    got = []
    for p in prompts:  # one after another: the second and third map the first chunk's blocks in
        got += [r.output for r in gen.generate([p], params)]
    assert got == want and gen.cached_prefill_tokens == 2 * 128


# ---- engines built with an FP8 cache --------------------------------------------------------------------------
def test_an_eager_engine_built_with_an_fp8_cache_keeps_it(scaled_pair, random_pair, fp8_engine, tmp_path):
    from conftest import cli_generate_ids

    out = tmp_path / "engine"
    r = run_cli("build", "--target", scaled_pair[0], "--draft", scaled_pair[1], "--out", out, "--max-batch", 2,
                "--max-seq", MAX_SEQ)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["target_config"]["kv_cache_dtype"] == "fp8" and "kv_cache_dtype" not in m["draft_config"]
    with safe_open(str(out / "target.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.2.self_attn.k_scale"),
                           fp8_engine.target.model.layers[2].self_attn.k_scale)
    engine = load_engine(out)
    assert engine.target_cache.k[0].dtype == torch.float8_e4m3fn
    assert torch.equal(engine.target.model.layers[3].self_attn.v_scale,
                       fp8_engine.target.model.layers[3].self_attn.v_scale)  # (float32: not cast to bf16)
    prompts, params = _workload(2, seed=7)
    want = [r.output for r in Generator(fp8_engine).generate(prompts, params)]
    assert [r.output for r in Generator(engine).generate(prompts, params)] == want
    assert cli_generate_ids(out, prompts[0], params[0].max_tokens, params[0].temperature, params[0].seed) == want[0]
    r = run_cli("generate", "--engine", out, "--prompt-ids", "1,2", "--kv-cache-dtype", "fp8")
    assert r.returncode == 2 and "an engine's KV cache is chosen when it is built" in r.stderr
    r = run_cli("build", "--target", random_pair[0], "--draft", random_pair[1], "--out", tmp_path / "mgx",
                "--backend", "migraphx", "--kv-cache-dtype", "fp8")
    assert r.returncode != 0 and "an FP8 KV cache builds eager and aoti engines" in r.stderr
    assert not (tmp_path / "mgx").exists()


def test_generate_from_checkpoints_with_an_fp8_cache(random_pair):
    prompt = [5, 9, 14, 3]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = Generator(_engine(random_pair)).generate([prompt], params)[0].output
    r = run_cli("generate", "--target", random_pair[0], "--draft", random_pair[1], "--prompt-ids",
                ",".join(map(str, prompt)), "--max-tokens", 16, "--ignore-eos", "--json", "--kv-cache-dtype", "fp8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["output_ids"] == want


def test_tensor_parallel_ranks_split_the_scales_with_their_kv_heads(random_pair):
    from muse_spark.sharding import shard_target

    target, _ = load_pair(*random_pair, kv_cache_dtype="fp8")
    kv = target.cfg.num_key_value_heads
    for layer in target.model.layers:
        layer.self_attn.k_scale.copy_(torch.arange(1, kv + 1) / 4)
    parts = [shard_target(target, r, 2, None) for r in range(2)]
    assert kv >= 2 and [p.cfg.num_key_value_heads for p in parts] == [kv // 2] * 2
    assert torch.equal(torch.cat([p.model.layers[0].self_attn.k_scale for p in parts]), torch.arange(1, kv + 1) / 4)
    assert all(p.allocate_cache(1, 8, "cpu").k[0].dtype == torch.float8_e4m3fn for p in parts)


def test_onnx_export_refuses_an_fp8_cache(random_pair, tmp_path):
    from muse_spark.builder.onnx_export import export_onnx

    target, draft = load_pair(*random_pair, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="FP8 KV cache .* is not exported; export it with --kv-cache-dtype auto"):
        export_onnx(target, draft, tmp_path, max_batch=1, max_seq=MAX_SEQ)
    assert not any(tmp_path.iterdir())
