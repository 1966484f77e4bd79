"""Serving: Triton Inference Server model repository and launcher."""
