"""Reference models: cached/incremental computation equals computing from scratch."""

import pytest
import torch

from muse_spark.checkpoint import load_pair
from muse_spark.models import layers
from muse_spark.plugins.acceptance.reference import output_transform
from muse_spark.options import KernelOptions, use_options

from conftest import small_engine
from tolerances import TOL


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request, agreeing_pair, random_pair):
    target, draft = load_pair(*random_pair, dtype=request.param)
    return target, draft


def full_forward(target, tokens, slot=0, max_seq=64):
    cache = target.allocate_cache(4, max_seq)
    S = tokens.shape[1]
    h, aux = target(tokens, torch.arange(S)[None], torch.tensor([slot]), cache, S)
    return target.logits(h), aux


def test_target_incremental_decoding_equals_full_forward(pair):
    target, _ = pair
    tokens = torch.randint(0, 259, (1, 20), generator=torch.Generator().manual_seed(0))
    full, full_aux = full_forward(target, tokens)
    cache = target.allocate_cache(4, 64)
    slot = torch.tensor([2])
    outs, auxs = [], []
    # A chunk of 7, a chunk of 5, then one token at a time.
    bounds = [0, 7, 12] + list(range(13, 21))
    for a, b in zip(bounds, bounds[1:]):
        h, aux = target(tokens[:, a:b], torch.arange(a, b)[None], slot, cache, b)
        outs.append(target.logits(h))
        auxs.append(aux)
    tol = TOL[target.dtype]
    torch.testing.assert_close(torch.cat(outs, 1), full, **tol)
    torch.testing.assert_close(torch.cat(auxs, 1), full_aux, **tol)


def test_batched_rows_of_different_lengths_equal_single_rows(pair):
    target, _ = pair
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 259, (1, 9), generator=g), torch.randint(0, 259, (1, 14), generator=g)
    cache = target.allocate_cache(4, 64)
    slots = torch.tensor([0, 3])
    target(a[:, :6], torch.arange(6)[None], slots[:1], cache, 6)
    target(b[:, :11], torch.arange(11)[None], slots[1:], cache, 11)
    # One batched verify-shaped call: 3 tokens each at their own positions.
    toks = torch.cat([a[:, 6:9], b[:, 11:14]])
    pos = torch.stack([torch.arange(6, 9), torch.arange(11, 14)])
    h, _ = target(toks, pos, slots, cache, 14)
    got = target.logits(h)
    tol = TOL[target.dtype]
    torch.testing.assert_close(got[0], full_forward(target, a)[0][0, 6:9], **tol)
    torch.testing.assert_close(got[1], full_forward(target, b)[0][0, 11:14], **tol)


def test_draft_cached_context_equals_recomputation(pair):
    """Context K/V stored chunk by chunk (as prefill + steps do) equal one from-scratch
    pass over the full sequence, and so does the block the draft runs on them."""
    target, draft = pair
    tokens = torch.randint(0, 259, (1, 17), generator=torch.Generator().manual_seed(2))
    p = 16  # anchor = tokens[16] at position 16; context = positions 0..15
    _, aux_full = full_forward(target, tokens)
    scratch = draft.allocate_cache(2, 64)
    draft.store_context(aux_full[:, :p], torch.arange(p)[None], torch.tensor([0]), scratch)

    tcache, dcache = target.allocate_cache(2, 64), draft.allocate_cache(2, 64)
    slot = torch.tensor([1])
    for a, b in ((0, 5), (5, 11), (11, 16)):
        pos = torch.arange(a, b)[None]
        _, aux = target(tokens[:, a:b], pos, slot, tcache, b)
        draft.store_context(aux, pos, slot, dcache)
    tol = TOL[draft.dtype]
    for i in range(draft.cfg.num_hidden_layers):
        torch.testing.assert_close(dcache.k[i][1, :p], scratch.k[i][0, :p], **tol)
        torch.testing.assert_close(dcache.v[i][1, :p], scratch.v[i][0, :p], **tol)
    anchor, ppos = tokens[:, p], torch.tensor([p])
    h1, u1 = draft.block(anchor, ppos, slot, dcache, p)
    h0, u0 = draft.block(anchor, ppos, torch.tensor([0]), scratch, p)
    torch.testing.assert_close(h1, h0, **tol)
    torch.testing.assert_close(u1, u0, **tol)
    # Garbage past the anchor position is never read: filling it (and widening the
    # key window over it) changes nothing beyond reduction-order rounding.
    for i in range(draft.cfg.num_hidden_layers):
        dcache.k[i][1, p:] = 100.0
        dcache.v[i][1, p:] = float("nan")
    h2, u2 = draft.block(anchor, ppos, slot, dcache, p + 5)
    torch.testing.assert_close(h2, h1, **tol)
    torch.testing.assert_close(u2, u1, **tol)


def test_draft_block_causality():
    """With causal=True, slot k does not see later slots: changing the mask embedding
    row only moves slots ≥ 1, and slot 0 stays fixed."""
    eng = small_engine(seed=4, causal=True)
    d = eng.draft
    h, _ = d.block(torch.tensor([3]), torch.tensor([0]), torch.tensor([0]), eng.draft_cache, 0)
    d.embed_weight[0] += 1.0  # mask_token_id = 0
    h2, _ = d.block(torch.tensor([3]), torch.tensor([0]), torch.tensor([0]), eng.draft_cache, 0)
    d.embed_weight[0] -= 1.0
    assert torch.equal(h[:, 0], h2[:, 0])
    assert not torch.allclose(h[:, 1:], h2[:, 1:])

    eng_nc = small_engine(seed=4, causal=False)
    d = eng_nc.draft
    h, _ = d.block(torch.tensor([3]), torch.tensor([0]), torch.tensor([0]), eng_nc.draft_cache, 0)
    d.embed_weight[0] += 1.0
    h2, _ = d.block(torch.tensor([3]), torch.tensor([0]), torch.tensor([0]), eng_nc.draft_cache, 0)
    assert not torch.allclose(h[:, 0], h2[:, 0])  # non-causal: slot 0 sees the masks


def test_output_transform():
    x = torch.tensor([[-100.0, 0.0, 3.0]])
    y = output_transform(x, 0.5, 10.0)
    torch.testing.assert_close(y, 10.0 * torch.tanh(x * 0.5 / 10.0))
    assert torch.equal(output_transform(x.bfloat16(), 1.0, None), x)


def attention_case(dtype, device="cpu", B=3, S=5, H=8, KV=2, dh=16, T=48, seed=0):
    """GQA attention inputs with stale garbage (NaN and large keys/values) past each request's
    length and one query that sees no key → (q, k, v, mask) in ``dtype``. K/V are strided views
    into a wider cache (as the engines' are)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, dh, generator=g)
    cache = torch.randn(B, T, KV + 1, 2, dh, generator=g)  # an extra head and k|v interleaved: strided views
    k, v = cache[:, :, 1:, 0], cache[:, :, 1:, 1]
    lens = torch.tensor([min(T, max(S, (i + 1) * T // B - 3 * i)) for i in range(B)])
    pos = lens[:, None] - S + torch.arange(S)
    mask = torch.arange(T)[None, None, :] <= pos[:, :, None]
    mask[-1, 0] = False
    for i in range(B):
        k[i, lens[i]:], v[i, lens[i]:] = (float("nan"), float("nan")) if i % 2 == 0 else (100.0, -1e4)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return [t.to(device) for t in (q, k, v, mask)]


def test_key_bounds_are_the_key_mask():
    """``key_mask`` gives bounds (``KeyBounds``), not a tensor: ``dense`` is the mask the models
    meant (key j visible iff j ≤ the query's bound), and ``attend`` with bounds equals ``attend``
    with that mask on every path that expands it (CPU here)."""
    from muse_spark.models.layers import attend
    from muse_spark.plugins.attention.reference import KeyBounds
    from muse_spark.models.target import LayerStackLM

    last = torch.tensor([[3, 4, -1], [0, 9, 20]])
    kb = LayerStackLM.key_mask(last, 10)
    assert isinstance(kb, KeyBounds) and kb.shape == (2, 3, 10)
    want = torch.tensor([[[j <= int(b) for j in range(10)] for b in row] for row in last])
    assert torch.equal(kb.dense(), want)
    q, k, v, mask = attention_case(torch.float32)
    last = mask.sum(-1) - 1  # attention_case's masks are prefixes
    assert torch.equal(attend(q, k, v, KeyBounds(last, mask.shape[-1])), attend(q, k, v, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_attention_matches_the_fp32_einsums(dtype):
    """The fused-SDPA attention (bf16 on CUDA) against the fp32 einsum path, run here on CPU:
    the GQA query folding, the masks and the garbage zeroing are the same math."""
    from muse_spark.models.layers import _attend_sdpa
    from muse_spark.plugins.attention.reference import attend_reference

    q, k, v, mask = attention_case(dtype)
    ref = attend_reference(q.float(), k.float(), v.float(), mask)
    out = _attend_sdpa(q, k, v, mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.equal(out[-1, 0], torch.zeros_like(out[-1, 0]))  # no visible key: zeros
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


def test_attend_reads_rows_of_whole_caches():
    """attend(..., slots): request b reads row slots[b] of whole caches, keys [0, T) of the mask;
    the other rows and later positions (NaN here) never matter."""
    from muse_spark.models.layers import attend

    q, k, v, mask = attention_case(torch.float32)
    B, T = k.shape[:2]
    slots = torch.tensor([3, 0, 2])
    kc = torch.full((4, T + 5) + tuple(k.shape[2:]), float("nan"))
    vc = kc.clone()
    kc[slots, :T], vc[slots, :T] = k, v
    assert torch.equal(attend(q, kc, vc, mask, slots), attend(q, k, v, mask))


def test_attention_kernel_choice():
    """The kernel option ``attention`` picks the fused kernel for bf16/fp16 on CUDA (the current
    options', or the ones passed); fp32 and CPU run the reference einsums."""
    from muse_spark.models.layers import attention_path

    assert attention_path("cuda", torch.bfloat16) == "triton"  # the default
    sdpa = KernelOptions(attention="sdpa")
    assert attention_path("cuda", torch.float16, sdpa) == "sdpa"
    with use_options(sdpa):
        assert attention_path("cuda", torch.float16) == "sdpa"
        assert attention_path("cuda", torch.float32) == "reference"
        assert attention_path("cpu", torch.bfloat16) == "reference"
    assert attention_path("cuda", torch.float16) == "triton"
