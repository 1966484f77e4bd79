"""The split-KV attention (plugins/attention) against the fp32 einsums: the dense mask and the
bounds form, the caches read in place, the splits, and the form with the q/k norm, RoPE and
KV-cache write folded in (attention_cache_triton)."""

from __future__ import annotations

import pytest
import torch

from kernels.kernel_utils import (BIG, DEV, HAS_TRITON, INTERPRETED, compile_for_hopper, launches, needs_gpu,
                                  needs_kernels)
from tolerances import TOL


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
    from muse_spark.plugins.attention.reference import attend_reference

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
    from muse_spark.plugins.attention.reference import attend_reference
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
    from muse_spark.plugins.attention.reference import KeyBounds

    last = mask.sum(-1) - 1
    assert torch.equal(KeyBounds(last, mask.shape[-1]).dense(), mask)
    return KeyBounds(last, mask.shape[-1])


def paged_from_slots(kc, vc, slots, T, P):
    """The same keys as NaN-filled pools of ``P``-position blocks [1 + 2·B·⌈T/P⌉, P, KV, Dh] (block 0 and
    the unused half NaN) and block tables [B, ⌈T/P⌉] naming shuffled blocks → (k_pool, v_pool, tables)."""
    B, n = slots.shape[0], -(-T // P)
    blocks = torch.randperm(2 * B * n, generator=torch.Generator().manual_seed(2))[: B * n].view(B, n) + 1
    pools = []
    for c in (kc, vc):
        pool = torch.full((1 + 2 * B * n, P) + tuple(c.shape[2:]), float("nan"), dtype=c.dtype, device=c.device)
        rows = c[slots, : n * P] if c.shape[1] >= n * P else torch.nn.functional.pad(
            c[slots], (0, 0, 0, 0, 0, n * P - c.shape[1]), value=float("nan"))
        pool[blocks.to(c.device)] = rows.reshape(B, n, P, *c.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], blocks.to(kc.device)


@needs_kernels
@pytest.mark.parametrize("shape", list(ATTN_SHAPES))
@pytest.mark.parametrize("page", [16, 64])
def test_attention_through_block_tables_gives_the_slot_caches_bits(tops, shape, page):
    """Paged caches (pools of blocks, per-request block tables: ``PagedKV``): the kernel reads each key
    through its request's table and gives the bits it gives reading the same keys from slot caches in
    place, early and per-tile loads alike; its reference path (the gathered blocks) agrees; the dense
    mask form and the fused cache write refuse tables."""
    from muse_spark.plugins.attention.reference import attend_reference
    from muse_spark.plugins.attention.triton_kernel import launch_attention
    from muse_spark.plugins.triton_math import interpreting

    from test_models import attention_case

    B, S, H, KV, dh, T = ATTN_SHAPES[shape]
    q, k, v, mask = attention_case(torch.bfloat16, DEV, B=B, S=S, H=H, KV=KV, dh=dh, T=T)
    kc, vc, slots = cache_with_slots(k, v, extra_positions=40)
    kb = bounds_of(mask)
    kp, vp, tables = paged_from_slots(kc, vc, slots, T, page)
    for early, i32 in ((True, None), (False, None), (True, False)):
        # (block offsets in int32, the launcher's choice for pools that fit, or int64: the same keys, the same bits)
        cfg = dict(EARLY_KV=early, TAB_I32=i32)
        want = launch_attention(q, kc, vc, kb.last, slots, config=cfg, interpret=interpreting(), window=T)
        got = launch_attention(q, kp, vp, kb.last, tables, config=cfg, interpret=interpreting(), window=T)
        assert torch.equal(got, want), cfg
    assert torch.equal(tops.attention(q, kp, vp, kb, tables), got)  # the op the models call
    torch.testing.assert_close(got.float(), attend_reference(q.float(), k.float(), v.float(), mask),
                               **TOL[torch.bfloat16])
    with pytest.raises(ValueError, match="bounds form"):
        tops.attention(q, kp, vp, mask, tables)
    with pytest.raises(ValueError, match="exceeds the block tables"):
        launch_attention(q, kp, vp, kb.last, tables[:, :1], interpret=interpreting(), window=T)


def fp8_caches(kc, vc, KV, seed=3):
    """An FP8 cache's codes of the caches kc/vc (NaN stays the E4M3 NaN code) with per-KV-head scales in
    [0.02, 0.2) → (k codes, v codes, (k_scale, v_scale), their dequantized bf16 keys and values)."""
    from muse_spark.plugins.attention.reference import dequantize_kv, quantize_kv

    g = torch.Generator().manual_seed(seed)
    ks, vs = (0.02 + 0.18 * torch.rand(KV, generator=g)).to(kc.device), (0.02 + 0.18 * torch.rand(KV, generator=g)).to(kc.device)
    kq, vq = quantize_kv(kc, ks), quantize_kv(vc, vs)
    assert kq.dtype == torch.float8_e4m3fn and kq.shape == kc.shape
    return kq, vq, (ks, vs), dequantize_kv(kq, ks, kc.dtype), dequantize_kv(vq, vs, vc.dtype)


@needs_kernels
@pytest.mark.parametrize("shape", list(ATTN_SHAPES))
@pytest.mark.parametrize("form", ["mask", "cache", "cache_table"])
def test_attention_over_an_fp8_cache_reads_its_dequantized_keys(tops, shape, form):
    """An FP8 KV cache (E4M3 codes, a float32 scale per KV head): the kernel dequantizes each tile as it loads
    it (code · scale, rounded once to bf16: ``dequantize_kv``), so it attends over the keys and values the
    reference path reads: within the bf16 tolerance of attend_reference on the dequantized rows, and (on the
    interpreter) the bits of the kernel on those rows stored in bf16. NaN codes in keys no query sees (the
    caches' garbage) never leak. The GPU's MMA may take a tile converted in registers in another order than
    a loaded one, so there the bits are not asserted."""
    from muse_spark.plugins.attention.reference import attend_reference, cache_rows
    from muse_spark.plugins.attention.triton_kernel import launch_attention
    from muse_spark.plugins.triton_math import interpreting

    from test_models import attention_case

    B, S, H, KV, dh, T = ATTN_SHAPES[shape]
    q, k, v, mask = attention_case(torch.bfloat16, DEV, B=B, S=S, H=H, KV=KV, dh=dh, T=T)
    kb = bounds_of(mask)
    if form == "mask":
        kq, vq, scales, kd, vd = fp8_caches(k, v, KV)
        got = tops.attention(q, kq, vq, mask, None, scales)
        want = tops.attention(q, kd, vd, mask)
        rows = (kd, vd)
    else:
        kc, vc, slots = cache_with_slots(k, v, extra_positions=40)  # (NaN past the requests' keys)
        kq, vq, scales, kd, vd = fp8_caches(kc, vc, KV)
        assert bool(torch.isnan(kq.float()).any())  # the garbage is NaN codes
        if form == "cache_table":
            kq, vq, slots = paged_from_slots(kq, vq, slots, T, 16)  # (NaN codes in the unused blocks)
        got = tops.attention(q, kq, vq, kb, slots, scales)
        rows = cache_rows(kq, vq, mask, slots, scales, q.dtype)
        want = launch_attention(q, *rows, kb.last, None, interpret=interpreting(), window=T)
    assert got.dtype == q.dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), attend_reference(q.float(), rows[0].float(), rows[1].float(), mask),
                               **TOL[torch.bfloat16])
    if INTERPRETED:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])


@needs_kernels
def test_the_attention_op_refuses_fp8_caches_without_their_scales(tops):
    from test_models import attention_case

    q, k, v, mask = attention_case(torch.bfloat16, DEV)
    KV = k.shape[2]
    kq, vq, scales, _, _ = fp8_caches(k, v, KV)
    with pytest.raises(ValueError, match=r"an FP8 cache is read with k_scale float32"):
        tops.attention(q, kq, vq, mask)
    with pytest.raises(ValueError, match=r"v_scale float32 \[%d\]" % KV):
        tops.attention(q, kq, vq, mask, None, (scales[0], scales[1][:1]))
    with pytest.raises(ValueError, match="KV scales are for an FP8"):
        tops.attention(q, k, v, mask, None, scales)
    with pytest.raises(ValueError, match="all the same, or k/v an FP8 cache's"):
        tops.attention(q, kq, v, mask, None, scales)


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
    from muse_spark.plugins.attention.reference import KeyBounds, attend_reference
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
    from muse_spark.plugins.attention.reference import KeyBounds

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
    # an FP8 cache (KV_FP8: E4M3 k/v, the KV head's float32 scales): the plain form, through block tables, and the
    # fused write (quantizing as it stores): each compiles and fits; the plain one stays free of contracted
    # multiply-adds (the tiles' dequantization is explicitly rounded)
    fp8 = {n: ("*fp8e4nv" if n in ("k_ptr", "v_ptr") else t) for n, t in zip(names, types)}
    plain = {n: fp8[n] for n in names[:25]}
    scales = {"ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    base = dict(SCALE=128 ** -0.5, REP=4, DH=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"],
                SPLIT_T=cfg["SPLIT_T"], IEEE_DOT=False, EARLY_KV=True, BOUNDS=True, KV_FP8=True)
    forms = [(dict(plain, **scales), dict(base, HAS_SLOTS=True)),
             (dict(plain, STAB="i32", **scales), dict(base, HAS_SLOTS=False, PAGE=16, SPLITS=3)),
             (dict(fp8, **scales), dict(base, HAS_SLOTS=True, NORM_QK=True, EPS=1e-6, THETA=5e5, ROPE=True))]
    quantized = [compile_for_hopper(ak._partial_kernel, sig, c, cfg["num_warps"]) for sig, c in forms]
    for k in quantized:
        assert k.asm["cubin"] and k.metadata.shared <= 227 * 1024
    assert "fma.rn.f32" not in quantized[0].asm["ptx"] and "e4m3" in quantized[2].asm["ptx"]
    # through block tables, with int64 or int32 block offsets: each compiles
    paged = dict({n: t for n, t in zip(names[:25], types[:25])}, STAB="i32")
    for i32 in (False, True):
        k = compile_for_hopper(ak._partial_kernel, paged, dict(base, KV_FP8=False, HAS_SLOTS=False, PAGE=16,
                                                               TAB_I32=i32), cfg["num_warps"])
        assert k.asm["cubin"] and k.metadata.shared <= 227 * 1024


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
    from muse_spark.plugins.attention.reference import KeyBounds

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
    from muse_spark.plugins.attention.reference import KeyBounds, attend_reference
    from muse_spark.plugins.head_norm_rope.reference import head_norm_rope_cache_reference

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
@pytest.mark.parametrize("shape", ["straddle", "past_window", "long_chunk"])
def test_the_fused_cache_writes_through_block_tables_give_the_slot_caches_bits(tops, shape):
    """Paged caches: the norm kernel's cache write (``head_norm_rope_cache_triton``) and the fused attention
    (``attention_cache_triton``) write each new key and value through its request's block table, into
    NaN-filled pools of 16-position blocks: the output and every written position bit for bit as on the
    slot caches, and nothing outside the requests' blocks written."""
    from muse_spark.plugins.attention.reference import KeyBounds, cache_rows

    B, S, H, KV, dh, n, T, window, firsts = ATTN_CACHE_SHAPES[shape]
    x, v, positions, slots, (kc, vc), last = attention_cache_operands(B, S, H, KV, dh, n, T, firsts)
    for fused in (False, True):
        k1, v1 = kc.clone(), vc.clone()
        kp, vp, tables = paged_from_slots(kc, vc, slots, T, 16)
        held = torch.zeros(kp.shape[0], dtype=torch.bool, device=kp.device)
        held[tables.flatten()] = True
        if fused:
            want = tops.attention_cache(x, v, positions, 1e-6, 5e5, True, k1, v1, slots, KeyBounds(last, window))
            got = tops.attention_cache(x, v, positions, 1e-6, 5e5, True, kp, vp, tables, KeyBounds(last, window))
        else:
            op = torch.ops.muse_spark.head_norm_rope_cache_triton
            want = op(x, v, positions, 1e-6, 5e5, True, k1, v1, slots)
            got = op(x, v, positions, 1e-6, 5e5, True, kp, vp, tables)
        assert torch.equal(got, want), fused
        every = KeyBounds(torch.full_like(last, T - 1), T).dense()
        for pool, cache in ((kp, k1), (vp, v1)):
            assert torch.equal(cache_rows(pool, pool, every, tables)[0], cache[slots, :T]), fused
            assert pool[~held].isnan().all()  # (block 0 and the blocks no table names: untouched)


@needs_kernels
def test_attention_cache_kernel_never_writes_outside_the_caches(tops):
    """A request whose row is outside the caches writes nothing and reads nothing (its output is
    zeros); a position past the caches' length is not written; the other request is unaffected."""
    from muse_spark.plugins.attention.reference import KeyBounds

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
    from muse_spark.plugins.attention.reference import KeyBounds
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


@needs_kernels
@pytest.mark.parametrize("shape", ["straddle", "past_window", "head128"])
def test_the_fused_attention_writes_and_reads_an_fp8_cache(tops, shape):
    """An FP8 KV cache in the fused kernel (``attention_cache_triton`` with the KV heads' scales): it quantizes
    the new keys and values as it writes them (the codes of the norm kernel's quantized write, bit for bit on
    the interpreter; within one E4M3 step of it on the GPU, where the keys' norm may round otherwise), then
    attends over the dequantized tiles: as the norm kernel's write followed by the attention over the same
    FP8 cache (bits on the interpreter, bf16 tolerance on the GPU), and within bf16 tolerance of the fp32 spec
    (the references' write, dequantized rows)."""
    from muse_spark.plugins.attention.reference import KeyBounds, attend_reference, cache_rows, quantize_kv
    from muse_spark.plugins.head_norm_rope.reference import head_norm_rope_cache_reference

    from tolerances import TOL as ATTN_TOL

    B, S, H, KV, dh, n, T, window, firsts = ATTN_CACHE_SHAPES[shape]
    x, v, positions, slots, (kc, vc), last = attention_cache_operands(B, S, H, KV, dh, n, T, firsts)
    scales = (torch.linspace(0.02, 0.2, KV, device=kc.device), torch.linspace(0.3, 0.03, KV, device=kc.device))
    kq, vq = quantize_kv(kc, scales[0]), quantize_kv(vc, scales[1])
    k2, v2 = kq.clone(), vq.clone()
    q = torch.ops.muse_spark.head_norm_rope_cache_triton(x, v, positions, 1e-6, 5e5, True, k2, v2, slots,
                                                         k_scale=scales[0], v_scale=scales[1])
    bounds = KeyBounds(last, window)
    want = tops.attention(q, k2, v2, bounds, slots, scales)
    got = tops.attention_cache(x, v, positions, 1e-6, 5e5, True, kq, vq, slots, bounds, scales=scales)
    assert got.shape == (B, S, H, dh) and torch.isfinite(got).all()
    assert torch.equal(vq.view(torch.uint8), v2.view(torch.uint8))
    if INTERPRETED:
        assert torch.equal(kq.view(torch.uint8), k2.view(torch.uint8)) and torch.equal(got, want)
    else:
        assert ((kq.float() - k2.float()).abs() <= 2.0**-3 * k2.float().abs() + 2.0**-9).all()
        torch.testing.assert_close(got, want, **ATTN_TOL[torch.bfloat16])
    rk, rv = (quantize_kv(c.cpu(), s.cpu()) for c, s in zip(attention_cache_operands(B, S, H, KV, dh, n, T, firsts)[4],
                                                             scales))
    cpu_scales = tuple(s.cpu() for s in scales)
    rq = head_norm_rope_cache_reference(x.cpu(), v.cpu(), positions.cpu(), 1e-6, 5e5, True, rk, rv, slots.cpu(),
                                        cpu_scales)
    mask = KeyBounds(last.cpu(), window).dense()
    rows = cache_rows(rk, rv, mask, slots.cpu(), cpu_scales, torch.bfloat16)
    ref = attend_reference(rq.float(), rows[0].float(), rows[1].float(), mask)
    torch.testing.assert_close(got.float().cpu(), ref, **ATTN_TOL[torch.bfloat16])
