"""The lossless acceptance rule of a speculative step (``runtime.sampling.accept``) in three kernels."""
