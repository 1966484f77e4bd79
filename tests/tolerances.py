"""One tolerance table, with the reasoning, for every comparison of two paths.

* float32: different summation orders (chunked prefill vs one pass, batched
  vs single-row matmuls) move results by a few ulps, amplified through a few
  layers and norms: 1e-4 relative/absolute is ample and still catches any
  real bug (a wrong mask or position shifts values by O(1e-1)).
* bfloat16: the compute dtype rounds every matmul output to 8 mantissa bits
  (relative step 2^-8 ≈ 4e-3); one rounding flip propagates through the
  residual stream, so compare at 3e-2.
* probabilities: softmax outputs in fp32 from the same logits, 1e-6 absolute.

The Triton kernels against their references (tests/kernels/):

* stream (fp32): exact. The gated residual kernel rounds g·branch and the add
  separately, as torch's two kernels do (no fused multiply-add).
* normed: the kernel sums x² in another order than torch's reduction and both
  use an approximate rsqrt, so the fp32 value before the cast differs by a few
  ulps (~1e-6 relative); the cast to the output dtype then lands at most one
  ulp of that dtype apart: 2^-7 relative for bf16 (8 significant bits), 2^-10
  for fp16; for an fp32 output, the few fp32 ulps themselves.
* draft probabilities (the Markov kernel's): the draft logits differ from
  torch's by the summation order of the r-term GEMV (~1e-6 absolute at these
  scales), exp is libdevice's in both.
* tokens: exact. The one source of difference is that summation order, so
  the token tests use weights whose products and sums are exact in fp32
  (small multiples of 2^-3): then every order gives the same logits and the
  tokens must be identical. With random bf16 weights, a token may flip only
  where two candidates tie within that rounding (≲ 1e-3 of rows).
"""

import torch

TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
    "probs": dict(rtol=1e-5, atol=1e-6),
    "normed_bf16": dict(rtol=2**-7, atol=1e-6),
    "normed_fp16": dict(rtol=2**-10, atol=1e-6),
    "normed_fp32": dict(rtol=1e-5, atol=1e-6),
    "draft_probs": dict(rtol=1e-4, atol=1e-6),
    "random_weight_token_flips": 1e-3,
}
NORM_TOL = {torch.bfloat16: TOL["normed_bf16"], torch.float16: TOL["normed_fp16"], torch.float32: TOL["normed_fp32"]}
