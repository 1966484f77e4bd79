"""One tolerance table, with the reasoning, for every comparison of two paths.

* float32: different summation orders (chunked prefill vs one pass, batched
  vs single-row matmuls) move results by a few ulps, amplified through a few
  layers and norms: 1e-4 relative/absolute is ample and still catches any
  real bug (a wrong mask or position shifts values by O(1e-1)).
* bfloat16: the compute dtype rounds every matmul output to 8 mantissa bits
  (relative step 2^-8 ≈ 4e-3); one rounding flip propagates through the
  residual stream, so compare at 3e-2.
* probabilities: softmax outputs in fp32 from the same logits, 1e-6 absolute.
"""

import torch

TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
    "probs": dict(rtol=1e-5, atol=1e-6),
}
