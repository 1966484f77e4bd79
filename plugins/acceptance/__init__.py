"""The lossless acceptance rule of a speculative step (``plugins.acceptance.reference.accept``) in three kernels."""
