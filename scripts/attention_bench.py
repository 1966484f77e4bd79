#!/usr/bin/env python3
"""Attention of one target layer at the Muse-Spark step shape, side by side on one GPU:

    python scripts/attention_bench.py [--batches 1,8,32] [--context 1024] [--window 1152] [--json out.json]

For each batch: the split-KV Triton kernel (``MUSE_SPARK_ATTENTION=triton``), the SDPA path
(``sdpa``, the default) and the fp32 einsum reference, each captured 16× in a CUDA graph and
timed by its replays (as inside the step's graph, without Python's launch cost); the K/V bytes
the step must read (the requests' lengths, not the window) over the measured copy bandwidth is
the roofline. Prints a table of ms, ratio to the roofline, and the largest deviation from the
reference; 32 layers of this is the attention share of the speculative step.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--window", type=int, default=1152)
    p.add_argument("--queries", type=int, default=8, help="γ + 1")
    p.add_argument("--iters", type=int, default=20, help="graph replays")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from muse_spark.bench import copy_bandwidth
    from muse_spark.plugins.markov.bench import time_in_graph
    from muse_spark.models.layers import _attend_sdpa, attend_reference
    from muse_spark.plugins import triton_ops

    dev = torch.device("cuda")
    H, KV, dh, S, T = 32, 8, 128, a.queries, a.window
    bw = copy_bandwidth(dev)["GBps"]
    rows, out = [], {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "copy_GBps": bw,
                     "shape": dict(H=H, KV=KV, head_dim=dh, queries=S, window=T, context=a.context), "batches": {}}
    for B in a.batches:
        g = torch.Generator(device=dev).manual_seed(B)
        q = torch.randn(B, S, H, dh, device=dev, generator=g).bfloat16()
        k = torch.randn(B, T, KV, dh, device=dev, generator=g).bfloat16()
        v = torch.randn(B, T, KV, dh, device=dev, generator=g).bfloat16()
        pos = a.context + torch.arange(S, device=dev)
        mask = (torch.arange(T, device=dev)[None, :] <= pos[:, None]).expand(B, S, T).contiguous()
        ref = attend_reference(q, k, v, mask).float()
        kv_bytes = B * (a.context + S) * KV * dh * 2 * 2
        roof_ms = kv_bytes / (bw * 1e9) * 1e3
        res = {"kv_bytes": kv_bytes, "roofline_ms": roof_ms}
        for name, fn in (("triton", lambda: triton_ops.attention(q, k, v, mask)),
                         ("sdpa", lambda: _attend_sdpa(q, k, v, mask)),
                         ("einsum_fp32", lambda: attend_reference(q, k, v, mask))):
            us, how = time_in_graph([fn], reps=16, replays=a.iters)
            err = (fn().float() - ref).abs().max().item()
            res[name] = dict(median_ms=us / 1e3, how=how, max_abs_err=err, x_roofline=us / 1e3 / roof_ms)
        out["batches"][B] = res
        rows.append(f"| {B} | {roof_ms * 1e3:.1f} | " + " | ".join(
            f"{res[n]['median_ms'] * 1e3:.1f} ({res[n]['x_roofline']:.1f}×, err {res[n]['max_abs_err']:.1e})"
            for n in ("triton", "sdpa", "einsum_fp32")) + " |")
        print(rows[-1], flush=True)
    print(f"\n{out['device']}, torch {out['torch']}, copy bandwidth {bw:.0f} GB/s; one layer, "
          f"{S} queries × {H}/{KV} heads × {dh}, window {T}, context {a.context}; µs (× roofline, max |err|)\n")
    print("| batch | K/V roofline µs | triton | sdpa | fp32 einsums |\n|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
