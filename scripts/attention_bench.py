#!/usr/bin/env python3
"""Attention of one target layer at the Muse-Spark step shape, side by side on one GPU:

    python scripts/attention_bench.py [--batches 1,8,32] [--context 1024] [--window 1152] [--json out.json]
    python scripts/attention_bench.py --sweep   # + the Triton kernel over launch configurations

The inputs are as the step's layer package passes them: whole KV caches (one spare row) and each
request's slot. For each batch: the split-KV Triton kernel (the default, reading the cache rows in
place), the SDPA path (``MUSE_SPARK_ATTENTION=sdpa``: rows gathered, unseen keys zeroed, then
SDPA) and the fp32 einsum reference, each captured 16× in a CUDA graph and timed by its replays
(as inside the step's graph, without Python's launch cost). The roofline is the K/V bytes the
step must read (the requests' lengths, not the window) over the measured copy bandwidth. Prints
a table of µs, ratio to the roofline and the largest deviation from the reference; 37 layers
(32 target + 5 draft) of this is the attention share of the speculative step. ``--sweep`` adds
the kernel under each configuration of ``SWEEP`` (``launch_attention(config=...)``). Every run times
the bounds form under other splits and with 1–9 splits a program (``SPLITS``), each against the
default's bits.
"""

from __future__ import annotations

import argparse
import json

import torch

from muse_spark.bench import batch_list


# Launch configurations the sweep times (keys of plugins/attention DEFAULT_CONFIG, plus num_stages).
# EARLY_KV gives the same bits as without it (same split and tile); the split and the tile change
# them. (A register cap, maxnreg 96 or 64, was slower at every batch: docs/benchmarks.md.)
SWEEP = [dict(SPLIT_T=st, BLOCK_T=bt, num_warps=w, EARLY_KV=e, **({"num_stages": ns} if ns else {}))
         for st, bt in ((64, 64), (128, 64), (256, 64), (128, 32))
         for e in (False, True) for w in (4, 8) for ns in (None, 3)]
SWEEP += [dict(MERGE_CHUNK=c, merge_warps=w) for c, w in ((16, 1), (16, 2), (8, 2), (16, 8), (8, 1))]
# Half the rows a program (two row blocks per (request, KV head, split)): each row's arithmetic is
# row-local, so the bits should not change (the sweep records whether they equal the default's);
# fewer registers a program (247 at 32 rows on the H200: two programs an
# SM), for the batch-8/32 steps, where the kernel is occupancy-bound (docs/benchmarks.md, seventeenth
# session). Not yet timed.
SWEEP += [dict(BLOCK_M=16, num_warps=w) for w in (2, 4)]
# The mask in bounds form (models.layers.KeyBounds) under a few splits, timed in every run.
BOUNDS_CONFIGS = [dict(SPLIT_T=64, BLOCK_T=64), dict(SPLIT_T=64, BLOCK_T=32), dict(SPLIT_T=256, BLOCK_T=64)]
# Splits a program (SPLITS; the default lets the launcher choose, ``splits_per_program``), the bounds
# form, timed in every run: the same bits as the default (checked), so only the time may differ.
SPLITS_CONFIGS = [dict(SPLITS=g) for g in (1, 2, 3, 5, 9)]


def _name(c: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(c.items()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=batch_list, default=[1, 8, 32], help="comma-separated, e.g. 1,8,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--window", type=int, default=1152)
    p.add_argument("--queries", type=int, default=8, help="γ + 1")
    p.add_argument("--iters", type=int, default=20, help="graph replays")
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true", help="also time the Triton kernel under each SWEEP config")
    a = p.parse_args()
    from muse_spark.bench import copy_bandwidth
    from muse_spark.plugins.markov.bench import time_in_graph
    from muse_spark.models.layers import KeyBounds, _attend_sdpa, attend_reference, cache_rows
    from muse_spark.plugins import triton_ops
    from muse_spark.plugins.attention.triton_kernel import DEFAULT_CONFIG, launch_attention, program_splits

    dev = torch.device("cuda")
    H, KV, dh, S, T = 32, 8, 128, a.queries, a.window
    bw = copy_bandwidth(dev)["GBps"]
    rows, out = [], {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "copy_GBps": bw,
                     "shape": dict(H=H, KV=KV, head_dim=dh, queries=S, window=T, context=a.context), "batches": {}}
    for B in a.batches:
        g = torch.Generator(device=dev).manual_seed(B)
        q = torch.randn(B, S, H, dh, device=dev, generator=g).bfloat16()
        kc = torch.randn(B + 1, T, KV, dh, device=dev, generator=g).bfloat16()  # + a spare row
        vc = torch.randn(B + 1, T, KV, dh, device=dev, generator=g).bfloat16()
        slots = torch.arange(1, B + 1, device=dev)
        pos = a.context + torch.arange(S, device=dev)
        mask = (torch.arange(T, device=dev)[None, :] <= pos[:, None]).expand(B, S, T).contiguous()
        k, v = cache_rows(kc, vc, mask, slots)
        ref = attend_reference(q, k, v, mask).float()
        kv_bytes = B * (a.context + S) * KV * dh * 2 * 2
        roof_ms = kv_bytes / (bw * 1e9) * 1e3
        res = {"kv_bytes": kv_bytes, "roofline_ms": roof_ms}
        kb = KeyBounds(pos.expand(B, S), T)  # what the models pass: no mask tensor
        cases = [("triton", lambda: triton_ops.attention(q, kc, vc, mask, slots)),
                 ("triton_bounds", lambda: triton_ops.attention(q, kc, vc, kb, slots)),
                 ("sdpa", lambda: _attend_sdpa(q, *cache_rows(kc, vc, mask, slots), mask)),
                 ("einsum_fp32", lambda: attend_reference(q, *cache_rows(kc, vc, mask, slots), mask))]
        if a.sweep:
            cases += [(f"triton {_name(c)}", lambda c=c: launch_attention(q, kc, vc, mask, slots, config=c))
                      for c in SWEEP]
        cases += [(f"triton_bounds {_name(c)}", lambda c=c: launch_attention(q, kc, vc, kb.last, slots, config=c,
                                                                             window=kb.width))
                  for c in BOUNDS_CONFIGS + SPLITS_CONFIGS]
        for name, fn in cases:
            try:
                us, how = time_in_graph([fn], reps=16, replays=a.iters)
            except Exception as e:  # a configuration that does not compile (shared memory, registers)
                res[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                print(f"B={B} {name}: {res[name]['error']}", flush=True)
                continue
            got = fn()
            err = (got.float() - ref).abs().max().item()
            res[name] = dict(median_ms=us / 1e3, how=how, max_abs_err=err, x_roofline=us / 1e3 / roof_ms)
            if name == "triton":
                default_out = got
            elif name == "triton_bounds":
                bounds_out = got
                res[name]["splits_per_program"] = program_splits(B, S * H // KV, T, KV, dev)
                print(f"B={B} {name}: {us:.1f} µs (splits a program: {res[name]['splits_per_program']})", flush=True)
            elif name.startswith("triton_bounds"):
                # other split sizes change the bits; splits a program must not (against the bounds default)
                same = default_out if "SPLITS" not in name else bounds_out
                res[name]["bits_equal_default"] = bool(torch.equal(got, same))
                print(f"B={B} {name}: {us:.1f} µs (bits = default: {res[name]['bits_equal_default']})", flush=True)
            elif name.startswith("triton "):
                res[name]["bits_equal_default"] = bool(torch.equal(got, default_out))
        out["batches"][B] = res
        if a.sweep:
            out["default_config"] = _name(DEFAULT_CONFIG)
            for name in sorted((n for n in res if n.startswith("triton ") and "median_ms" in res[n]),
                               key=lambda n: res[n]["median_ms"]):
                print(f"B={B} {name}: {res[name]['median_ms'] * 1e3:.1f} µs ({res[name]['x_roofline']:.1f}×, "
                      f"err {res[name]['max_abs_err']:.1e}, bits = default: {res[name]['bits_equal_default']})",
                      flush=True)
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
