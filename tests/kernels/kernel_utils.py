"""What the kernel tests share: whether and where the kernels run, the skip marks, the operands
more than one op's tests build, and the ahead-of-time compile for sm_90."""

from __future__ import annotations

import os

import pytest
import torch

try:
    import triton

    HAS_TRITON = True
except ImportError:
    triton = None
    HAS_TRITON = False
ON_GPU = HAS_TRITON and torch.cuda.is_available()
INTERPRETED = HAS_TRITON and not ON_GPU and os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if ON_GPU else "cpu"

needs_kernels = pytest.mark.skipif(
    not (ON_GPU or INTERPRETED),
    reason="needs a CUDA device with Triton (or Triton's CPU interpreter: TRITON_INTERPRET=1)",
)
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device with Triton (compiles kernels)")

BIG = ON_GPU  # production sizes only where kernels are compiled


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
