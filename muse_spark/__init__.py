"""Muse Spark DSpark deployment backend: one import namespace.

Subpackages: ``muse_spark.builder`` (checkpoints → engines),
``muse_spark.plugins`` (custom ops: references and GPU kernels),
``muse_spark.runtime`` (engines → speculative generation),
``muse_spark.models`` (the plain-torch reference models).
"""

__version__ = "0.1.0"
