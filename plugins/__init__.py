"""Custom ops of the Muse Spark backend, in the ``muse_spark`` torch.library namespace.

Each plugin folder holds ``reference.py`` (the plain-torch spec, used on CPU and
ROCm), ``triton_kernel.py`` (its Triton kernels) and ``op.py`` (the torch.library
registration, the one place that states the op's schema: its reference custom op,
where it has one, registered at import, and ``register_triton`` for its
``muse_spark::*_triton`` ops, which ``plugins.triton_ops`` calls), so every fast
path has the same schema as its reference. Importing this package registers the
reference ops; it never imports Triton or touches a GPU at import time.
"""

from muse_spark.plugins import keyed_random  # noqa: F401
from muse_spark.plugins.gated_residual import op as _gated_residual_op  # noqa: F401
from muse_spark.plugins.markov import op as _markov_op  # noqa: F401

PLUGIN_VERSIONS = {
    "gated_residual_add": 2,  # 2: the branch's own norm fused in (norm_branch)
    "markov_sample": 1,
    "keyed_random": 1,
    "head_norm_rope": 1,  # the attention's q/k norm + RoPE (bf16/fp16 on CUDA)
}
