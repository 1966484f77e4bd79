"""Gated FP32 residual add, optionally fused with the RMSNorm that follows it."""
