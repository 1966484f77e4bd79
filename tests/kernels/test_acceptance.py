"""The acceptance rule's kernels (plugins/acceptance) against its reference, and the target
distribution they emit."""

from __future__ import annotations

import pytest
import torch

from kernels.kernel_utils import DEV, HAS_TRITON, INTERPRETED, compile_for_hopper, needs_kernels


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
    from muse_spark.plugins.acceptance.reference import accept, output_transform
    from muse_spark.plugins.acceptance.triton_kernel import launch_accept

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
