"""The kernel tests' fixtures: the Triton ops' module and the Markov kernel's, imported on first use
(importing them imports Triton)."""

from __future__ import annotations

import pytest

import muse_spark.plugins  # noqa: F401  (registers the reference ops)


@pytest.fixture(scope="module")
def tops():
    from muse_spark.plugins import triton_ops

    return triton_ops


@pytest.fixture(scope="module")
def kern():
    from muse_spark.plugins.markov import triton_kernel

    return triton_kernel
