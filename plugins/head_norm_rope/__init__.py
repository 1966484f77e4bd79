"""The attention's per-head q/k RMS norm and RoPE in one pass: the Triton kernel (``triton_kernel``)."""
