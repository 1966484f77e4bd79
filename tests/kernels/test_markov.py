"""The fused Markov loop (plugins/markov) against its reference: tokens and probabilities, the
kernel's keyed noise, the sanitization of non-finite rows, the fallbacks, the sampled statistics."""

from __future__ import annotations

import logging

import pytest
import torch

from muse_spark.plugins.keyed_random import SALT_DRAFT, keyed_gumbel
from muse_spark.plugins.markov.reference import markov_sample_ref

from kernels.kernel_utils import (BIG, DEV, HAS_TRITON, INTERPRETED, ON_GPU, compile_for_hopper, markov_inputs,
                                  needs_kernels, triton)
from stat_utils import chi2_pvalue
from tolerances import TOL


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
    torch.testing.assert_close(probs, ref_probs, **TOL["draft_probs"])
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
        torch.testing.assert_close(probs, ref_probs, **TOL["draft_probs"])


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
        torch.testing.assert_close(probs[same], ref_probs[same], **TOL["draft_probs"])
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
    torch.testing.assert_close(probs, ref_probs, **TOL["draft_probs"])


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
