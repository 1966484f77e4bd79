"""Exactly-rounded arithmetic for the Triton plugin kernels (imports Triton).

The plugin kernels must reproduce their plain-torch references bit for bit
where the reference's rounding decides a result (a sampled token, the fp32
residual stream). Two habits of the Triton compiler get in the way:

* it contracts ``a * b + c`` into one fused multiply-add (one rounding instead
  of the reference's two), and
* ``tl.log`` / ``tl.exp`` lower to the approximate hardware instructions,
  while torch's CUDA kernels call the accurate CUDA math library.

So the kernels call these helpers: on the GPU they are libdevice's
``__nv_fmul_rn`` / ``__nv_fadd_rn`` (explicit round-to-nearest, which ptxas
never contracts) and ``__nv_logf`` / ``__nv_expf`` / ``__nv_powf`` / ``__nv_cosf`` / ``__nv_sinf`` (the
CUDA math library that torch's kernels use; the approximate ``cos.approx`` would be far
off at RoPE's large angles). Triton's CPU interpreter (``TRITON_INTERPRET=1``)
cannot call libdevice; there numpy's IEEE float32 arithmetic is already
uncontracted, and ``log``/``exp`` are numpy's. The interpreter also truncates
float32 → bfloat16 where the GPU rounds to nearest even, so ``to_rne`` rounds
explicitly there.

Only Triton kernel modules import this module, and only
``muse_spark.plugins.triton_ops`` imports those.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if interpreting():

    @triton.jit
    def mul_rn(a, b):
        return a * b

    @triton.jit
    def add_rn(a, b):
        return a + b

    @triton.jit
    def div_rn(a, b):
        return a / b

    @triton.jit
    def log_exact(x):
        return tl.log(x)

    @triton.jit
    def exp_exact(x):
        return tl.exp(x)

    # In float64, rounded once: the correctly rounded float32 result almost always, as a CPU libm
    # gives it (numpy's float32 pow is not reachable from the interpreter).
    @triton.jit
    def pow_exact(x, y):
        return tl.exp(y.to(tl.float64) * tl.log(x.to(tl.float64))).to(tl.float32)

    @triton.jit
    def cos_exact(x):
        return tl.cos(x.to(tl.float64)).to(tl.float32)

    @triton.jit
    def sin_exact(x):
        return tl.sin(x.to(tl.float64)).to(tl.float32)

    @triton.jit
    def to_rne(x, dtype: tl.constexpr):
        if dtype == tl.bfloat16:  # round the fp32 bits to nearest even, then the cast truncates exactly
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = b.to(tl.float32, bitcast=True)
        if dtype == tl.float8e4nv:  # E4M3 (|x| ≤ 448): the interpreter's cast does not carry a rounding into the
            # exponent (126 became 64), so round here and cast an exact value: 3 mantissa bits from 2^-6 up, and
            # below it steps of 2^-9 (the subnormals), by adding and taking away 1.5·2^23 (ties to even)
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000
            a = tl.abs(x)
            sub = ((a * 512.0 + 12582912.0) - 12582912.0) / 512.0
            x = tl.where(a >= 0.015625, b.to(tl.float32, bitcast=True), tl.where(x < 0, -sub, sub))  # (its cast
            # makes −0 +0: a sign the dequantized zero does not carry into any product)
        return x.to(dtype)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def mul_rn(a, b):
        return libdevice.mul_rn(a, b)

    @triton.jit
    def add_rn(a, b):
        return libdevice.add_rn(a, b)

    @triton.jit
    def div_rn(a, b):
        return libdevice.div_rn(a, b)

    @triton.jit
    def log_exact(x):
        return libdevice.log(x)

    @triton.jit
    def exp_exact(x):
        return libdevice.exp(x)

    @triton.jit
    def pow_exact(x, y):
        return libdevice.pow(x, y)

    @triton.jit
    def cos_exact(x):
        return libdevice.cos(x)

    @triton.jit
    def sin_exact(x):
        return libdevice.sin(x)

    @triton.jit
    def to_rne(x, dtype: tl.constexpr):
        return x.to(dtype)  # cvt.rn (E4M3: cvt.rn.satfinite): round to nearest even


# Programmatic dependent launch (docs/pdl-research.md; an option the engines do not use yet).
# A kernel compiled with ``PDL`` may let the next kernel of the graph launch early
# (``griddepcontrol.launch_dependents``), then waits until the kernels it depends on have
# finished and their writes are visible (``griddepcontrol.wait``). Every access to memory an
# earlier kernel writes, and every store, must come after the wait: the kernels make those
# addresses depend on the returned zero (a data dependency no compiler reorders), which is why the
# asm is pure and returns a value (torch's mutation analysis of a user kernel also refuses impure
# asm). Under a normal launch the wait returns at once: the kernel before has already finished.
# Without ``PDL`` (and on Triton's CPU interpreter, which has no inline asm) the zero is a
# constant and nothing changes.
@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """``PDL`` 1: trigger the dependents, then wait for the upstream kernels; 2: only wait (the
    dependents launch as this kernel's programs exit); 3: only wait here, the kernel triggers later
    (``pdl_release``); 0: neither. → an int32 zero to add to indices."""
    return pdl_enter_after(PDL, tl.zeros((), tl.int32))


@triton.jit
def pdl_enter_after(PDL: tl.constexpr, after):
    """``pdl_enter`` ordered after ``after`` (an int32 from work that reads no upstream data, which so
    overlaps the kernel before)."""
    if PDL == 1:
        z = tl.inline_asm_elementwise("griddepcontrol.launch_dependents; griddepcontrol.wait; mov.u32 $0, 0;",
                                      "=r,r", [after], dtype=tl.int32, is_pure=True, pack=1)
    elif PDL == 2 or PDL == 3:
        z = tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r,r", [after], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        z = 0
    return z


@triton.jit
def pdl_release(after):
    """Trigger the dependents' launch (``PDL`` 3's late trigger) once ``after`` (a tensor: the work the
    program must finish first, e.g. a GEMM's accumulators) is computed → int32 zeros of its shape.
    The asm is pure, so only a use keeps it and orders it: the caller puts ``== 0`` of the zeros
    into the mask of the stores that follow, never into their addresses (Inductor's analysis of what
    a user kernel writes follows a store's address back to the loads it came from, and would name
    the GEMM's inputs as written; a mask is not followed). Each element's asm triggers again: the
    instruction is idempotent. Triggering before the stores is safe: a dependent's
    ``griddepcontrol.wait`` still waits for this whole grid to finish and flush its writes."""
    return tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r,r",
                                     [after.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=True, pack=1)


# The least W8A8 row scale (``plugins.linear.reference.quantize_rows``): the smallest normal fp32, so 1 / scale stays
# finite
MIN_ROW_SCALE = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def e4m3_codes(v, inv):
    """Values v (fp32) as E4M3 codes, as ``quantize_rows`` computes them: v · inv (1 / the row's scale), saturated at
    ±448, rounded to nearest even."""
    return to_rne(tl.minimum(tl.maximum(mul_rn(v, inv), -448.0), 448.0), tl.float8e4nv)


@triton.jit
def row_scale(v, STATIC: tl.constexpr, in_scale_ptr):
    """A W8A8 row's scale, as ``quantize_rows`` computes it: ``STATIC``, the float32 at ``in_scale_ptr`` (at least
    ``MIN_ROW_SCALE``); else the row's absmax / 448 (v: the whole row in fp32, zeros past its end)."""
    if STATIC:
        scale = tl.maximum(tl.load(in_scale_ptr), MIN_ROW_SCALE)
    else:
        scale = tl.maximum(div_rn(tl.max(tl.abs(v), 0), 448.0), MIN_ROW_SCALE)
    return scale
