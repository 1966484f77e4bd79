"""The Triton plugin kernels against their references (plugins/*/reference.py).

Runs on a CUDA device with Triton. Without one every kernel test skips, except
under Triton's CPU interpreter (``TRITON_INTERPRET=1`` with Triton installed),
where the same tests run at small sizes: correct, not fast. Compilation tests
(torch.compile, AOTInductor) need the GPU.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import muse_spark.plugins  # noqa: F401  (registers the reference ops)
from muse_spark.plugins import dispatch
from muse_spark.plugins.gated_residual.reference import gated_residual_add_ref
from muse_spark.plugins.norm import rms_norm
from muse_spark.plugins.keyed_random import SALT_DRAFT, keyed_gumbel
from muse_spark.plugins.markov.reference import markov_sample_ref

from stat_utils import chi2_pvalue

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
ON_GPU = HAS_TRITON and torch.cuda.is_available()
INTERPRETED = HAS_TRITON and not ON_GPU and os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if ON_GPU else "cpu"

needs_kernels = pytest.mark.skipif(
    not (ON_GPU or INTERPRETED),
    reason="needs a CUDA device with Triton (or Triton's CPU interpreter: TRITON_INTERPRET=1)",
)
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device with Triton (compiles kernels)")

# ---- tolerances, one table -------------------------------------------------------------------
# * stream (fp32): exact. The kernel rounds g·branch and the add separately,
#   as torch's two kernels do (no fused multiply-add).
# * normed: the kernel sums x² in another order than torch's reduction and both
#   use an approximate rsqrt, so the fp32 value before the cast differs by a few
#   ulps (~1e-6 relative); the cast to the output dtype then lands at most one
#   ulp of that dtype apart: 2^-7 relative for bf16 (8 significant bits), 2^-10
#   for fp16; for an fp32 output, the few fp32 ulps themselves.
# * probs: the draft logits differ from torch's by the summation order of the
#   r-term GEMV (~1e-6 absolute at these scales), exp is libdevice's in both.
# * tokens: exact. The one source of difference is that summation order, so
#   the token tests use weights whose products and sums are exact in fp32
#   (small multiples of 2^-3): then every order gives the same logits and the
#   tokens must be identical. With random bf16 weights, a token may flip only
#   where two candidates tie within that rounding (≲ 1e-3 of rows).
TOL = {
    "normed_bf16": dict(rtol=2**-7, atol=1e-6),
    "normed_fp16": dict(rtol=2**-10, atol=1e-6),
    "normed_fp32": dict(rtol=1e-5, atol=1e-6),
    "probs": dict(rtol=1e-4, atol=1e-6),
    "random_weight_token_flips": 1e-3,
}
NORM_TOL = {torch.bfloat16: TOL["normed_bf16"], torch.float16: TOL["normed_fp16"], torch.float32: TOL["normed_fp32"]}

BIG = ON_GPU  # production sizes only where kernels are compiled


@pytest.fixture(scope="module")
def tops():
    from muse_spark.plugins import triton_ops

    return triton_ops


@pytest.fixture(scope="module")
def kern():
    from muse_spark.plugins.markov import triton_kernel

    return triton_kernel


# ---- gated residual + norm ----------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [33, 1000, 4096])
@pytest.mark.parametrize("weight", ["plain", "zero_centered", "none"])
@pytest.mark.parametrize("norm_branch", [False, True], ids=["branch_as_is", "branch_normed"])
def test_gated_residual_norm_matches_reference(tops, out_dtype, D, weight, norm_branch):
    g = torch.Generator().manual_seed(D)
    stream = (4 * torch.randn(2, 7, D, generator=g)).to(DEV)
    branch = (3 * torch.randn(2, 7, D, generator=g)).to(out_dtype).to(DEV)
    gate = (0.5 + torch.rand(D, generator=g)).to(DEV)
    w = None if weight == "none" else (0.1 * torch.randn(D, generator=g)).to(out_dtype).to(DEV)
    wb = None if weight == "none" else (1 + 0.1 * torch.randn(D, generator=g)).to(out_dtype).to(DEV)
    args = (stream, branch, gate, w, 1e-6, weight == "zero_centered", True, out_dtype, wb, norm_branch)
    new, normed = tops.gated_residual_add(*args)
    ref_new, ref_normed = gated_residual_add_ref(*args)
    if norm_branch:
        # The normed branch may differ from the reference's by its rounding (a few units in the
        # last place of the branch dtype where the fp32 norm straddles a rounding boundary); the
        # stream then by gate times that, and nowhere else.
        rb = rms_norm(branch, wb, 1e-6, weight == "zero_centered", out_dtype).float()
        bound = 4 * torch.finfo(out_dtype).eps * (gate * rb.abs()) + 4 * torch.finfo(torch.float32).eps * ref_new.abs()
        assert ((new - ref_new).abs() <= bound).all()
        if out_dtype != torch.float32:  # fp32: the norm's scale may differ in its last bit, so every element
            assert (new != ref_new).float().mean() < 0.05
        # given the reference's normed branch, the kernel's stream is the reference's bit for bit
        again, _ = tops.gated_residual_add(stream, rb.to(out_dtype), *args[2:8])
        assert torch.equal(again, ref_new)
        # the next norm reads the kernel's own stream
        ref_normed = rms_norm(new.to(out_dtype), w, 1e-6, weight == "zero_centered", out_dtype)
    else:
        assert torch.equal(new, ref_new)
    assert normed.dtype == out_dtype and normed.shape == stream.shape
    torch.testing.assert_close(normed, ref_normed, **NORM_TOL[out_dtype])


@needs_kernels
def test_gated_residual_without_norm_returns_empty(tops):
    stream = torch.randn(3, 64, device=DEV)
    branch = torch.randn(3, 64, device=DEV).bfloat16()
    gate = torch.rand(64, device=DEV)
    new, empty = tops.gated_residual_add(stream, branch, gate, None, 1e-6, False, False, torch.bfloat16)
    assert torch.equal(new, stream + gate * branch.float())
    assert empty.numel() == 0 and empty.dtype == torch.bfloat16


# ---- Markov loop: inputs ----------------------------------------------------------------------


def markov_inputs(B, gamma, Vd, V, r, seed=0, exact=True, temps=None, wdtype=torch.bfloat16):
    """Inputs of markov_sample on DEV. ``exact``: weights in {-2..2}·2^-3, so every
    product and partial sum of the bias is exact in fp32 (any summation order)."""
    g = torch.Generator().manual_seed(seed)
    U = 2 * torch.randn(B, gamma, Vd, generator=g)
    if exact:
        w1 = torch.randint(-2, 3, (V, r), generator=g) * 2**-3
        w2 = torch.randint(-2, 3, (Vd, r), generator=g) * 2**-3
    else:
        w1 = 0.5 * torch.randn(V, r, generator=g)
        w2 = 0.2 * torch.randn(Vd, r, generator=g)
    ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
    d2t = ids - torch.arange(Vd)
    anchor = torch.randint(0, V, (B,), generator=g)
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=g)
    positions = torch.randint(0, 1_000_000, (B,), generator=g)
    if temps is None:
        temps = torch.tensor([0.0, 1.0, 0.5, 1.7])[torch.arange(B) % 4]
    h = torch.randn(B, gamma, 8, generator=g)
    to = lambda t: t.to(DEV)  # noqa: E731
    return [to(U), to(h), to(anchor), to(w1.to(wdtype)), to(w2.to(wdtype)), to(d2t), to(seeds), to(positions),
            to(temps.float()), "vanilla", None, None, 0]


def kernel_configs():
    """Launch configurations to cover (the default, and each alternative the wrapper can pick)."""
    cfgs = [None, dict(BLOCK_B=1, BLOCK_V=128, RESIDENT=False), dict(BLOCK_B=1, BLOCK_V=64, RESIDENT=True),
            dict(BLOCK_B=1, BLOCK_V=64, RESIDENT=True, MMA=False, POLL_MAX=False, COUNT_BARRIER=False),
            dict(BLOCK_B=16, BLOCK_V=64, GRID_SYNC=False)]
    if ON_GPU:
        cfgs += [dict(COUNT_BARRIER=False),
                 dict(POLL_MAX=False),
                 dict(BLOCK_B=1, BLOCK_V=256, RESIDENT=False, num_warps=8),
                 dict(BLOCK_B=1, BLOCK_V=256, RESIDENT=True, MMA=False),
                 dict(BLOCK_B=1, BLOCK_V=256, RESIDENT=True, MMA=False, num_warps=16),
                 dict(BLOCK_B=16, BLOCK_V=512, GRID_SYNC=True)]
    return cfgs


def run_kernel(kern, args, config):
    U, _h, anchor, w1, w2, d2t, seeds, positions, temps = args[:9]
    return kern.launch_markov_sample(U, anchor, w1, w2, d2t, seeds, positions, temps, config=config,
                                     interpret=INTERPRETED)


# ---- Markov loop: exactness ---------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("config", kernel_configs(), ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 1000, 3001, 24), (1, 7, 257, 300, 16), (5, 2, 300, 400, 0)], ids=str)
def test_markov_tokens_and_probs_match_reference(kern, config, shape):
    B, gamma, Vd, V, r = shape
    if INTERPRETED and config and config.get("BLOCK_B") == 1 and B > 1 and Vd > 512:
        # one program per request and slice: 15-20 s each on the interpreter (CI time); the GPU runs
        # it, and the interpreter runs these configurations at the other shapes
        pytest.skip("a one-request-per-program configuration at the large shape: GPU only")
    args = markov_inputs(B, gamma, Vd, V, r, seed=sum(shape))
    ids, probs = run_kernel(kern, args, config)
    ref_ids, ref_probs = markov_sample_ref(*args)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, ref_probs, **TOL["probs"])
    greedy = args[8] == 0
    assert torch.equal(probs[greedy], ref_probs[greedy])  # one-hot rows are exact


@needs_kernels
def test_markov_sampled_tokens_identical_over_many_seeds(tops):
    B, gamma, Vd, V, r, calls = (16, 7, 4096, 8192, 64, 24) if BIG else (16, 3, 300, 500, 16, 4)
    for c in range(calls):
        args = markov_inputs(B, gamma, Vd, V, r, seed=100 + c, temps=torch.full((B,), 0.3 + 0.1 * (c % 10)))
        ids, _ = tops.markov_sample(*args)
        ref_ids, _ = markov_sample_ref(*args)
        assert torch.equal(ids, ref_ids), f"call {c}: {(ids != ref_ids).any(-1).sum().item()} rows differ"


@needs_kernels
@pytest.mark.parametrize("B", [8, 16, 40])
@pytest.mark.parametrize("grid_sync", [True, False])
def test_markov_kernel_never_gives_up_polling(kern, B, grid_sync):
    """Full 16-row blocks, a partial one (40), the persistent launch and one launch per step: no
    program gives up waiting for the step words (the error flag; the H200 defect fixed by the
    kernel's CTA barriers), and the sampled tokens equal the reference's."""
    gamma, Vd, V, r = (7, 4096, 8192, 64) if BIG else (3, 1024, 2048, 16)
    args = markov_inputs(B, gamma, Vd, V, r, seed=100 + B, temps=torch.full((B,), 0.3))
    U, _h, anchor, w1, w2, d2t, seeds, positions, temps = args[:9]
    ids, _ = kern.launch_markov_sample(U, anchor, w1, w2, d2t, seeds, positions, temps, interpret=INTERPRETED,
                                       check=True, config={"GRID_SYNC": grid_sync})
    assert torch.equal(ids, markov_sample_ref(*args)[0])


@needs_kernels
@pytest.mark.parametrize("count_barrier", [False, True], ids=["sense_reversing", "count_barrier"])
@pytest.mark.parametrize("B", [1, 3, 16])
@pytest.mark.parametrize("grid_sync", [True, False])
def test_markov_kept_workspace_gives_the_same_results_call_after_call(kern, B, grid_sync, count_barrier):
    """A workspace zeroed once and kept (an engine's bucket): every call flips the word parity and
    advances the epoch (or, with ``COUNT_BARRIER``, the counter by one call's programs), so call
    after call gives the fresh workspace's ids and probabilities, and no program ever gives up."""
    gamma, Vd, V, r = (7, 1000, 3001, 24) if ON_GPU else (3, 300, 500, 16)
    args = markov_inputs(B, gamma, Vd, V, r, seed=11 + B)
    U, _h, anchor, w1, w2, d2t, seeds, positions, temps = args[:9]
    config = {"GRID_SYNC": grid_sync, "COUNT_BARRIER": count_barrier}
    call = dict(interpret=INTERPRETED, config=config)
    ref_ids, ref_probs = kern.launch_markov_sample(U, anchor, w1, w2, d2t, seeds, positions, temps, **call)
    ws = torch.zeros(kern.workspace_words(B, gamma, Vd, r, U.device) + 5, dtype=torch.int64, device=DEV)
    cfg = kern.default_config(B, Vd, r, U.device)
    n_prog = triton.cdiv(Vd, cfg["BLOCK_V"]) * triton.cdiv(B, cfg["BLOCK_B"])
    for c in range(4 if ON_GPU else 3):
        ids, probs = kern.launch_markov_sample(U, anchor, w1, w2, d2t, seeds, positions, temps, workspace=ws,
                                               check=True, **call)
        assert torch.equal(ids, ref_ids) and torch.equal(probs, ref_probs), f"call {c}"
        if count_barrier:  # the counter only grows, by the call's programs
            assert int(ws[0]) == (c + 1) * n_prog and int(ws[1]) == 0
        else:  # the epoch advanced; the barrier's counter reset
            assert int(ws[1]) == c + 1 and int(ws[0]) == 0
    with pytest.raises(ValueError, match="workspace must be int64"):
        kern.launch_markov_sample(U, anchor, w1, w2, d2t, seeds, positions, temps, workspace=ws[:5], **call)


@needs_kernels
@pytest.mark.parametrize("config", [None, dict(BLOCK_B=1, BLOCK_V=128, RESIDENT=False)], ids=str)
def test_markov_reads_no_partial_before_writing_it(kern, config):
    """With its softmax partials and probability buffer filled with NaN before the launch
    (``poison``: the launcher's diagnosis mode), every call gives the same ids and
    probabilities as the reference: nothing is read before it is written."""
    B, gamma, Vd, V, r = 3, 5, 1000, 3001, 24
    for c in range(4 if ON_GPU else 1):
        args = markov_inputs(B, gamma, Vd, V, r, seed=4033 + c)
        U, _h, anchor, w1, w2, d2t, seeds, positions, temps = args[:9]
        ids, probs = kern.launch_markov_sample(U, anchor, w1, w2, d2t, seeds, positions, temps, config=config,
                                               interpret=INTERPRETED, check=True, poison=True)
        ref_ids, ref_probs = markov_sample_ref(*args)
        assert torch.equal(ids, ref_ids) and not probs.isnan().any()
        torch.testing.assert_close(probs, ref_probs, **TOL["probs"])


@needs_kernels
def test_markov_production_shape_random_weights(tops):
    """Vd = 32768, r = 256, V = 131072 with random bf16 weights: tokens flip only at rounding ties."""
    B, gamma, Vd, V, r = (8, 7, 32768, 131072, 256) if BIG else (4, 3, 2048, 4096, 32)
    rows = bad = 0
    for c in range(4 if BIG else 1):
        args = markov_inputs(B, gamma, Vd, V, r, seed=7 + c, exact=False)
        ids, probs = tops.markov_sample(*args)
        ref_ids, ref_probs = markov_sample_ref(*args)
        same = (ids == ref_ids).all(-1)
        rows += B
        bad += int((~same).sum())
        torch.testing.assert_close(probs[same], ref_probs[same], **TOL["probs"])
    assert bad <= max(0, int(TOL["random_weight_token_flips"] * rows)), f"{bad} of {rows} rows differ"


@needs_kernels
def test_keyed_gumbel_noise_matches_reference(kern):
    seeds = torch.tensor([0, 1, -5, 2**40 + 3, -(2**62), 2**62 + 11], device=DEV)
    pos = torch.tensor([0, 7, 123456, 1, 2**31 + 5, 99], device=DEV)
    n = 32768 if BIG else 3000
    got = kern.launch_keyed_gumbel(seeds, pos, SALT_DRAFT, n)
    want = keyed_gumbel(seeds, pos, SALT_DRAFT, n)
    if ON_GPU:  # libdevice logf on both sides: bit-identical
        diff = (got != want).sum().item()
        assert diff == 0, f"{diff} of {got.numel()} noise values differ, max {(got - want).abs().max().item()}"
    else:  # the interpreter's numpy log may differ from torch's by an ulp
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---- Markov loop: sanitization, fallbacks, statistics -----------------------------------------


@needs_kernels
@pytest.mark.parametrize("config", [None, dict(BLOCK_B=1, BLOCK_V=256, RESIDENT=True)],
                         ids=["default", "batch_1_config"])
@pytest.mark.parametrize("r", [0, 16])
def test_markov_non_finite_rows(kern, r, config):
    Vd = 5000 if BIG else 300
    base = 2 * torch.randn(6, Vd)
    inf, nan = float("inf"), float("nan")
    base[0, ::7] = nan  # NaN counts as −inf
    base[1, [3, 100, 250]] = inf  # +inf entries: uniform over them
    base[1, 5] = nan
    base[2] = -inf  # nothing finite: uniform over the vocabulary
    base[3] = nan
    base[4] = -inf
    base[4, 123] = 1.0  # one finite entry
    base[5] = -inf
    base[5, 200] = inf
    B = 12
    args = markov_inputs(B, 2, Vd, 2 * Vd, r, seed=3, temps=torch.tensor([0.0, 0.8]).repeat_interleave(6))
    U = base.repeat(2, 1)[:, None, :].expand(B, 2, Vd).contiguous()
    U[:, 1] = args[0][:, 1].cpu()  # the second step is a normal row
    args[0] = U.to(DEV)
    ids, probs = run_kernel(kern, args, config)  # the kernel itself
    ref_ids, ref_probs = markov_sample_ref(*args)
    assert torch.equal(ids, ref_ids)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, ref_probs, **TOL["probs"])


@needs_kernels
def test_markov_topk_is_rejected(tops):
    args = markov_inputs(2, 2, 64, 100, 8)
    args[-1] = 5
    with pytest.raises(ValueError, match="dspark_draft_topk is set"):
        tops.markov_sample(*args)


@needs_kernels
@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_markov_other_heads_fall_back_to_the_reference_bit_identically(tops, head, caplog):
    args = markov_inputs(3, 3, 64, 100, 8, temps=torch.tensor([0.0, 1.0, 0.5]))
    D, r = 8, 8
    g = torch.Generator().manual_seed(1)
    shape_w = (r, D + r) if head == "gated" else (3 * r, 2 * r + D)
    args[9:12] = [head, torch.randn(shape_w, generator=g).to(DEV), torch.randn(shape_w[0], generator=g).to(DEV)]
    with caplog.at_level(logging.WARNING, logger="muse_spark.plugins.triton_ops"):
        ids, probs = tops.markov_sample(*args)
        tops.markov_sample(*args)
    ref_ids, ref_probs = markov_sample_ref(*args)
    assert torch.equal(ids, ref_ids) and torch.equal(probs, ref_probs)
    assert sum(head in rec.getMessage() for rec in caplog.records) <= 1  # logged once per process


@needs_kernels
def test_markov_fp32_weights_at_batch_32_fit_shared_memory(tops):
    """fp32 draft weights above batch 16: the default tile fits an SM (512 columns did not on the H200)."""
    B, gamma, Vd, V, r = (32, 7, 32768, 131072, 256) if BIG else (32, 3, 600, 1000, 16)
    args = markov_inputs(B, gamma, Vd, V, r, seed=7, wdtype=torch.float32)
    ids, _ = tops.markov_sample(*args)
    assert torch.equal(ids, markov_sample_ref(*args)[0])


@needs_kernels
def test_markov_sampled_frequencies_match_probabilities(kern):
    """Same logits, different seeds: step-0 tokens are draws from the recorded q."""
    B, Vd = (8192, 64) if BIG else (1024, 32)
    args = markov_inputs(1, 1, Vd, 100, 8, temps=torch.tensor([0.9]))
    args[0] = args[0].expand(B, 1, Vd).contiguous()
    args[1] = args[1].expand(B, 1, 8).contiguous()
    for i in (2, 7, 8):
        args[i] = args[i].expand(B).contiguous()
    args[6] = torch.arange(B, device=DEV) * 7919 + 13
    ids, probs = run_kernel(kern, args, None)  # the kernel itself
    target_of = torch.arange(Vd, device=DEV) + args[5]  # sorted: invert d2t by search
    draft = torch.searchsorted(target_of, ids[:, 0])
    assert (target_of[draft] == ids[:, 0]).all()
    counts = torch.bincount(draft, minlength=Vd).cpu().numpy()
    assert (probs[0, 0][draft] > 0).all()
    assert chi2_pvalue(counts, probs[0, 0].double().cpu().numpy()) > 1e-4


# ---- registration, dispatch, compilation ------------------------------------------------------


def test_importing_plugins_imports_no_triton():
    code = (
        "import sys, torch; before = 'triton' in sys.modules\n"
        "import muse_spark.plugins, muse_spark.plugins.dispatch\n"
        "assert 'muse_spark.plugins.triton_ops' not in sys.modules\n"
        "assert before or 'triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_kernels
def test_dispatch_selects_the_triton_ops(tops):
    args = markov_inputs(2, 3, 300, 400, 16)
    with dispatch.plugin_impl("triton"):
        ids, probs = dispatch.markov_sample(*args)
    ref_ids, ref_probs = markov_sample_ref(*args)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, ref_probs, **TOL["probs"])
    stream = torch.randn(2, 64, device=DEV)
    branch = torch.randn(2, 64, device=DEV).bfloat16()
    gate = torch.rand(64, device=DEV)
    with dispatch.plugin_impl("triton"):
        new, _ = dispatch.gated_residual_add(stream, branch, gate, None, 1e-6, False, True, torch.bfloat16)
    assert torch.equal(new, stream + gate * branch.float())


class _Tiny(torch.nn.Module):
    """A function of both ops, as an engine graph would call them."""

    def forward(self, stream, branch, gate, w, x, wl, U, h, anchor, w1, w2, d2t, seeds, positions, temps, ws):
        new, normed = torch.ops.muse_spark.gated_residual_add_triton(stream, branch, gate, w, 1e-6, False, True,
                                                                    torch.bfloat16)
        y = torch.ops.muse_spark.linear_triton(normed, wl, False)
        act = torch.ops.muse_spark.linear_triton(x, wl, True)
        # y's rows as [B = 2, S = 2, heads 3, Dh 32] at the requests' positions
        qk = torch.ops.muse_spark.head_norm_rope_triton(y.view(2, 2, 3, 32), positions[:, None].expand(2, 2), 1e-6,
                                                        5e5, True)
        ids, probs = torch.ops.muse_spark.markov_sample_triton(U, h, anchor, w1, w2, d2t, seeds, positions, temps,
                                                               "vanilla", None, None, 0, ws)
        return new, normed, y, act, qk, ids, probs


def _tiny_args(tops):
    g = torch.Generator().manual_seed(5)
    resid = [torch.randn(4, 128, generator=g), torch.randn(4, 128, generator=g).bfloat16(),
             torch.rand(128, generator=g), torch.randn(128, generator=g).bfloat16(),
             torch.randn(8, 128, generator=g).bfloat16(), (0.1 * torch.randn(96, 128, generator=g)).bfloat16()]
    markov = markov_inputs(2, 3, 512, 1024, 32)[:9]
    n_ws = tops.markov_workspace_words(2, 3, 512, 1024, 32, "vanilla", markov[0].device, markov[3].dtype)
    return [t.to(DEV) for t in resid] + markov + [torch.zeros(n_ws, dtype=torch.int64, device=DEV)]


@needs_gpu  # (the interpreter's kernels cannot be traced with fake tensors)
def test_triton_ops_export_as_ops(tops):
    """The ops stay ops in an exported graph, and the graph computes what the ops do in eager; the
    Markov op's kept workspace is mutated in place (the second call, eager, reads the parity the
    exported one left and gets the same results)."""
    args = _tiny_args(tops)
    assert args[-1].numel() > 0
    ep = torch.export.export(_Tiny(), tuple(args))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "muse_spark.gated_residual_add_triton.default" in targets
    assert "muse_spark.markov_sample_triton.default" in targets
    assert "muse_spark.linear_triton.default" in targets
    assert "muse_spark.head_norm_rope_triton.default" in targets
    for a, b in zip(ep.module()(*args), _Tiny()(*args)):
        assert torch.equal(a, b)
    assert int(args[-1][0]) > 0 and int(args[-1][2]) == 0  # two calls counted on the kept words; no error flag


@needs_gpu
def test_triton_ops_under_torch_compile(tops):
    args = _tiny_args(tops)
    eager = _Tiny()(*args)
    compiled = torch.compile(_Tiny(), fullgraph=True)(*args)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


@needs_gpu
@pytest.mark.slow
def test_triton_ops_compile_into_an_aoti_package(tops, tmp_path):
    args = _tiny_args(tops)
    ep = torch.export.export(_Tiny(), tuple(args))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "tiny.pt2"))
    from muse_spark.runtime.aoti_engine import load_package  # (the runtime's loader: docs/aoti.md)

    runner = load_package(path, torch.device(DEV))
    got = runner(*args)
    assert int(args[-1][0]) > 0  # the package counted its call on the caller's workspace, in place
    for a, b in zip(got, _Tiny()(*args)):
        assert torch.equal(a, b)


# ---- attention ----------------------------------------------------------------------------------


ATTN_SHAPES = {  # (B, S, H, KV, dh, T): the step's few queries, a prefill chunk, the production step
    "step": (3, 5, 8, 2, 32, 300),
    "prefill": (2, 40, 4, 4, 16, 130),
    "one_request_many_splits": (1, 8, 8, 2, 16, 640),
    "one_query_no_grouping": (2, 1, 4, 4, 64, 70),  # rep 1, a window shorter than two tiles
}
if BIG:
    ATTN_SHAPES.update({f"muse_spark_b{b}": (b, 8, 32, 8, 128, 1152) for b in (1, 8, 32)})


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(ATTN_SHAPES))
def test_attention_kernel_matches_the_fp32_einsums(tops, shape, dtype):
    """The split-KV kernel against attend_reference: bf16 tolerance, garbage ignored, zeros for
    a query with no visible key, and the same bits whatever the garbage past the lengths is."""
    from muse_spark.models.layers import attend_reference

    from test_models import attention_case
    from tolerances import TOL

    B, S, H, KV, dh, T = ATTN_SHAPES[shape]
    q, k, v, mask = attention_case(dtype, DEV, B=B, S=S, H=H, KV=KV, dh=dh, T=T)
    out = tops.attention(q, k, v, mask)
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    assert torch.equal(out[-1, 0], torch.zeros_like(out[-1, 0]))
    ref = attend_reference(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(out.float(), ref, **TOL[torch.bfloat16])  # fp16 rounds finer: the same bound holds
    unseen = ~mask.any(1)  # [B, T]: keys no query sees
    k2, v2 = k.clone(), v.clone()
    k2[unseen], v2[unseen] = float("inf"), float("-inf")
    assert torch.equal(tops.attention(q, k2, v2, mask), out)


def cache_with_slots(k, v, extra_rows=2, extra_positions=10):
    """Whole NaN-filled caches [B + extra_rows, T + extra_positions, KV, Dh] holding request b's
    k/v at row slots[b] (rows permuted) → (k_cache, v_cache, slots)."""
    B, T = k.shape[:2]
    slots = torch.randperm(B + extra_rows, generator=torch.Generator().manual_seed(1))[:B].to(k.device)
    caches = []
    for x in (k, v):
        c = torch.full((B + extra_rows, T + extra_positions) + tuple(x.shape[2:]), float("nan"), dtype=x.dtype,
                       device=x.device)
        c[slots, :T] = x
        caches.append(c)
    return caches[0], caches[1], slots


@needs_kernels
@pytest.mark.parametrize("shape", ["step", "one_request_many_splits"])
def test_attention_kernel_reads_cache_rows_in_place(tops, shape):
    """With ``slots`` the kernel reads request b's row of whole caches (other rows and positions
    past the mask are NaN): the same bits as on the gathered rows."""
    from test_models import attention_case

    B, S, H, KV, dh, T = ATTN_SHAPES[shape]
    q, k, v, mask = attention_case(torch.bfloat16, DEV, B=B, S=S, H=H, KV=KV, dh=dh, T=T)
    kc, vc, slots = cache_with_slots(k, v)
    out = tops.attention(q, kc, vc, mask, slots)
    assert torch.isfinite(out).all()
    assert torch.equal(out, tops.attention(q, k, v, mask))


@needs_kernels
@pytest.mark.parametrize("bad_slot", [-1, 5, 2**40], ids=["negative", "past_the_rows", "huge"])
def test_attention_slot_outside_the_caches_reads_nothing(tops, bad_slot):
    """A slot outside the caches' rows (a caller's bug) reads no memory: that request's rows are
    zeros, as for a query that sees no key, and the other requests' rows are the bits they have
    with valid slots (no out-of-bounds read takes the GPU down), in both mask forms."""
    from test_models import attention_case

    B, S, H, KV, dh, T = ATTN_SHAPES["step"]
    q, k, v, mask = attention_case(torch.bfloat16, DEV, B=B, S=S, H=H, KV=KV, dh=dh, T=T)
    kc, vc, slots = cache_with_slots(k, v)  # B + 2 rows
    assert not 0 <= bad_slot < kc.shape[0]
    bad = slots.clone()
    bad[1] = bad_slot
    kb = bounds_of(mask)
    for m in (mask, kb):
        want = tops.attention(q, kc, vc, m, slots)
        got = tops.attention(q, kc, vc, m, bad)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        assert torch.equal(got[0], want[0]) and torch.equal(got[2:], want[2:])


@needs_kernels
def test_attention_bits_do_not_depend_on_batch_queries_or_masked_tail(tops):
    """A row's output is the same bits whatever else is in the call: other requests, other queries
    (a padded prefill chunk), or masked keys past the last visible one (a longer window). This is
    what keeps the eager engine (window kv_len) and the packages (a static window) bit-equal."""
    from test_models import attention_case

    q, k, v, mask = attention_case(torch.bfloat16, DEV, B=3, S=6, H=8, KV=2, dh=32, T=300)
    out = tops.attention(q, k, v, mask)
    assert torch.equal(tops.attention(q[1:2], k[1:2], v[1:2], mask[1:2]), out[1:2])
    assert torch.equal(tops.attention(q[:, :4], k, v, mask[:, :4]), out[:, :4])
    pad = 200  # 300 → 500 keys: NaN keys and values, never visible
    k2, v2 = (torch.cat([x, torch.full_like(x[:, :pad], float("nan"))], 1) for x in (k, v))
    assert torch.equal(tops.attention(q, k2, v2, torch.nn.functional.pad(mask, (0, pad))), out)


@needs_kernels
@pytest.mark.parametrize("config", [dict(SPLIT_T=64, BLOCK_T=64), dict(SPLIT_T=512, BLOCK_T=128, num_warps=8),
                                    dict(SPLIT_T=128, BLOCK_T=32, maxnreg=64),
                                    dict(BLOCK_M=16, MERGE_CHUNK=4, merge_warps=2)])
def test_attention_launch_configurations_of_the_sweep_agree(tops, config):
    """benchmarks/attention.py --sweep times launch_attention under other configurations: each
    is the same attention (bf16 tolerance against the fp32 reference, zeros for no visible key)."""
    from muse_spark.models.layers import attend_reference
    from muse_spark.plugins.attention.triton_kernel import launch_attention
    from muse_spark.plugins.triton_math import interpreting

    from test_models import attention_case
    from tolerances import TOL

    q, k, v, mask = attention_case(torch.bfloat16, DEV, B=3, S=5, H=8, KV=2, dh=32, T=300)
    kc, vc, slots = cache_with_slots(k, v)
    out = launch_attention(q, kc, vc, mask, slots, config=config, interpret=interpreting())
    assert torch.equal(out[-1, 0], torch.zeros_like(out[-1, 0]))
    torch.testing.assert_close(out.float(), attend_reference(q.float(), k.float(), v.float(), mask),
                               **TOL[torch.bfloat16])
    with pytest.raises(ValueError, match="not a multiple of BLOCK_T"):
        launch_attention(q, kc, vc, mask, slots, config=dict(SPLIT_T=96, BLOCK_T=64))


@needs_kernels
@pytest.mark.parametrize("shape", ["step", "one_request_many_splits", "prefill"] + (["muse_spark_b8"] if BIG else []))
@pytest.mark.parametrize("split", [(128, 64), (64, 64), (256, 64)], ids=lambda x: f"split{x[0]}_tile{x[1]}")
def test_attention_early_kv_loads_give_the_same_bits(shape, split):
    """EARLY_KV (K/V loads that wait only on one mask load per split, straight-line tiles) is the
    branchy kernel's arithmetic: the same bits, over NaN-filled caches read in place, with a
    masked tail long enough to hold whole splits nobody sees."""
    from muse_spark.plugins.attention.triton_kernel import launch_attention
    from muse_spark.plugins.triton_math import interpreting

    from test_models import attention_case

    B, S, H, KV, dh, T = ATTN_SHAPES[shape]
    q, k, v, mask = attention_case(torch.bfloat16, DEV, B=B, S=S, H=H, KV=KV, dh=dh, T=T)
    kc, vc, slots = cache_with_slots(k, v, extra_positions=300)
    mask = torch.nn.functional.pad(mask, (0, 300))  # 300 more keys nobody sees (NaN in the caches)
    cfg = dict(SPLIT_T=split[0], BLOCK_T=split[1])
    early = launch_attention(q, kc, vc, mask, slots, config=dict(cfg, EARLY_KV=True), interpret=interpreting())
    late = launch_attention(q, kc, vc, mask, slots, config=dict(cfg, EARLY_KV=False), interpret=interpreting())
    assert torch.isfinite(early).all()
    assert torch.equal(early, late)


@needs_kernels
@pytest.mark.parametrize("form", ["mask", "bounds", "cache", "cache_table"])
@pytest.mark.parametrize("shape", ["step", "one_request_many_splits"] + (["muse_spark_b8"] if BIG else []))
def test_attention_splits_per_program_give_the_same_bits(shape, form):
    """``SPLITS`` (a program of the partial kernel running several splits of the window in turn,
    what the launcher picks at batch 4 and above on the H200) gives each split's partials as a
    program of its own does: the output bit for bit, and with the K/V write folded in
    (``new_kv``) the same caches, for every grouping of the splits, even ones that leave a
    program's last splits past the window. Over NaN-filled caches read in place, with whole
    splits nobody sees."""
    from muse_spark.plugins.attention.triton_kernel import launch_attention
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_rope_table
    from muse_spark.plugins.triton_math import interpreting

    from test_models import attention_case

    B, S, H, KV, dh, T = ATTN_SHAPES[shape]
    nsplit = -(-(T + 300) // 128)
    groupings = sorted({1, 2, 3, nsplit - 1, nsplit, nsplit + 2} - {0})
    if form in ("mask", "bounds"):
        q, k, v, mask = attention_case(torch.bfloat16, DEV, B=B, S=S, H=H, KV=KV, dh=dh, T=T)
        kc, vc, slots = cache_with_slots(k, v, extra_positions=300)
        mask = torch.nn.functional.pad(mask, (0, 300))  # 300 more keys nobody sees (NaN in the caches)
        kb = bounds_of(mask)
        args = (q, kc, vc, mask, slots) if form == "mask" else (q, kc, vc, kb.last, slots)
        extra = {} if form == "mask" else dict(window=kb.width)
        outs = {g: launch_attention(*args, config=dict(SPLITS=g), interpret=interpreting(), **extra)
                for g in groupings}
        assert torch.isfinite(outs[1]).all()
        for g in groupings:
            assert torch.equal(outs[g], outs[1]), g
        return
    # the fused form: q/k norm, rotation and the new K/V written by the partial kernel
    # request 0's new keys straddle key 256: a split boundary, and a boundary between programs for
    # groupings of 1, 2 and 4 splits (a program stores the new keys of its own splits only)
    x, v, positions, slots, (kc, vc), last = attention_cache_operands(B if B <= 2 else 2, S, H, KV, dh, 2, T + 300,
                                                                     (256 - S // 2, 100))
    table = launch_rope_table(positions, 5e5, dh) if form == "cache_table" else None
    got = {}
    for g in groupings:
        k2, v2 = kc.clone(), vc.clone()
        out = launch_attention(x, k2, v2, last, slots, config=dict(SPLITS=g), interpret=interpreting(),
                               window=T + 300, new_kv=(v, positions, 1e-6, 5e5, True), table=table)
        got[g] = (out, k2, v2)
    assert torch.isfinite(got[1][0]).all()
    for g in groupings:
        assert all(torch.equal(a, b) for a, b in zip(got[g], got[1])), g


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the kernel's module imports it)")
def test_the_attention_splits_come_from_the_config_then_the_option_then_the_launcher():
    """What ``launch_attention`` passes as ``SPLITS`` and the grid it launches (through ``wrap``, no kernel
    runs): an explicit config first, then the kernel option ``attention_splits``, then the launcher's
    choice (1 without a GPU); a negative config is refused. ``program_splits`` (what the attention
    benches report) gives the same count."""
    from muse_spark.options import KernelOptions, use_options
    from muse_spark.plugins.attention import triton_kernel as ak

    B, S, H, KV, dh, n, T, window, firsts = ATTN_CACHE_SHAPES["straddle"]  # 300 keys: 3 splits
    x, v, positions, slots, (kc, vc), last = attention_cache_operands(B, S, H, KV, dh, n, T, firsts)
    seen = []

    class Record:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, kw.get("SPLITS"))) if self.fn is ak._partial_kernel else None

    def launch(**config):
        seen.clear()
        ak.launch_attention(x[:, :, :H], kc, vc, last, slots, wrap=Record, window=window, config=config or None)
        assert ak.program_splits(B, S * H // KV, window, KV, x.device, config or None) == seen[0][1]  # (the benches')
        return seen[0]

    rows = -(-(S * H // KV) // ak.DEFAULT_CONFIG["BLOCK_M"])
    assert launch() == ((rows, 3, B * KV), 1)  # CPU tensors: no GPU to size a wave by
    with use_options(KernelOptions(attention_splits=2)):
        assert launch() == ((rows, 2, B * KV), 2)
        assert launch(SPLITS=3) == ((rows, 1, B * KV), 3)  # the config wins
    with pytest.raises(ValueError, match="SPLITS -1 must be ≥ 1"):
        launch(SPLITS=-1)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the kernel's module imports it)")
def test_the_launcher_groups_splits_only_where_the_grid_outgrows_one_wave():
    """``splits_per_program``: one split a program while a program per split fits in one wave of
    the GPU (two programs an SM), so batch 1's kernel is the one it always was; past that, the
    fewest splits a program that bring the grid into one wave, evened out over the programs."""
    from muse_spark.plugins.attention.triton_kernel import splits_per_program as f

    sms, nsplit = 132, 9  # the H200; the step's 1152-key window in 128-key splits
    assert [f(nsplit, b * 8, sms) for b in (1, 2, 3, 4, 8, 16, 32)] == [1, 1, 1, 2, 3, 5, 9]
    for b in range(1, 65):
        g = f(nsplit, b * 8, sms)
        groups = -(-nsplit // g)
        assert 1 <= g <= nsplit and g == -(-nsplit // groups)  # evened out: 9 in 2 groups is 5 + 4, not 8 + 1
        assert groups * b * 8 <= 2 * sms or g == nsplit  # one wave, unless even one group a program is more
    assert f(1, 4096, sms) == 1 and f(nsplit, 64, 0) == 1  # one split; no GPU (the interpreter, CPU)
    assert f(object(), 8, sms) == 1  # a size that is not an int (a symbolic one, in a dynamic export)


@needs_kernels
def test_attention_op_rejects_bad_inputs(tops):
    from test_models import attention_case

    q, k, v, mask = attention_case(torch.bfloat16, DEV)
    with pytest.raises(ValueError, match="mask must be bool"):
        tops.attention(q, k, v, mask.to(torch.uint8))
    with pytest.raises(ValueError, match="expected k and v"):
        tops.attention(q, k[..., :8], v[..., :8], mask)
    with pytest.raises(ValueError, match="head_dim 8 "):
        tops.attention(q[..., :8], k[..., :8], v[..., :8], mask)
    with pytest.raises(ValueError, match="all the same"):
        tops.attention(q, k.float(), v.float(), mask)
    with pytest.raises(ValueError, match="mask must be bool"):  # a window longer than the cache
        tops.attention(q, k[:, :-1], v[:, :-1], mask)
    with pytest.raises(ValueError, match="slots must be int64"):
        tops.attention(q, k, v, mask, torch.arange(q.shape[0], device=q.device, dtype=torch.int32))


def bounds_of(mask):
    """The ``KeyBounds`` of a prefix mask (attention_case's: keys 0 … last visible, or none)."""
    from muse_spark.models.layers import KeyBounds

    last = mask.sum(-1) - 1
    assert torch.equal(KeyBounds(last, mask.shape[-1]).dense(), mask)
    return KeyBounds(last, mask.shape[-1])


@needs_kernels
@pytest.mark.parametrize("shape", list(ATTN_SHAPES))
@pytest.mark.parametrize("early", [True, False], ids=["early_kv", "per_tile"])
def test_attention_bounds_match_the_fp32_einsums(tops, shape, early):
    """The mask in bounds form (``KeyBounds``, what the models pass: no mask tensor) over
    NaN-filled caches read in place, with a window longer than every request (whole splits nobody
    sees): bf16 tolerance against attend_reference with the dense mask, zeros for a query that
    sees no key, and the op the models call gives the launcher's bits. Strided bounds (the draft's
    non-causal block repeats one bound per request) give what their contiguous copy gives.

    Not asserted: the same bits as the dense-mask kernel. On the H200 they differed at the
    production shape (head_dim 128) though the PTX has the same arithmetic instructions;
    the engines call the bounds form in eager and in the packages alike (the engine tests
    check those agree)."""
    from muse_spark.models.layers import KeyBounds, attend_reference
    from muse_spark.plugins.attention.triton_kernel import launch_attention
    from muse_spark.plugins.triton_math import interpreting

    from test_models import attention_case
    from tolerances import TOL

    B, S, H, KV, dh, T = ATTN_SHAPES[shape]
    q, k, v, mask = attention_case(torch.bfloat16, DEV, B=B, S=S, H=H, KV=KV, dh=dh, T=T)
    kc, vc, slots = cache_with_slots(k, v, extra_positions=300)
    kb = bounds_of(torch.nn.functional.pad(mask, (0, 300)))
    got = launch_attention(q, kc, vc, kb.last, slots, config=dict(EARLY_KV=early), interpret=interpreting(),
                           window=kb.width)
    assert torch.isfinite(got).all() and torch.equal(got[-1, 0], torch.zeros_like(got[-1, 0]))
    torch.testing.assert_close(got.float(), attend_reference(q.float(), k.float(), v.float(), mask),
                               **TOL[torch.bfloat16])
    if early:
        assert torch.equal(tops.attention(q, kc, vc, kb, slots), got)  # the op the models call
    one = KeyBounds(kb.last[:, -1:].expand(B, S), kb.width)  # stride 0 along the queries
    assert torch.equal(tops.attention(q, kc, vc, one, slots),
                       tops.attention(q, kc, vc, KeyBounds(one.last.contiguous(), kb.width), slots))


@needs_kernels
def test_attention_bounds_bits_do_not_depend_on_batch_queries_or_window(tops):
    """As for the dense mask: a row's bits are the same whatever other requests and queries share
    the call and however long the static window past the last visible key is. This is what
    keeps the eager engine (window kv_len, unpadded prefill chunks) and the packages (a static
    window, padded chunks) bit-equal."""
    from muse_spark.models.layers import KeyBounds

    from test_models import attention_case

    q, k, v, mask = attention_case(torch.bfloat16, DEV, B=3, S=6, H=8, KV=2, dh=32, T=300)
    kc, vc, slots = cache_with_slots(k, v, extra_positions=200)
    kb = bounds_of(mask)
    out = tops.attention(q, kc, vc, kb, slots)
    assert torch.equal(tops.attention(q[1:2], kc, vc, KeyBounds(kb.last[1:2], 300), slots[1:2]), out[1:2])
    assert torch.equal(tops.attention(q[:, :4], kc, vc, KeyBounds(kb.last[:, :4], 300), slots), out[:, :4])
    assert torch.equal(tops.attention(q, kc, vc, KeyBounds(kb.last, 500), slots), out)  # 200 NaN keys more


@needs_kernels
def test_attention_bounds_op_rejects_bad_inputs(tops):
    from test_models import attention_case

    q, k, v, mask = attention_case(torch.bfloat16, DEV)
    kb = bounds_of(mask)
    op = torch.ops.muse_spark.attention_bounds_triton
    with pytest.raises(ValueError, match="last must be int64"):
        op(q, k, v, kb.last.to(torch.int32), kb.width)
    with pytest.raises(ValueError, match="last must be int64"):
        op(q, k, v, kb.last[:, :-1], kb.width)
    with pytest.raises(ValueError, match="key window 49 must be in"):  # a window longer than the cache
        op(q, k, v, kb.last, kb.width + 1)
    with pytest.raises(ValueError, match="expected k and v"):
        op(q, k[..., :8], v[..., :8], kb.last, kb.width)
    with pytest.raises(ValueError, match="slots must be int64"):
        op(q, k, v, kb.last, kb.width, torch.arange(q.shape[0], device=q.device, dtype=torch.int32))


@needs_gpu
@pytest.mark.parametrize("splits", [0, 2], ids=["launcher_choice", "two_splits_a_program"])
def test_attention_kernel_compiles_into_an_aoti_package(tops, tmp_path, monkeypatch, splits):
    """The attention op exported and compiled by AOTInductor: the package runs the same kernels as
    eager, so it gives the same bits. Also with two of the window's three splits a program
    (``SPLITS``, set while the op is traced: what the launcher picks for large batches), against
    eager's one split a program."""
    from muse_spark.plugins.attention import triton_kernel as ak

    from test_models import attention_case

    q, k, v, mask = attention_case(torch.bfloat16, DEV, T=300)
    kc, vc, slots = cache_with_slots(k, v)  # as the layer package calls it: whole caches and slots

    class Attn(torch.nn.Module):
        def forward(self, q, k, v, mask, slots):
            return tops.attention(q, k, v, mask, slots)

    with monkeypatch.context() as m:
        m.setitem(ak.DEFAULT_CONFIG, "SPLITS", splits)
        ep = torch.export.export(Attn(), (q, kc, vc, mask, slots))
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "attn.pt2"))
    from muse_spark.runtime.aoti_engine import load_package  # (torch's own loader can segfault: docs/aoti.md)

    run = load_package(path, torch.device(DEV))
    assert torch.equal(run(q, kc, vc, mask, slots), tops.attention(q, k, v, mask))


def compile_for_hopper(fn, sig: dict, consts: dict, num_warps: int, num_stages: int | None = None,
                       multiples_of_16: tuple = ()):
    """``fn`` compiled ahead of time for sm_90 by Triton's compiler (no GPU needed). ``sig``: the
    runtime arguments' Triton types by name (pointers 16-byte aligned); ``consts``: constexprs;
    ``multiples_of_16``: integer arguments a launch specializes as such (as a real launch would,
    which lets the pipeliner stage the loads in shared memory)."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(consts)  # constexprs left out take their defaults, as a launch does
    params = inspect.signature(fn.fn).parameters
    for name, prm in params.items():
        if name not in consts and name not in sig and prm.default is not inspect.Parameter.empty:
            consts[name] = prm.default
    at = list(params)  # an attribute names its argument by its place among the kernel's parameters
    attrs = {(at.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n].startswith("*") or n in multiples_of_16}
    src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}), constexprs=consts, attrs=attrs)
    options = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the kernels' modules import it)")
@pytest.mark.parametrize("fused", [False, True, "table"], ids=["attention", "attention_cache", "attention_cache_table"])
def test_the_attention_launcher_passes_every_kernel_argument(fused):
    """Inductor's mutation analysis of a user-defined kernel (``identify_mutated_tensors``) takes
    the arguments as passed and fills in no defaults: one left out and it assumes every input is
    mutated (seen on the H200 with the partial kernel's new arguments). The launcher, both forms,
    must pass each of its kernels' parameters (checked through ``wrap``, no kernel runs)."""
    from muse_spark.plugins.attention import triton_kernel as ak

    B, S, H, KV, dh, n, T, window, firsts = ATTN_CACHE_SHAPES["straddle"]
    x, v, positions, slots, (kc, vc), last = attention_cache_operands(B, S, H, KV, dh, n, T, firsts)
    q = x if fused else x[:, :, :H]
    table = (torch.zeros(B * S, dh // 2), torch.zeros(B * S, dh // 2)) if fused == "table" else None
    calls = launches(lambda wrap: ak.launch_attention(q, kc, vc, last, slots, wrap=wrap, window=window,
                                                      new_kv=(v, positions, 1e-6, 5e5, True) if fused else None,
                                                      table=table))
    assert [c[0] for c in calls] == [ak._partial_kernel, ak._combine_kernel]
    for fn, passed in calls:
        assert passed == set(fn.arg_names), fn.__name__


def launches(run) -> list:
    """The kernel launches ``run(wrap)`` makes through ``wrap`` (no kernel runs): (kernel, the names
    of the parameters it was passed, positionally or by name; launch options left out)."""
    calls = []

    class Record:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(
                (self.fn, set(self.fn.arg_names[:len(args)]) | (set(kw) - LAUNCH_OPTIONS)))

    run(Record)
    return calls


LAUNCH_OPTIONS = {"num_warps", "num_stages", "maxnreg", "launch_pdl"}


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the kernels' modules import it)")
@pytest.mark.parametrize("form", ["linear", "linear_silu_mul", "linear_rope_table", "norm_cache", "norm_cache_table",
                                  "norm", "rope_table", "gated_residual"])
def test_the_other_launchers_pass_every_kernel_argument(form):
    """``test_the_attention_launcher_passes_every_kernel_argument`` for the launchers the engines'
    ops call: each passes every parameter of its kernel, the arguments a form does not use included
    (the RoPE table's, PDL's), so Inductor's mutation analysis sees what the kernel writes."""
    from muse_spark.plugins.gated_residual import triton_kernel as gk
    from muse_spark.plugins.head_norm_rope import triton_kernel as hk
    from muse_spark.plugins.linear import triton_kernel as lk

    x4, v, positions, slots, (kc, vc) = cache_write_operands(B=2, S=3)
    x = torch.zeros(1, 6, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(128, 64, dtype=torch.bfloat16, device=DEV)
    table = (torch.zeros(6, x4.shape[3] // 2, device=DEV), torch.zeros(6, x4.shape[3] // 2, device=DEV))
    run = {
        "linear": lambda wrap: lk.launch_linear(x, w, wrap=wrap),
        "linear_silu_mul": lambda wrap: lk.launch_linear(x, w, True, wrap=wrap),
        "linear_rope_table": lambda wrap: lk.launch_linear_rope_table(x, w, positions, 5e5, 32, wrap=wrap),
        "norm_cache": lambda wrap: hk.launch_head_norm_rope_cache(x4, v, positions, 1e-6, 5e5, True, kc, vc,
                                                                  slots, wrap=wrap),
        "norm_cache_table": lambda wrap: hk.launch_head_norm_rope_cache(x4, v, positions, 1e-6, 5e5, True, kc, vc,
                                                                        slots, wrap=wrap, table=table),
        "norm": lambda wrap: hk.launch_head_norm_rope(x4, positions, 1e-6, 5e5, True, wrap=wrap),
        "rope_table": lambda wrap: hk.launch_rope_table(positions, 5e5, 32, wrap=wrap),
        "gated_residual": lambda wrap: gk.launch_gated_residual_add(
            torch.zeros(6, 64, device=DEV), torch.zeros(6, 64, dtype=torch.bfloat16, device=DEV),
            torch.zeros(64, device=DEV), torch.ones(64, dtype=torch.bfloat16, device=DEV), 1e-6, False, True,
            torch.bfloat16, wrap=wrap),
    }
    calls = launches(run[form])
    assert len(calls) == 1
    fn, passed = calls[0]
    assert passed == set(fn.arg_names), (fn.__name__, set(fn.arg_names) - passed)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED,
                    reason="needs Triton's JIT functions (the interpreter's have no source to re-emit)")
def test_plugin_kernels_survive_inductors_source_re_emission(tmp_path):
    """AOTInductor compiles a user-defined Triton kernel from source it re-emits: the kernel's own
    source, the @triton.jit functions it calls and the module constants its body names, nothing
    else. A module constant used as a parameter's default is not among them: it once made every
    CUDA engine build fail (NameError in Inductor's autotuning block). Each plugin kernel's
    re-emitted source must define the kernel again in a fresh namespace (no GPU needed)."""
    import triton.language as tl
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    from muse_spark.plugins.attention import triton_kernel as attention
    from muse_spark.plugins.gated_residual import triton_kernel as gated_residual
    from muse_spark.plugins.head_norm_rope import triton_kernel as head_norm_rope
    from muse_spark.plugins.linear import triton_kernel as linear
    from muse_spark.plugins.markov import triton_kernel as markov

    kernels = [attention._partial_kernel, attention._combine_kernel, gated_residual._gated_residual_norm_kernel,
               head_norm_rope._head_norm_rope_kernel, head_norm_rope._head_norm_rope_cache_kernel,
               linear._linear_kernel, markov._markov_kernel]
    import importlib.util

    for kernel in kernels:
        src = user_defined_triton_kernel_transitive_closure_source_code(kernel)
        path = tmp_path / f"re_emitted{kernel.__name__}.py"  # (a file, as Inductor's: @triton.jit reads it back)
        path.write_text("import triton\nimport triton.language as tl\n\n@triton.jit\n" + src + "\n")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # a name the source needs and lacks: NameError here
        again = getattr(module, kernel.__name__)
        assert isinstance(again, triton.JITFunction) and again.arg_names == kernel.arg_names
        assert module.tl is tl


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
def test_attention_kernels_compile_for_hopper_without_fused_multiply_adds():
    """Compiled ahead of time for sm_90 (no GPU needed: Triton's LLVM and ptxas): the attention
    kernels fit (shared memory) and their PTX has no fma.rn.f32, so their bits do not depend on
    whether a launcher compiles them with FMA contraction on (Triton's eager launch) or off."""
    from muse_spark.plugins.attention import triton_kernel as ak

    cfg = ak.DEFAULT_CONFIG
    names = ["q_ptr", "k_ptr", "v_ptr", "mask_ptr", "slot_ptr", "po_ptr", "pm_ptr", "pl_ptr", "S", "T", "M", "KV",
             "NSPLIT", "N_ROWS", "sq_b", "sq_s", "sq_h", "sk_b", "sk_t", "sk_h", "sv_b", "sv_t", "sv_h", "sm_b", "sm_s"]
    types = ["*bf16", "*bf16", "*bf16", "*i1", "*i64", "*fp32", "*fp32", "*fp32"] + ["i32"] * 17
    partials = [compile_for_hopper(ak._partial_kernel, dict(zip(names, types)), dict(
        SCALE=128 ** -0.5, REP=4, DH=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"], SPLIT_T=cfg["SPLIT_T"],
        IEEE_DOT=False, HAS_SLOTS=True, EARLY_KV=early), cfg["num_warps"]) for early in (True, False)]
    names = ["po_ptr", "pm_ptr", "pl_ptr", "out_ptr", "S", "M", "KV", "NSPLIT", "H"]
    types = ["*fp32", "*fp32", "*fp32", "*bf16"] + ["i32"] * 5
    combine = compile_for_hopper(ak._combine_kernel, dict(zip(names, types)),
                                 dict(REP=4, DH=128, CHUNK=cfg["MERGE_CHUNK"]), cfg["merge_warps"])
    for k in partials + [combine]:
        assert k.asm["cubin"] and k.metadata.shared <= 227 * 1024
        assert "fma.rn.f32" not in k.asm["ptx"]
    # With the q/k norm, RoPE and cache write folded in (attention_cache_triton): it compiles and fits.
    # Its norm is head_norm_rope's (norm_rotate): the rotation is explicitly rounded, the sum of
    # squares is the norm kernel's own reduction (contracted as there), so not asserted FMA-free.
    names = ["q_ptr", "k_ptr", "v_ptr", "mask_ptr", "slot_ptr", "po_ptr", "pm_ptr", "pl_ptr", "S", "T", "M", "KV",
             "NSPLIT", "N_ROWS", "sq_b", "sq_s", "sq_h", "sk_b", "sk_t", "sk_h", "sv_b", "sv_t", "sv_h", "sm_b", "sm_s",
             "vn_ptr", "pos_ptr", "svn_b", "svn_s", "svn_h", "sp_b", "sp_s", "T_CACHE"]
    types = (["*bf16", "*bf16", "*bf16", "*i64", "*i64", "*fp32", "*fp32", "*fp32"] + ["i32"] * 17
             + ["*bf16", "*i64"] + ["i32"] * 6)
    fused = compile_for_hopper(ak._partial_kernel, dict(zip(names, types)), dict(
        SCALE=128 ** -0.5, REP=4, DH=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"], SPLIT_T=cfg["SPLIT_T"],
        IEEE_DOT=False, HAS_SLOTS=True, EARLY_KV=True, BOUNDS=True, NORM_QK=True, EPS=1e-6, THETA=5e5, ROPE=True),
        cfg["num_warps"])
    assert fused.asm["cubin"] and fused.metadata.shared <= 227 * 1024
    assert "bar.sync" in fused.asm["ptx"]  # the barrier between the cache write and the tiles' loads
    # reading the step's RoPE table (TABLE): none of the library's trigonometry (its large-argument
    # reduction keeps an array in local memory), still fits
    table = compile_for_hopper(ak._partial_kernel, dict(zip(names + ["cos_ptr", "sin_ptr"], types + ["*fp32"] * 2)),
                               dict(SCALE=128 ** -0.5, REP=4, DH=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"],
                                    SPLIT_T=cfg["SPLIT_T"], IEEE_DOT=False, HAS_SLOTS=True, EARLY_KV=True, BOUNDS=True,
                                    NORM_QK=True, EPS=1e-6, THETA=5e5, ROPE=True, TABLE=True), cfg["num_warps"])
    assert table.asm["cubin"] and table.metadata.shared <= 227 * 1024
    assert "ld.local" in fused.asm["ptx"] and "ld.local" not in table.asm["ptx"]
    # several splits a program (SPLITS, the launcher's choice from batch 4 on the H200): each form
    # compiles, fits, and the plain one stays free of contracted multiply-adds
    grouped = [compile_for_hopper(ak._partial_kernel, dict(zip(n, t)), dict(c, SPLITS=3), cfg["num_warps"])
               for n, t, c in ((names[:25], types[:25], dict(
                   SCALE=128 ** -0.5, REP=4, DH=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"],
                   SPLIT_T=cfg["SPLIT_T"], IEEE_DOT=False, HAS_SLOTS=True, EARLY_KV=True, BOUNDS=True)),
                   (names + ["cos_ptr", "sin_ptr"], types + ["*fp32"] * 2, dict(
                       SCALE=128 ** -0.5, REP=4, DH=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"],
                       SPLIT_T=cfg["SPLIT_T"], IEEE_DOT=False, HAS_SLOTS=True, EARLY_KV=True, BOUNDS=True,
                       NORM_QK=True, EPS=1e-6, THETA=5e5, ROPE=True, TABLE=True)))]
    for k in grouped:
        assert k.asm["cubin"] and k.metadata.shared <= 227 * 1024
    assert "fma.rn.f32" not in grouped[0].asm["ptx"]


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("variant", [{}, dict(COUNT_BARRIER=False, POLL_MAX=False), dict(MMA=False),
                                     dict(CHECK_READS=True)],
                         ids=["default", "sense_reversing_count_poll", "registers", "check_reads"])
@pytest.mark.parametrize("batch", [1, 32])
def test_markov_kernel_compiles_for_hopper(batch, variant):
    """The Markov kernel under its default launch configurations at the production shape (γ = 7,
    Vd = 32768, r = 256), and with the alternatives to its defaults, compiled ahead of time for
    sm_90 without a GPU: it compiles (batch 1: W2 resident in shared memory for the tensor cores,
    or in registers) and fits an SM's shared memory."""
    from muse_spark.plugins.markov import triton_kernel as mk

    cfg = dict(mk.default_config(batch, 32768, 256, torch.device("cpu")), **variant)
    resident = cfg["RESIDENT"]
    mma = resident and cfg["MMA"]
    w = "*i32" if resident and not mma else "*bf16"
    names = ["u_ptr", "anchor_ptr", "w1_ptr", "w2_ptr", "d2t_ptr", "seed_ptr", "pos_ptr", "temp_ptr", "ids_ptr",
             "probs_ptr", "ws_ptr", "pf_ptr", "pi_ptr", "B", "Vd", "GAMMA", "RANK", "NS", "k_begin", "k_end",
             "stride_ub", "stride_uk", "RANK_W"]
    types = ["*fp32", "*i64", w, w, "*i64", "*i64", "*i64", "*fp32", "*i64", "*fp32", "*i64", "*fp32", "*i32"]
    sig = dict(zip(names, types + ["i32"] * 10))
    ns = 32768 // cfg["BLOCK_V"]
    consts = dict(RANK_P2=256, NS_P2=triton.next_power_of_2(ns), BLOCK_B=cfg["BLOCK_B"], BLOCK_V=cfg["BLOCK_V"],
                  BLOCK_R=32 if cfg["BLOCK_B"] == 1 else 64, FINAL_ROWS=8 if cfg["BLOCK_B"] == 1 else cfg["BLOCK_B"],
                  SALT=mk.SALT_KEY, HAS_MARKOV=True, RESIDENT=resident, GRID_SYNC=True, FINAL=True, IEEE_DOT=False,
                  SPIN=mk.SPIN_LIMIT, COUNT_BARRIER=cfg["COUNT_BARRIER"], POLL_MAX=cfg["POLL_MAX"], MMA=mma,
                  CHECK_READS=cfg.get("CHECK_READS", False))  # the poisoned diagnosis's check of the final reads
    k = compile_for_hopper(mk._markov_kernel, sig, consts, cfg["num_warps"],
                           multiples_of_16=("Vd", "stride_ub", "stride_uk", "RANK_W"))
    assert k.asm["cubin"] and k.metadata.shared <= 227 * 1024
    if mma:  # the GEMV is on the tensor cores, and the W2 slice is in shared memory (128 KB)
        assert "wgmma.mma_async" in k.asm["ptx"] and k.metadata.shared >= 128 * 1024


# ---- q/k head norm + RoPE ------------------------------------------------------------------------

ROPE_SHAPES = {  # (B, S, heads, Dh): q and k of a step side by side, a prefill chunk, one head
    "step": (1, 8, 40, 128),
    "batch": (3, 5, 12, 64),
    "prefill_chunk": (2, 33, 10, 128),
    "one_head": (2, 3, 1, 16),
}


def rope_operands(shape, dtype, strided, seed=0):
    """x [B, S, NH, Dh] on DEV (with ``strided``: the first NH heads of a wider row, as q|k are of a
    qkv projection) and positions [B, S] up to 10^5 (angles far past 2π)."""
    B, S, NH, dh = shape
    g = torch.Generator().manual_seed(seed)
    wide = (3 * torch.randn(B, S, (NH + 3 if strided else NH) * dh, generator=g)).to(dtype).to(DEV)
    x = wide[..., : NH * dh].reshape(B, S, NH, dh)
    positions = torch.randint(0, 100_000, (B, S), generator=g).to(DEV)
    return x, positions


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
@pytest.mark.parametrize("theta", [5e5, 1e4])
def test_head_norm_rope_kernel_matches_reference(tops, shape, dtype, theta):
    """The norm within its rounding (one unit of the dtype's last place where the fp32 value
    straddles a boundary). RoPE of the kernel's own normed values against torch's rope of them:
    the angle position·inv_freq is fp32, whose resolution at positions up to 10^5 is ~0.008 rad,
    so two math libraries (libdevice as Triton links it, torch's CUDA kernels on the H200; numpy
    under the interpreter) may disagree by a few ulps of the angle. The bound is that, plus one
    unit of the dtype at the head's scale. On the H200 a bound of one dtype unit alone failed in
    fp16 at these positions (errors up to 0.012, concentrated in the highest-frequency dims)."""
    from muse_spark.models.layers import head_norm_rope_reference, head_rms_norm, rope

    x, positions = rope_operands(ROPE_SHAPES[shape], dtype, strided=shape != "one_head", seed=len(shape))
    normed = tops.head_norm_rope(x, positions, 1e-6, theta, False)
    ref_normed = head_rms_norm(x, 1e-6)
    assert normed.shape == x.shape and normed.dtype == dtype and normed.is_contiguous()
    torch.testing.assert_close(normed, ref_normed, **NORM_TOL[dtype])
    assert (normed != ref_normed).float().mean() < 0.02
    out = tops.head_norm_rope(x, positions, 1e-6, theta, True)
    given_normed = rope(normed, positions, theta)
    # 4 ulps of each dim's fp32 angle, times the pair's magnitude |n1| + |n2| (both halves of y see it)
    dh = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh))
    angle = positions.float()[..., None, None] * inv_freq  # [B, S, 1, Dh/2]
    d_angle = 4 * (torch.nextafter(angle, torch.full_like(angle, float("inf"))) - angle)
    nf = normed.float()
    pair = nf[..., : dh // 2].abs() + nf[..., dh // 2 :].abs()
    angle_bound = torch.cat([pair * d_angle] * 2, -1)
    unit = 2 * torch.finfo(dtype).eps * (nf.abs().amax(-1, keepdim=True) + 1e-3)  # a dtype unit at the head's scale
    bound = angle_bound + unit
    err = (out.float() - given_normed.float()).abs()
    differ = (out != given_normed).float().mean().item()
    assert (err <= bound).all(), f"{(err > bound).sum().item()} values off by more than the bound (max {err.max():.4g})"
    assert differ < 0.1, f"{differ:.4f} of the values differ"
    # against the whole reference: the norm's rounding, rotated, on top
    ref = head_norm_rope_reference(x, positions, 1e-6, theta, True)
    assert ((out.float() - ref.float()).abs() <= bound + unit).all()


@needs_kernels
def test_head_norm_rope_rows_are_independent_of_batch_and_grid(tops):
    """A row's bits depend on its own heads and position only: one request alone, or among others,
    or with fewer heads beside it, gives the same bits."""
    x, positions = rope_operands((3, 4, 40, 128), torch.bfloat16, strided=True, seed=3)
    full = tops.head_norm_rope(x, positions, 1e-6, 5e5, True)
    assert torch.equal(tops.head_norm_rope(x[1:2], positions[1:2], 1e-6, 5e5, True), full[1:2])
    assert torch.equal(tops.head_norm_rope(x[:, :, 32:], positions, 1e-6, 5e5, True), full[:, :, 32:])


def cache_target(g, B, S, KV, dh, slots_n, T, dtype):
    """Where a cache write goes: distinct positions < T per request, rows ``slots``, and random
    caches [slots_n, T, KV, dh] (K, V)."""
    caches = [torch.randn(slots_n, T, KV, dh, generator=g).to(dtype).to(DEV) for _ in range(2)]
    positions = torch.stack([torch.randperm(T, generator=g)[:S] for _ in range(B)]).to(DEV)
    slots = torch.tensor([2, 0, 3, 1][:B]).to(DEV)
    return positions, slots, caches


def cache_write_operands(B=2, S=3, H=4, KV=2, dh=32, slots_n=4, T=16, dtype=torch.bfloat16, seed=5):
    """A layer's qkv row as the model slices it (q|k heads and v, views of one wider tensor), and
    ``cache_target``."""
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(B, S, (H + 2 * KV + 1) * dh, generator=g)).to(dtype).to(DEV)
    x = qkv[..., : (H + KV) * dh].reshape(B, S, H + KV, dh)
    v = qkv[..., (H + KV) * dh : (H + 2 * KV) * dh].reshape(B, S, KV, dh)
    return (x, v, *cache_target(g, B, S, KV, dh, slots_n, T, dtype))


@needs_kernels
@pytest.mark.parametrize("rope", [True, False])
def test_head_norm_rope_cache_kernel_writes_what_the_layers_wrote(tops, rope):
    """The fused cache write: q is bit for bit the plain kernel's first H heads; the caches hold, at
    rows ``slots`` and ``positions``, the plain kernel's k heads and v exactly, as the layers'
    index_put wrote them, and nothing else changed; the reference op (CPU path) does the same."""
    from muse_spark.models.layers import head_norm_rope_cache_reference

    x, v, positions, slots, (kc, vc) = cache_write_operands()
    H = x.shape[2] - v.shape[2]
    want_kc, want_vc = kc.clone(), vc.clone()
    normed = tops.head_norm_rope(x, positions, 1e-6, 5e5, rope)
    want_kc[slots[:, None], positions] = normed[:, :, H:]
    want_vc[slots[:, None], positions] = v
    q = torch.ops.muse_spark.head_norm_rope_cache_triton(x, v, positions, 1e-6, 5e5, rope, kc, vc, slots)
    assert q.shape == (*x.shape[:2], H, x.shape[3]) and q.is_contiguous()
    assert torch.equal(q, normed[:, :, :H])
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    # the spec on fresh copies of the same operands (on the CPU): the same writes, its norm and RoPE
    # within the kernel's rounding (test_head_norm_rope_kernel_matches_reference bounds that closely)
    x, v, positions, slots, (rkc, rvc) = (t.cpu() if torch.is_tensor(t) else [c.cpu() for c in t]
                                          for t in cache_write_operands())
    rq = head_norm_rope_cache_reference(x, v, positions, 1e-6, 5e5, rope, rkc, rvc, slots)
    assert torch.equal(rvc, want_vc.cpu())
    torch.testing.assert_close(rq.float(), q.float().cpu(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(rkc.float(), want_kc.float().cpu(), rtol=0.05, atol=0.05)


@needs_kernels
def test_head_norm_rope_cache_kernel_never_writes_outside_the_caches(tops):
    """A row or position outside the caches writes nothing (the index_put it replaces would have
    raised); the other requests' rows are written as usual and q is still computed."""
    x, v, positions, slots, (kc, vc) = cache_write_operands()
    before_k, before_v = kc.clone(), vc.clone()
    bad_pos = positions.clone()
    bad_pos[0, 1] = kc.shape[1]  # one past the window
    bad_slots = slots.clone()
    bad_slots[1] = kc.shape[0]  # one past the last row
    q = torch.ops.muse_spark.head_norm_rope_cache_triton(x, v, bad_pos, 1e-6, 5e5, True, kc, vc, bad_slots)
    changed = (kc != before_k).any(-1).any(-1) | (vc != before_v).any(-1).any(-1)  # [N, T]
    expect = torch.zeros_like(changed)
    for b, slot in enumerate(bad_slots.tolist()):
        for p in bad_pos[b].tolist():
            if slot < kc.shape[0] and p < kc.shape[1]:
                expect[slot, p] = True
    assert expect.sum() == bad_pos.shape[1] - 1  # request 0's other positions; request 1 nothing
    assert torch.equal(changed, expect)
    assert torch.equal(q, tops.head_norm_rope(x, bad_pos, 1e-6, 5e5, True)[:, :, : x.shape[2] - v.shape[2]])


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the op's module imports it)")
def test_head_norm_rope_cache_op_rejects_bad_inputs(tops):
    x, v, positions, slots, (kc, vc) = cache_write_operands()
    op = torch.ops.muse_spark.head_norm_rope_cache_triton
    with pytest.raises(ValueError, match="v must be"):
        op(x, v[:, :2], positions, 1e-6, 5e5, True, kc, vc, slots)
    with pytest.raises(ValueError, match="k_cache must be"):
        op(x, v, positions, 1e-6, 5e5, True, kc.float(), vc, slots)
    with pytest.raises(ValueError, match="v_cache must be"):
        op(x, v, positions, 1e-6, 5e5, True, kc, vc[..., :16], slots)
    with pytest.raises(ValueError, match="slots must be int64"):
        op(x, v, positions, 1e-6, 5e5, True, kc, vc, slots.int())
    with pytest.raises(ValueError, match="positions must be int64"):
        op(x, v, positions[:, :1], 1e-6, 5e5, True, kc, vc, slots)


# ---- the attention with the q/k norm, RoPE and cache write folded in (attention_cache_triton) ----

# (B, S, H, KV, dh, cache rows, cache length, window, first position of request 0 and 1): one row
# block and two (H·S/KV > 32), new rows straddling a 128-key split, positions past the window (the
# last split writes them), the production head_dim.
ATTN_CACHE_SHAPES = {
    "straddle": (2, 10, 8, 2, 32, 4, 300, 280, (120, 5)),
    "row_blocks": (2, 12, 16, 2, 32, 3, 200, 200, (60, 0)),
    "past_window": (2, 3, 4, 2, 32, 4, 200, 140, (137, 40)),
    "head128": (1, 8, 32, 8, 128, 2, 1152, 1152, (1024, 0)) if BIG else (1, 8, 8, 2, 128, 2, 300, 300, (200, 0)),
    # more new rows than one pass of the cache write takes (NEW_ROWS = 16): a prompt chunk
    "long_chunk": (2, 21, 4, 2, 32, 3, 160, 160, (90, 0)),
}


def attention_cache_operands(B, S, H, KV, dh, slots_n, T, firsts, seed=11):
    """A layer's raw q|k heads and v (views of one qkv row, as the model slices it), caches of random
    values, consecutive new positions from ``firsts`` per request, rows ``slots``, and the bounds of
    a causal step (a query sees the keys up to its own position)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(B, S, (H + 2 * KV) * dh, generator=g)).to(torch.bfloat16).to(DEV)
    x = qkv[..., : (H + KV) * dh].reshape(B, S, H + KV, dh)
    v = qkv[..., (H + KV) * dh :].reshape(B, S, KV, dh)
    caches = [torch.randn(slots_n, T, KV, dh, generator=g).to(torch.bfloat16).to(DEV) for _ in range(2)]
    positions = torch.stack([torch.arange(f, f + S) for f in firsts[:B]]).to(DEV)
    slots = torch.tensor([1, 0][:B]).to(DEV)
    return x, v, positions, slots, caches, positions.clone()


def norm_then_attend(tops, x, v, positions, slots, kc, vc, last, window, rope=True):
    """The two-kernel path the fused op replaces: head_norm_rope_cache_triton, then the attention."""
    from muse_spark.models.layers import KeyBounds

    q = torch.ops.muse_spark.head_norm_rope_cache_triton(x, v, positions, 1e-6, 5e5, rope, kc, vc, slots)
    return tops.attention(q, kc, vc, KeyBounds(last, window), slots)


@needs_kernels
@pytest.mark.parametrize("shape", list(ATTN_CACHE_SHAPES))
@pytest.mark.parametrize("rope", [True, False])
def test_attention_cache_kernel_equals_the_norm_kernel_then_attention(tops, shape, rope):
    """One launch (the partial kernel norms q and the new keys, writes K/V, then attends) against
    head_norm_rope_cache_triton followed by attention_bounds_triton on copies of the same caches.
    The caches: v exactly; k exactly under the interpreter, and on the GPU within one unit of bf16
    (the sum of squares may be reduced in another order inside the attention kernel's layout),
    nothing else written. The output: exactly under the interpreter, within bf16 attention
    tolerance on the GPU. The fp32 spec (the two references) within bf16 tolerance."""
    from muse_spark.models.layers import KeyBounds, attend_reference, head_norm_rope_cache_reference

    from tolerances import TOL as ATTN_TOL

    B, S, H, KV, dh, n, T, window, firsts = ATTN_CACHE_SHAPES[shape]
    x, v, positions, slots, (kc, vc), last = attention_cache_operands(B, S, H, KV, dh, n, T, firsts)
    kc2, vc2 = kc.clone(), vc.clone()
    want = norm_then_attend(tops, x, v, positions, slots, kc2, vc2, last, window, rope)
    got = tops.attention_cache(x, v, positions, 1e-6, 5e5, rope, kc, vc, slots, KeyBounds(last, window))
    assert got.shape == (B, S, H, dh) and torch.isfinite(got).all()
    assert torch.equal(vc, vc2)
    if INTERPRETED:
        assert torch.equal(kc, kc2) and torch.equal(got, want)
    else:
        torch.testing.assert_close(kc, kc2, **TOL["normed_bf16"])
        torch.testing.assert_close(got, want, **ATTN_TOL[torch.bfloat16])
    # the spec, on the CPU in fp32 from fresh caches
    rkc, rvc = (c.cpu() for c in attention_cache_operands(B, S, H, KV, dh, n, T, firsts)[4])
    rq = head_norm_rope_cache_reference(x.cpu(), v.cpu(), positions.cpu(), 1e-6, 5e5, rope, rkc, rvc, slots.cpu())
    mask = KeyBounds(last.cpu(), window).dense()
    rows = slots.cpu()
    ref = attend_reference(rq.float(), rkc[rows, :window].float(), rvc[rows, :window].float(), mask)
    torch.testing.assert_close(got.float().cpu(), ref, **ATTN_TOL[torch.bfloat16])
    assert torch.equal(rvc, vc.cpu())


@needs_kernels
def test_attention_cache_kernel_never_writes_outside_the_caches(tops):
    """A request whose row is outside the caches writes nothing and reads nothing (its output is
    zeros); a position past the caches' length is not written; the other request is unaffected."""
    from muse_spark.models.layers import KeyBounds

    B, S, H, KV, dh, n, T, window, firsts = ATTN_CACHE_SHAPES["past_window"]
    x, v, positions, slots, (kc, vc), last = attention_cache_operands(B, S, H, KV, dh, n, T, (T - 2, 40))
    before_k, before_v = kc.clone(), vc.clone()
    alone = tops.attention_cache(x[:1], v[:1], positions[:1], 1e-6, 5e5, True, kc.clone(), vc.clone(), slots[:1],
                                 KeyBounds(last[:1], window))  # request 0 without the other
    bad_slots = slots.clone()
    bad_slots[1] = n  # one past the last row
    out = tops.attention_cache(x, v, positions, 1e-6, 5e5, True, kc, vc, bad_slots, KeyBounds(last, window))
    changed = (kc != before_k).any(-1).any(-1) | (vc != before_v).any(-1).any(-1)  # [N, T]
    expect = torch.zeros_like(changed)
    expect[slots[0], T - 2 :] = True  # request 0: positions T-2 and T-1 written (past the window), T not
    assert torch.equal(changed, expect)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[:1], alone)


@needs_kernels
@pytest.mark.parametrize("shape", ["straddle", "past_window", "head128"])
def test_the_rope_table_gives_the_attention_cache_kernel_its_own_bits(tops, shape):
    """The fused attention (``attention_cache_triton``) reading the step's RoPE table, as the layers
    give it the qkv projection's table: its output and both caches bit for bit as when it computes
    the angles itself."""
    from muse_spark.models.layers import KeyBounds
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_rope_table

    B, S, H, KV, dh, n, T, window, firsts = ATTN_CACHE_SHAPES[shape]
    x, v, positions, slots, (kc, vc), last = attention_cache_operands(B, S, H, KV, dh, n, T, firsts)
    kc2, vc2 = kc.clone(), vc.clone()
    table = launch_rope_table(positions, 5e5, dh)
    got = tops.attention_cache(x, v, positions, 1e-6, 5e5, True, kc, vc, slots, KeyBounds(last, window))
    got_t = tops.attention_cache(x, v, positions, 1e-6, 5e5, True, kc2, vc2, slots, KeyBounds(last, window), *table)
    assert torch.equal(got, got_t) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the op's module imports it)")
def test_attention_cache_op_rejects_bad_inputs(tops):
    B, S, H, KV, dh, n, T, window, firsts = ATTN_CACHE_SHAPES["straddle"]
    x, v, positions, slots, (kc, vc), last = attention_cache_operands(B, S, H, KV, dh, n, T, firsts)
    op = torch.ops.muse_spark.attention_cache_triton
    args = [x, v, positions, 1e-6, 5e5, True, kc, vc, slots, last, window]

    def call(**changes):
        names = ["x", "v", "positions", "eps", "theta", "rope", "kc", "vc", "slots", "last", "window"]
        return op(*[changes.get(nm, a) for nm, a in zip(names, args)])

    with pytest.raises(ValueError, match="v must be"):
        call(v=v[:, :2])
    with pytest.raises(ValueError, match="k_cache must be"):
        call(kc=kc.float())
    with pytest.raises(ValueError, match="slots must be int64"):
        call(slots=slots.int())
    with pytest.raises(ValueError, match="positions must be int64"):
        call(positions=positions[:, :1])
    with pytest.raises(ValueError, match="last must be int64"):
        call(last=last.int())
    with pytest.raises(ValueError, match="key window 301 must be in"):
        call(window=T + 1)
    with pytest.raises(ValueError, match="the kernel takes"):
        call(x=x.float())
    half = torch.zeros(B * S, dh // 2, device=x.device)  # the RoPE table: both halves, [B·S, Dh/2] fp32
    with pytest.raises(ValueError, match=r"attention_cache: rope_sin must be a contiguous float32 \[20, 16\]"):
        op(*args, half, None)
    with pytest.raises(ValueError, match=r"attention_cache: rope_cos must be a contiguous float32"):
        op(*args, half[:-1], half)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the op's module imports it)")
def test_head_norm_rope_op_rejects_bad_inputs(tops):
    x, positions = rope_operands((1, 2, 4, 16), torch.bfloat16, strided=False)
    op = torch.ops.muse_spark.head_norm_rope_triton
    with pytest.raises(ValueError, match="bf16 or fp16 with Dh a power of two"):
        op(x.float(), positions, 1e-6, 5e5, True)
    with pytest.raises(ValueError, match="Dh a power of two"):
        op(x[..., :12], positions, 1e-6, 5e5, True)
    with pytest.raises(ValueError, match="positions must be int64"):
        op(x, positions.int(), 1e-6, 5e5, True)
    with pytest.raises(ValueError, match="positions must be int64"):
        op(x, positions[:, :1], 1e-6, 5e5, True)


@needs_kernels
def test_models_call_the_head_norm_rope_kernel_on_cuda(tops, monkeypatch):
    """``models.layers.head_norm_rope`` runs the kernel for bf16/fp16 on CUDA, the reference
    elsewhere (fp32, CPU)."""
    from muse_spark.models import layers

    calls = []
    real = torch.ops.muse_spark.head_norm_rope_triton
    monkeypatch.setattr(layers.torch.ops.muse_spark, "head_norm_rope_triton",
                        lambda *a: calls.append(a[0].device.type) or real(*a), raising=False)
    x, positions = rope_operands((1, 3, 5, 32), torch.bfloat16, strided=True)
    out = layers.head_norm_rope(x, positions, 1e-6, 5e5, True)
    layers.head_norm_rope(x.float(), positions, 1e-6, 5e5, True)
    assert calls == (["cuda"] if ON_GPU else [])  # bf16 on CUDA only
    assert torch.equal(out, tops.head_norm_rope(x, positions, 1e-6, 5e5, True) if ON_GPU
                       else layers.head_norm_rope_reference(x, positions, 1e-6, 5e5, True))


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
def test_head_norm_rope_kernel_compiles_for_hopper_with_the_exact_math():
    """Compiled for sm_90 without a GPU: cos/sin are the CUDA math library's (range reduction in
    software), not the approximate instructions. (The library itself uses FMAs, so the rotation's
    separate roundings are checked by the GPU test's exact match with torch instead.)"""
    from muse_spark.plugins.head_norm_rope import triton_kernel as hk

    names = ["x_ptr", "pos_ptr", "out_ptr", "S", "NH", "sx_b", "sx_s", "sx_h", "sp_b", "sp_s"]
    sig = dict(zip(names, ["*bf16", "*i64", "*bf16"] + ["i32"] * 7))
    k = compile_for_hopper(hk._head_norm_rope_kernel, sig,
                           dict(EPS=1e-6, THETA=5e5, DH=128, BLOCK_H=hk.BLOCK_H, ROPE=True), 4)
    ptx = k.asm["ptx"]
    assert k.asm["cubin"] and "cos.approx" not in ptx and "sin.approx" not in ptx
    # the cache-writing variant: the same math, compiled
    import inspect

    names = [n for n, prm in inspect.signature(hk._head_norm_rope_cache_kernel.fn).parameters.items()
             if "constexpr" not in str(prm.annotation)]
    sig = dict(zip(names, ["*bf16", "*bf16", "*i64", "*i64", "*bf16", "*bf16", "*bf16"] + ["i32"] * 20
                   + ["*fp32", "*fp32"]))  # (cos_ptr, sin_ptr: the table, read with TABLE)
    assert len(sig) == len(names) == 29
    consts = dict(EPS=1e-6, THETA=5e5, DH=128, BLOCK_H=hk.BLOCK_H, ROPE=True, BLOCK_KV=8)
    k = compile_for_hopper(hk._head_norm_rope_cache_kernel, sig, consts, 4)
    assert k.asm["cubin"] and "cos.approx" not in k.asm["ptx"]
    # reading the step's table (launch_rope_table) instead: no angle computed, none of the library's
    # trigonometry (its large-argument reduction keeps an array in local memory)
    t = compile_for_hopper(hk._head_norm_rope_cache_kernel, sig, dict(consts, TABLE=True), 4).asm["ptx"]
    assert "ld.local" in k.asm["ptx"] and "ld.local" not in t and len(t.splitlines()) < len(ptx.splitlines()) / 2


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("norm_branch", [False, True], ids=["one_norm", "branch_norm_too"])
def test_gated_residual_kernel_issues_every_load_before_its_first_reduction(norm_branch):
    """Compiled for sm_90 (the 8B row, 8 warps): every global load, the norms' weights included, comes
    before the first rsqrt, so no trip to memory waits on a reduction (the GEMMs between two calls
    evict the norm weights from L2: each late load was a trip to HBM on the row's critical path)."""
    import re

    from muse_spark.plugins.gated_residual.triton_kernel import _gated_residual_norm_kernel

    sig = {"stream_ptr": "*fp32", "branch_ptr": "*bf16", "gate_ptr": "*fp32", "weight_ptr": "*bf16",
           "bweight_ptr": "*bf16", "new_ptr": "*fp32", "out_ptr": "*bf16", "D": "i32"}
    consts = dict(EPS=1e-6, HAS_WEIGHT=True, ZERO_CENTERED=False, APPLY_NORM=True, BLOCK_D=4096,
                  NORM_BRANCH=norm_branch, HAS_BRANCH_WEIGHT=norm_branch)
    ptx = compile_for_hopper(_gated_residual_norm_kernel, sig, consts, 8, multiples_of_16=("D",)).asm["ptx"]
    lines = ptx.splitlines()
    loads = [i for i, line in enumerate(lines) if re.search(r"\bld\.global", line)]
    rsqrts = [i for i, line in enumerate(lines) if "rsqrt" in line and not line.lstrip().startswith("//")]
    assert len(rsqrts) == (2 if norm_branch else 1)
    # stream, branch, gate, the norm weight(s): 4-byte rows of 4096 in v4 loads of 8 warps
    assert len(loads) == (14 if norm_branch else 12) and max(loads) < min(rsqrts)


# ---- the skinny linear layer ---------------------------------------------------------------------

LINEAR_SHAPES = {  # (M rows of x, N outputs, K)
    "step_rows": (8, 96, 256),
    "draft_rows_ragged_n": (7, 80, 192),  # N not a multiple of the tile
    "ragged_k": (5, 64, 200),  # K not a multiple of the chunk
    "one_row": (1, 64, 128),
    "max_rows": (16, 48, 64),
}
if BIG:
    LINEAR_SHAPES.update({"muse_o": (8, 4096, 4096), "muse_down": (8, 4096, 14336), "muse_b2_qkv": (16, 6144, 4096)})


def linear_operands(M, N, K, dtype, exact, seed=0):
    """x [M, K], w [N, K]. ``exact``: small multiples of 2^-2 and 2^-3, whose products and sums are
    exact in fp32 in any order, so every kernel must give the correctly rounded result."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        x = torch.randint(-3, 4, (M, K), generator=g) * 0.25
        w = torch.randint(-2, 3, (N, K), generator=g) * 0.125
    else:
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5
    return x.to(dtype).to(DEV), w.to(dtype).to(DEV)


def exact_linear(x, w, silu_mul):
    """The correctly rounded result: fp32 sums (exact for ``linear_operands(exact=True)``) rounded
    once, then silu·mul in the compute dtype as the modules compute it."""
    from muse_spark.models.layers import silu_mul_halves

    y = torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)
    return silu_mul_halves(y) if silu_mul else y


@needs_kernels
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
def test_linear_kernel_gives_the_correctly_rounded_result(tops, shape, dtype, silu_mul):
    M, N, K = LINEAR_SHAPES[shape]
    x, w = linear_operands(M, N, K, dtype, exact=True)
    y = torch.ops.muse_spark.linear_triton(x, w, silu_mul)
    ref = exact_linear(x, w, silu_mul)
    assert y.shape == ref.shape and y.dtype == dtype
    if silu_mul and INTERPRETED:  # numpy's exp against torch's CPU exp: an fp32 ulp may round across
        torch.testing.assert_close(y, ref, rtol=2**-7, atol=0)
    else:  # on the GPU both compute silu with the CUDA math library's expf: the same bits
        assert torch.equal(y, ref)


@needs_kernels
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("shape", ["step_rows", "ragged_k"] + (["muse_down"] if BIG else []))
def test_linear_kernel_random_weights_match_the_reference(tops, shape, silu_mul):
    """Random bf16 operands: the kernel's fp32 sums differ from cuBLAS's (or the CPU's) in order
    only, so the outputs agree to a few bf16 ulps of the output's scale."""
    from muse_spark.models.layers import linear_reference

    M, N, K = LINEAR_SHAPES[shape]
    x, w = linear_operands(M, N, K, torch.bfloat16, exact=False, seed=1)
    y = torch.ops.muse_spark.linear_triton(x, w, silu_mul).float()
    ref = linear_reference(x, w, silu_mul).float()
    torch.testing.assert_close(y, ref, rtol=2**-6, atol=2**-7 * ref.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
def test_linear_bits_do_not_depend_on_the_number_of_rows(tops, silu_mul):
    """A row's output is one fixed-order fp32 dot per element, whatever the other rows: a step's
    rows give the same bits in an engine's batch bucket, in the eager engine, or alone."""
    x, w = linear_operands(16, 96, 320, torch.bfloat16, exact=False, seed=2)
    full = torch.ops.muse_spark.linear_triton(x, w, silu_mul)
    for lo, hi in ((0, 1), (3, 11), (7, 16)):
        assert torch.equal(torch.ops.muse_spark.linear_triton(x[lo:hi], w, silu_mul), full[lo:hi])


@needs_kernels
def test_linear_op_rejects_bad_inputs(tops):
    x, w = linear_operands(8, 64, 128, torch.bfloat16, exact=True)
    with pytest.raises(ValueError, match="at most 16 rows"):
        torch.ops.muse_spark.linear_triton(torch.cat([x] * 9), w, False)
    with pytest.raises(ValueError, match="contiguous weight"):
        torch.ops.muse_spark.linear_triton(x, w.t().contiguous().t(), False)
    with pytest.raises(ValueError, match="both bf16 or fp16"):
        torch.ops.muse_spark.linear_triton(x, w.half(), False)
    with pytest.raises(ValueError, match="even number of weight rows"):
        torch.ops.muse_spark.linear_triton(x, w[:63], True)


@needs_kernels
def test_models_call_the_linear_kernel_where_it_fits(tops):
    """``models.layers.linear`` takes the Triton kernel for few rows on CUDA (in bf16/fp16; the kernel
    option ``linear``: ``triton``, the default), cuBLAS for more rows or with ``linear="cublas"``,
    ``F.linear`` elsewhere; every path gives the correctly rounded result on exact operands."""
    from muse_spark.models import layers
    from muse_spark.options import KernelOptions, use_options

    assert layers.linear_path("cuda", torch.bfloat16) == "triton"  # the default
    assert layers.linear_path("cpu", torch.bfloat16) == "reference"
    x, w = linear_operands(8, 64, 128, torch.bfloat16, exact=True)
    expect = "triton" if ON_GPU else "reference"
    assert layers.linear_path(x.device, x.dtype) == expect
    assert layers._triton_linear_fits(x, w) == ON_GPU
    assert not layers._triton_linear_fits(torch.cat([x] * 3), w)
    for silu_mul in (False, True):
        fn = layers.linear_silu_mul if silu_mul else layers.linear
        assert torch.equal(fn(x, w), exact_linear(x, w, silu_mul)) or INTERPRETED
    with use_options(KernelOptions(linear="cublas")):
        assert layers.linear_path("cuda", torch.bfloat16) == "cublas"
        assert not layers._triton_linear_fits(x, w)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("shape", [(8, 6144, 4096, False), (8, 14336, 4096, True), (8, 4096, 14336, False),
                                   (16, 4096, 4096, False), (16, 14336, 4096, True), (16, 4096, 14336, False)],
                         ids=str)
def test_linear_kernel_compiles_for_hopper(shape):
    """The linear kernel under its default launch configurations at the production shapes,
    compiled ahead of time for sm_90 without a GPU: it fits an SM's shared memory."""
    from muse_spark.plugins.linear import triton_kernel as lk

    M, N, K, silu_mul = shape
    cfg = lk.default_config(M, N, K, silu_mul)
    names = ["x_ptr", "w_ptr", "y_ptr", "M", "N", "K", "stride_xm", "stride_ym"]
    sig = dict(zip(names, ["*bf16", "*bf16", "*bf16"] + ["i32"] * 5))
    consts = dict(BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                  EVEN_N=N % cfg["BLOCK_N"] == 0, EVEN_K=K % cfg["BLOCK_K"] == 0, SILU_MUL=silu_mul, IEEE_DOT=False)
    k = compile_for_hopper(lk._linear_kernel, sig, consts, cfg["num_warps"], cfg["num_stages"],
                           multiples_of_16=("N", "K", "stride_xm", "stride_ym"))
    assert k.asm["cubin"] and k.metadata.shared <= 227 * 1024


# ---- programmatic dependent launch (docs/pdl.md) ---------------------------------------------------


def _global_accesses_before_the_wait(ptx: str) -> tuple[bool, list[str]]:
    import re

    lines = ptx.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    access = [line.strip() for i, line in enumerate(lines)
              if re.search(r"\b(ld|st|atom|red)\.global|cp\.async\.(cg|ca)", line) and (wait is None or i < wait)]
    return wait is not None, access


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("mode", [1, 2, 3], ids=["trigger_then_wait", "wait_only", "wait_then_late_trigger"])
def test_pdl_kernels_wait_before_any_global_access(mode):
    """Compiled for sm_90 without a GPU, with ``PDL`` each plugin kernel executes
    ``griddepcontrol.wait`` before its first global load or store (the data dependency on
    ``pdl_enter``'s zero holds through the compiler's scheduling and software pipelining). Without
    ``PDL`` there is no wait at all. Mode 3 (the kernel option ``pdl_gemm_trigger``, the GEMMs only): the linear
    kernel triggers its dependents after its last weight load and before its first store; the other
    kernels (never compiled so) only wait."""
    from muse_spark.plugins.attention import triton_kernel as ak
    from muse_spark.plugins.gated_residual import triton_kernel as gk
    from muse_spark.plugins.head_norm_rope import triton_kernel as hk
    from muse_spark.plugins.linear import triton_kernel as lk

    names = ["q_ptr", "k_ptr", "v_ptr", "mask_ptr", "slot_ptr", "po_ptr", "pm_ptr", "pl_ptr", "S", "T", "M", "KV",
             "NSPLIT", "N_ROWS", "sq_b", "sq_s", "sq_h", "sk_b", "sk_t", "sk_h", "sv_b", "sv_t", "sv_h", "sm_b", "sm_s"]
    types = ["*bf16", "*bf16", "*bf16", "*i64", "*i64", "*fp32", "*fp32", "*fp32"] + ["i32"] * 17
    cfg = ak.DEFAULT_CONFIG
    attn = dict(SCALE=128 ** -0.5, REP=4, DH=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"],
                SPLIT_T=cfg["SPLIT_T"], IEEE_DOT=False, HAS_SLOTS=True, EARLY_KV=True, BOUNDS=True)
    lin_names = ["x_ptr", "w_ptr", "y_ptr", "M", "N", "K", "stride_xm", "stride_ym"]
    lin = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, EVEN_N=True, EVEN_K=True, SILU_MUL=False, IEEE_DOT=False)
    cases = {
        "partial": (ak._partial_kernel, dict(zip(names, types)), attn, 4, None, ()),
        "combine": (ak._combine_kernel, dict(zip(["po_ptr", "pm_ptr", "pl_ptr", "out_ptr", "S", "M", "KV", "NSPLIT",
                                                   "H"], ["*fp32", "*fp32", "*fp32", "*bf16"] + ["i32"] * 5)),
                    dict(REP=4, DH=128, CHUNK=cfg["MERGE_CHUNK"]), 1, None, ()),
        "gated_residual": (gk._gated_residual_norm_kernel, dict(zip(
            ["stream_ptr", "branch_ptr", "gate_ptr", "weight_ptr", "bweight_ptr", "new_ptr", "out_ptr", "D"],
            ["*fp32", "*bf16", "*fp32", "*bf16", "*bf16", "*fp32", "*bf16", "i32"])),
            dict(EPS=1e-6, HAS_WEIGHT=True, ZERO_CENTERED=False, APPLY_NORM=True, BLOCK_D=4096, NORM_BRANCH=True,
                 HAS_BRANCH_WEIGHT=True), 8, None, ()),
        "head_norm_rope": (hk._head_norm_rope_kernel, dict(zip(
            ["x_ptr", "pos_ptr", "out_ptr", "S", "NH", "sx_b", "sx_s", "sx_h", "sp_b", "sp_s"],
            ["*bf16", "*i64", "*bf16"] + ["i32"] * 7)), dict(EPS=1e-6, THETA=5e5, DH=128, BLOCK_H=16, ROPE=True), 4,
            None, ()),
        "head_norm_rope_cache": (hk._head_norm_rope_cache_kernel, dict(zip(
            ["x_ptr", "v_ptr", "pos_ptr", "slot_ptr", "out_ptr", "kc_ptr", "vc_ptr", "S", "NH", "H", "KVH", "N_SLOTS",
             "T", "sx_b", "sx_s", "sx_h", "sp_b", "sp_s", "sv_b", "sv_s", "sv_h", "skc_n", "skc_t", "skc_h", "svc_n",
             "svc_t", "svc_h"], ["*bf16", "*bf16", "*i64", "*i64", "*bf16", "*bf16", "*bf16"] + ["i32"] * 20)),
            dict(EPS=1e-6, THETA=5e5, DH=128, BLOCK_H=16, ROPE=True, BLOCK_KV=8), 4, None, ()),
        "linear": (lk._linear_kernel, dict(zip(lin_names, ["*bf16"] * 3 + ["i32"] * 5)), lin, 4, 4,
                   ("N", "K", "stride_xm", "stride_ym")),
        # the RoPE table (the default since the thirteenth session): the qkv GEMM's extra program
        # that writes it, and the norm kernel reading it
        "linear_rope_table": (lk._linear_kernel, dict(zip(
            lin_names + ["pos_ptr", "cos_ptr", "sin_ptr", "N_POS"],
            ["*bf16"] * 3 + ["i32"] * 5 + ["*i64", "*fp32", "*fp32", "i32"])),
                              dict(lin, ROPE_TABLE=True, THETA=5e5, DH_ROPE=128, BLOCK_POS=16), 4, 4,
                              ("N", "K", "stride_xm", "stride_ym")),
        "attention_cache_table": (ak._partial_kernel, dict(zip(
            names + ["vn_ptr", "pos_ptr", "svn_b", "svn_s", "svn_h", "sp_b", "sp_s", "T_CACHE", "cos_ptr", "sin_ptr"],
            types + ["*bf16", "*i64"] + ["i32"] * 6 + ["*fp32", "*fp32"])),
            dict(attn, NORM_QK=True, EPS=1e-6, THETA=5e5, ROPE=True, TABLE=True), 4, None, ()),
        "head_norm_rope_cache_table": (hk._head_norm_rope_cache_kernel, dict(zip(
            ["x_ptr", "v_ptr", "pos_ptr", "slot_ptr", "out_ptr", "kc_ptr", "vc_ptr", "S", "NH", "H", "KVH", "N_SLOTS",
             "T", "sx_b", "sx_s", "sx_h", "sp_b", "sp_s", "sv_b", "sv_s", "sv_h", "skc_n", "skc_t", "skc_h", "svc_n",
             "svc_t", "svc_h", "cos_ptr", "sin_ptr"],
            ["*bf16", "*bf16", "*i64", "*i64", "*bf16", "*bf16", "*bf16"] + ["i32"] * 20 + ["*fp32", "*fp32"])),
            dict(EPS=1e-6, THETA=5e5, DH=128, BLOCK_H=16, ROPE=True, BLOCK_KV=8, TABLE=True), 4, None, ()),
    }
    from muse_spark.models.layers import PDL_KERNELS

    # Every kernel an engine built with the kernel option pdl launches as a programmatic dependent is checked here.
    assert set(PDL_KERNELS) <= {case[0].fn.__name__ for case in cases.values()}
    for name, (fn, sig, consts, warps, stages, m16) in cases.items():
        ptx = compile_for_hopper(fn, sig, dict(consts, PDL=mode), warps, stages, multiples_of_16=m16).asm["ptx"]
        waits, before = _global_accesses_before_the_wait(ptx)
        assert waits and before == [], (name, before)
        late = mode == 3 and fn is lk._linear_kernel
        assert ("griddepcontrol.launch_dependents" in ptx) == (mode == 1 or late), name
        if late and name == "linear":  # after the weight stream, before the stores
            lines = ptx.splitlines()
            trigger = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
            loads = [i for i, line in enumerate(lines) if "cp.async.cg.shared.global" in line or "ld.global" in line]
            stores = [i for i, line in enumerate(lines) if "st.global" in line]
            assert loads and stores and max(loads) < trigger < min(stores), (max(loads), trigger, min(stores))
        if name in ("partial", "linear"):  # and without PDL: no wait
            plain = compile_for_hopper(fn, sig, dict(consts, PDL=0), warps, stages, multiples_of_16=m16).asm["ptx"]
            assert "griddepcontrol" not in plain
            if name == "linear":  # the same vectorized, pipelined weight loads
                assert plain.count("cp.async.cg.shared.global") == ptx.count("cp.async.cg.shared.global")


@needs_gpu
def test_a_gemm_triggering_after_its_weight_stream_changes_no_result():
    """``PDL`` 3 (the kernel option ``pdl_gemm_trigger``) in a captured graph with programmatic edges: a
    producer, a GEMM that triggers its dependents after its weight stream, then a GEMM reading its
    output (launched early, waiting). Every replay with new producer input gives the plain
    launches' result bit for bit: the dependent reads nothing of the first GEMM's output before it
    is complete, though it launched before that GEMM's stores."""
    from muse_spark.plugins.linear.triton_kernel import launch_linear
    from muse_spark.runtime.cuda_graph import make_programmatic

    g = torch.Generator().manual_seed(5)
    src = torch.randn(8, 4096, generator=g).to(torch.bfloat16).to(DEV)
    x = torch.empty_like(src)
    w1 = (torch.randn(2 * 2048, 4096, generator=g) / 64).to(torch.bfloat16).to(DEV)
    w2 = (torch.randn(4096, 2048, generator=g) / 45).to(torch.bfloat16).to(DEV)

    def step(pdl):
        torch.mul(src, 2.0, out=x)
        return launch_linear(launch_linear(x, w1, True, pdl=pdl), w2, pdl=2)

    step(3)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = step(3)
    assert make_programmatic(graph.raw_cuda_graph(), {"_linear_kernel"})[0] == 2
    graph.instantiate()
    for i in range(10):
        src.copy_(torch.randn(src.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(i)))
        graph.replay()
        want = launch_linear(launch_linear(src * 2.0, w1, True), w2)
        torch.cuda.synchronize()
        assert torch.equal(out, want), i


@needs_gpu
@pytest.mark.parametrize("port", ["programmatic", "launch_order"])
def test_programmatic_edges_into_a_waiting_kernel_change_no_result(port):
    """``runtime.cuda_graph.make_programmatic`` on a captured graph: a 64 MB elementwise producer,
    then the q/k norm kernel compiled with the PDL wait reading the producer's last rows. Only the
    edge into the named kernel becomes programmatic (one of the graph's edges), and every replay
    with new producer input gives the unfused result bit for bit: the consumer launched early
    reads nothing before its wait. A graph whose kernels are not named keeps its edges."""
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_head_norm_rope
    from muse_spark.runtime.cuda_graph import make_programmatic

    B, S, NH, DH = 2, 8, 12, 128
    n = B * S * NH * DH
    src = torch.randn(1 << 25, device=DEV, dtype=torch.bfloat16)
    buf = torch.empty_like(src)
    pos = torch.arange(B * S, device=DEV).view(B, S) + 100

    def step(pdl):
        torch.mul(src, 2.0, out=buf)  # the producer: every element, its last rows read next
        return launch_head_norm_rope(buf[-n:].view(B, S, NH, DH), pos, 1e-6, 5e5, True, pdl=pdl)

    def capture(names):
        step(2)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g):
            out = step(2)
        counts = make_programmatic(g.raw_cuda_graph(), names, port)
        g.instantiate()
        return g, out, counts

    g, out, counts = capture({"_head_norm_rope_kernel"})
    assert counts == (1, 2)
    for i in range(10):
        src.copy_(torch.randn(src.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(i)))
        g.replay()
        want = launch_head_norm_rope((src[-n:] * 2.0).view(B, S, NH, DH), pos, 1e-6, 5e5, True)
        torch.cuda.synchronize()
        assert torch.equal(out, want), i
    assert capture({"_some_other_kernel"})[2] == (0, 2)
    with pytest.raises(ValueError, match="PDL port"):
        make_programmatic(g.raw_cuda_graph(), {"_head_norm_rope_kernel"}, "early")


@needs_kernels
@pytest.mark.parametrize("rope", [True, False])
def test_the_rope_table_gives_the_norm_kernel_its_own_bits(rope):
    """``launch_rope_table``: the step's RoPE cos/sin computed once (the angles' chain of libdevice
    calls costs 2.7 of the norm kernel's 4.2 µs a layer on the H200, docs/log.md,
    2026-12-03). The norm + cache kernel reading it gives the bits it computes in place: q and the
    caches equal (without RoPE the table is not read)."""
    from muse_spark.plugins.head_norm_rope import triton_kernel as hk

    x, v, positions, slots, (kc, vc) = cache_write_operands()
    kc2, vc2 = kc.clone(), vc.clone()
    table = hk.launch_rope_table(positions, 5e5, x.shape[3])
    assert table[0].shape == (positions.numel(), x.shape[3] // 2) and table[0].dtype == torch.float32
    q = hk.launch_head_norm_rope_cache(x, v, positions, 1e-6, 5e5, rope, kc, vc, slots)
    qt = hk.launch_head_norm_rope_cache(x, v, positions, 1e-6, 5e5, rope, kc2, vc2, slots, table=table)
    assert torch.equal(q, qt) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_the_qkv_projection_writes_the_rope_table_the_norm_kernel_reads(tops, rows):
    """``linear_rope_table_triton`` (the layers' default, the kernel option ``rope_table``): y is
    ``linear_triton``'s bit for bit (the extra program writes only the table); the table is ``launch_rope_table``'s (the same
    angles' code) and close to the torch spec (``rope_table_reference``); the norm + cache op fed
    the table gives its own bits."""
    from muse_spark.models.layers import rope_table_reference
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_rope_table

    g = torch.Generator().manual_seed(rows)
    dh, K, N = 32, 256, 3 * 64 + 32  # a ragged last weight tile
    x = torch.randn(1, rows, K, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(torch.bfloat16).to(DEV)
    positions = (1000 + torch.arange(rows)).view(1, rows).to(DEV)
    y, cos, sin = torch.ops.muse_spark.linear_rope_table_triton(x, w, positions, 5e5, dh)
    assert torch.equal(y, torch.ops.muse_spark.linear_triton(x, w, False))
    want = launch_rope_table(positions, 5e5, dh)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1]) and cos.shape == (rows, dh // 2)
    spec = rope_table_reference(positions.cpu(), 5e5, dh)
    torch.testing.assert_close(cos.cpu(), spec[0], rtol=0, atol=1e-3)  # angles ~1e3 rad: an fp32 ulp moves them
    torch.testing.assert_close(sin.cpu(), spec[1], rtol=0, atol=1e-3)
    # the norm + cache op reading the table: its own bits
    x4, v, pos, slots, (kc, vc) = cache_write_operands(B=2, S=3)
    table = launch_rope_table(pos, 5e5, x4.shape[3])
    kc2, vc2 = kc.clone(), vc.clone()
    q = torch.ops.muse_spark.head_norm_rope_cache_triton(x4, v, pos, 1e-6, 5e5, True, kc, vc, slots)
    qt = torch.ops.muse_spark.head_norm_rope_cache_triton(x4, v, pos, 1e-6, 5e5, True, kc2, vc2, slots, *table)
    assert torch.equal(q, qt) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@needs_kernels
def test_the_rope_table_ops_refuse_what_they_cannot_take(tops):
    x4, v, pos, slots, (kc, vc) = cache_write_operands(B=2, S=3)
    cos, sin = torch.zeros(6, x4.shape[3] // 2, device=DEV), torch.zeros(6, x4.shape[3] // 2, device=DEV)
    op = torch.ops.muse_spark.head_norm_rope_cache_triton
    with pytest.raises(ValueError, match=r"rope_sin must be a contiguous float32 \[6, 16\].*got none"):
        op(x4, v, pos, 1e-6, 5e5, True, kc, vc, slots, cos, None)
    with pytest.raises(ValueError, match=r"rope_cos must be a contiguous float32 \[6, 16\]"):
        op(x4, v, pos, 1e-6, 5e5, True, kc, vc, slots, cos[:5], sin)
    x = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(64, 64, dtype=torch.bfloat16, device=DEV)
    lrt = torch.ops.muse_spark.linear_rope_table_triton
    with pytest.raises(ValueError, match="one per row of x"):
        lrt(x, w, torch.zeros(1, 3, dtype=torch.int64, device=DEV), 5e5, 16)
    with pytest.raises(ValueError, match="head_dim 12 must be a power of two"):
        lrt(x, w, torch.zeros(1, 4, dtype=torch.int64, device=DEV), 5e5, 12)


# ----------------------------------------------------------------------------- acceptance
def accept_operands(B, gamma, V, Vd, temps, seed=0, logits_dtype=torch.bfloat16, special=False):
    """A verification's inputs: target logits [B, γ+1, V] (raw, before the multiplier), drafts sampled
    from draft distributions close to the target's (so some are accepted, some not), an injective
    d2t (a sorted random subset of the target vocabulary), per-request temperatures, seeds, anchors.
    ``special``: rows with NaN, +inf and all −inf entries (the sanitize cases)."""
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, gamma + 1, V, generator=g)
    targets = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
    d2t = targets - torch.arange(Vd)
    # draft distributions: the target's softmax over the draft's vocabulary, perturbed
    dl = logits[:, :gamma, targets] + 0.7 * torch.randn(B, gamma, Vd, generator=g)
    probs = torch.softmax(dl, -1)
    ids = targets[torch.multinomial(probs.reshape(-1, Vd), 1, generator=g).reshape(B, gamma)]
    if special and B >= 3:
        logits[0, 1, :: 7] = float("nan")
        logits[1, 0, 5] = float("inf")
        logits[1, 0, 9] = float("inf")
        logits[2, 0] = float("-inf")
        logits[2, 0, 3] = float("nan")
        ids[1, 0] = 9  # a drafted +inf entry
    temperature = torch.tensor(temps[:B], dtype=torch.float32)
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    anchor = torch.randint(0, 5000, (B,), generator=g)
    dev = torch.device(DEV)
    return [t.to(dev) for t in (logits.to(logits_dtype), ids, probs.float(), d2t, temperature, seeds, anchor)]


ACCEPT_CASES = {  # B, γ, V, Vd, temperatures, chunk
    "one_chunk": (3, 3, 700, 300, [0.0, 1.0, 0.6], 2048),
    "chunks": (4, 7, 1000, 256, [1.0, 0.0, 1.3, 0.8], 256),
    "ragged_chunks": (3, 2, 333, 100, [0.9, 1.0, 0.0], 64),
}


@needs_kernels
@pytest.mark.parametrize("case", list(ACCEPT_CASES))
@pytest.mark.parametrize("special", [False, True], ids=["plain", "nan_inf_rows"])
def test_accept_kernels_give_the_reference_n_and_bonus(case, special):
    """The three acceptance kernels (``launch_accept``) against ``plugins.acceptance.reference.accept`` on the
    transformed logits: the same n and bonus token for greedy and sampled requests in one batch,
    over several seeds, one or many vocabulary chunks, with the sanitize cases (NaN entries, +inf
    entries, a row all −inf)."""
    from muse_spark.models.layers import output_transform
    from muse_spark.plugins.acceptance.triton_kernel import launch_accept
    from muse_spark.plugins.acceptance.reference import accept

    B, gamma, V, Vd, temps, chunk = ACCEPT_CASES[case]
    mult = 0.75
    for seed in range(4):
        logits, ids, probs, d2t, temp, seeds, anchor = accept_operands(B, gamma, V, Vd, temps, seed, special=special)
        n, bonus = launch_accept(logits, mult, ids, probs, d2t, temp, seeds, anchor, chunk=chunk)
        rn, rb = accept(output_transform(logits, mult, None), ids, probs, d2t, temp, seeds, anchor)
        assert torch.equal(n, rn), (seed, n, rn)
        assert torch.equal(bonus, rb), (seed, bonus, rb)


@needs_kernels
def test_accept_op_runs_the_kernels_and_refuses_bad_shapes(tops):
    """``muse_spark::accept_triton`` (fp32 logits, no multiplier) equals the reference; wrong shapes
    are refused with the argument named."""
    from muse_spark.plugins.acceptance.reference import accept

    logits, ids, probs, d2t, temp, seeds, anchor = accept_operands(3, 4, 500, 120, [0.0, 1.0, 0.7], 5,
                                                                   logits_dtype=torch.float32)
    got = tops.accept(logits, 1.0, ids, probs, d2t, temp, seeds, anchor)
    want = accept(logits, ids, probs, d2t, temp, seeds, anchor)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match=r"draft_ids \[B, γ\]=\[3, 4\]"):
        tops.accept(logits, 1.0, ids[:, :3], probs, d2t, temp, seeds, anchor)
    with pytest.raises(ValueError, match=r"d2t \[Vd\]=\[120\]"):
        tops.accept(logits, 1.0, ids, probs, d2t[:5], temp, seeds, anchor)
    with pytest.raises(ValueError, match=r"seeds of shape \[B\]=\[3\]"):
        tops.accept(logits, 1.0, ids, probs, d2t, temp, seeds[:2], anchor)


@needs_kernels
def test_accept_kernels_emit_the_target_distribution():
    """Statistically: over 3000 seeds (600 on the interpreter) with one draft, the first token the
    kernels emit (the draft when accepted, else the bonus) follows the target's P_0 (speculative
    sampling is lossless), and
    the token after an accepted draft follows P_1 — chi-square p > 1e-4. The draft distribution is
    far from the target's, so rejections and residual samples are frequent."""
    from stat_utils import chi2_pvalue

    from muse_spark.plugins.acceptance.triton_kernel import launch_accept

    N, V, gamma = (600 if INTERPRETED else 3000), 12, 1  # (the interpreter: ≈ 15 ms a program)
    g = torch.Generator().manual_seed(3)
    target = torch.randn(1, gamma + 1, V, generator=g) * 1.5
    dl = torch.randn(1, gamma, V, generator=g) * 1.5
    q = torch.softmax(dl, -1)
    ids = torch.multinomial(q[0], N, replacement=True, generator=g).T  # [N, γ]: drafts drawn from q
    dev = torch.device(DEV)
    logits = target.expand(N, -1, -1).contiguous().to(dev)
    n, bonus = launch_accept(logits, 1.0, ids.to(dev), q.expand(N, -1, -1).contiguous().to(dev),
                             torch.zeros(V, dtype=torch.int64, device=dev), torch.ones(N, device=dev),
                             torch.arange(N, device=dev) * 7919 + 1, torch.full((N,), 40, device=dev),
                             chunk=16)
    n, bonus, ids = n.cpu(), bonus.cpu(), ids[:, 0]
    first = torch.where(n >= 1, ids, bonus)
    P = torch.softmax(target[0].double(), -1)
    assert chi2_pvalue(torch.bincount(first, minlength=V).numpy(), P[0].numpy()) > 1e-4
    after = bonus[n == 1]  # the bonus after an accepted draft comes from P_1
    assert 0.2 * N < len(after) < 0.9 * N
    assert chi2_pvalue(torch.bincount(after, minlength=V).numpy(), P[1].numpy()) > 1e-4


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
def test_accept_kernels_compile_for_hopper_without_fused_multiply_adds():
    """Compiled ahead of time for sm_90 (no GPU needed) at the Muse-Spark step's shape: the three
    acceptance kernels compile, keep nothing in local memory, and have no fma.rn.f32 (the softmax's
    and the Gumbel scores' multiply-adds are rounded as the spec rounds them)."""
    from muse_spark.plugins.acceptance import triton_kernel as ak

    big = ("V", "VD", "sl_b", "sl_g")
    stats = dict(logits_ptr="*bf16", temp_ptr="*fp32", d2t_ptr="*i64", t2d_ptr="*i32", mx_ptr="*fp32", sm_ptr="*fp32",
                 am_ptr="*i32", ni_ptr="*i32", fi_ptr="*i32", G1="i32", V="i32", VD="i32", NC="i32", sl_b="i32",
                 sl_g="i32")
    accept = dict(logits_ptr="*bf16", ids_ptr="*i64", probs_ptr="*fp32", t2d_ptr="*i32", temp_ptr="*fp32",
                  seed_ptr="*i64", apos_ptr="*i64", mx_ptr="*fp32", sm_ptr="*fp32", am_ptr="*i32", ni_ptr="*i32",
                  fi_ptr="*i32", rv_ptr="*fp32", ri_ptr="*i32", pv_ptr="*fp32", pi_ptr="*i32", ar_ptr="*i32",
                  nb_ptr="*i64", GAMMA="i32", V="i32", VD="i32", NC="i32", sl_b="i32", sl_g="i32")
    finish = dict(temp_ptr="*fp32", rv_ptr="*fp32", ri_ptr="*i32", pv_ptr="*fp32", pi_ptr="*i32", ar_ptr="*i32",
                  nb_ptr="*i64", n_ptr="*i64", bonus_ptr="*i64", NC="i32")
    kernels = [
        compile_for_hopper(ak._stats_kernel, stats, dict(MULT=0.5, CHUNK=ak.CHUNK, T2D_BLOCK=ak.T2D_BLOCK), 4,
                           multiples_of_16=big),
        compile_for_hopper(ak._accept_kernel, accept, dict(MULT=0.5, CHUNK=ak.CHUNK, G1_P2=8, NC_P2=64,
                                                           ACCEPT_KEY=ak.ACCEPT_KEY, TARGET_KEY=ak.TARGET_KEY), 4,
                           multiples_of_16=big),
        compile_for_hopper(ak._finish_kernel, finish, dict(NC_P2=64), 1),
    ]
    for k in kernels:
        assert k.asm["cubin"] and "fma.rn.f32" not in k.asm["ptx"] and "ld.local" not in k.asm["ptx"]


# ----------------------------------------------------------------------------- Inductor's view of the kernels
class _LaunchRecorder:
    """A launcher's ``wrap``: records (kernel, every argument by name) instead of launching."""

    def __init__(self):
        self.calls = []

    def __call__(self, kernel):
        recorder = self

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    named = {k: v for k, v in kwargs.items()
                             if k not in ("num_warps", "num_stages", "launch_pdl", "maxnreg")}
                    named.update(zip(kernel.arg_names, args))
                    recorder.calls.append((kernel, named))
                return launch

        return _Grid()


@pytest.fixture
def hopper_target():
    """Triton's active driver answering sm_90 where there is no GPU (Inductor's kernel analysis asks
    it for the compile target); the real driver on a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    if torch.cuda.is_available():
        yield
        return

    class _Hopper:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def is_active(self):
            return True

    before = driver._active  # (None until a kernel first asks: the CUDA driver, absent here)
    driver.set_active(_Hopper())
    try:
        yield
    finally:
        driver._active = before


def inductor_writes(kernel, kwargs) -> set[str]:
    """The arguments Inductor's analysis of a user-defined Triton kernel finds written (what it
    treats as mutated: an input it wrongly names is copied before every launch, and written back
    where it is a graph input)."""
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    if hasattr(tkw, "identify_accessed_tensors"):  # torch 2.13
        return {d.name for d in tkw.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes}
    return set(tkw.identify_mutated_tensors(kernel, kwargs, {}))  # torch 2.11


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("form", ["fused_table", "fused_angles", "bounds", "accept"])
def test_inductor_finds_exactly_the_outputs_the_kernels_write(form, hopper_target):
    """As the launchers call them at the Muse-Spark step's shape (batch 1), Inductor's mutation
    analysis of each kernel names exactly the buffers it writes. A false positive is not harmless:
    in the nineteenth session a variant of the fused attention (``HOIST``, reverted) made the
    analysis name q, v, the positions and the RoPE table too, and the engines then copied them
    before every layer's attention and failed to load (docs/aoti.md, "Known problems")."""
    from muse_spark.plugins.acceptance.triton_kernel import launch_accept
    from muse_spark.plugins.attention.triton_kernel import launch_attention

    rec = _LaunchRecorder()
    bf, i64, f32 = torch.bfloat16, torch.int64, torch.float32
    B, S, H, KV, DH, T = 1, 8, 32, 8, 128, 1152
    if form == "accept":
        V, Vd = 131072, 32768
        launch_accept(torch.empty(B, S, V, dtype=bf), 1.0, torch.zeros(B, S - 1, dtype=i64),
                      torch.empty(B, S - 1, Vd, dtype=f32), torch.zeros(Vd, dtype=i64), torch.ones(B),
                      torch.zeros(B, dtype=i64), torch.zeros(B, dtype=i64), wrap=rec)
        want = {"_stats_kernel": {"t2d_ptr", "mx_ptr", "sm_ptr", "am_ptr", "ni_ptr", "fi_ptr"},
                "_accept_kernel": {"rv_ptr", "ri_ptr", "pv_ptr", "pi_ptr", "ar_ptr", "nb_ptr"},
                "_finish_kernel": {"n_ptr", "bonus_ptr"}}
    else:
        kc, vc = torch.empty(2, T, KV, DH, dtype=bf), torch.empty(2, T, KV, DH, dtype=bf)
        last, slots = torch.zeros(B, S, dtype=i64), torch.zeros(B, dtype=i64)
        if form == "bounds":
            launch_attention(torch.empty(B, S, H, DH, dtype=bf), kc, vc, last, slots, wrap=rec, window=T, pdl=1)
            partial = {"po_ptr", "pm_ptr", "pl_ptr"}
        else:
            table = (torch.empty(B * S, DH // 2, dtype=f32), torch.empty(B * S, DH // 2, dtype=f32))
            launch_attention(torch.empty(B, S, H + KV, DH, dtype=bf), kc, vc, last, slots, wrap=rec, window=T,
                             pdl=1, new_kv=(torch.empty(B, S, KV, DH, dtype=bf), torch.zeros(B, S, dtype=i64), 1e-6,
                                            5e5, True), table=table if form == "fused_table" else None)
            partial = {"k_ptr", "v_ptr", "po_ptr", "pm_ptr", "pl_ptr"}
        want = {"_partial_kernel": partial, "_combine_kernel": {"out_ptr"}}
    assert [k.fn.__name__ for k, _ in rec.calls] == list(want)
    for kernel, kwargs in rec.calls:
        assert inductor_writes(kernel, kwargs) == want[kernel.fn.__name__], kernel.fn.__name__


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("form", ["linear", "linear_silu_mul", "linear_rope_table", "linear_late",
                                  "linear_silu_mul_late", "linear_rope_table_late", "gated_residual",
                                  "head_norm_rope_cache", "markov"])
def test_inductor_finds_no_caller_input_written_but_the_declared_ones(form, hopper_target):
    """The step's other plugin kernels, as their launchers call them at the Muse-Spark shape (batch
    1): Inductor's mutation analysis names no buffer the caller passed in as written, except those
    the op declares mutated (the caches, the Markov workspace). Such a false positive is copied
    before every launch in the packages, and written back where it is a graph input. ``_late``: the
    GEMMs with their late trigger (``PDL`` 3, the kernel option ``pdl_gemm_trigger``), whose first form
    (fifteenth session) fed the stores' addresses and made the packages copy the GEMMs' inputs."""
    from muse_spark.plugins.gated_residual.triton_kernel import launch_gated_residual_add
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_head_norm_rope_cache
    from muse_spark.plugins.linear.triton_kernel import launch_linear, launch_linear_rope_table
    from muse_spark.plugins.markov import triton_kernel as mk

    rec = _LaunchRecorder()
    bf, i64, f32 = torch.bfloat16, torch.int64, torch.float32
    B, S, H, KV, DH, D, T = 1, 8, 32, 8, 128, 4096, 1152
    declared = []
    pdl = 3 if form.endswith("_late") else 2
    form = form.removesuffix("_late")
    if form in ("linear", "linear_silu_mul"):
        inputs = [torch.empty(B, S, D, dtype=bf), torch.empty(2 * 14336 if form != "linear" else 4096, D, dtype=bf)]
        launch_linear(*inputs, silu_mul=form != "linear", wrap=rec, pdl=pdl)
    elif form == "linear_rope_table":
        inputs = [torch.empty(B, S, D, dtype=bf), torch.empty((H + 2 * KV) * DH, D, dtype=bf),
                  torch.zeros(B, S, dtype=i64)]
        launch_linear_rope_table(*inputs, 5e5, DH, wrap=rec, pdl=pdl)
    elif form == "gated_residual":
        inputs = [torch.empty(B, S, D), torch.empty(B, S, D, dtype=bf), torch.empty(D), torch.empty(D, dtype=bf)]
        launch_gated_residual_add(*inputs, 1e-6, False, True, bf, wrap=rec, pdl=1)
    elif form == "head_norm_rope_cache":
        declared = [torch.empty(2, T, KV, DH, dtype=bf), torch.empty(2, T, KV, DH, dtype=bf)]
        inputs = [torch.empty(B, S, H + KV, DH, dtype=bf), torch.empty(B, S, KV, DH, dtype=bf),
                  torch.zeros(B, S, dtype=i64), torch.zeros(B, dtype=i64)]
        launch_head_norm_rope_cache(inputs[0], inputs[1], inputs[2], 1e-6, 5e5, True, *declared, inputs[3], wrap=rec,
                                    pdl=1)
    else:
        V, Vd, r, gamma = 131072, 32768, 256, 7
        inputs = [torch.empty(B, gamma, Vd), torch.zeros(B, dtype=i64), torch.empty(V, r, dtype=bf),
                  torch.empty(Vd, r, dtype=bf), torch.zeros(Vd, dtype=i64), torch.zeros(B, dtype=i64),
                  torch.zeros(B, dtype=i64), torch.ones(B)]
        declared = [torch.zeros(mk.workspace_words(B, gamma, Vd, r, torch.device("cuda")), dtype=i64)]
        mk.launch_markov_sample(*inputs, wrap=rec, workspace=declared[0])
    assert rec.calls, "the launcher launched nothing"
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    allowed = {t.untyped_storage().data_ptr() for t in declared}
    for kernel, kwargs in rec.calls:
        written = inductor_writes(kernel, kwargs)
        callers = {n for n in written if torch.is_tensor(kwargs[n])
                   and kwargs[n].untyped_storage().data_ptr() in storages - allowed}
        assert not callers, (kernel.fn.__name__, sorted(callers))
        assert written, kernel.fn.__name__  # (the analysis ran: every kernel writes something)
