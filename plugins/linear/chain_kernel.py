"""An experiment (scripts/chain_bench.py), not used by the engines: a chain of dependent skinny
GEMMs in one persistent launch, phases separated by grid barriers instead of kernel boundaries.

Why: fitted to the H200's isolated GEMM timings, each GEMM launch of a batch-1 step costs ~5 µs
of launch, ramp and tail on top of streaming its weight (docs/benchmarks.md, eleventh session).
That is 151 launches and ~0.7 ms a step. This kernel measures what a grid barrier costs instead.
It also measures the barrier with the next phase's first weight chunk already loaded
(``PRELOAD``). The weights do not depend on the phase before, so a program can fetch them while
it waits for the others.

The chain: phase p computes out_p = in_p @ W_pᵀ (``silu`` phases: silu(g)·u of W_p's two halves,
as ``plugins/linear``'s silu·mul) for the same few rows. Each phase's input and output are regions
of one activation buffer, described by a table of int64 rows
``(w_offset, N, K, in_offset, out_offset, silu)``: the bench chains qkv → o → gate/up → down per
layer, each reading the one before.

Work split: each phase's N output rows are cut into ``BLOCK_N``-row tiles, and tile t goes to
program t mod P. At 16-row tiles every batch-1 shape splits within 3 % of even over 132
programs. Each tile is one program's fp32 dot over the whole of K (``_stream_tiles``, the engine
kernel's weight stream), so the bits do not depend on the grid. They can differ from the engine
kernel's where its chunk (``BLOCK_K``) differs.

``FLAT``: each program runs its tiles of a phase as one loop of (tile, K chunk) steps
(``_flat_phase``), so the software pipeline keeps its weight loads in flight from one tile into
the next; without it every tile runs its own loop and the pipeline fills again per tile (the
suspect when this kernel, one launch per GEMM, measured 1.7 × the engine's GEMMs in the twelfth
session). The same bits.

``GRID_SYNC``: one launch runs phases [lo, hi) with ``_count_barrier`` (the Markov kernel's:
a counter that only grows, kept between calls) between them. Every program must be resident (the
launcher sizes the grid to the SMs; a program that gives up waiting raises ctl[2]). Without it,
the launcher runs one launch per phase: the same arithmetic, for the CPU interpreter and as the
bench's baseline.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse_spark.plugins.linear.triton_kernel import _first_tiles, _mma, _silu_mul, _stream_tiles
from muse_spark.plugins.markov.triton_kernel import _count_barrier
from muse_spark.plugins.triton_math import to_rne

TABLE_COLS = 6  # w_offset, N, K, in_offset, out_offset, silu
DEFAULT_CONFIG = dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=3)


@triton.jit
def _phase_row(table_ptr, p, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Phase p's table row. Offsets are multiples of 16 elements and N, K of the tiles
    (``chain_table`` checks): said to the compiler, so the weight loads are vectorized and
    pipelined as the engine kernel's are (whose sizes are specialized arguments)."""
    row = table_ptr + p * 6
    return (tl.multiple_of(tl.load(row), 16), tl.multiple_of(tl.load(row + 1), BLOCK_N),
            tl.multiple_of(tl.load(row + 2), BLOCK_K), tl.multiple_of(tl.load(row + 3), 16),
            tl.multiple_of(tl.load(row + 4), 16), tl.load(row + 5))


@triton.jit
def _tile(w_ptr, act_ptr, M, t, w_off, N, K, in_off, out_off, silu, rm, mmask, w_first, u_first,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FIRST: tl.constexpr,
          IEEE_DOT: tl.constexpr):
    """Output rows [t·BLOCK_N, (t+1)·BLOCK_N) of one phase for the M rows of its input."""
    DT = act_ptr.dtype.element_ty
    rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    wp = w_ptr + w_off
    xp = act_ptr + in_off
    yp = act_ptr + out_off + rm[None, :] * N + rn[:, None]  # [BLOCK_N, BLOCK_M]: yᵀ, rows of N
    if silu != 0:
        acc, acc_u = _stream_tiles(xp, wp, rn, rn + N, rm, nmask, mmask, K, K, BLOCK_M, BLOCK_N, BLOCK_K, True, True,
                                   True, IEEE_DOT, FIRST, w_first, u_first)
        tl.store(yp, _silu_mul(acc, acc_u, DT), mask=nmask[:, None] & mmask[None, :])
    else:
        acc, acc_u = _stream_tiles(xp, wp, rn, rn, rm, nmask, mmask, K, K, BLOCK_M, BLOCK_N, BLOCK_K, True, True,
                                   False, IEEE_DOT, FIRST, w_first, u_first)
        tl.store(yp, to_rne(acc, DT), mask=nmask[:, None] & mmask[None, :])


@triton.jit
def _flat_phase(w_ptr, act_ptr, pid, n_prog, w_off, N, K, in_off, out_off, rm, mmask,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr,
                IEEE_DOT: tl.constexpr):
    """One phase's tiles of this program (t = pid, pid + n_prog, ...) as one stream of (tile, K chunk)
    steps: a single loop, so the software pipeline keeps the weight loads going from one tile into
    the next instead of filling again at every tile (``_tile`` runs a loop per tile). Each tile's
    sum starts from zero at its chunk 0 and takes its chunks in order, as ``_stream_tiles`` does:
    the same bits. ``TWO``: a silu phase (both halves of W, silu·mul stored)."""
    DT = act_ptr.dtype.element_ty
    n_tiles = tl.cdiv(N, BLOCK_N)
    chunks = K // BLOCK_K  # (chain_table: K is a multiple of BLOCK_K, N of BLOCK_N)
    mine = tl.where(pid < n_tiles, tl.cdiv(n_tiles - pid, n_prog), 0)
    rb = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(0, mine * chunks):
        j = i // chunks
        c = i - j * chunks
        rn = (pid + j * n_prog) * BLOCK_N + rb
        k0 = c * BLOCK_K
        w = tl.load(w_ptr + w_off + rn.to(tl.int64)[:, None] * K + k0 + rk[None, :])
        xt = tl.load(act_ptr + in_off + rm[None, :] * K + k0 + rk[:, None], mask=mmask[None, :], other=0.0)
        fresh = c == 0
        acc = _mma(w, xt, tl.where(fresh, 0.0, acc), IEEE_DOT)
        if TWO:
            wu = tl.load(w_ptr + w_off + (rn + N).to(tl.int64)[:, None] * K + k0 + rk[None, :])
            acc_u = _mma(wu, xt, tl.where(fresh, 0.0, acc_u), IEEE_DOT)
        if c == chunks - 1:
            yp = act_ptr + out_off + rm[None, :] * N + rn[:, None]  # [BLOCK_N, BLOCK_M]: yᵀ, rows of N
            if TWO:
                tl.store(yp, _silu_mul(acc, acc_u, DT), mask=mmask[None, :])
            else:
                tl.store(yp, to_rne(acc, DT), mask=mmask[None, :])


@triton.jit
def _prefetch_next_rows(w_ptr, table_ptr, p, pid, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NBYTES: tl.constexpr):
    """Before the barrier into phase p: the first ``NBYTES`` of each weight row of this program's first
    tile of phase p (both halves' rows for a silu phase) prefetched into L2 (fire-and-forget
    ``cp.async.bulk.prefetch.L2``): the weights do not depend on the phase before, so their stream
    can start while the program waits. → an int32 zero ordered after the prefetches are issued."""
    w_off, N, K, _i, _o, silu = _phase_row(table_ptr, p, BLOCK_N, BLOCK_K)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    size = tl.minimum(K * 2, NBYTES).to(tl.int32)  # bytes (K, a multiple of BLOCK_K: 16-byte multiples)
    base = w_ptr.to(tl.pointer_type(tl.int8))
    a = base + (w_off + tl.where(ok, rows, 0).to(tl.int64) * K) * 2
    b = base + (w_off + (tl.where(ok, rows, 0) + N).to(tl.int64) * K) * 2
    z = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $4; "
        "setp.ne.s32 p, $5, 0; @p cp.async.bulk.prefetch.L2.global [$2], $4; mov.u32 $0, 0; }",
        "=r,l,l,r,r,r", [a, b, ok.to(tl.int32), tl.full((BLOCK_N,), 0, tl.int32) + size,
                         (ok & (silu != 0)).to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1)
    return tl.max(z, axis=0)


@triton.jit
def _chain_kernel(
    w_ptr,  # every phase's weight, flat (bf16/fp16)
    act_ptr,  # the activations, flat: phase inputs and outputs [M, K] / [M, N] row-major at their offsets
    table_ptr,  # [phases, 6] int64
    ctl_ptr,  # int64 [3]: the barrier's counter (kept, only grows), -, the error flag
    M, lo, hi,  # rows; the phases this launch runs
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GRID_SYNC: tl.constexpr,
    PRELOAD: tl.constexpr, SPIN: tl.constexpr, IEEE_DOT: tl.constexpr, FLAT: tl.constexpr = False,
    NEXT_L2: tl.constexpr = 0,  # with GRID_SYNC: bytes of each next-phase weight row prefetched before a barrier
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    w_first = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)
    u_first = w_first
    for p in range(lo, hi):
        w_off, N, K, in_off, out_off, silu = _phase_row(table_ptr, p, BLOCK_N, BLOCK_K)
        n_tiles = tl.cdiv(N, BLOCK_N)
        first = pid
        if FLAT:  # this program's tiles as one stream (no per-tile loop below)
            if silu != 0:
                _flat_phase(w_ptr, act_ptr, pid, n_prog, w_off, N, K, in_off, out_off, rm, mmask, BLOCK_M,
                            BLOCK_N, BLOCK_K, True, IEEE_DOT)
            else:
                _flat_phase(w_ptr, act_ptr, pid, n_prog, w_off, N, K, in_off, out_off, rm, mmask, BLOCK_M,
                            BLOCK_N, BLOCK_K, False, IEEE_DOT)
            first = n_tiles
        elif PRELOAD:
            if p > lo:  # this program's first tile: its first K chunk was loaded before the barrier
                if pid < n_tiles:
                    _tile(w_ptr, act_ptr, M, pid, w_off, N, K, in_off, out_off, silu, rm, mmask, w_first, u_first,
                          BLOCK_M, BLOCK_N, BLOCK_K, True, IEEE_DOT)
                first = pid + n_prog
        for t in range(first, n_tiles, n_prog):
            _tile(w_ptr, act_ptr, M, t, w_off, N, K, in_off, out_off, silu, rm, mmask, w_first, u_first,
                  BLOCK_M, BLOCK_N, BLOCK_K, False, IEEE_DOT)
        if GRID_SYNC and p + 1 < hi:
            if PRELOAD:  # the next phase's first K chunk of this program's first tile, before the wait
                nw_off, nN, nK, _i, _o, nsilu = _phase_row(table_ptr, p + 1, BLOCK_N, BLOCK_K)
                rn0 = pid * BLOCK_N + tl.arange(0, BLOCK_N)
                w_first, u_first = _first_tiles(w_ptr + nw_off, rn0, rn0 + nN, rn0 < nN, nK, BLOCK_K, True,
                                                nsilu != 0)  # (no up half: nothing read past the weight)
            z = 0
            if NEXT_L2 > 0:
                z = _prefetch_next_rows(w_ptr, table_ptr, p + 1, pid, BLOCK_N, BLOCK_K, NEXT_L2)
            _count_barrier(ctl_ptr + z, n_prog, SPIN)


def chain_table(phases: list[dict], M: int, w: torch.Tensor, act: torch.Tensor,
                config: dict | None = None) -> torch.Tensor:
    """[phases, 6] int64 on ``act``'s device from dicts with w_offset, N, K, in_offset, out_offset,
    silu, checked against the buffers and the configuration's tiles (here, on the host: a launch
    inside a CUDA graph capture cannot read the table back)."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    keys = ("w_offset", "N", "K", "in_offset", "out_offset", "silu")
    rows = [[int(ph[k]) for k in keys] for ph in phases]
    for w_off, N, K, i_off, o_off, silu in rows:
        if w_off % 16 or i_off % 16 or o_off % 16:
            raise ValueError(f"chain: offsets {w_off}, {i_off}, {o_off} must be multiples of 16 elements")
        if K % cfg["BLOCK_K"] or N % cfg["BLOCK_N"]:
            raise ValueError(f"chain: phase N {N}, K {K} must be multiples of BLOCK_N {cfg['BLOCK_N']} and "
                             f"BLOCK_K {cfg['BLOCK_K']}")
        if w_off + (2 if silu else 1) * N * K > w.numel() or max(i_off + M * K, o_off + M * N) > act.numel():
            raise ValueError("chain: a phase reaches past the weight or activation buffer")
    return torch.tensor(rows, dtype=torch.int64, device=act.device)


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_chain(w: torch.Tensor, act: torch.Tensor, table: torch.Tensor, ctl: torch.Tensor, M: int,
                 grid_sync: bool, preload: bool = False, programs: int | None = None, phases_per_launch: int = 0,
                 config: dict | None = None, interpret: bool = False, spin: int = 1 << 22, flat: bool = False,
                 next_l2: int = 0) -> None:
    """Runs the chain of ``table`` (``chain_table``, made with the same ``config``) over ``act`` in
    place. ``grid_sync``: phases share launches (``phases_per_launch`` each, 0: all in one),
    separated by grid barriers; ``programs`` defaults to the SM count (all resident). Otherwise
    one launch per phase, with the same default grid, so the work split is the same. ``ctl``: int64
    [3], zeroed once and kept (ctl[2] != 0: a program gave up waiting). ``flat``: each program runs
    its tiles of a phase as one stream of (tile, K chunk) steps (``_flat_phase``; not with
    ``preload``): the same bits. ``next_l2``: with ``grid_sync``, before each barrier every program
    prefetches into L2 the first ``next_l2`` bytes (a multiple of 16) of each weight row of its
    first tile of the next phase (the same bits: a prefetch writes nothing)."""
    if flat and preload:
        raise ValueError("chain: flat streams load no first chunk ahead (preload): one or the other")
    if next_l2 % 16 or next_l2 < 0 or (next_l2 and (not grid_sync or interpret)):
        raise ValueError(f"chain: next_l2 {next_l2}: a multiple of 16 bytes, with grid barriers on the GPU only")
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    n_phases = table.shape[0]
    if grid_sync and interpret:
        raise ValueError("chain: the grid barrier needs every program resident (not the CPU interpreter)")
    if programs is None:
        programs = 4 if interpret else sm_count(act.device)
    if grid_sync and not interpret and programs > sm_count(act.device):
        raise ValueError(f"chain: {programs} programs cannot all be resident on {sm_count(act.device)} SMs")
    block_m = max(16, triton.next_power_of_2(M))
    step = (phases_per_launch or n_phases) if grid_sync else 1
    for lo in range(0, n_phases, step):
        _chain_kernel[(programs,)](
            w, act, table, ctl, M, lo, min(lo + step, n_phases), BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], GRID_SYNC=grid_sync, PRELOAD=preload and grid_sync, SPIN=spin,
            IEEE_DOT=interpret, FLAT=flat, NEXT_L2=next_l2, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
