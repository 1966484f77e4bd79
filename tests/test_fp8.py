"""FP8 (E4M3) checkpoints (docs/fp8.md): `muse-spark quantize`, loading (per-channel and per-tensor
scales, stacking, refusals), the W8A16 reference path, and exactness of speculative decoding on
the quantized pair."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from conftest import clone, run_cli
from muse_spark.builder.pair import draft_token_ids, make_pair, random_prompts
from muse_spark.builder.quantize import FP8_MAX, QuantizeError, quantize_checkpoint, quantize_pair, quantize_weight
from muse_spark.checkpoint import CheckpointError, load_draft, load_pair, load_target
from muse_spark.config import MuseSpark1xConfig, QuantizationConfig, load_config, quantizable
from muse_spark.models.layers import FP8, Fp8Linear, Fp8Weight, linear, linear_silu_mul, proj_weight
from muse_spark.runtime import EagerEngine, Generator, SamplingParams, load_engine
from muse_spark.runtime.target_only import generate_target_only

PARTS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj", "o_gate_proj"), "self_attn.o_proj": ("o_proj",),
         "feed_forward.gate_up_proj": ("gate_proj", "up_proj"), "feed_forward.down_proj": ("down_proj",)}

# E4M3 has 3 mantissa bits: round-to-nearest-even of v = w/s errs by at most half a unit in the last place,
# 2^-4·|v| where v is normal (|v| ≥ 2^-6), and half the subnormal spacing 2^-9, 2^-10, below. So each
# dequantized element obeys |q·s − w| ≤ 2^-4·|w| + 2^-10·s (twice as tight as 2^-3 relative).
REL, SUB = 2.0**-4, 2.0**-10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """→ folder with bf16/{target,draft} (make_pair's tiny pair) and fp8/{target,draft} (quantized, per channel)."""
    out = tmp_path_factory.mktemp("fp8")
    make_pair(out / "bf16", "tiny", acceptance=0.8, seed=0)
    quantize_pair(out / "bf16" / "target", out / "fp8" / "target", draft=out / "bf16" / "draft",
                  draft_out=out / "fp8" / "draft", log=lambda s: None)
    return out


def _layers(module):
    return list(module.model.layers)


def _raw_parts(raw: dict, prefix: str, proj: str) -> list[torch.Tensor]:
    base = proj.rpartition(".")[0]
    return [raw[f"{prefix}{base}.{p}.weight"] for p in PARTS[proj]]


def _projections(module, raw: dict, draft: bool):
    """(name, Fp8Linear, [bf16 parts]) for every decoder projection of a loaded module."""
    for i, layer in enumerate(_layers(module)):
        prefix = f"{'' if draft else 'model.'}layers.{i}."
        for proj in PARTS:
            yield f"{prefix}{proj}", layer.get_submodule(proj), _raw_parts(raw, prefix, proj)


# ---- quantize → load --------------------------------------------------------------------------
def test_quantized_weights_are_fp8_with_absmax_scales(pair):
    target, draft = load_pair(pair / "fp8" / "target", pair / "fp8" / "draft")
    for module, kind in ((target, "target"), (draft, "draft")):
        raw = load_file(str(pair / "bf16" / kind / "model.safetensors"))
        seen = 0
        for name, proj, parts in _projections(module, raw, kind == "draft"):
            assert isinstance(proj, Fp8Linear), name
            assert proj.weight.dtype == FP8 and proj.weight_scale.dtype == torch.float32
            assert proj.weight_scale.shape == (proj.weight.shape[0], 1) and proj.input_scale is None
            want = torch.cat([p.float().abs().amax(1, keepdim=True) / FP8_MAX for p in parts])
            assert torch.equal(proj.weight_scale, want), name
            # the stored FP8 codes are the parts' codes, stacked in vLLM's order
            codes = torch.cat([quantize_weight(p)[0].view(torch.uint8) for p in parts])
            assert torch.equal(proj.weight.view(torch.uint8), codes), name
            seen += 1
        assert seen == 4 * len(_layers(module))
        # everything else is the bf16 checkpoint's, bit for bit
        plain = load_target(pair / "bf16" / "target") if kind == "target" else load_draft(pair / "bf16" / "draft")
        other = {k: v for k, v in plain.state_dict().items() if not quantizable(k.rpartition(".")[0])}
        have = module.state_dict()
        assert other and all(torch.equal(have[k], v) and have[k].dtype == v.dtype for k, v in other.items())
    # the files hold what the loader holds: per-channel [out, 1] float32 scales beside float8 weights
    raw = load_file(str(pair / "fp8" / "target" / "model.safetensors"))
    assert raw["model.layers.0.self_attn.k_proj.weight"].dtype == FP8
    assert raw["model.layers.0.self_attn.k_proj.weight_scale"].shape == (32, 1)
    assert raw["lm_head.weight"].dtype == raw["model.embed_tokens.weight"].dtype == torch.bfloat16
    cfg = json.loads((pair / "fp8" / "draft" / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None,
        "ignored_layers": ["confidence_head.proj", "fc", "lm_head", "markov_head.markov_w1", "markov_head.markov_w2"]}
    assert sorted(p.name for p in (pair / "fp8" / "target").iterdir()) == sorted(
        p.name for p in (pair / "bf16" / "target").iterdir())


def test_dequantized_weights_are_within_e4m3_rounding(pair):
    target = load_target(pair / "fp8" / "target")
    raw = load_file(str(pair / "bf16" / "target" / "model.safetensors"))
    worst = 0.0
    for name, proj, parts in _projections(target, raw, False):
        w = torch.cat(parts).float()
        s = proj.weight_scale
        dq = proj.fp8().dequantize()
        err = (dq - w).abs()
        assert bool((err <= (REL * w.abs() + SUB * s) * (1 + 2.0**-20)).all()), name
        normal = w.abs() >= 2.0**-6 * s
        worst = max(worst, float((err[normal] / w.abs()[normal]).max()))
    assert 0 < worst <= REL
    print(f"\nworst relative error of a dequantized element in E4M3's normal range: {worst:.4f} (bound 2^-4)")


def test_zero_rows_and_per_tensor_scales():
    w = torch.randn(6, 10, dtype=torch.bfloat16)
    w[2] = 0
    q, s = quantize_weight(w)
    assert s.shape == (6, 1) and float(s[2]) == 1.0 and not bool(q.float()[2].any())
    q, s = quantize_weight(w, "per-tensor")
    assert s.shape == () and float(q.float().abs().max()) == FP8_MAX
    assert torch.allclose(q.float() * s, w.float(), rtol=REL, atol=SUB * float(s))
    with pytest.raises(QuantizeError, match="unknown scheme 'per-block'"):
        quantize_weight(w, "per-block")


# ---- the reference path --------------------------------------------------------------------
def test_linear_is_the_w8a16_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 16, generator=g)
    q, s = quantize_weight(w)
    fw = Fp8Weight(q, s, dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(3, 5, 16, generator=g).to(dtype)
        spec = x @ (q.float() * s).to(dtype).T  # dequantized per call, computed in the activations' dtype
        assert linear(x, fw).dtype == dtype and torch.equal(linear(x, fw), spec)
        assert torch.equal(linear_silu_mul(x, fw), F.silu(spec[..., :6]) * spec[..., 6:])
        assert torch.equal(linear(x, fw[4:10]), x @ (q[4:10].float() * s[4:10]).to(dtype).T)  # slices keep scales
    assert fw.shape == (12, 16) and fw.dtype == torch.bfloat16 and fw[4:10].scale.shape == (6, 1)


def _w8a8_operands(M=24, N=48, K=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, 1, generator=g))
    q, s = quantize_weight(w)
    x = (torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g))).to(torch.bfloat16)
    return x, Fp8Weight(q, s, dtype=torch.bfloat16)


def test_activation_rows_are_quantized_per_token():
    """``quantize_rows``: one absmax scale per row, so a row's codes do not depend on the others; an all-zero
    row stays zero; a static ``input_scale`` serves every row and saturates at ±448."""
    from muse_spark.models.layers import quantize_rows

    x, _ = _w8a8_operands()
    x[3] = 0
    q, s = quantize_rows(x)
    assert q.dtype == FP8 and s.shape == (x.shape[0], 1) and s.dtype == torch.float32
    assert float(q.float().abs().amax(1)[0]) == FP8_MAX and not bool(q.float()[3].any())
    assert torch.allclose(q.float() * s, x.float(), rtol=REL, atol=SUB * float(s.max()))
    q5, s5 = quantize_rows(x[5:6])
    assert torch.equal(q5.view(torch.uint8), q[5:6].view(torch.uint8)) and torch.equal(s5, s[5:6])
    qs, ss = quantize_rows(x, torch.tensor(0.001))
    assert bool((ss == 0.001).all()) and float(qs.float().abs().max()) == FP8_MAX  # saturated, not inf/NaN


@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
def test_the_w8a8_product_is_its_spec(silu_mul):
    """``fp8_linear_w8a8`` (``torch._scaled_mm`` with row-wise scales; the CPU's here, the GPU's in
    tests/kernels/test_linear.py) against ``fp8_w8a8_reference`` within one bf16 rounding, and against the W8A16
    spec within the activations' quantization error (each code within 2^-4 of its value: |Δy| ≤ 2^-4·|x|·|w|
    per output, plus a rounding). A planted error, the last output channel's scale 5 % off, is caught."""
    from muse_spark.models.layers import fp8_linear_reference, fp8_linear_w8a8, fp8_w8a8_reference

    x, fw = _w8a8_operands(N=96 if silu_mul else 48)
    got, spec = fp8_linear_w8a8(x, fw, silu_mul), fp8_w8a8_reference(x, fw, silu_mul)
    assert got.dtype == torch.bfloat16 and got.shape == spec.shape == (24, 48)
    tol = dict(rtol=2**-7, atol=2**-7 * float(spec.float().abs().max()) * 2**-6)
    torch.testing.assert_close(got.float(), spec.float(), **tol)
    w16 = fp8_linear_reference(x, fw, silu_mul).float()
    if not silu_mul:
        bound = (REL + 2**-8) * (x.float().abs() @ fw.dequantize().abs().T) + 2**-8 * w16.abs()
        assert bool(((got.float() - w16).abs() <= bound).all())
    else:
        assert float((got.float() - w16).abs().max()) <= 0.1 * float(w16.abs().max())
    bad = Fp8Weight(fw.weight, fw.scale.clone(), dtype=torch.bfloat16)
    bad.scale[-1] *= 1.05  # (the last channel: an up-projection's under silu·mul)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(fp8_linear_w8a8(x, bad, silu_mul).float(), spec.float(), **tol)
    x3 = x.reshape(2, 12, 64)  # leading dims kept
    torch.testing.assert_close(fp8_linear_w8a8(x3, fw, silu_mul).float(), got.reshape(2, 12, -1).float(), **tol)
    static = Fp8Weight(fw.weight, fw.scale, torch.tensor(float(x.float().abs().max()) / 448), torch.bfloat16)
    spec = fp8_w8a8_reference(x, static, silu_mul).float()  # (a static input_scale: one scale for every row)
    torch.testing.assert_close(fp8_linear_w8a8(x, static, silu_mul).float(), spec,
                               rtol=2**-7, atol=2**-13 * float(spec.abs().max()))


def test_the_w8a8_path_is_taken_only_on_fp8_hardware():
    """``linear`` runs W8A8 only for bf16 activations on an NVIDIA GPU of compute capability ≥ 8.9; on the CPU
    it stays the W8A16 reference, the spec the quantized target is defined by."""
    from muse_spark.models import layers

    x, fw = _w8a8_operands()
    assert not layers._w8a8_fits(x, fw)
    assert torch.equal(linear(x, fw), layers.fp8_linear_reference(x, fw))


def test_the_draft_context_uses_the_fp8_kv_rows(pair):
    _, draft = load_pair(pair / "fp8" / "target", pair / "fp8" / "draft")
    attn = draft.model.layers[0].self_attn
    kv = attn.kv_weight()
    c = draft.cfg
    assert isinstance(kv, Fp8Weight) and kv.shape == (2 * c.kv_size, c.hidden_size)
    assert torch.equal(kv.dequantize(), proj_weight(attn.qkv_proj).dequantize()[c.q_size : c.q_size + 2 * c.kv_size])


# ---- the engine on the quantized pair ----------------------------------------------------------
def test_eager_engine_is_lossless_on_the_quantized_pair(pair):
    engine = EagerEngine.from_checkpoints(pair / "fp8" / "target", pair / "fp8" / "draft", max_batch=4, max_seq=128)
    assert isinstance(engine.target.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    prompts = random_prompts(draft_token_ids(pair / "bf16"), 3, 7, seed=2) + [[200]]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    reqs = Generator(engine).generate(prompts, params)
    for r in reqs:
        assert len(r.output) == 32
        assert r.output == generate_target_only(engine, r.prompt, params)  # greedy speculative == greedy target
    steps = [s for r in reqs for s in r.steps]
    accepted = sum(s.accepted for s in steps) / len(steps)
    print(f"\nquantized pair: {accepted:.2f} drafts accepted per greedy step (γ={engine.gamma})")
    assert accepted > 1.0  # (the bf16 pair's drafts agree at 0.8: quantization keeps most of that)


def _target_logits(target, tokens: list[int]) -> torch.Tensor:
    cache = target.allocate_cache(1, 128, "cpu")
    t = torch.tensor([tokens])
    pos = torch.arange(len(tokens))[None]
    with torch.inference_mode():
        h, _ = target(t, pos, torch.tensor([0]), cache, len(tokens))
        return target.logits(h)[0]


def test_logits_against_the_bf16_target(pair):
    bf16 = load_target(pair / "bf16" / "target")
    fp8 = load_target(pair / "fp8" / "target")
    tokens = random_prompts(draft_token_ids(pair / "bf16"), 1, 64, seed=5)[0]
    a, b = _target_logits(bf16, tokens), _target_logits(fp8, tokens)
    max_abs = float((a - b).abs().max())
    kl = float(F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean())
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    print(f"\nFP8 (per-channel) vs bf16 target logits over {len(tokens)} positions: max |Δ| {max_abs:.4f}, "
          f"mean KL(bf16‖fp8) {kl:.3g} nats, greedy tokens agree at {agree:.3f}")
    assert torch.isfinite(b).all() and 0 < max_abs < float(a.abs().max())  # (sanity only)
    assert kl < 0.5 and agree > 0.5


def test_a_float32_compute_dtype_keeps_the_fp8_weights(pair):
    target, draft = load_pair(pair / "fp8" / "target", pair / "fp8" / "draft", dtype="float32")
    proj = target.model.layers[1].feed_forward.down_proj
    assert proj.weight.dtype == FP8 and proj.compute_dtype == torch.float32 and target.dtype == torch.float32
    logits = _target_logits(target, [1, 2, 3])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# ---- hand-made checkpoints: per-tensor scales, static input scales, ignored layers -------------
def _hand_made(pair, tmp_path, *, ignore=(), scale_shape=(1,), static=True):
    """The bf16 tiny target quantized by hand with per-tensor scales (each part its own, so q/k/v/o_gate
    differ) → (FP8 folder, bf16 folder holding the dequantized weights: the reference)."""
    src = pair / "bf16" / "target"
    raw = load_file(str(src / "model.safetensors"))
    fp8, ref = dict(raw), dict(raw)
    g = torch.Generator().manual_seed(7)
    for name, w in raw.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and quantizable(module)) or any(module.startswith(i) for i in ignore):
            continue
        s = w.float().abs().max() / FP8_MAX * (1 + torch.rand((), generator=g))  # (not the absmax: any scale loads)
        q = (w.float() / s).to(FP8)
        fp8[name] = q
        fp8[f"{module}.weight_scale"] = s.reshape(scale_shape)
        if static:
            fp8[f"{module}.input_scale"] = (0.01 + torch.rand((), generator=g)).reshape(scale_shape)
        ref[name] = (q.float() * s).to(torch.bfloat16)
    out = {}
    for kind, tensors in (("fp8", fp8), ("ref", ref)):
        d = tmp_path / kind
        shutil.copytree(src, d)
        save_file(tensors, str(d / "model.safetensors"))
        out[kind] = d
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                                  "ignored_layers": list(ignore)}
    (out["fp8"] / "config.json").write_text(json.dumps(cfg))
    return out["fp8"], out["ref"], fp8


def test_hand_made_per_tensor_checkpoint_equals_its_dequantized_reference(pair, tmp_path):
    fp8_dir, ref_dir, files = _hand_made(pair, tmp_path)
    fp8, ref = load_target(fp8_dir), load_target(ref_dir)
    qkv = fp8.model.layers[2].self_attn.qkv_proj
    c = fp8.cfg
    rows = [c.q_size, c.kv_size, c.kv_size, c.q_size]
    scales = [float(files[f"model.layers.2.self_attn.{p}.weight_scale"]) for p in PARTS["self_attn.qkv_proj"]]
    assert len(set(scales)) == 4  # four different per-tensor scales …
    assert torch.equal(qkv.weight_scale, torch.cat([torch.full((n, 1), s) for n, s in zip(rows, scales)]))  # (by row)
    ins = [float(files[f"model.layers.2.self_attn.{p}.input_scale"]) for p in PARTS["self_attn.qkv_proj"]]
    assert qkv.input_scale.shape == () and float(qkv.input_scale) == max(ins)  # (one activation scale: the largest)
    assert torch.equal(qkv.fp8().dequantize(torch.bfloat16), ref.model.layers[2].self_attn.qkv_proj.weight)
    tokens = list(range(40, 90))
    assert torch.equal(_target_logits(fp8, tokens), _target_logits(ref, tokens))  # bit for bit


def test_per_tensor_scalars_and_ignored_layers(pair, tmp_path):
    fp8_dir, ref_dir, _ = _hand_made(pair, tmp_path, ignore=("model.layers.0.self_attn",), scale_shape=(),
                                     static=False)
    fp8, ref = load_target(fp8_dir), load_target(ref_dir)
    layer0 = fp8.model.layers[0]
    assert not isinstance(layer0.self_attn.qkv_proj, Fp8Linear) and not isinstance(layer0.self_attn.o_proj, Fp8Linear)
    assert isinstance(layer0.feed_forward.gate_up_proj, Fp8Linear) and layer0.feed_forward.down_proj.input_scale is None
    assert torch.equal(_target_logits(fp8, [5, 6, 7, 8]), _target_logits(ref, [5, 6, 7, 8]))


# ---- refusals ----------------------------------------------------------------------------------
def _edit(src, dst, tensors=None, config=None):
    return clone(src, dst, edit=tensors, config_edit=config)


def _qc(**kw):
    return lambda cfg: cfg["quantization_config"].update(kw)


@pytest.mark.parametrize("edit, message", [
    (_qc(weight_block_size=[128, 128]), r"block-wise FP8 \(weight_block_size \[128, 128\]\) is not supported"),
    (_qc(quant_method="gptq"), r"unsupported quant_method 'gptq'.* quant_method 'fp8'"),
    (_qc(quant_method="compressed-tensors"), r"unsupported quant_method 'compressed-tensors'"),
    (_qc(activation_scheme="per-token"), r"activation_scheme must be one of \['dynamic', 'static'\]"),
    (_qc(kv_cache_scheme={"num_bits": 8, "dynamic": True}), r"dynamic KV-cache scales are not supported"),
    (_qc(kv_cache_scheme={"num_bits": 8}), r"missing tensor 'model.layers.0.self_attn.k_scale' \(the FP8 KV cache"),
    (_qc(ignored_layers="lm_head"), r"ignored_layers must be a list of module names"),
    (_qc(ignored_layers=["model.layers.1.self_attn.k_proj"]),
     r"names \['model.layers.1.self_attn.k_proj'\] but not .*q_proj.* quantized whole"),
])
def test_refused_quantization_configs(pair, tmp_path, edit, message):
    d = _edit(pair / "fp8" / "target", tmp_path / "t", config=edit)
    with pytest.raises(ValueError, match=message):
        load_target(d)


def _block_scales(t):  # (a 128×128-block layout of a 256×256 weight would be [2, 2])
    t["model.layers.1.self_attn.q_proj.weight_scale"] = torch.ones(2, 2)


@pytest.mark.parametrize("tensors, message", [
    (lambda t: t.update({"model.layers.1.self_attn.q_proj.weight_scale_inv": torch.ones(1, 1)}),
     r"'model.layers.1.self_attn.q_proj.weight_scale_inv'.*block-wise FP8 scales"),
    (_block_scales, r"'model.layers.1.self_attn.q_proj.weight_scale' has shape \[2, 2\], expected a per-tensor.*"
                    r"block-wise scales are not supported"),
    (lambda t: t.pop("model.layers.3.feed_forward.down_proj.weight_scale"),
     r"missing tensor 'model.layers.3.feed_forward.down_proj.weight_scale' \(its FP8 weight's scale\)"),
    (lambda t: t["model.layers.0.feed_forward.up_proj.weight_scale"].__setitem__(3, -1.0),
     r"'model.layers.0.feed_forward.up_proj.weight_scale' has 1 scale\(s\) that are not positive"),
    (lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(FP8)}),
     r"'lm_head.weight' has dtype float8_e4m3fn, expected bfloat16: only the decoder layers' projections"),
    (lambda t: t.update({"lm_head.weight_scale": torch.ones(())}),
     r"unexpected tensor 'lm_head.weight_scale': only the decoder layers' projections"),
    (lambda t: t.update({"model.layers.2.self_attn.v_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16)}),
     r"'model.layers.2.self_attn.v_proj.weight' has dtype bfloat16, expected float8_e4m3fn"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.input_scale": torch.ones(())}),
     r"'model.layers.0.self_attn.q_proj.input_scale' is a static activation scale, but .*'dynamic'"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(64, 1, dtype=torch.float64)}),
     r"'model.layers.0.self_attn.o_proj.weight_scale' has dtype float64, expected float32"),
    (lambda t: t["model.layers.1.feed_forward.gate_proj.weight"].view(torch.uint8).__setitem__((0, 0), 0x7F),
     r"'model.layers.1.feed_forward.gate_proj.weight' has non-finite values \(1 NaN\)"),
])
def test_refused_fp8_tensors(pair, tmp_path, tensors, message):
    d = _edit(pair / "fp8" / "target", tmp_path / "t", tensors=tensors)
    with pytest.raises(CheckpointError, match=message):
        load_target(d)


def test_fp8_weights_without_a_quantization_config_are_refused(pair, tmp_path):
    d = _edit(pair / "fp8" / "draft", tmp_path / "d", config=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"'layers.0.[a-z_.]+_proj.weight' has dtype float8_e4m3fn, expected "
                                              r"bfloat16: the checkpoint's config.json has no quantization_config"):
        load_draft(d)
    # a layer listed in ignored_layers must hold torch_dtype weights
    d2 = _edit(pair / "fp8" / "draft", tmp_path / "d2", config=_qc(ignored_layers=["layers.1.feed_forward"]))
    with pytest.raises(CheckpointError, match=r"'layers.1.feed_forward.[a-z_]+.weight' has dtype float8_e4m3fn.*"
                                              r"in quantization_config's ignored_layers"):
        load_draft(d2)


def test_an_eager_engine_built_from_fp8_checkpoints_keeps_them_and_their_tokens(pair, tmp_path):
    """`muse-spark build` of the FP8 pair (eager): the engine's files hold the projections as float8_e4m3fn
    weights with float32 scales (half the bytes of the bf16 engine's), its manifest the quantization_config,
    and it generates the checkpoints' own tokens, greedy and sampled, in a fresh process too."""
    from safetensors import safe_open

    from conftest import cli_generate_ids

    out, ref = tmp_path / "engine", tmp_path / "bf16"
    for src, dst in ((pair / "fp8", out), (pair / "bf16", ref)):
        r = run_cli("build", "--target", src / "target", "--draft", src / "draft", "--out", dst, "--max-batch", 2,
                    "--max-seq", 128)
        assert r.returncode == 0, r.stderr[-3000:]
    with safe_open(str(out / "target.safetensors"), "pt") as f:
        name = "model.layers.0.self_attn.qkv_proj"
        assert f.get_slice(f"{name}.weight").get_dtype() == "F8_E4M3" and f"{name}.weight_scale" in f.keys()
        assert f.get_tensor(f"{name}.weight_scale").dtype == torch.float32
    assert (out / "target.safetensors").stat().st_size < 0.75 * (ref / "target.safetensors").stat().st_size
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target_config"]["quantization_config"]["quant_method"] == "fp8"
    engine = load_engine(out)
    assert isinstance(engine.target.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert isinstance(engine.draft.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    direct = EagerEngine.from_checkpoints(pair / "fp8" / "target", pair / "fp8" / "draft", max_batch=2, max_seq=128)
    prompts = random_prompts(draft_token_ids(pair / "bf16"), 2, 7, seed=4)
    params = [SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)]
    want = [r.output for r in Generator(direct).generate(prompts, params)]
    assert [r.output for r in Generator(engine).generate(prompts, params)] == want
    assert cli_generate_ids(out, prompts[0], 24) == want[0]
    from muse_spark.builder.build import BuildError, build_engine

    with pytest.raises(BuildError, match=r"FP8 checkpoints \(quantization_config\) build eager and aoti engines"):
        build_engine(pair / "fp8" / "target", pair / "fp8" / "draft", tmp_path / "mgx", backend="migraphx",
                     device="cpu", max_batch=2, max_seq=128, quiet=True)
    assert not (tmp_path / "mgx").exists()


def test_an_aoti_engine_of_fp8_checkpoints_and_an_fp8_cache_gives_the_eager_engines_tokens(pair, tmp_path, cxx_build):
    """The compiled graphs of an FP8 pair whose target also declares an FP8 KV cache (scales by layer and KV
    head): its projections' weights (E4M3) and scales are graph inputs, and the exported modules hold Fp8Linear
    projections, so every graph dequantizes as the eager engine does (the W8A16 reference here, the Triton
    kernels on CUDA); the target's caches are E4M3 graph inputs and the layers' KV scales weights. Its tokens
    are the eager engine's, greedy and sampled, from the Python runtime and from the C++ library: a two-chunk
    prompt among three requests on two slots. The pair also has ``norm_zero_centered_gamma`` and
    ``residual_multiplier`` 0.75: the other branch of the prompt chunk's first norm (``y·(1 + w)``, computed in
    C++) and materialized residual gates that are not the raw ones (``derived.safetensors``). (One build for
    all of it: each costs a couple of minutes of compiling on the CPU.)"""
    from cxx_utils import gives_the_eager_tokens
    from test_fp8_kv_cache import _scales, _scheme

    kv = load_config(pair / "fp8" / "target").num_key_value_heads

    def config(scheme=None):
        def edit(cfg):
            cfg.update(norm_zero_centered_gamma=True, residual_multiplier=0.75)
            if scheme:
                scheme(cfg)
        return edit

    target = clone(pair / "fp8" / "target", tmp_path / "target", config_edit=config(_scheme(strategy="attn_head")),
                   edit=_scales(lambda i: (torch.arange(kv, dtype=torch.float32) + 1 + i) / (2 * kv + 8)))
    draft = clone(pair / "fp8" / "draft", tmp_path / "draft", config_edit=config())
    out = tmp_path / "aoti"
    r = run_cli("build", "--target", target, "--draft", draft, "--out", out, "--backend", "aoti", "--max-batch", 2,
                "--max-seq", 192)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out / "manifest.json").read_text())
    dtypes = {name: dt for name, _, dt in m["aoti"]["weights"]}
    assert dtypes["target.model.layers.0.self_attn.qkv_proj.weight"] == "float8_e4m3fn"
    assert dtypes["target.model.layers.0.self_attn.qkv_proj.weight_scale"] == "float32"
    assert dtypes["target.model.layers.0.self_attn.k_scale"] == "float32"
    assert m["embedding"]["caches"]["target"]["dtype"] == "float8_e4m3fn"
    assert m["embedding"]["caches"]["draft"]["dtype"] == "bfloat16"
    assert m["embedding"]["prefill_embed"]["zero_centered"] is True
    engine = load_engine(out)
    assert engine.target_cache.k[0].dtype == torch.float8_e4m3fn
    direct = EagerEngine.from_checkpoints(target, draft, max_batch=2, max_seq=192)
    assert direct.target_cache.k[0].dtype == torch.float8_e4m3fn
    assert direct.target.cfg.norm_zero_centered_gamma and direct.target.cfg.residual_multiplier == 0.75
    ids = draft_token_ids(pair / "bf16")
    prompts = random_prompts(ids, 1, 150, seed=5) + random_prompts(ids, 1, 7, seed=6) + [ids[:3]]
    gives_the_eager_tokens(cxx_build, out, engine, direct, prompts)


def test_quantization_config_round_trip(pair):
    cfg = load_config(pair / "fp8" / "target")
    assert cfg.quantization_config == QuantizationConfig("fp8", "dynamic", ("lm_head", "model.embed_tokens"))
    assert MuseSpark1xConfig.from_dict(cfg.to_dict()) == cfg
    assert "quantization_config" not in load_config(pair / "bf16" / "target").to_dict()
    q = QuantizationConfig.from_dict({"quant_method": "fp8", "modules_to_not_convert": ["re:.*\\.o_proj", "lm_head"],
                                      "ignored_layers": ["lm_head"]})
    assert q.ignored_layers == ("lm_head", "re:.*\\.o_proj")  # (both spellings, merged)
    assert q.ignores("model.layers.3.self_attn.o_proj") and not q.ignores("model.layers.3.self_attn.q_proj")


# ---- sharded checkpoints and the command -------------------------------------------------------
def test_sharded_input_is_sharded_alike(pair, tmp_path):
    make_pair(tmp_path / "bf16", "tiny", acceptance=0.8, seed=0, shard_bytes=1 << 17)
    src, out = tmp_path / "bf16" / "target", tmp_path / "fp8"
    lines = []
    summary = quantize_checkpoint(src, out, log=lines.append)
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(p.name for p in out.glob("model-*.safetensors")) == shards
    assert summary["shards"] == len(shards) and len(lines) == len(shards) + 1
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for name, shard in index.items():
        if name.endswith(".weight_scale"):
            assert index[name.replace(".weight_scale", ".weight")] == shard  # (a scale sits with its weight)
    a, b = load_target(out), load_target(pair / "fp8" / "target")
    assert all(torch.equal(x.view(torch.uint8) if x.dtype == FP8 else x, y.view(torch.uint8) if y.dtype == FP8 else y)
               for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_quantize_command(pair, tmp_path):
    out = tmp_path / "pt"
    r = run_cli("quantize", "--target", pair / "bf16" / "target", "--out", out / "target", "--draft",
                pair / "bf16" / "draft", "--draft-out", out / "draft", "--scheme", "per-tensor")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[quantize] target: model.safetensors (1 of 1): 32 projections → FP8" in r.stdout
    assert "[quantize] draft written to" in r.stdout and "(per-tensor scales)" in r.stdout
    raw = load_file(str(out / "target" / "model.safetensors"))
    assert raw["model.layers.0.self_attn.q_proj.weight_scale"].shape == ()
    target, draft = load_pair(out / "target", out / "draft")
    qkv = target.model.layers[0].self_attn.qkv_proj
    c = target.cfg
    q, k = qkv.weight_scale[: c.q_size], qkv.weight_scale[c.q_size : c.q_size + c.kv_size]
    assert len(set(q.flatten().tolist())) == len(set(k.flatten().tolist())) == 1 and float(q[0]) != float(k[0])
    engine = EagerEngine(target, draft, max_batch=1, max_seq=64, device="cpu")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert Generator(engine).generate([[7, 8, 9]], params)[0].output == generate_target_only(engine, [7, 8, 9], params)

    # errors: one line, exit status 2
    def fails(*args, match):
        r = run_cli("quantize", *args)
        assert r.returncode == 2 and r.stderr.startswith("muse-spark: error: "), (r.returncode, r.stderr[-2000:])
        assert match in r.stderr, r.stderr
        assert "Traceback" not in r.stderr

    fails("--target", out / "target", "--out", tmp_path / "again", match="is already quantized")
    fails("--target", tmp_path / "nowhere", "--out", tmp_path / "x", match="no such checkpoint directory")
    fails("--target", pair / "bf16" / "target", "--out", out / "target",
          match=f"--out {out / 'target'} exists: pass --overwrite")
    fails("--target", pair / "bf16" / "target", "--out", tmp_path / "y", "--draft", pair / "bf16" / "draft",
          match="--draft and --draft-out must be given together")
    assert not (tmp_path / "y").exists()  # (checked before anything is written)
    r = run_cli("quantize", "--target", pair / "bf16" / "target", "--out", out / "target", "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    assert load_file(str(out / "target" / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight_scale"].shape \
        == (64, 1)  # (per-channel again: the default)


def test_calibration_writes_static_activation_scales_that_cover_what_the_pair_sees(pair, tmp_path):
    """`quantize --calibrate N`: every quantized projection of the target and the draft gets a float32 scalar
    ``input_scale`` (its parts one value: they share the input), the config says ``static``, the scales are the
    largest |x| the bf16 pair's projections saw / 448 (so the calibration prompts' activations never saturate),
    and the static pair loads and decodes losslessly. Bad calibration arguments are one-line errors."""
    from muse_spark.models.layers import observe_linear_inputs
    from muse_spark.runtime.activation_scales import measure_input_amax

    out = tmp_path / "static"
    r = run_cli("quantize", "--target", pair / "bf16" / "target", "--out", out / "target", "--draft",
                pair / "bf16" / "draft", "--draft-out", out / "draft", "--calibrate", 3, "--calibration-len", 12,
                "--calibration-tokens", 8)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[calibrate] measured 24 projections' activation scales on 3 prompts" in r.stdout
    assert "static activation scales" in r.stdout
    for what, prefix in (("target", "model.layers.0."), ("draft", "layers.0.")):
        raw = load_file(str(out / what / "model.safetensors"))
        assert json.loads((out / what / "config.json").read_text())["quantization_config"]["activation_scheme"] \
            == "static"
        scales = {k: v for k, v in raw.items() if k.endswith(".input_scale")}
        assert len(scales) == sum(k.endswith(".weight_scale") for k in raw)
        assert all(v.dtype == torch.float32 and v.shape == () and v.item() > 0 for v in scales.values())
        qkv = {raw[f"{prefix}self_attn.{p}.input_scale"].item() for p in ("q_proj", "k_proj", "v_proj")}
        assert len(qkv) == 1

    # the same prompts measured again, by hand: the scale is the largest input / 448
    prompts = random_prompts(list(range(load_config(pair / "bf16" / "target").vocab_size)), 3, 12, seed=0)
    amax = measure_input_amax(pair / "bf16" / "target", pair / "bf16" / "draft", prompts, 8, log=lambda s: None)
    raw = load_file(str(out / "target" / "model.safetensors"))
    name = "model.layers.1.feed_forward.down_proj"
    assert raw[f"{name}.input_scale"].item() == pytest.approx(amax["target"][name] / FP8_MAX, rel=1e-6)
    engine = EagerEngine.from_checkpoints(pair / "bf16" / "target", pair / "bf16" / "draft", max_batch=3,
                                          max_seq=96)
    down = engine.target.model.layers[1].feed_forward.down_proj.weight
    seen = []
    with observe_linear_inputs(lambda w, x: seen.append(x.abs().amax().item()) if w is down else None):
        Generator(engine).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert seen and max(seen) / raw[f"{name}.input_scale"].item() == pytest.approx(FP8_MAX, rel=1e-6)

    target, draft = load_pair(out / "target", out / "draft")
    assert target.model.layers[0].self_attn.qkv_proj.input_scale is not None
    engine = EagerEngine(target, draft, max_batch=1, max_seq=64, device="cpu")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = generate_target_only(engine, [7, 8, 9], params)
    assert Generator(engine).generate([[7, 8, 9]], params)[0].output == want
    # an engine built from the static pair (its scalar scales hashed and saved with the weights) gives its tokens
    from muse_spark.builder.build import build_engine

    build_engine(out / "target", out / "draft", tmp_path / "static-engine", backend="eager", device="cpu",
                 max_batch=1, max_seq=64, quiet=True)
    built = load_engine(tmp_path / "static-engine")
    assert built.target.model.layers[0].self_attn.qkv_proj.input_scale.item() == \
        target.model.layers[0].self_attn.qkv_proj.input_scale.item()
    assert Generator(built).generate([[7, 8, 9]], params)[0].output == want

    def fails(*args, match):
        r = run_cli("quantize", "--target", pair / "bf16" / "target", "--out", tmp_path / "bad", *args)
        assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]

    fails("--calibrate", 2, match="it needs --draft and --draft-out")
    fails("--calibrate", -1, match="--calibrate takes a count ≥ 0")
    fails("--calibrate", 2, "--calibration-tokens", 0, match="--calibration-tokens counts ≥ 1")
    fails("--draft", pair / "bf16" / "draft", "--draft-out", tmp_path / "bad-d", "--calibration-prompts",
          tmp_path / "none.txt", match="none.txt: cannot read it")
    assert not (tmp_path / "bad").exists()

    # text prompts, one a line, through the target's tokenizer
    (tmp_path / "prompts.txt").write_text("Hello there\n\nThe quick brown fox\n")
    r = run_cli("quantize", "--target", pair / "bf16" / "target", "--out", tmp_path / "text" / "target", "--draft",
                pair / "bf16" / "draft", "--draft-out", tmp_path / "text" / "draft", "--calibration-prompts",
                tmp_path / "prompts.txt", "--calibration-tokens", 4)
    assert r.returncode == 0 and "activation scales on 2 prompts" in r.stdout, r.stderr[-3000:]
