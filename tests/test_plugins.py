"""Reference plugin ops: the spec that every fast kernel must match."""

from pathlib import Path

import pytest
import torch
from scipy import stats

import muse_spark.plugins  # noqa: F401
from muse_spark.options import KernelOptions, use_options
from muse_spark.plugins import dispatch
from muse_spark.plugins.keyed_random import SALT_DRAFT, keyed_gumbel, keyed_uniform

from stat_utils import chi2_pvalue
from tolerances import TOL

# ---- gated residual ------------------------------------------------------------------------


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("with_weight", [False, True])
def test_gated_residual_add_matches_the_formula(zero_centered, with_weight):
    g = torch.Generator().manual_seed(0)
    stream = torch.randn(5, 33, generator=g)
    branch = torch.randn(5, 33, generator=g).bfloat16()
    gate = torch.rand(33, generator=g)
    w = torch.randn(33, generator=g).bfloat16() if with_weight else None
    new, normed = torch.ops.muse_spark.gated_residual_add(stream, branch, gate, w, 1e-6, zero_centered, True,
                                                          torch.bfloat16)
    want = stream + gate * branch.float()
    assert torch.equal(new, want)
    x = want.bfloat16().float()  # the norm reads the stream rounded to the compute dtype
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    if with_weight:
        y = y * (1 + w.float()) if zero_centered else y * w.float()
    assert normed.dtype == torch.bfloat16
    assert torch.equal(normed, y.bfloat16())
    new2, empty = torch.ops.muse_spark.gated_residual_add(stream, branch, gate, w, 1e-6, zero_centered, False,
                                                          torch.bfloat16)
    assert torch.equal(new2, want) and empty.numel() == 0


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("with_weight", [False, True])
def test_gated_residual_add_norms_the_branch_first(zero_centered, with_weight):
    """``norm_branch``: the branch's own output norm (post-attention / post-FFN) inside the op,
    exactly the separate norm it replaces: rms_norm in the branch's dtype, then the residual."""
    from muse_spark.plugins.norm import rms_norm

    g = torch.Generator().manual_seed(1)
    stream = torch.randn(5, 33, generator=g)
    branch = (4 * torch.randn(5, 33, generator=g)).bfloat16()
    gate = torch.rand(33, generator=g)
    w = torch.randn(33, generator=g).bfloat16() if with_weight else None
    wb = torch.randn(33, generator=g).bfloat16() if with_weight else None
    normed_branch = rms_norm(branch, wb, 1e-6, zero_centered, torch.bfloat16)
    for apply_norm in (True, False):
        got = torch.ops.muse_spark.gated_residual_add(stream, branch, gate, w, 1e-6, zero_centered, apply_norm,
                                                      torch.bfloat16, wb, True)
        want = torch.ops.muse_spark.gated_residual_add(stream, normed_branch, gate, w, 1e-6, zero_centered,
                                                       apply_norm, torch.bfloat16)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the weight is ignored unless norm_branch is set
    plain = torch.ops.muse_spark.gated_residual_add(stream, branch, gate, w, 1e-6, zero_centered, True,
                                                    torch.bfloat16, wb, False)
    assert torch.equal(plain[0], stream + gate * branch.float())


def test_gated_residual_add_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"expected gate of shape \[8\], got \[7\]"):
        torch.ops.muse_spark.gated_residual_add(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(7), None, 1e-6,
                                                False, False, torch.float32)
    with pytest.raises(ValueError, match=r"expected norm weight of shape \[8\], got \[1\]"):  # not broadcast
        torch.ops.muse_spark.gated_residual_add(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(8), torch.ones(1),
                                                1e-6, False, True, torch.float32)
    with pytest.raises(ValueError, match=r"expected branch norm weight of shape \[8\], got \[7\]"):
        torch.ops.muse_spark.gated_residual_add(torch.zeros(2, 8), torch.zeros(2, 8).bfloat16(), torch.ones(8), None,
                                                1e-6, False, True, torch.bfloat16, torch.ones(7), True)


# ---- keyed randomness -----------------------------------------------------------------------


def test_keyed_uniform_is_a_pure_function_of_its_key():
    seeds = torch.tensor([1, 2, 1, -5, 2**62])
    pos = torch.tensor([10, 10, 11, 10, 3])
    a = keyed_uniform(seeds, pos, SALT_DRAFT, 64)
    b = keyed_uniform(seeds.flip(0), pos.flip(0), SALT_DRAFT, 64).flip(0)
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert not torch.equal(a, keyed_uniform(seeds, pos, SALT_DRAFT + 1, 64))
    assert bool((a > 0).all() and (a < 1).all())


def test_keyed_uniform_is_uniform():
    u = keyed_uniform(torch.arange(200), torch.full((200,), 7), SALT_DRAFT, 500).flatten()
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3


# ---- Markov loop ----------------------------------------------------------------------------
B, GAMMA, V, VD, R, D = 6, 5, 37, 19, 8, 12


def markov_inputs(seed=0, temps=None, head="vanilla"):
    g = torch.Generator().manual_seed(seed)
    d2t = torch.sort(torch.randperm(V, generator=g)[:VD]).values - torch.arange(VD)
    head_w = head_b = None
    if head == "gated":
        head_w, head_b = torch.randn(R, D + R, generator=g), torch.randn(R, generator=g)
    elif head == "rnn":
        head_w, head_b = torch.randn(3 * R, 2 * R + D, generator=g), torch.randn(3 * R, generator=g)
    return dict(
        base_logits=torch.randn(B, GAMMA, VD, generator=g) * 2,
        hidden=torch.randn(B, GAMMA, D, generator=g),
        anchor=torch.randint(0, V, (B,), generator=g),
        w1=torch.randn(V, R, generator=g) * 0.5,
        w2=torch.randn(VD, R, generator=g) * 0.5,
        d2t=d2t,
        seeds=torch.randint(0, 2**40, (B,), generator=g),
        positions=torch.randint(0, 100, (B,), generator=g),
        temperature=torch.zeros(B) if temps is None else temps,
        head_type=head,
        head_w=head_w,
        head_b=head_b,
        topk=0,
    )


def run(kw):
    return torch.ops.muse_spark.markov_sample(**kw)


def rebuild_logits(kw, ids):
    """Recompute z_k from the spec's formulas, written independently of the reference."""
    w1, w2, hid = kw["w1"], kw["w2"], kw["hidden"]
    prev = kw["anchor"]
    state = torch.zeros(B, R)
    zs = []
    for k in range(GAMMA):
        e = w1[prev]
        if kw["head_type"] == "gated":
            e = torch.sigmoid(torch.cat([hid[:, k], e], -1) @ kw["head_w"].T + kw["head_b"]) * e
        elif kw["head_type"] == "rnn":
            j = torch.cat([state, e, hid[:, k]], -1) @ kw["head_w"].T + kw["head_b"]
            gg, c, o = j.split(R, -1)
            state = torch.sigmoid(gg) * state + (1 - torch.sigmoid(gg)) * torch.tanh(c)
            e = torch.tanh(o)
        zs.append(kw["base_logits"][:, k] + e @ w2.T)
        prev = ids[:, k]
    return torch.stack(zs, 1)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_greedy_chain_is_exact(head):
    kw = markov_inputs(head=head)
    ids, probs = run(kw)
    z = rebuild_logits(kw, ids)
    draft = z.argmax(-1)
    assert torch.equal(ids, draft + kw["d2t"][draft])
    assert torch.equal(probs, torch.nn.functional.one_hot(draft, VD).float())


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_recorded_probs_are_the_softmax_of_the_rebuilt_logits(head):
    temps = torch.tensor([0.5, 1.0, 1.7, 0.9, 1.0, 3.0])
    kw = markov_inputs(seed=3, temps=temps, head=head)
    ids, probs = run(kw)
    z = rebuild_logits(kw, ids)
    torch.testing.assert_close(probs, torch.softmax(z / temps[:, None, None], -1), **TOL["probs"])
    # Every sampled token has nonzero probability under the distribution it came from.
    draft = ids - 0
    inv = {int(t): i for i, t in enumerate(torch.arange(VD) + kw["d2t"])}
    dids = torch.tensor([[inv[int(t)] for t in row] for row in draft])
    assert bool((probs.gather(-1, dids[..., None]) > 0).all())


def test_same_seed_same_tokens_whatever_the_batch():
    temps = torch.ones(B)
    kw = markov_inputs(seed=5, temps=temps)
    ids, probs = run(kw)
    for i in range(B):
        solo = {k: (v[i : i + 1] if isinstance(v, torch.Tensor) and v.shape[:1] == (B,) else v) for k, v in kw.items()}
        sid, sprobs = run(solo)
        assert torch.equal(sid[0], ids[i])
        torch.testing.assert_close(sprobs[0], probs[i], **TOL["probs"])
    # Reordering the batch permutes the outputs and nothing else.
    perm = torch.randperm(B)
    shuffled = {k: (v[perm] if isinstance(v, torch.Tensor) and v.shape[:1] == (B,) else v) for k, v in kw.items()}
    assert torch.equal(run(shuffled)[0], ids[perm])


def test_non_finite_rows_are_handled():
    kw = markov_inputs(seed=7, temps=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0]))
    kw["w1"] = torch.zeros_like(kw["w1"])  # no Markov bias: z = U
    U = kw["base_logits"]
    U[0, :] = float("-inf")  # nothing finite: uniform over the draft vocabulary
    U[1, :, 3] = float("nan")  # NaN counts as -inf
    U[2, :, 4] = float("inf")  # +inf: certain
    U[3, :, :] = float("nan")
    ids, probs = run(kw)
    assert bool(torch.isfinite(probs).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, GAMMA))
    torch.testing.assert_close(probs[0], torch.full((GAMMA, VD), 1.0 / VD))
    assert bool((probs[1, :, 3] == 0).all())
    t4 = 4 + int(kw["d2t"][4])
    assert bool((ids[2] == t4).all()) and bool((probs[2, :, 4] == 1).all())


def test_topk_restricts_the_support():
    kw = markov_inputs(seed=9, temps=torch.full((B,), 2.0))
    kw["topk"] = 3
    ids, probs = run(kw)
    assert bool(((probs > 0).sum(-1) == 3).all())
    z = rebuild_logits(kw, ids)
    top = z.topk(3, -1).indices
    assert bool(probs.gather(-1, top).sum(-1).sub(1).abs().lt(1e-5).all())


def test_sampled_frequencies_match_the_probabilities():
    """First-slot tokens over many seeds follow q_0 (which does not depend on the noise)."""
    n = 6000
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(1, GAMMA, VD, generator=g).expand(n, -1, -1).contiguous()
    kw = dict(base_logits=logits, hidden=torch.zeros(n, GAMMA, D), anchor=torch.full((n,), 3),
              w1=torch.randn(V, R, generator=g), w2=torch.randn(VD, R, generator=g) * 0.3,
              d2t=torch.zeros(VD, dtype=torch.int64), seeds=torch.arange(n), positions=torch.full((n,), 20),
              temperature=torch.full((n,), 1.3), head_type="vanilla", head_w=None, head_b=None, topk=0)
    ids, probs = run(kw)
    counts = torch.bincount(ids[:, 0], minlength=VD)
    assert chi2_pvalue(counts.numpy(), probs[0, 0].numpy()) > 1e-3


def test_inline_and_op_paths_are_identical():
    kw = markov_inputs(seed=13, temps=torch.tensor([0.0, 1.0, 0.7, 0.0, 2.0, 1.0]), head="rnn")
    a = run(kw)
    with dispatch.plugin_impl("inline"):
        b = dispatch.markov_sample(*kw.values())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="unknown plugin implementation"):
        with dispatch.plugin_impl("fast"):
            pass


def test_markov_rejects_bad_shapes():
    kw = markov_inputs()
    kw["d2t"] = kw["d2t"][:-1]
    with pytest.raises(ValueError, match=rf"expected d2t of shape \[Vd\]=\[{VD}\], got \[{VD - 1}\]"):
        run(kw)


def test_gumbel_noise_has_the_gumbel_distribution():
    x = keyed_gumbel(torch.arange(50), torch.zeros(50, dtype=torch.int64), SALT_DRAFT, 400).flatten()
    assert stats.kstest(x.numpy(), "gumbel_r").pvalue > 1e-3


def test_uniforms_never_reach_one_or_zero():
    # The extreme hash values must map strictly inside (0, 1): u = 1 would make the
    # Gumbel noise +inf (a forced token) and break the acceptance test u·q < p.
    from muse_spark.plugins.keyed_random import uniform_from_hash

    u = uniform_from_hash(torch.tensor([0, 1, 511, 512, 0xFFFFFDFF, 0xFFFFFE00, 0xFFFFFFFF], dtype=torch.int64))
    assert bool((u > 0).all() and (u < 1).all())
    assert float(-torch.log(-torch.log(u[-1]))) < float("inf")
    assert len(set(u.tolist())) == 4  # 23 bits of resolution: values 512 apart are distinct


def test_every_op_launch_of_a_pdl_kernel_compiles_it_with_the_pdl_mode():
    """An engine built with the kernel option ``pdl`` makes the graph edges into ``PDL_KERNELS``
    programmatic, which is only safe where every launch of those kernels compiled the wait in. So
    every launcher call in plugins/triton_ops.py that reaches one passes ``pdl=_pdl()``."""
    import ast

    from muse_spark.plugins.pdl import PDL_KERNELS

    launchers = {"launch_linear": "_linear_kernel", "launch_linear_rope_table": "_linear_kernel",
                 "launch_gated_residual_add": "_gated_residual_norm_kernel",
                 "launch_head_norm_rope": "_head_norm_rope_kernel",
                 "launch_head_norm_rope_cache": "_head_norm_rope_cache_kernel", "launch_attention": "_partial_kernel"}
    # (launch_attention launches _combine_kernel too; launch_linear's W8A8 form _quantize_rows_kernel and a split-K
    # launch _split_sum_kernel, with the mode the GEMM's pdl gives them)
    assert set(PDL_KERNELS) == set(launchers.values()) | {"_combine_kernel", "_quantize_rows_kernel",
                                                          "_split_sum_kernel"}
    tree = ast.parse((Path(__file__).resolve().parents[1] / "plugins" / "triton_ops.py").read_text())
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
             and (getattr(c.func, "id", None) or getattr(c.func, "attr", None)) in launchers]
    assert {getattr(c.func, "id", None) or c.func.attr for c in calls} == set(launchers)
    for c in calls:
        pdl = [k.value for k in c.keywords if k.arg == "pdl"]
        assert pdl and isinstance(pdl[0], ast.Call) and pdl[0].func.id == "_pdl", ast.unparse(c)
        # pdl_trigger: only the small kernels trigger their dependents first (small=True); a GEMM
        # triggers at most after its weight stream (pdl_gemm_trigger)
        small = [k.value.value for k in pdl[0].keywords if k.arg == "small"]
        name = getattr(c.func, "id", None) or c.func.attr
        assert small == ([] if launchers[name] == "_linear_kernel" else [True]), ast.unparse(c)


def test_pdl_modes_of_the_ops_follow_the_options(monkeypatch):
    """``_pdl`` on a GPU that runs PDL (sm_90+): by default 1 (trigger, then wait) for the small
    kernels and 3 (wait, trigger after the weight stream) for the GEMMs; the GEMMs 2 (wait only)
    with the kernel option ``pdl_gemm_trigger`` off, the small kernels with ``pdl_trigger`` off; 0
    with ``pdl`` off, whatever the triggers. On an older GPU or none: 0 whatever the options."""
    pytest.importorskip("triton")
    from muse_spark.plugins import pdl
    from muse_spark.plugins import triton_ops
    from muse_spark.plugins.triton_math import interpreting

    if interpreting():
        pytest.skip("under TRITON_INTERPRET=1 the ops compile no PDL (no inline asm)")
    def modes(**options):
        with use_options(KernelOptions(**options)):
            return triton_ops._pdl(), triton_ops._pdl(small=True)

    monkeypatch.setattr(pdl, "pdl_supported", lambda: False)
    assert modes() == (0, 0)
    monkeypatch.setattr(pdl, "pdl_supported", lambda: True)
    assert modes() == (3, 1) and (triton_ops._pdl(), triton_ops._pdl(small=True)) == (3, 1)  # (the defaults)
    assert modes(pdl_gemm_trigger=False) == (2, 1)
    assert modes(pdl_gemm_trigger=False, pdl_trigger=False) == (2, 2)
    assert modes(pdl_trigger=False) == (3, 2)
    assert modes(pdl=False) == (0, 0)


@pytest.mark.parametrize("kernels", ["0", "1"])
@pytest.mark.parametrize("impl", ["op", "inline", "triton"])
@pytest.mark.parametrize("soft_cap", [None, 4.0])
def test_dispatch_accept_is_the_rule_on_the_transformed_logits(impl, soft_cap, kernels):
    """``dispatch.accept`` (what step_verify calls, on the head's raw output) gives
    ``plugins.acceptance.reference.accept`` on ``output_transform(raw, multiplier, soft_cap)``; under ``"triton"``
    with the kernel option ``accept_kernels`` off it is that same reference code; with the kernels on, the op
    falls back to it on the CPU, and under TRITON_INTERPRET=1 its kernels give the same n and bonus."""
    from muse_spark.plugins.acceptance.reference import output_transform
    from muse_spark.plugins.acceptance.reference import accept

    if impl == "triton" and kernels == "1":
        pytest.importorskip("triton")  # muse_spark::accept_triton's module imports it
    g = torch.Generator().manual_seed(4)
    B, gamma, V, Vd = 3, 4, 90, 40
    raw = (3 * torch.randn(B, gamma + 1, V, generator=g)).bfloat16()
    d2t = torch.sort(torch.randperm(V, generator=g)[:Vd]).values - torch.arange(Vd)
    probs = torch.softmax(torch.randn(B, gamma, Vd, generator=g), -1)
    drafted = torch.multinomial(probs.reshape(-1, Vd), 1, generator=g).reshape(B, gamma)
    ids = drafted + d2t[drafted]  # their target ids
    args = (ids, probs, d2t, torch.tensor([0.0, 1.0, 0.7]), torch.tensor([1, 2, 3]), torch.tensor([5, 9, 0]))
    with dispatch.plugin_impl(impl), use_options(KernelOptions(accept_kernels=kernels == "1")):
        got = dispatch.accept(raw, 0.5, soft_cap, *args)
    want = accept(output_transform(raw, 0.5, soft_cap), *args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
