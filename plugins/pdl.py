"""Programmatic dependent launch (PDL): which plugin kernels wait for their predecessor first, and
whether PDL is in effect (the kernel option, on a GPU that runs it). docs/pdl.md has the findings."""

from __future__ import annotations

import functools

import torch

from muse_spark.options import KernelOptions, current_options


# The plugin kernels that, compiled under ``KernelOptions.pdl`` (the default on sm_90+), execute
# ``griddepcontrol.wait`` before any global load or store (``plugins.triton_math.pdl_enter``;
# tests/kernels/test_pdl.py checks their sm_90 code). A build records them in its manifest; the
# runtime turns the edges into these kernels in its captured step graphs into programmatic ones
# (``runtime.cuda_graph.make_programmatic``).
# Only a kernel that waits may have one: it could otherwise read its predecessor's output early.
PDL_KERNELS = ("_linear_kernel", "_quantize_rows_kernel", "_split_sum_kernel", "_gated_residual_norm_kernel", "_head_norm_rope_kernel",
               "_head_norm_rope_cache_kernel", "_partial_kernel", "_combine_kernel")


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported() -> bool:
    """Whether the current CUDA device runs the PDL instructions (``griddepcontrol``: sm_90 and
    newer). False without CUDA. (Asked at every plugin op call: the capability is cached.)"""
    return torch.cuda.is_available() and _sm90_or_newer(torch.cuda.current_device())


def pdl_active(options: KernelOptions | None = None) -> bool:
    """PDL in effect: ``KernelOptions.pdl`` of ``options`` (default: the current ones) on a GPU that
    runs it. The one condition under which the plugin ops compile their kernels with the wait first,
    and so the one under which a build records them for programmatic edges (an edge into a kernel
    that does not wait would let it read its predecessor's output early)."""
    return (options or current_options()).pdl and pdl_supported()
