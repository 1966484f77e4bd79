#!/usr/bin/env python3
"""Where the fused attention + cache write (``MUSE_SPARK_ATTENTION_CACHE=1``) loses its time, on one GPU:

    python scripts/attention_cache_bench.py [--batch 1] [--layers 32] [--json out.json]
    ncu --clock-control none --profile-from-start off ... python scripts/attention_cache_bench.py --ncu

The twelfth session's step profile (docs/benchmarks.md) had the fused partial kernel at 22 µs a
layer against 6.8 µs for the plain partial kernel plus 4.6 µs for the q/k norm + cache kernel it
replaces. Each variant below runs the step's attention shape (γ + 1 = 8 queries, 32/8 heads × 128,
the mask in bounds form over a 1152-key window, context 1024) for ``--layers`` layers with their
own caches, captured in a CUDA graph and timed by its replays; variants leave one stage of the
fused kernel out, so differences place its time (timing only: ``no_rope`` changes the result):

* ``norm_cache+attention``: the default path (``head_norm_rope_cache`` then the attention);
* ``norm_cache`` / ``attention``: each alone; ``norm_cache_no_rope``: the norm kernel without the rotation;
* ``norm_cache_table`` (``+attention``): the norm kernel reading the step's RoPE table
  (``launch_rope_table``, computed once a pass over the layers, its time shared by them);
* ``fused``: ``launch_attention(new_kv=...)``, the fused path;
* ``fused_table``: the fused path reading the step's RoPE table (thirteenth session);
* ``fused_no_rope``: the same without the rotation (no cos/sin/pow);
* ``fused_no_store``: positions past the caches, so no program stores new keys (the barrier stays);
* ``fused_table SPLITS=g`` (``--splits``): ``fused_table`` with g splits of the window a program
  (the default lets the launcher choose: ``splits_per_program``); checked bit for bit against it.

``--ncu``: each kernel once, between cudaProfilerStart/Stop, for Nsight Compute.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, KV, DH, S = 32, 8, 128, 8
EPS, THETA = 1e-6, 5e5


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--window", type=int, default=1152)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--ncu", action="store_true", help="run each kernel once inside a profiler range (for ncu)")
    p.add_argument("--splits", default="1,3,9",
                   help="SPLITS values timed beside the default (fused_table), comma-separated")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    a.splits = [int(g) for g in a.splits.split(",") if g]
    from muse_spark.bench import time_fn
    from muse_spark.plugins.attention.triton_kernel import launch_attention
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_head_norm_rope_cache, launch_rope_table

    dev = torch.device("cuda")
    B, T = a.batch, a.window
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, S, H + KV, DH, device=dev, generator=g).bfloat16()  # the layer's raw q and k heads
    v = torch.randn(B, S, KV, DH, device=dev, generator=g).bfloat16()
    slots = torch.arange(B, device=dev)
    pos = (a.context + torch.arange(S, device=dev)).expand(B, S).contiguous()
    past = pos + 4 * T  # outside the caches: nothing is stored
    caches = [(torch.randn(B + 1, T, KV, DH, device=dev, generator=g).bfloat16(),
               torch.randn(B + 1, T, KV, DH, device=dev, generator=g).bfloat16()) for _ in range(a.layers)]

    step = {}  # per pass over the layers: the RoPE table of the *_table variants

    def norm_cache(kc, vc, positions=pos, rope=True, table=None):
        return launch_head_norm_rope_cache(x, v, positions, EPS, THETA, rope, kc, vc, slots, table=table)

    def attention(q, kc, vc):
        return launch_attention(q, kc, vc, pos, slots, window=T)

    def fused(kc, vc, rope=True, positions=pos, table=None, config=None):
        return launch_attention(x, kc, vc, pos, slots, window=T, new_kv=(v, positions, EPS, THETA, rope), table=table,
                                config=config)

    q0 = norm_cache(*caches[0])
    variants = {
        "norm_cache+attention": lambda kc, vc: attention(norm_cache(kc, vc), kc, vc),
        "norm_cache": lambda kc, vc: norm_cache(kc, vc),
        "norm_cache_no_rope": lambda kc, vc: norm_cache(kc, vc, rope=False),
        "norm_cache_table": lambda kc, vc: norm_cache(kc, vc, table=step["table"]),
        "norm_cache_table+attention": lambda kc, vc: attention(norm_cache(kc, vc, table=step["table"]), kc, vc),
        "attention": lambda kc, vc: attention(q0, kc, vc),
        "fused": lambda kc, vc: fused(kc, vc),
        "fused_table": lambda kc, vc: fused(kc, vc, table=step["table"]),
        "fused_no_rope": lambda kc, vc: fused(kc, vc, rope=False),
        "fused_no_store": lambda kc, vc: fused(kc, vc, positions=past),
    }
    for g in a.splits:  # splits a program (the default: the launcher's choice, splits_per_program)
        variants[f"fused_table SPLITS={g}"] = lambda kc, vc, g=g: fused(kc, vc, table=step["table"],
                                                                         config=dict(SPLITS=g))
    same = torch.equal(fused(*caches[0]), attention(norm_cache(*caches[0]), *caches[0]))
    print(f"B={B}: fused output = norm_cache then attention, bit for bit: {same}", flush=True)
    step["table"] = launch_rope_table(pos, THETA, DH)
    table_same = torch.equal(norm_cache(*caches[0], table=step["table"]), norm_cache(*caches[0]))
    print(f"B={B}: norm_cache with the step's RoPE table = without, bit for bit: {table_same}", flush=True)
    fused_table_same = torch.equal(fused(*caches[0], table=step["table"]), fused(*caches[0]))
    print(f"B={B}: fused with the step's RoPE table = without, bit for bit: {fused_table_same}", flush=True)
    from muse_spark.plugins.attention.triton_kernel import program_splits

    chosen = program_splits(B, S * H // KV, T, KV, dev)
    splits_same = {}
    for g in a.splits:  # output and caches bit for bit as the default's, from the same caches
        runs = []
        for config in (None, dict(SPLITS=g)):
            kc, vc = (c.clone() for c in caches[0])
            runs.append((fused(kc, vc, table=step["table"], config=config), kc, vc))
        splits_same[g] = all(torch.equal(p, q) for p, q in zip(*runs))
    print(f"B={B}: the launcher runs {chosen} splits a program; SPLITS=g gives the default's output and caches "
          f"bit for bit: {splits_same}", flush=True)
    if a.ncu:
        for fn in variants.values():  # compiled and warm before the profiled range
            fn(*caches[0])
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step["table"] = launch_rope_table(pos, THETA, DH)
        for name in ("norm_cache", "attention", "fused", "fused_no_rope", "fused_no_store", "fused_table"):
            variants[name](*caches[1])
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return 0
    results = {}
    for name, fn in variants.items():
        def run(fn=fn, name=name):
            if "table" in name:  # one table a step, for every layer
                step["table"] = launch_rope_table(pos, THETA, DH)
            for kc, vc in caches:
                fn(kc, vc)

        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        t = time_fn(graph.replay, dev, a.replays)
        results[name] = t["median_ms"] * 1e3 / a.layers
        print(f"{name:22} {results[name]:7.2f} us a layer", flush=True)
        del graph
    base = results["norm_cache+attention"]
    print("\nvariant                 us/layer  vs default path")
    for name, us in results.items():
        print(f"{name:22} {us:9.2f} {us / base:8.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(args=vars(a), fused_equals_default=same,
                                                table_equals_in_place=table_same,
                                                fused_table_equals_in_place=fused_table_same,
                                                splits_per_program=chosen, splits_equal_default=splits_same,
                                                us_per_layer=results),
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
