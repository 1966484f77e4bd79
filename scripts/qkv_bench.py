#!/usr/bin/env python3
"""The attention's qkv step at batch 1, fused against unfused, on the Muse-Spark 8B shapes.

    python scripts/qkv_bench.py [--json out.json]     # on a CUDA device

Graph-timed (``plugins/markov/bench.time_in_graph``) over 32 layers' own weights and caches, so
no weight stays in L2, as in a step. Prints µs per layer for
(a) unfused: the skinny GEMM (``linear_triton``), then ``head_norm_rope_cache_triton`` (the q/k
    norm, RoPE and the K/V cache write), two launches;
(b) fused: ``linear_qkv_cache_triton`` (all of it in the GEMM's epilogue), one launch;
and the plain GEMM alone, with the ratios, and checks that (b)'s q matches (a)'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse_spark.plugins import triton_ops  # noqa: E402,F401  (registers the ops)
from muse_spark.plugins.markov.bench import time_in_graph  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rows", type=int, default=8, help="B·S: 8 = batch 1, γ = 7")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    H, KV, dh, D, T = 32, 8, 128, 4096, 1152
    S = a.rows
    ops = torch.ops.muse_spark
    ws = [(torch.randn((H + 2 * KV) * dh, D, device=dev) * 0.02).to(torch.bfloat16) for _ in range(a.layers)]
    kcs = [torch.randn(2, T, KV, dh, device=dev).to(torch.bfloat16) for _ in range(a.layers)]
    vcs = [torch.randn(2, T, KV, dh, device=dev).to(torch.bfloat16) for _ in range(a.layers)]
    x = torch.randn(1, S, D, device=dev).to(torch.bfloat16)
    pos = torch.arange(1024, 1024 + S, device=dev)[None]
    slots = torch.zeros(1, dtype=torch.int64, device=dev)

    def unfused(i):
        def call():
            qkv = ops.linear_triton(x, ws[i], False)
            qk = qkv[..., : (H + KV) * dh].reshape(1, S, H + KV, dh)
            v = qkv[..., (H + KV) * dh :].reshape(1, S, KV, dh)
            return ops.head_norm_rope_cache_triton(qk, v, pos, 1e-5, 5e5, True, kcs[i], vcs[i], slots)
        return call

    def fused(i):
        return lambda: ops.linear_qkv_cache_triton(x, ws[i], pos, slots, kcs[i], vcs[i], 1e-5, 5e5, True, H)

    def gemm(i):
        return lambda: ops.linear_triton(x, ws[i], False)

    n = a.layers
    res = {}
    for name, make in (("gemm_only", gemm), ("unfused", unfused), ("fused", fused)):
        us, how = time_in_graph([make(i) for i in range(n)], reps=n, replays=20)
        res[name] = us
        print(f"{name:10s} {us:7.2f} µs per layer ({how})")
    q_a, q_b = unfused(0)(), fused(0)()
    diff = (q_a.float() - q_b.float()).abs().max().item()
    res["q_max_abs_diff"] = diff
    res["q_equal_fraction"] = (q_a == q_b).float().mean().item()
    print(f"fused / unfused {res['fused'] / res['unfused']:.3f}; fused / GEMM alone {res['fused'] / res['gemm_only']:.3f}; "
          f"q max |diff| {diff:.3g}, equal {res['q_equal_fraction']:.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=S, layers=n, **res), indent=1))


if __name__ == "__main__":
    main()
