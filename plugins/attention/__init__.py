"""Masked GQA attention over a static KV window: the split-KV Triton kernel (``triton_kernel``)."""
